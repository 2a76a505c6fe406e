"""A running job cancelled under each kind of worker (CancelJob with
running: true, protocol.md 14.26): `jobserver worker` cancels an async
handler's task and tells a thread handler through `job.cancelled`; the
worker manager stops the worker process as at its timeout. Neither reports
the job afterwards. Real worker processes on a real server, on every
backend, waits with deadlines. Leases are a minute, so that a worker can
hear of the cancel in time only through CancelledJobs (every second), not
a renewal (every 20 s).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from harness import LoggedProcess, ManagerProcess
from helpers import create, ok, until
from wire import Client

pytestmark = pytest.mark.backends

LONG_LEASE = 60
# CancelledJobs' second, and a loaded machine's slack.
HEARD_WITHIN = 5.0
DEADLINE = 30.0

HANDLERS = """
import os, time
import anyio
from jobserver.worker import Worker

worker = Worker()
MARKS = os.environ["MARKS"]


def mark(name):
    open(os.path.join(MARKS, name), "w").close()


@worker.handler("thread")
def in_a_thread(data, job):
    mark("thread-started")
    # Checks its flag between steps of work, as a long handler would.
    while not job.cancelled.wait(0.05):
        pass
    mark("thread-told")
    return {"reported": True}


@worker.handler("task")
async def in_a_task(data, job):
    mark("task-started")
    try:
        await anyio.sleep(3600)
    finally:
        mark("task-cancelled")
"""


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cancel_handlers.py").write_text(HANDLERS)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    made = tmp_path / "marks"
    made.mkdir()
    monkeypatch.setenv("MARKS", str(made))
    return made


def state(client: Client, job_id: int) -> str:
    return str(ok(client.request("QueryJob", jobID=job_id)).json["state"])


def cancel(client: Client, job_id: int) -> float:
    """CancelJob with running: true; when it was sent."""
    sent = time.monotonic()
    ok(client.request("CancelJob", jobID=job_id, running="true"))
    return sent


@pytest.mark.parametrize("kind", ["thread", "task"])
def test_the_python_worker_stops_a_cancelled_handler(server, client, marks, kind):
    job_id = create(client, kind)
    worker = LoggedProcess(
        [sys.executable, "-m", "jobserver", "worker", "cancel_handlers:worker",
         "--server", f"127.0.0.1:{server.port}", "--lease", str(LONG_LEASE)]
    )
    try:
        until((marks / f"{kind}-started").exists, DEADLINE, "the handler to start")
        sent = cancel(client, job_id)
        told = marks / ("thread-told" if kind == "thread" else "task-cancelled")
        until(told.exists, DEADLINE, "the handler to hear of the cancel")
        # Long before a renewal of the lease (a third of it).
        assert time.monotonic() - sent < HEARD_WITHIN
        assert state(client, job_id) == "CANCELLED"
        found = worker.matching(rf"job {job_id} {kind} cancelled while it ran", 1, DEADLINE)
        assert found, worker.log
        # Not reported afterwards: no refusal of a report in its log.
        worker.proc.terminate()
        worker.proc.wait(DEADLINE)
        assert "refused" not in worker.log and "Traceback" not in worker.log, worker.log
        # Its data is the job's own: the thread's result was not sent.
        assert ok(client.request("QueryJob", jobID=job_id)).json["data"] == {}
    finally:
        worker.kill()


def test_the_worker_manager_stops_a_cancelled_jobs_worker(server, client, workers, tmp_path):
    pid = tmp_path / "pid"
    script = workers / "Hang"
    script.write_text(f"#!/bin/sh\ncat >/dev/null\necho $$ > {pid}.tmp && mv {pid}.tmp {pid}\n"
                      "exec sleep 3600\n")
    script.chmod(0o755)
    job_id = create(client, "Hang")
    running = ManagerProcess(server.port, workers, "--lease", str(LONG_LEASE)).started()
    try:
        until(pid.exists, DEADLINE, "the worker to start")
        worker_pid = int(pid.read_text())
        sent = cancel(client, job_id)
        running.wait_for(rf"job {job_id} Hang cancelled while it ran", deadline=DEADLINE)
        until(lambda: not _alive(worker_pid), DEADLINE, "the worker process to be stopped")
        assert time.monotonic() - sent < HEARD_WITHIN
        assert state(client, job_id) == "CANCELLED"
    finally:
        running.stop()
    assert "refused" not in running.log, running.log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie the manager has not reaped yet is gone all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
