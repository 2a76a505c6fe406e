"""What both kinds of worker log of a job's end: a failed attempt that the
server will retry reads apart from the last one, and what a worker process
that did not fail wrote to stderr is logged, not dropped.

Real processes and a real server; waits on the log, with deadlines.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from anyio.from_thread import start_blocking_portal
from test_worker_python import InProcess, in_process
from test_workers import write_worker

from harness import MANAGER, LoggedProcess, ThreadServer
from helpers import create, free_ports, until
from jobserver.worker import Worker
from jobserver.worker.settings import Settings

Starter = Callable[[str], tuple[Callable[[], None], Callable[[], str]]]

DEADLINE = 15.0
POLICY: dict[str, Any] = {"maxAttempts": 2, "retryBackoff": "fixed", "retryDelay": 0}


def test_the_manager_logs_a_retried_attempt_apart_from_the_last(server, client, workers, manager):
    write_worker(workers, "Flaky", "cat >/dev/null\nexit 1\n")
    job_id = create(client, "Flaky", **POLICY)
    plain = create(client, "Flaky")
    running = manager(server.port)
    running.wait_for(rf"job {job_id} Flaky failed .*the last", deadline=DEADLINE)
    running.wait_for(rf"job {plain} Flaky failed", deadline=DEADLINE)
    log = running.log
    assert re.search(
        rf"job {job_id} Flaky failed \(exit status 1; attempt 1 of 2, retried after its backoff\)",
        log,
    ), log
    assert f"job {job_id} Flaky failed (exit status 1; attempt 2 of 2, the last: FAILED)" in log
    assert f"job {plain} Flaky failed (exit status 1; no retry policy: FAILED)" in log


def test_the_manager_logs_what_a_successful_worker_wrote_to_stderr(
    server, client, workers, manager
):
    noisy_body = "cat >/dev/null\necho 'disk 91% full' >&2\necho 'again\\x1b' >&2\n"
    write_worker(workers, "Noisy", noisy_body)
    write_worker(workers, "Quiet", "cat >/dev/null\n")
    noisy, quiet = create(client, "Noisy"), create(client, "Quiet")
    running = manager(server.port)
    running.wait_for(rf"job {quiet} Quiet finished", deadline=DEADLINE)
    [line] = running.wait_for(rf"job {noisy} Noisy wrote to stderr", deadline=DEADLINE)
    # One line, its control characters escaped.
    assert line.rstrip("\n").endswith("wrote to stderr: disk 91% full\\nagain\\x1b"), line
    assert f"job {quiet} Quiet wrote" not in running.log


def test_the_python_worker_logs_a_retried_attempt_apart_from_the_last(server, client, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker = Worker()

    @worker.handler("flaky")
    def flaky(data: dict[str, Any]) -> None:
        raise ValueError("boom")

    job_id = create(client, "flaky", **POLICY)
    with in_process(worker, server.port, "asyncio"):
        until(lambda: "the last" in caplog.text, DEADLINE, "the last attempt")
    assert (
        f"job {job_id} flaky failed (ValueError: boom; attempt 1 of 2, retried after its backoff)"
        in caplog.text
    )
    assert f"job {job_id} flaky failed (ValueError: boom; attempt 2 of 2, the last: FAILED)" in (
        caplog.text
    )


def fail_over(tmp_path: Path, start: Starter) -> None:
    """Two servers, A and B (nodes, as far as a worker can tell, though
    each has a queue of its own), and a worker on both, which
    `start(servers)` starts: (stop it, its log). A stops (the worker's
    links on it move to B), then A comes back and B stops: the worker's
    GetJobs move from B to A, in one line."""
    ports = free_ports(2)
    a, b = (f"127.0.0.1:{port}" for port in ports)
    nodes = {port: ThreadServer(tmp_path / f"{port}.db", port=port) for port in ports}

    def run_a_job_on(port: int) -> None:
        with nodes[port].client() as client:
            job_id = create(client, "Move", repeat="FINISHED, +1 HOUR")
            until(lambda: client.request("QueryJob", jobID=job_id).json["lastRun"], DEADLINE,
                  f"the job on {port}")

    stop, log = start(f"{a},{b}")
    try:
        nodes[ports[0]].stop()
        run_a_job_on(ports[1])
        nodes[ports[0]] = ThreadServer(tmp_path / f"{ports[0]}.db", port=ports[0])
        nodes[ports[1]].stop()
        run_a_job_on(ports[0])
    finally:
        stop()
        for node in nodes.values():
            node.stop()
    back = [line for line in log().splitlines()
            if f"taking jobs: moved from node {b} to node {a}" in line]
    assert len(back) == 1, log()


def test_the_python_worker_logs_each_move_between_nodes_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker = Worker()

    @worker.handler("Move")
    def move(data: dict[str, Any]) -> None:
        return None

    def start(servers: str) -> tuple[Callable[[], None], Callable[[], str]]:
        portal_context = start_blocking_portal()
        portal = portal_context.__enter__()
        running = InProcess(portal, worker, Settings(servers=servers, signals=False))

        def stop() -> None:
            running.stop()
            portal_context.__exit__(None, None, None)

        return stop, lambda: caplog.text

    fail_over(tmp_path, start)


def test_the_manager_logs_each_move_between_nodes_once(tmp_path, workers):
    write_worker(workers, "Move", "cat >/dev/null\n")

    def start(servers: str) -> tuple[Callable[[], None], Callable[[], str]]:
        process = LoggedProcess(
            [sys.executable, *MANAGER, "--worker-path", str(workers), "--server", servers]
        )
        process.matching("worker manager started", 1, DEADLINE)

        def stop() -> None:
            process.signal(signal.SIGTERM)
            process.wait(DEADLINE)

        return stop, lambda: process.log

    fail_over(tmp_path, start)
