"""Group commit: many requests, one transaction, each still on its own."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import trio
import trio.testing

from helpers import HeldSync
from jobserver.core.commands import create as commands
from jobserver.core.engine.clock import SystemClock
from jobserver.core.engine.context import Context
from jobserver.core.engine.engine import Engine
from jobserver.core.errors import CommandError
from jobserver.storage.sqlite import Store
from jobserver.wire.framing import Request


def create(name: str, **headers: str) -> Request:
    return Request("CreateJob", {"name": name, **{k.lower(): v for k, v in headers.items()}})


def fails_after_writing(ctx: Context) -> None:
    commands.create_job(ctx, create("half-done"))
    raise CommandError("402 Changed my mind")


async def test_a_batch_commits_once_and_a_failure_undoes_only_itself(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    notified: list[set[str]] = []
    writer = Engine(store, SystemClock())
    ready = writer.waits.ready

    def noted(names: set[str]) -> list:
        notified.append(set(names))
        return ready(names)

    writer.waits.ready = noted
    writer.start()
    try:
        # Hold the writer with a heavy request (its batch runs in a thread)
        # so that everything below queues up behind it as one batch.
        release = threading.Event()
        holding = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def hold(ctx: Context) -> None:
            token.run_sync_soon(holding.set)
            release.wait(10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(writer.call, hold, heavy=True))
            await holding.wait()
            before = writer.batches
            results: dict[str, object] = {}

            async def run(label: str, work) -> None:
                try:
                    results[label] = await writer.call(work)
                except CommandError as error:
                    results[label] = error.status

            for n in range(20):
                good = create(f"good{n}")
                nursery.start_soon(run, f"good{n}", lambda ctx, r=good: commands.create_job(ctx, r))
            nursery.start_soon(run, "bad", fails_after_writing)
            nursery.start_soon(
                run, "invalid", lambda ctx: commands.create_job(ctx, create("x", priority="7"))
            )
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        # The held request's batch, then everything else in one more.
        assert writer.batches == before + 2
        assert results["bad"] == "402 Changed my mind"
        assert results["invalid"] == "402 Invalid priority value"
        assert all(results[f"good{n}"].status == "200 OK" for n in range(20))
        names = {row[0] for row in store._db.execute("SELECT name FROM jobs")}
        assert names == {f"good{n}" for n in range(20)}
        assert {f"good{n}" for n in range(20)} <= set().union(*notified)
    finally:
        await writer.stop()
        store.close()


# Durability: an outcome goes out only after a sync that covers its commit.
# The store's sync is held here (a real fdatasync follows), so what waits
# for it shows.


async def test_no_outcome_before_the_sync_that_covers_it(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    held = HeldSync(store)
    writer = Engine(store, SystemClock())
    writer.start()
    order: list[str] = []

    async def call(label: str, work) -> None:
        await writer.call(work)
        order.append(label)

    def count(ctx: Context) -> int:
        return ctx.store.count_by_state().get("QUEUED", 0)

    try:
        # Nothing waits for the disk: a batch that only reads needs no sync.
        with trio.fail_after(10):
            assert await writer.call(count) == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "write", lambda ctx: commands.create_job(ctx, create("a")))
            await trio.to_thread.run_sync(held.entered.wait, 10)
            # A read after an unsynced write may see it: it waits too.
            nursery.start_soon(call, "read", count)
            await trio.testing.wait_all_tasks_blocked()
            assert order == []
            held.release.set()
        # Both outcomes come with the one sync; trio may run the two woken
        # tasks in either order, so only that both came is checked.
        assert sorted(order) == ["read", "write"]
    finally:
        held.release.set()
        await writer.stop()
        store.close()
