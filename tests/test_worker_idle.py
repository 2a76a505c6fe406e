"""An idle `jobserver worker` is one waiting GetJobs on the server, so
Status (and `top`, and the dashboard's Idle workers) counts it as one
worker: its two fetchers took turns waiting on the server rather than
both waiting (it showed as 2). Busy, both still fetch at once. A real
server and a real worker process; waits have deadlines, never fixed
sleeps."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness import LoggedProcess
from helpers import create, importable_module, ok, until
from wire import Client

DEADLINE = 30.0
PATTERN = "idle/*"
HANDLERS = """
from jobserver.worker import Worker

worker = Worker()


@worker.handler("idle/*")
def noop(data):
    return {"done": True}
"""


@pytest.fixture
def handlers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The handlers above, importable as idlers:worker by the worker processes."""
    return importable_module(tmp_path, monkeypatch, "idlers", HANDLERS)


@contextmanager
def worker(port: int) -> Iterator[LoggedProcess]:
    proc = LoggedProcess([
        sys.executable, "-m", "jobserver", "worker", "idlers:worker",
        "--server", f"127.0.0.1:{port}",
    ])
    try:
        yield proc
    finally:
        proc.kill()


def waiting(client: Client) -> int:
    """How many GetJobs wait for the worker's pattern."""
    by_name = ok(client.request("Status")).json.get("waitingByName") or []
    return sum(entry["waiting"] for entry in by_name if entry["name"] == PATTERN)


def finished(client: Client, job_ids: list[int]) -> bool:
    return all(
        ok(client.request("QueryJob", jobID=j)).json["data"].get("done") for j in job_ids
    )


def test_an_idle_worker_waits_once_and_a_busy_one_still_takes_everything(
    server, client, handlers_path
):
    with worker(server.port) as proc:
        until(lambda: waiting(client) >= 1, DEADLINE, "the worker waiting for jobs")
        # Its other fetcher has had its answer (none) by now, and waits on
        # the first's: over a second of samples, one waiting GetJobs.
        samples = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            samples.append(waiting(client))
            time.sleep(0.05)
        assert set(samples) == {1}, (samples, proc.log)
        # Busy: everything is run, by both fetchers as before.
        job_ids = [create(client, "idle/job", repeat="FINISHED, +1 HOUR") for _ in range(200)]
        until(lambda: finished(client, job_ids), DEADLINE, "every job run")
        # And idle again: one.
        until(lambda: waiting(client) == 1, DEADLINE, "the worker waiting once again")
        assert proc.proc.poll() is None, proc.log
