"""The engine simulator (``kvgate sim``): an OpenAI-compatible server that behaves like one vLLM replica.

Modules: :mod:`.tokenizer` (tokens and chat template), :mod:`.prefix_cache` (block hashes,
LRU prefix cache), :mod:`.engine` (scheduler, latency model, metrics), :mod:`.server`
(aiohttp app), :mod:`.cli` (the ``sim`` click command). See ``docs/simulator.md``.
"""
