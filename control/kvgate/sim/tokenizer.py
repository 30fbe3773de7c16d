"""The simulator's tokeniser and chat template: deterministic, dependency-free, documented.

A real engine tokenises with the model's BPE vocabulary; the simulator only needs a
rule that is stable (same text → same tokens, so prefix caching behaves like the
real thing) and cheap (a 30k-token prompt in well under a millisecond per kB). Its
rule: **a token is a maximal run of non-whitespace characters** (``str.split()``).
The chat template is ChatML-like; ``docs/simulator.md`` documents both, and the
trace replay (``kvgate.bench``) renders prompts so that one trace token is one word.
"""

from __future__ import annotations

import json
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


def tokenize(text: str) -> list[str]:
    """Split ``text`` into tokens: maximal runs of non-whitespace characters.

    Args:
        text: any string; whitespace (``str.split`` semantics) only separates tokens.

    Returns:
        The tokens in order; ``[]`` for an empty or all-whitespace string.
    """
    return text.split()


def _content_text(content: Any) -> str:
    # OpenAI content is a string, null (assistant turns that only call tools) or a list of
    # parts; only text parts carry tokens here, images/audio are ignored.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


def render_chat(messages: list[dict], tools: list | None = None) -> str:
    """Render chat ``messages`` (and ``tools``) with the simulator's ChatML-like template.

    Template, in order:

    * if ``tools`` is non-empty: ``<|im_start|>tools\\n{json}<|im_end|>\\n`` where ``json`` is
      ``json.dumps(tools, sort_keys=True, separators=(",", ":"))``;
    * per message: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``content`` is a string,
      ``None`` (rendered empty) or a list of OpenAI content parts whose text parts are
      concatenated without separator (non-text parts are ignored);
    * the generation prompt ``<|im_start|>assistant\\n``.

    Other message fields (``name``, ``tool_calls``, ``tool_call_id``) are not rendered.

    Args:
        messages: OpenAI chat messages (dicts with ``role`` and ``content``).
        tools: OpenAI ``tools`` list or ``None``.

    Returns:
        The prompt text the engine tokenises.
    """
    out: list[str] = []
    if tools:
        out.append(f"{IM_START}tools\n{json.dumps(tools, sort_keys=True, separators=(',', ':'))}{IM_END}\n")
    for message in messages:
        role = message.get("role", "user") if isinstance(message, dict) else "user"
        content = _content_text(message.get("content") if isinstance(message, dict) else message)
        out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    out.append(f"{IM_START}assistant\n")
    return "".join(out)


def tokenize_chat(messages: list[dict], tools: list | None = None) -> list[str]:
    """``tokenize(render_chat(messages, tools))``: the prompt tokens of a chat request."""
    return tokenize(render_chat(messages, tools))
