"""What both kinds of worker log of a job's end: a failed attempt that the
server will retry reads apart from the last one, and what a worker process
that did not fail wrote to stderr is logged, not dropped.

Real processes and a real server; waits on the log, with deadlines.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from test_worker_python import in_process
from test_workers import write_worker

from helpers import create, until
from jobserver.worker import Worker

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
