"""The worker manager's --policy (jobserver/workers/policy.py): per job-name
pattern, a retry policy sent with the failures of jobs created without one
(FailJob's, protocol.md 14.1), a timeout instead of --worker-timeout and a
lease instead of --lease (TouchJob's `lease`, 14.4); a job's own policy
wins. A real manager process on a real server; the option's checks through
the real command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_worker_lease import SLACK, guard_of, lease_left, taken_again
from test_workers import job, write_worker

from harness import MANAGER, ManagerProcess
from helpers import create, until
from jobserver.workers.policy import parse_policy

DEADLINE = 20.0
FAILING = 'echo run >> "$RUNS"\necho "no mail server" >&2\nexit 1\n'


def test_a_failing_job_without_a_policy_is_retried_by_the_managers(
    server, client, workers, manager, tmp_path, monkeypatch
):
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    write_worker(workers, "Send", FAILING)
    job_id = create(client, "email/Send")
    running = manager(
        server.port, "--policy", "email/*:max_attempts=3,backoff=fixed,retry_delay=0s"
    )
    until(lambda: job(client, job_id)["state"] == "FAILED", DEADLINE, "the third failure")
    failed = job(client, job_id)
    assert (failed["attempt"], failed["maxAttempts"], failed["retryBackoff"]) == (3, 3, "fixed")
    assert (tmp_path / "runs").read_text() == "run\n" * 3
    running.wait_for(
        rf"job {job_id} email/Send failed \(exit status 1; the --policy for 'email/\*' "
        r"decides \(3 attempts\)\)"
    )


def test_a_job_with_its_own_policy_keeps_it(
    server, client, workers, manager, tmp_path, monkeypatch
):
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    write_worker(workers, "Send", FAILING)
    job_id = create(client, "email/Send", maxAttempts=1)
    running = manager(server.port, "--policy", "email/*:max_attempts=5,retry_delay=0")
    running.wait_for(rf"job {job_id} email/Send failed \(exit status 1; attempt 1 of 1, the last")
    until(lambda: job(client, job_id)["state"] == "FAILED", DEADLINE, "the failure")
    assert job(client, job_id)["maxAttempts"] == 1
    assert (tmp_path / "runs").read_text() == "run\n"


def test_the_first_matching_policy_applies_and_others_keep_the_defaults(
    server, client, workers, manager
):
    write_worker(workers, "Hang", "exec sleep 60\n")
    quick = create(client, "quick/Hang")
    other = create(client, "slow/Hang")
    running = manager(
        server.port, "--policy", "quick/*:timeout=0.5s", "--policy", "*:lease=60",
        "--worker-timeout", "3600",
    )
    running.wait_for(rf"job {quick} quick/Hang failed \(timed out after 0.5s \(worker killed\)")
    # Under the lease of the policy it matched (60 s), not --lease's 30.
    until(lambda: lease_left(client, other) > 40, DEADLINE, "the policy's lease")


def test_a_killed_managers_job_is_back_when_its_policys_lease_ends(
    server, client, workers, tmp_path
):
    """--lease stays 30 s; the policy's 2 s replaces it at the first renewal."""
    lease = 2
    pid = tmp_path / "pid"
    write_worker(workers, "Hang", f"echo $$ > {pid}.tmp && mv {pid}.tmp {pid}\nexec sleep 3600\n")
    job_id = create(client, "Hang")
    running = ManagerProcess(server.port, workers, "--policy", f"H*:lease={lease}").started()
    try:
        until(pid.exists, DEADLINE, "the worker to start")
        until(lambda: lease_left(client, job_id) < 10, DEADLINE, "the policy's lease")
        # The whole of it at once, the guard too, which would hand the job back.
        for process in (guard_of(running.proc.pid), running.proc.pid):
            os.kill(process, signal.SIGKILL)
        os.killpg(int(pid.read_text()), signal.SIGKILL)
    finally:
        running.kill()
    assert taken_again(client, "Hang", job_id) < lease + SLACK


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("email/*:max_atempts=5", "unknown policy key 'max_atempts'; did you mean max_attempts?"),
        ("email/*", "is not PATTERN:KEY=VALUE"),
        ("email/*:max_attempts=0", "max_attempts must be 1 to 10000, not 0"),
        ("email/*:backoff=fixed", "need max_attempts"),
        ("email/*:max_attempts=3,backoff=linear", "backoff must be one of fixed, exponential"),
        ("email/*:max_attempts=3,retry_delay=-1", "retry_delay must be seconds from 0"),
        ("email/*:timeout=0", "timeout must be seconds above 0"),
        ("email/*:lease=1.5", "lease must be a whole number"),
        ("email/*:lease=86401", "lease must be whole seconds from 1 to 86400"),
        ("email/*:max_attempts=2,max_attempts=3", "policy key max_attempts given twice"),
        ("email/*:max_attempts=\u0663", "max_attempts must be a whole number"),
        ("email/*:lease=1_0s", "lease must be a whole number"),
        ("email/*:timeout=\u0665s", "timeout must be a number of seconds"),
    ],
)
def test_a_bad_policy_is_refused_with_what_is_wrong(workers, policy, message):
    done = subprocess.run(
        [sys.executable, *MANAGER, "--worker-path", str(workers), "--server", "127.0.0.1:1",
         "--policy", policy],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert "argument --policy: " in done.stderr and message in done.stderr


def test_a_policys_pattern_is_read_without_the_spaces_around_it():
    """' email/*:lease=2' (a space after a shell's quote) applied to no
    job: the pattern kept its space."""
    assert parse_policy(" email/* :lease=2").pattern == "email/*"
