"""The engine's hop to a writer's thread (batch.in_thread): what
trio.to_thread.run_sync does by default, less what a batch does not need."""

from __future__ import annotations

import threading

import pytest
import trio

from jobserver.core.engine.batch import in_thread

WAIT = 30.0


async def test_it_runs_the_function_in_another_thread_and_returns_its_value() -> None:
    here = threading.get_ident()
    there, value = await in_thread(lambda a, b: (threading.get_ident(), a + b), 2, 3)
    assert value == 5 and there != here


async def test_the_functions_exception_is_raised_by_the_call() -> None:
    def fail() -> None:
        raise LookupError("from the thread")

    with pytest.raises(LookupError, match="from the thread"):
        await in_thread(fail)


async def test_a_cancel_waits_for_the_function_to_end_and_then_lands() -> None:
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def batch() -> str:
        started.set()
        assert release.wait(WAIT)
        ended.set()
        return "committed"

    got: list[str] = []
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            got.append(await in_thread(batch))
            await trio.lowlevel.checkpoint()
            got.append("not reached: the cancel lands here")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.to_thread.run_sync(started.wait, WAIT)
        scope.cancel()
        # Cancelled, the call still waits for its thread: its outcome is
        # the batch's, and nobody else's.
        await trio.sleep(0.05)
        assert not ended.is_set() and got == []
        release.set()
    assert ended.is_set() and got == ["committed"]


async def test_its_thread_reaches_the_event_loop_with_the_token() -> None:
    token = trio.lowlevel.current_trio_token()
    loop_thread = threading.get_ident()

    def ask_the_loop() -> int:
        return trio.from_thread.run_sync(threading.get_ident, trio_token=token)

    assert await in_thread(ask_the_loop) == loop_thread
