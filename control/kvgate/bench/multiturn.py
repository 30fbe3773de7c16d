"""The seed's multi-turn chat workload and its closed-loop sender.

Shape (issue 16, the seeds): many users, 4–6 turns each, a shared system prompt of about
3,000 tokens, and every turn re-sends the whole history, so the system prompt plus the
history are 60–80 % of a turn's input (:func:`history_share` computes it for given sizes).

Text: words of the trace module's deterministic vocabulary (:mod:`kvgate.bench.trace`,
4,096 six-letter words), one word = one simulator token (docs/simulator.md). Every text is
drawn from a ``random.Random`` seeded by a string naming the workload seed and the item
(``kvgate-mt-system-<seed>-<variant>``, ``kvgate-mt-<seed>-<n>``), so conversation ``n`` is
the same text in every process and whatever the number of conversations asked for.

The prompt of turn ``k`` (0-based) is ``system + (user_0, answer_0) … (user_{k-1},
answer_{k-1}) + user_k``: the assistant messages re-sent are fixed, seeded texts of
``answer_tokens`` words, not what the engine answered, so every run sends the same bytes
and turn ``k+1``'s prompt starts with turn ``k``'s prompt (an engine that served turn ``k``
holds it in its prefix cache).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from .replay import RequestResult, _one_request
# The trace renderer's vocabulary (16^3 words of 6 letters), shared so both workloads read alike.
from .trace import _VOCAB

DEFAULT_USER_TOKENS = 2000
DEFAULT_ANSWER_TOKENS = 200
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True)
class Conversation:
    """One user's conversation.

    ``id`` ("mt-<n>") is also its ``X-Session-Id``; ``user`` is "u<n>"; ``start_s`` the first
    turn's send time in seconds from the workload's start (before any speedup); ``system`` the
    shared system prompt of its variant; ``turns`` the user messages; ``answers`` the assistant
    message re-sent in the history after each turn (``len(answers) == len(turns)``; the last is
    never sent); ``max_tokens`` each turn's completion length; ``think_s`` the pause between an
    answer's end and the next turn (seconds, before any speedup).
    """

    id: str
    user: str
    start_s: float
    system: str
    turns: tuple[str, ...]
    answers: tuple[str, ...]
    max_tokens: int
    think_s: float


@dataclass
class TurnResult:
    """One sent turn. ``ttft_s``: seconds from when the turn was ready to send (a wait for a
    concurrency slot included) to its first content chunk, at the client; the token counts come
    from the stream's final ``usage`` chunk (None when it sent none); ``cache`` is the
    ``X-Kvgate-Cache`` response header (HIT/MISS/SEMANTIC/STATIC/…) when present."""

    conversation: str
    turn: int
    ok: bool
    status: int
    ttft_s: float | None
    error: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    cache: str | None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_VOCAB, k=n))


def system_prompt(seed: int, variant: int, tokens: int) -> str:
    """The shared system prompt of one variant: ``tokens`` words, the same in every process."""
    return _words(random.Random(f"kvgate-mt-system-{seed}-{variant}"), tokens)


def multi_turn_workload(*, conversations: int, turns: tuple[int, int] = (4, 6), system_tokens: int = 3000,
                        system_prompts: int = 1, user_tokens: int = DEFAULT_USER_TOKENS,
                        answer_tokens: int = DEFAULT_ANSWER_TOKENS, max_tokens: int = DEFAULT_MAX_TOKENS,
                        rate_per_s: float, think_s: float, seed: int) -> list[Conversation]:
    """``conversations`` conversations sorted by ``start_s``.

    Starts are a Poisson process of ``rate_per_s`` conversations per second (the first at 0);
    each conversation has a uniform number of turns in ``turns`` (inclusive), a pause of
    ``think_s`` × uniform(0.5, 1.5) between turns (``think_s`` is the mean: equal pauses would
    make conversations take turns in lockstep, which lines them up with a round robin's
    rotation), uses system prompt
    variant ``n % system_prompts`` and user/answer texts of ``user_tokens``/``answer_tokens``
    words (simulator tokens). Deterministic in ``seed``.

    Raises:
        ValueError: a count or size is out of range (conversations < 0, turns not 1 ≤ lo ≤ hi,
            system_prompts < 1, a token count < 1, rate_per_s ≤ 0, think_s < 0).
    """
    lo, hi = turns
    if conversations < 0:
        raise ValueError(f"conversations must be >= 0, not {conversations}")
    if not 1 <= lo <= hi:
        raise ValueError(f"turns must be (lo, hi) with 1 <= lo <= hi, not {turns}")
    if system_prompts < 1:
        raise ValueError(f"system_prompts must be >= 1, not {system_prompts}")
    if min(system_tokens, user_tokens, answer_tokens, max_tokens) < 1:
        raise ValueError("system_tokens, user_tokens, answer_tokens and max_tokens must be >= 1")
    if rate_per_s <= 0 or think_s < 0:
        raise ValueError(f"rate_per_s must be > 0 and think_s >= 0 (got {rate_per_s}, {think_s})")
    systems = [system_prompt(seed, v, system_tokens) for v in range(system_prompts)]
    arrivals = random.Random(f"kvgate-mt-arrivals-{seed}")
    t = 0.0
    out = []
    for n in range(conversations):
        if n:
            t += arrivals.expovariate(rate_per_s)
        rng = random.Random(f"kvgate-mt-{seed}-{n}")
        k = rng.randint(lo, hi)
        users = tuple(_words(rng, user_tokens) for _ in range(k))
        answers = tuple(_words(rng, answer_tokens) for _ in range(k))
        out.append(Conversation(
            id=f"mt-{n}", user=f"u{n}", start_s=t, system=systems[n % system_prompts], turns=users,
            answers=answers, max_tokens=max_tokens, think_s=think_s * rng.uniform(0.5, 1.5)))
    return out


def turn_messages(conv: Conversation, k: int) -> list[dict[str, str]]:
    """The chat messages of turn ``k`` (0-based): system, the ``k`` earlier (user, assistant)
    pairs, then user message ``k``. Raises IndexError when ``k`` is not a turn of ``conv``."""
    if not 0 <= k < len(conv.turns):
        raise IndexError(f"{conv.id} has {len(conv.turns)} turns, no turn {k}")
    messages = [{"role": "system", "content": conv.system}]
    for j in range(k):
        messages.append({"role": "user", "content": conv.turns[j]})
        messages.append({"role": "assistant", "content": conv.answers[j]})
    messages.append({"role": "user", "content": conv.turns[k]})
    return messages


def history_share(system_tokens: int, user_tokens: int, answer_tokens: int, turns: tuple[int, int]) -> float:
    """Mean over turns of (system prompt + history) ÷ the turn's input, in words, for
    conversations of every length in ``turns`` weighted alike (chat-template tokens left out).
    The defaults (3,000 / 2,000 / 200, 4–6 turns) give 0.76; the seeds report 60–80 %."""
    shares = []
    for n in range(turns[0], turns[1] + 1):
        per = []
        for k in range(n):
            reused = system_tokens + k * (user_tokens + answer_tokens)
            per.append(reused / (reused + user_tokens))
        shares.append(sum(per) / len(per))
    return sum(shares) / len(shares)


async def send_conversations(gateway: str, model: str, convs: list[Conversation], *, speedup: float,
                             concurrency: int, headers: Callable[[Conversation], dict[str, str]] | None = None,
                             on_done: Callable[[TurnResult], None] | None = None,
                             request_timeout_s: float = 600.0, no_store: bool = False) -> list[TurnResult]:
    """Send every conversation to ``{gateway}/v1/chat/completions``, closed loop.

    Conversation ``c``'s first turn is sent at ``c.start_s / speedup`` seconds after the call;
    turn ``k+1`` ``c.think_s / speedup`` seconds after turn ``k``'s stream ended (a failed turn
    does not stop the conversation: the history re-sent is fixed text). Streamed with
    ``stream_options.include_usage``, ``temperature 0``, ``max_tokens = c.max_tokens``. Headers:
    ``X-Session-Id: c.id`` updated with ``headers(c)`` when given (which may override it);
    ``no_store=True`` adds ``Cache-Control: no-store`` (the gateway's response cache answers
    nothing; measurements of routing want it), False (default) leaves caching to the policy.
    At most ``concurrency`` turns are in flight; a turn waiting for a slot counts the wait in its
    TTFT. ``on_done`` is called after each turn. Results: conversation order, then turn order.
    """
    url = gateway.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    t_start = time.perf_counter()

    async with aiohttp.ClientSession(connector=connector) as session:
        async def converse(conv: Conversation) -> list[TurnResult]:
            delay = conv.start_s / speedup - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            hdrs = {"X-Session-Id": conv.id, **(headers(conv) if headers else {})}
            results = []
            for k in range(len(conv.turns)):
                if k:
                    await asyncio.sleep(conv.think_s / speedup)
                body = json.dumps({
                    "model": model, "messages": turn_messages(conv, k), "max_tokens": conv.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                }).encode()
                r: RequestResult = await _one_request(session, url, body, sem, timeout, time.perf_counter(),
                                                      hdrs, no_store)
                res = TurnResult(conversation=conv.id, turn=k, ok=r.ok, status=r.status, ttft_s=r.ttft_s,
                                 error=r.error, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                                 completion_tokens=r.completion_tokens, cache=r.cache)
                results.append(res)
                if on_done:
                    on_done(res)
            return results

        per_conv = await asyncio.gather(*(converse(c) for c in convs))
    return [r for rs in per_conv for r in rs]
