"""Jobs the Python worker holds beyond its slots (--prefetch) do not wait
behind a long handler call: with every slot in a call past STUCK_AFTER,
the held jobs are handed back, due at once, for other workers (one 20 s
handler among 2 ms ones held 812 jobs for its 20 s). A real server and a
real worker process; waits have deadlines, never fixed sleeps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness import LoggedProcess
from helpers import ok, until
from jobserver.worker.prefetch import STUCK_AFTER
from wire import Client

DEADLINE = 60.0
HANDLERS = """
import time
from jobserver.worker import Worker

worker = Worker()


@worker.handler("held/*")
def run(data, job):
    if job.name == "held/slow":
        time.sleep(120)
"""


@pytest.fixture
def handlers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "holders.py").write_text(HANDLERS)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    return tmp_path


def create_many(client: Client, name: str, count: int) -> None:
    ok(client.request("CreateJobs", jobs=json.dumps([{"name": name}] * count)))


def count(client: Client, name: str, state: str | None = None) -> int:
    """How many jobs of `name` there are (in `state`); a finished job is gone."""
    where = f"name = '{name}'" + (f" AND state = '{state}'" if state else "")
    query = f"SELECT COUNT(*) FROM jobs WHERE {where};"
    return int(ok(client.request("Query", query=query)).body.decode().splitlines()[1])


def test_held_jobs_go_back_when_every_slot_is_stuck(server, client, handlers_path):
    proc = LoggedProcess([
        sys.executable, "-m", "jobserver", "worker", "holders:worker",
        "--server", f"127.0.0.1:{server.port}", "--concurrency", "1",
    ])
    try:
        # Fast calls first, so that the worker holds jobs beyond its slot.
        create_many(client, "held/fast", 2000)
        until(lambda: count(client, "held/fast") == 0, DEADLINE, "the fast jobs run")
        create_many(client, "held/slow", 1)
        create_many(client, "held/late", 500)
        until(lambda: count(client, "held/slow", "RUNQUEUED") == 1, DEADLINE, "the slow call")
        # The worker held late jobs behind it; once its call is past
        # STUCK_AFTER they are due again, for anyone: a GetJobs gets them
        # while the slow call still runs.
        taken = 0

        def taken_here() -> bool:
            nonlocal taken
            reply = client.request("GetJobs", name="held/late", numResults=1000)
            taken += len(reply.json["jobs"]) if reply.status.startswith("200") else 0
            return taken >= 400

        until(taken_here, STUCK_AFTER + 10, "held jobs handed back")
        assert count(client, "held/slow", "RUNQUEUED") == 1, proc.log
        assert proc.proc.poll() is None, proc.log
    finally:
        proc.kill()
