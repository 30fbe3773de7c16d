"""kvgate: a cache-affinity gateway for fleets of OpenAI-compatible LLM inference servers."""

__version__ = "0.1.0"
