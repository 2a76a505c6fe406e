"""`jobserver worker --processes N` against a real server: N worker
processes share the queue, a signal stops them all cleanly, one killed is
started again, one that cannot work stops them all with status 2.

Nothing sleeps for a fixed time: tests wait for the server's state or the
command's log, each with a deadline."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness import LoggedProcess
from helpers import create, importable_module, ok, until
from jobserver.cli import main
from wire import Client

DEADLINE = 30.0
REPEAT = "FINISHED, +1 HOUR"  # a finished job stays, with its new data
HANDLERS = """
import os
import time

from jobserver.worker import Worker

worker = Worker()


@worker.handler("proc/*")
def record_pid(data):
    time.sleep(0.05)
    return {"pid": os.getpid()}
"""
STARTED = re.compile(r"worker process (\d) of 2 started: pid (\d+)")


@pytest.fixture
def handlers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The handlers above, importable as pids:worker by the worker processes."""
    return importable_module(tmp_path, monkeypatch, "pids", HANDLERS)


@contextmanager
def processes(port: int, *options: str) -> Iterator[LoggedProcess]:
    """`jobserver worker --processes 2`, the handlers above, one job at a
    time in each process."""
    proc = LoggedProcess([
        sys.executable, "-m", "jobserver", "worker", "pids:worker", "--processes", "2",
        "--server", f"127.0.0.1:{port}", "--concurrency", "1", "--prefetch", "0", *options,
    ])
    try:
        yield proc
    finally:
        proc.kill()


def pids(proc: LoggedProcess) -> dict[int, int]:
    """The last pid of each worker process by its number, from the log."""
    return {int(number): int(pid) for number, pid in STARTED.findall(proc.log)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def done_by(client: Client, job_ids: list[int]) -> set[int]:
    """The pids that ran the jobs, once all have run."""
    ran = [ok(client.request("QueryJob", jobID=j)).json["data"] for j in job_ids]
    return {data["pid"] for data in ran} if all("pid" in data for data in ran) else set()


def test_processes_share_the_queue_and_stop_together_on_sigterm(server, client, handlers_path):
    job_ids = [create(client, "proc/a", repeat=REPEAT) for _ in range(40)]
    with processes(server.port) as proc:
        ran_by = until(lambda: done_by(client, job_ids), DEADLINE, "every job run")
        workers = pids(proc)
        assert set(workers) == {1, 2}
        assert ran_by == set(workers.values()), proc.log  # both took jobs, the parent none
        proc.signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0, proc.log
    assert not any(alive(pid) for pid in workers.values())
    assert "received SIGTERM: passing SIGTERM on to 2 worker processes" in proc.log
    assert len(re.findall(r"jobserver INFO worker stopped", proc.log)) == 2, proc.log


def test_a_killed_process_is_started_again(server, client, handlers_path):
    with processes(server.port) as proc:
        assert len(proc.matching(STARTED, 2, DEADLINE)) == 2, proc.log
        first = pids(proc)[1]
        os.kill(first, signal.SIGKILL)
        assert proc.matching(
            "worker process 1 of 2 exited with status 137 without being stopped; "
            "starting it again in 1s", 1, DEADLINE,
        ), proc.log
        until(lambda: pids(proc)[1] != first, DEADLINE, "process 1 started again")
        job_ids = [create(client, "proc/b", repeat=REPEAT) for _ in range(10)]
        until(lambda: done_by(client, job_ids), DEADLINE, "every job run")
        proc.signal(signal.SIGINT)
        assert proc.wait(DEADLINE) == 0, proc.log


def test_a_process_that_cannot_work_stops_them_all(start_server, tmp_path, handlers_path):
    (tmp_path / "token").write_text("right")
    running = start_server(None, "--auth-token-file", str(tmp_path / "token"))
    (tmp_path / "wrong").write_text("wrong")
    with processes(running.port, "--auth-token-file", str(tmp_path / "wrong")) as proc:
        assert proc.wait(DEADLINE) == 2, proc.log
    assert "exited with status 2 (it cannot work): stopping the others" in proc.log
    assert not any(alive(pid) for pid in pids(proc).values())


@pytest.mark.parametrize("wrong", ["0", "65", "two"])
def test_processes_is_range_checked(capsys, wrong):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "jobs:worker", "--processes", wrong])
    assert exited.value.code == 2
    assert "--processes: must be a whole number from 1 to 64" in capsys.readouterr().err


def test_the_processes_stop_when_their_parent_is_killed(server, client, handlers_path):
    """SIGKILL to the parent forwards no signal: each worker notices its
    parent gone and stops as on SIGTERM (they ran on for good before)."""
    job_ids = [create(client, "proc/a", repeat=REPEAT) for _ in range(10)]
    with processes(server.port) as proc:
        until(lambda: done_by(client, job_ids), DEADLINE, "every job run")
        workers = until(lambda: len(pids(proc)) == 2 and pids(proc), DEADLINE, "two processes")
        proc.signal(signal.SIGKILL)
        until(
            lambda: not any(alive(pid) for pid in workers.values()),
            DEADLINE,
            "both worker processes gone",
        )
