"""The engine's admission queue, driven directly on an event loop (no HTTP, no timing)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvgate.sim.engine import Engine, Sequence, output_rng

from .conftest import make_config


def _engine(**overrides) -> Engine:
    return Engine(make_config(**dict(dict(max_num_seqs=1, prefill_s_per_token=0.0, decode_s_per_token=0.0),
                                     **overrides)))


def _assert_idle(engine: Engine) -> None:
    """No sequence running or waiting, in the engine's counts and in its vLLM gauges."""
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    assert engine.metrics.waiting._value.get() == 0 and engine.metrics.running._value.get() == 0


def test_waiter_cancelled_then_skipped_by_leave_raises_cancelled_error():
    """The race: the waiter's future is cancelled, ``_leave`` pops it before the task resumes."""

    async def main() -> None:
        engine = _engine()
        await engine._admit()  # takes the only slot
        waiter = asyncio.create_task(engine._admit())
        await asyncio.sleep(0)
        assert engine.num_waiting == 1
        waiter.cancel()  # cancels the future the waiter awaits; the task has not resumed yet
        engine._leave()  # the running sequence finishes in the same loop turn: pops and skips it
        with pytest.raises(asyncio.CancelledError):
            await waiter  # was: ValueError from deque.remove
        _assert_idle(engine)

    asyncio.run(main())


def test_waiter_cancelled_while_still_queued_leaves_the_queue():
    async def main() -> None:
        engine = _engine()
        await engine._admit()
        waiters = [asyncio.create_task(engine._admit()) for _ in range(3)]
        await asyncio.sleep(0)
        assert engine.num_waiting == 3 and engine.metrics.waiting._value.get() == 3
        waiters[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiters[1]
        assert engine.num_waiting == 2 and engine.metrics.waiting._value.get() == 2
        engine._leave()
        await waiters[0]  # FIFO: the first waiter gets the slot, the cancelled one is gone
        assert (engine.num_running, engine.num_waiting) == (1, 1)
        engine._leave()
        await waiters[2]
        engine._leave()
        _assert_idle(engine)

    asyncio.run(main())


def test_slot_handed_over_as_the_waiter_is_cancelled_is_given_back():
    async def main() -> None:
        engine = _engine()
        await engine._admit()
        waiter = asyncio.create_task(engine._admit())
        await asyncio.sleep(0)
        engine._leave()  # hands the slot to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (engine.num_running, engine.num_waiting) == (0, 0)

    asyncio.run(main())


def test_cancelling_queued_generations_keeps_counts_and_metrics_right():
    async def main() -> None:
        engine = _engine(decode_s_per_token=0.01)

        async def run(max_tokens: int) -> Sequence:
            seq = Sequence(prompt_tokens=["a"] * 40, max_tokens=max_tokens, rng=output_rng(["a"], 0, True))
            async with contextlib.aclosing(engine.generate(seq, 1)) as gen:
                async for _ in gen:
                    pass
            return seq

        running = asyncio.create_task(run(3))
        queued = [asyncio.create_task(run(2)) for _ in range(4)]
        await asyncio.sleep(0)
        assert engine.num_waiting == 4
        for task in queued[:3]:
            task.cancel()
        assert (await running).finish_reason == "length"
        assert (await queued[3]).finish_reason == "length"
        for task in queued[:3]:
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (engine.num_running, engine.num_waiting) == (0, 0)
        m = engine.metrics
        assert m.waiting._value.get() == 0 and m.running._value.get() == 0
        assert m.request_success["length"]._value.get() == 2
        assert engine.cache.usage == 0

    asyncio.run(main())
