"""Both kinds of worker take their jobs under a lease they renew (--lease,
protocol.md 14.24): a worker killed with SIGKILL leaves its job to come back
when the lease ends, not after --stale-after; a live worker's job that runs
longer than --stale-after is never taken for lost.

Real processes on a real server; leases of 2 s, and waits with deadlines.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_worker_python import in_process

from harness import LoggedProcess, ManagerProcess, ThreadServer
from helpers import create, ok, until
from jobserver.worker import Worker
from wire import Client

LEASE = 2
DEADLINE = 20.0
# Past the lease's end, how long the job may take to come back: the clock
# that wakes the waiting GetJob, on a loaded machine.
SLACK = 3.0

HANGING = """
import os, time
from jobserver.worker import Worker

worker = Worker()


@worker.handler("hang")
def hang(data, job):
    open(os.environ["STARTED"], "w").close()
    time.sleep(3600)
"""


@pytest.fixture
def stale_server(tmp_path: Path):
    running = ThreadServer(tmp_path / "jobs.db", stale_after=1.0)
    yield running
    running.stop()


def taken_again(client: Client, name: str, job_id: int) -> float:
    """Wait for the job to be handed out again; seconds it took."""
    asked = time.monotonic()
    reply = ok(client.request("GetJob", name=name, Connection="wait", timeout=int(DEADLINE * 1000)))
    assert reply.json["jobID"] == job_id
    return time.monotonic() - asked


def test_a_killed_python_workers_job_is_back_when_its_lease_ends(
    server, client, tmp_path, monkeypatch
):
    (tmp_path / "hanging.py").write_text(HANGING)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("STARTED", str(tmp_path / "started"))
    job_id = create(client, "hang")
    proc = LoggedProcess(
        [sys.executable, "-m", "jobserver", "worker", "hanging:worker",
         "--server", f"127.0.0.1:{server.port}", "--lease", str(LEASE)]
    )
    try:
        until((tmp_path / "started").exists, DEADLINE, "the handler to start")
        proc.proc.kill()
    finally:
        proc.kill()
    assert taken_again(client, "hang", job_id) < LEASE + SLACK


HANDLERS_LEASE = f"""
import os, time
from jobserver.worker import Worker

worker = Worker()


@worker.handler("hang", lease={LEASE})
def hang(data, job):
    open(os.environ["STARTED"], "w").close()
    time.sleep(3600)
"""


def test_a_killed_python_workers_job_is_back_when_its_handlers_lease_ends(
    server, client, tmp_path, monkeypatch
):
    """The worker asks for its own lease (30 s by default); the handler's
    replaces it at the job's first renewal, due at once."""
    (tmp_path / "leased.py").write_text(HANDLERS_LEASE)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("STARTED", str(tmp_path / "started"))
    job_id = create(client, "hang")
    proc = LoggedProcess(
        [sys.executable, "-m", "jobserver", "worker", "leased:worker",
         "--server", f"127.0.0.1:{server.port}"]
    )
    try:
        until((tmp_path / "started").exists, DEADLINE, "the handler to start")
        until(lambda: lease_left(client, job_id) < 10, DEADLINE, "the handler's lease")
        proc.proc.kill()
    finally:
        proc.kill()
    assert taken_again(client, "hang", job_id) < LEASE + SLACK


def lease_left(client: Client, job_id: int) -> float:
    """Seconds until the job's lease ends (its nextRun, UTC); infinite
    while it is not leased (not yet taken: its nextRun is when it is due)."""
    job = ok(client.request("QueryJob", jobID=job_id)).json
    if job["state"] != "RUNQUEUED":
        return math.inf
    end = datetime.fromisoformat(job["nextRun"]).replace(tzinfo=UTC)
    return (end - datetime.now(UTC)).total_seconds()


def test_a_killed_managers_job_is_back_when_its_lease_ends(server, client, workers, tmp_path):
    pid = tmp_path / "pid"
    script = workers / "Hang"
    script.write_text(f"#!/bin/sh\ncat >/dev/null\necho $$ > {pid}.tmp && mv {pid}.tmp {pid}\n"
                      "exec sleep 3600\n")
    script.chmod(0o755)
    job_id = create(client, "Hang")
    running = ManagerProcess(server.port, workers, "--lease", str(LEASE)).started()
    try:
        until(pid.exists, DEADLINE, "the worker to start")
        # The whole of it at once, as `docker kill` or the host going down:
        # the guard, which would hand the job back at once, too.
        for process in (guard_of(running.proc.pid), running.proc.pid):
            os.kill(process, signal.SIGKILL)
        os.killpg(int(pid.read_text()), signal.SIGKILL)
    finally:
        running.kill()
    assert taken_again(client, "Hang", job_id) < LEASE + SLACK


def guard_of(manager: int) -> int:
    """The process ID of a manager's guard: its child running guard.py."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if parent == manager and b"guard.py" in command:
            return int(entry.name)
    raise AssertionError(f"manager {manager} has no guard")


def test_a_python_workers_job_outlives_stale_after_under_its_lease(stale_server):
    runs: list[int] = []
    worker = Worker()

    @worker.handler("slow")
    def slow(data, job):
        runs.append(job.id)
        time.sleep(3)  # three times --stale-after
        return {"done": True}

    with stale_server.client() as client:
        job_id = create(client, "slow", repeat="FINISHED, +1 HOUR")
        with in_process(worker, stale_server.port, "asyncio", lease=LEASE):
            until(lambda: client.request("QueryJob", jobID=job_id).json["data"], DEADLINE,
                  "the job to finish")
        job = ok(client.request("QueryJob", jobID=job_id)).json
    assert runs == [job_id]
    assert (job["state"], job["data"]) == ("QUEUED", {"done": True})


def test_a_python_workers_job_is_renewed_by_its_handlers_lease(server, client):
    worker = Worker()

    @worker.handler("slow", lease=1)
    def slow(data, job):
        time.sleep(3)  # three of the handler's leases, within the worker's
        return {"done": True}

    job_id = create(client, "slow", repeat="FINISHED, +1 HOUR")
    with in_process(worker, server.port, "asyncio", lease=60):
        until(lambda: lease_left(client, job_id) < 10, DEADLINE, "the handler's lease")
        # Renewed at a third of it: nobody else gets the job while it runs.
        with server.client() as other:
            while not ok(client.request("QueryJob", jobID=job_id)).json["data"]:
                assert other.request("GetJob", name="slow").status == "404 No job found"
                time.sleep(0.2)
    assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "QUEUED"


def test_a_managers_job_outlives_stale_after_under_its_lease(stale_server, workers, tmp_path):
    runs = tmp_path / "runs"
    script = workers / "Slow"
    script.write_text(f"#!/bin/sh\ncat >/dev/null\necho run >> {runs}\nsleep 3\n"
                      'echo \'{"done":true}\'\n')
    script.chmod(0o755)
    with stale_server.client() as client:
        job_id = create(client, "Slow", repeat="FINISHED, +1 HOUR")
        running = ManagerProcess(stale_server.port, workers, "--lease", str(LEASE)).started()
        try:
            until(lambda: client.request("QueryJob", jobID=job_id).json["state"] == "QUEUED"
                  and runs.exists(), DEADLINE, "the job to finish")
        finally:
            running.stop()
        job = ok(client.request("QueryJob", jobID=job_id)).json
    assert runs.read_text() == "run\n"
    assert job["data"] == {"done": True}
    assert "handed out again" not in running.log
