"""The command-line client: `python -m jobserver create/get/...` as scripts
run it, against a real server. Each run checks stdout, stderr and the exit
status together."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conformance_helpers import fmt, force, utcnow
from fake_server import FakeServer, reply
from harness import ThreadServer
from helpers import free_port, until
from jobserver.cli import build_parser, create_from, main, top
from jobserver.client import Client, InvalidRequest, JobNotFound

RUN_TIMEOUT = 15.0
DEADLINE = 5.0


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobserver", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=environment(env),
    )


def environment(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOBSERVER_SERVER"}
    return {**env, **(extra or {})}


class Cli:
    """Runs client subcommands against one server."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run(*args, "--server", self.address)

    def ok(self, *args: str) -> Any:
        done = self(*args)
        assert (done.returncode, done.stderr) == (0, ""), done
        return json.loads(done.stdout)

    def refused(self, status: str, code: int, *args: str) -> None:
        done = self(*args)
        assert (done.returncode, done.stdout, done.stderr) == (code, "", status + "\n")


class CliHere(Cli):
    """The same subcommands run in this process (jobserver.cli.main), for
    speed: the same parser, client and exit statuses, on real sockets."""

    def __init__(self, address: str, capsys: pytest.CaptureFixture[str]) -> None:
        super().__init__(address)
        self.capsys = capsys

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_here(self.capsys, *args, "--server", self.address)


def run_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """main(args) as `python -m jobserver` runs it: argparse's exits included."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


@pytest.fixture
def cli(server) -> Cli:
    return Cli(f"127.0.0.1:{server.port}")


@pytest.fixture
def cli_here(server, capsys) -> CliHere:
    return CliHere(f"127.0.0.1:{server.port}", capsys)


@pytest.fixture
def jobs(server) -> Iterator[Client]:
    with Client(port=server.port, timeout=10) as client:
        yield client


def test_create_prints_the_job_id_and_query_shows_the_job(cli):
    created = cli.ok(
        "create", "report/daily",
        "--data", '{"to": "ann", "path": "C:\\\\temp"}',
        "--first-run", "2030-01-01 04:00:00",
        "--repeat", "finished, +1 day",
        "--priority", "1000",
        "--retry-after", "+5 MINUTES",
    )
    assert created == {"jobID": 1}
    job = cli.ok("query", "1")
    assert {k: job[k] for k in ("name", "data", "nextRun", "repeat", "priority", "retryAfter",
                                "state")} == {
        "name": "report/daily",
        "data": {"to": "ann", "path": "C:\\temp"},
        "nextRun": "2030-01-01 04:00:00",
        "repeat": "FINISHED, +1 DAY",
        "priority": 1000,
        "retryAfter": "+5 MINUTES",
        "state": "QUEUED",
    }


def test_get_prints_the_job_or_exits_1(cli, jobs):
    job_id = jobs.create_job("email/send", {"to": "ann"})
    job = cli.ok("get", "email/*")
    assert (job["jobID"], job["data"]) == (job_id, {"to": "ann"})
    assert jobs.query_job(job_id)["state"] == "RUNNING"
    cli.refused("404 No job found", 1, "get", "email/*")
    cli.refused("404 No job found", 1, "get", "email/*", "--wait", "0.1")


def test_get_waits_for_a_job(server, jobs):
    waiting = subprocess.Popen(
        [sys.executable, "-m", "jobserver", "get", "late/*", "--wait", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment({"JOBSERVER_SERVER": f"127.0.0.1:{server.port}"}),
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while jobs.status()["waitingGetJobs"] != 1:
            assert time.monotonic() < deadline and waiting.poll() is None
            time.sleep(0.01)
        job_id = jobs.create_job("late/one")
        out, err = waiting.communicate(timeout=DEADLINE)
    finally:
        waiting.kill()
    assert (waiting.returncode, err) == (0, "")
    assert json.loads(out)["jobID"] == job_id


def test_finish_fail_retry_delete(cli, jobs):
    ids = jobs.create_jobs([{"name": "w"}, {"name": "w"}, {"name": "w"}])
    assert len(jobs.get_jobs("w", 3)) == 3
    finished, failed, retried = ids

    assert cli.ok("finish", str(finished), "--data", '{"result": 42}') == {}
    cli.refused("404 No job with this jobID", 1, "query", str(finished))

    assert cli.ok("fail", str(failed)) == {}
    assert jobs.query_job(failed)["state"] == "FAILED"

    assert cli.ok("retry", str(retried), "--delay", "3600") == {}
    job = jobs.query_job(retried)
    assert job["state"] == "QUEUED"
    assert job["nextRun"] > datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")

    assert cli.ok("delete", str(retried)) == {}
    cli.refused("404 No job with this jobID", 1, "delete", str(retried))


def test_fail_with_an_error_records_it_as_the_last_error(cli, jobs):
    job_id = jobs.create_job("mail/send", max_attempts=2)
    assert jobs.get_job("mail/*")["jobID"] == job_id
    assert cli.ok("fail", str(job_id), "--error", "SMTP said 451") == {}
    job = jobs.query_job(job_id)
    assert (job["state"], job["lastError"]) == ("QUEUED", "SMTP said 451")


def test_failed_shows_last_errors_as_text_and_as_they_are_with_json(cli, jobs):
    assert cli("failed").stdout == "No FAILED jobs.\n"
    crashed, timed_out, other = jobs.create_jobs([{"name": "img/resize"}] * 3)
    jobs.create_job("img/thumb", max_attempts=1)
    assert len(jobs.get_jobs("img/*", 4)) == 4
    # As the worker manager records a failed worker; its stderr is anyone's.
    stderr = "Traceback (most recent call last):\n  \x1b[2J<script>\nValueError: bad\n"
    jobs.fail_job(crashed, data={"error": {"exitStatus": 3, "stderr": stderr}})
    jobs.fail_job(timed_out, error="timed out after 60s (worker killed)")
    jobs.fail_job(other, data={"error": {"code": 7, "why": ["a", "b"], "signal": "SIGKILL"}})
    jobs.fail_job(other + 1)
    done = cli("failed")
    assert (done.returncode, done.stderr) == (0, "")
    last_run = jobs.query_job(crashed)["lastRun"]
    assert done.stdout == f"""\
job {crashed} img/resize, last run {last_run}
    exit status 3
    Traceback (most recent call last):
      \\x1b[2J<script>
    ValueError: bad

job {timed_out} img/resize, last run {last_run}
    timed out after 60s (worker killed)

job {other} img/resize, last run {last_run}
    killed by signal SIGKILL
    code: 7
    why: ["a", "b"]

job {other + 1} img/thumb, last run {last_run}, attempt 1 of 1
    (no error recorded)
"""
    raw = cli.ok("failed", "img/resize", "--json")["jobs"]
    assert json.loads(raw[0]["lastError"]) == {"exitStatus": 3, "stderr": stderr}
    assert [job["lastError"] for job in raw[1:]] == [
        "timed out after 60s (worker killed)",
        '{"code":7,"why":["a","b"],"signal":"SIGKILL"}',
    ]


def test_requeue_revives_failed_jobs_and_may_rename_them(cli, jobs):
    ids = jobs.create_jobs([{"name": "w"}, {"name": "w"}, {"name": "w"}])
    assert len(jobs.get_jobs("w", 3)) == 3
    for job_id in ids:
        jobs.fail_job(job_id, error="broken")
    assert [job["jobID"] for job in cli.ok("failed", "--json")["jobs"]] == ids
    assert cli.ok("requeue", str(ids[0]), str(ids[1]), "--name", "w2") == {}
    assert [(j["name"], j["state"]) for j in map(jobs.query_job, ids)] == [
        ("w2", "QUEUED"), ("w2", "QUEUED"), ("w", "FAILED")]
    assert cli.ok("requeue", str(ids[2]), "999") == {}  # IDs of no job are skipped
    assert jobs.query_job(ids[2])["state"] == "QUEUED"
    done = cli("requeue")
    assert (done.returncode, done.stdout) == (2, "")
    assert "the following arguments are required: ID" in done.stderr


def test_status(cli, jobs):
    jobs.create_job("s")
    status = cli.ok("status")
    assert status["jobs"] == {"QUEUED": 1}
    assert status["version"]


def test_illegal_state_exits_3(cli, jobs):
    job_id = jobs.create_job("queued")
    cli.refused("405 Can only retry/finish RUNNING and RUNQUEUED jobs", 3, "finish", str(job_id))
    cli.refused("405 Can only fail RUNNING or RUNQUEUED jobs", 3, "fail", str(job_id))


def test_invalid_request_exits_2(cli, jobs):
    cli.refused("402 Malformed repeat", 2, "create", "x", "--repeat", "bogus")
    cli.refused(
        '402 Malformed repeat: a CRON rule is written "CRON 0 2 * * *"',
        2, "create", "x", "--repeat", "0 2 * * *",
    )
    cli.refused("402 Malformed firstRun", 2, "create", "x", "--first-run", "soon")
    assert jobs.status()["jobs"] == {}


@pytest.mark.parametrize("data", ["[1]", "{bad", '"text"', '{"x": NaN}'])
def test_data_must_be_a_json_object(cli, jobs, data):
    done = cli("create", "x", "--data", data)
    assert (done.returncode, done.stdout) == (2, "")
    assert "--data: must be a JSON object" in done.stderr
    assert jobs.status()["jobs"] == {}


# Every CreateJob parameter, and the wire commands beyond a job's basic life,
# run in this process (cli_here) for speed.

NOT_A_LEASE = "0123456789abcdef"


def test_create_takes_every_create_job_parameter(cli_here, jobs):
    parent = jobs.create_job("parent")
    assert jobs.get_job("parent")["jobID"] == parent
    created = cli_here.ok(
        "create", "report/nightly",
        "--data", '{"to": "ann"}',
        "--first-run", "2030-01-01 12:00:00",
        "--repeat", "finished, +1 day",
        "--priority", "250",
        "--retry-after", "+5 MINUTES",
        "--parent", str(parent),
        "--max-attempts", "5",
        "--retry-backoff", "fixed",
        "--retry-delay", "2.5",
        "--retry-max-delay", "60",
        "--cost", "3",
        "--time-windows", "01:00-05:00",
        "--time-zone", "Europe/Paris",
    )
    job = cli_here.ok("query", str(created["jobID"]))
    assert {k: job[k] for k in (
        "name", "data", "repeat", "priority", "retryAfter", "state", "maxAttempts",
        "retryBackoff", "retryDelay", "retryMaxDelay", "cost", "timeWindows", "timeZone",
        "nextRun")} == {
        "name": "report/nightly", "data": {"to": "ann"}, "repeat": "FINISHED, +1 DAY",
        "priority": 250, "retryAfter": "+5 MINUTES", "state": "PAUSED", "maxAttempts": 5,
        "retryBackoff": "fixed", "retryDelay": 2.5, "retryMaxDelay": 60, "cost": 3,
        "timeWindows": "01:00-05:00", "timeZone": "Europe/Paris",
        # Noon is outside the window: moved to its start, 01:00 in Paris (UTC+1).
        "nextRun": "2030-01-02 00:00:00.000",
    }
    # QueryJob has no parent key; Query has.
    rows = cli_here.ok("query", f"SELECT parentJobID FROM jobs WHERE jobID = {job['jobID']};")
    assert rows == {"headers": ["parentJobID"], "rows": [[parent]]}


def test_create_from_stdin_creates_a_job_per_line(cli, jobs):
    lines = [json.dumps({"name": f"bulk/{n}", "data": {"n": n}}) for n in range(1, 21)]
    lines[0] = json.dumps({"Name": "bulk/first", "data": {"path": "C:\\temp\nnext"},
                           "jobPriority": 1000, "retryAfter": "+5 MINUTES"})
    lines.insert(10, "   ")  # a blank line is skipped
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", "create", "--from", "-", "--server", cli.address],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=RUN_TIMEOUT,
        env=environment(None),
    )
    assert (done.returncode, done.stderr) == (0, ""), done
    ids = json.loads(done.stdout)["jobIDs"]
    assert ids == list(range(1, 21))  # in line order
    first = jobs.query_job(ids[0])
    assert (first["name"], first["data"], first["priority"], first["retryAfter"]) == (
        "bulk/first", {"path": "C:\\temp\nnext"}, 1000, "+5 MINUTES")
    assert jobs.query_job(ids[-1])["data"] == {"n": 20}


@given(st.lists(st.integers(1, 9) | st.integers(1, create_from.BATCH_BYTES), max_size=3000))
@example([1] * 2500)
def test_create_from_batches_keep_the_order_and_both_bounds(sizes):
    lines = [create_from.Line(n, {"name": "x"}, size) for n, size in enumerate(sizes, 1)]
    batches = list(create_from.batches(lines))
    assert [line for batch in batches for line in batch] == lines
    for batch in batches:
        assert 1 <= len(batch) <= create_from.BATCH_JOBS
        assert sum(line.size for line in batch) + len(batch) - 1 <= create_from.BATCH_BYTES
    # Each batch is cut only where the next line would not fit.
    for batch, after in itertools.pairwise(batches):
        wire = sum(line.size for line in batch) + len(batch) + after[0].size
        assert len(batch) == create_from.BATCH_JOBS or wire > create_from.BATCH_BYTES


def test_create_from_a_file_names_a_bad_line_and_keeps_within_a_requests_line(
    cli_here, jobs, tmp_path
):
    source = tmp_path / "jobs.jsonl"
    # A bad line creates nothing: every line is checked before sending.
    for bad, problem in [
        ('{"name": "ok"}\n{"name": \n', "line 2: not JSON (Expecting value at column 9)"),
        ('{"name": "ok"}\n\n[1, 2]\n', "line 3: not a JSON object: '[1, 2]'"),
        ('{"data": {}}\n', 'line 1: no "name": each line is a job object'),
        ('{"name": "ok"}\n\xff\n', "line 2: not UTF-8"),
    ]:
        source.write_bytes(bad.encode("latin-1"))
        done = cli_here("create", "--from", str(source))
        assert (done.returncode, done.stdout) == (2, ""), done
        assert done.stderr.startswith(f"jobserver: --from {problem}"), done.stderr
    assert jobs.status()["jobs"] == {}
    # Three jobs of 800 KB do not fit on one 2 MiB `jobs` line: the first
    # two go in one CreateJobs, the third in the next, with line 4; that
    # batch is refused, the first one's jobs stay and are printed.
    big = "x" * 800_000
    source.write_text("".join(json.dumps({"name": f"big/{n}", "data": {"big": big}}) + "\n"
                              for n in range(3)) + '{"name": "odd", "repeat": "SOMETIMES"}\n')
    done = cli_here("create", "--from", str(source))
    assert (done.returncode, json.loads(done.stdout)) == (2, {"jobIDs": [1, 2]}), done.stderr
    assert done.stderr.startswith("lines 3 to 4: 402 Malformed repeat")
    assert "none of their jobs was created" in done.stderr
    assert jobs.status()["jobs"] == {"QUEUED": 2}
    # --from describes each job on its line, so NAME and the job options
    # cannot go with it; a missing file is named.
    for args, message in [(["name", "--from", "-"], "NAME cannot go with it"),
                          (["--from", "-", "--priority", "1000"], "--priority cannot go with it"),
                          ([], "give the job's NAME, or --from FILE")]:
        done = cli_here("create", *args)
        assert done.returncode == 2 and message in done.stderr, done
    done = cli_here("create", "--from", str(tmp_path / "none.jsonl"))
    assert (done.returncode, done.stderr) == (
        2, f"jobserver: cannot read --from {tmp_path / 'none.jsonl'}: No such file or directory\n")


def test_create_unique_reuses_a_job_and_no_overwrite_keeps_its_data(cli_here, jobs):
    first = cli_here.ok("create", "only/one", "--data", '{"a": 1}', "--unique")["jobID"]
    again = cli_here.ok("create", "only/one", "--data", '{"a": 2}', "--unique", "--no-overwrite")
    assert again == {"jobID": first}
    assert jobs.query_job(first)["data"] == {"a": 1}
    assert cli_here.ok("create", "only/one", "--data", '{"b": 2}', "--unique") == {"jobID": first}
    assert jobs.query_job(first)["data"] == {"a": 1, "b": 2}
    assert cli_here.ok("create", "only/one")["jobID"] != first
    cli_here.refused("404 parentJobID does not exist", 1, "create", "child", "--parent", "999")


def test_get_count_takes_several_jobs_at_once(cli_here, jobs):
    ids = jobs.create_jobs([{"name": "batch/a"}, {"name": "batch/b"}, {"name": "batch/c"},
                            {"name": "batch/urgent", "jobPriority": 1000}])
    urgent = cli_here.ok("get", "batch/*", "--count", "5", "--priority", "1000")
    assert [job["jobID"] for job in urgent["jobs"]] == [ids[3]]
    taken = cli_here.ok("get", "batch/*", "--count", "2")
    assert [job["jobID"] for job in taken["jobs"]] == ids[:2]
    assert all(len(job["leaseID"]) == 16 for job in taken["jobs"])
    assert [jobs.query_job(i)["state"] for i in ids[:3]] == ["RUNNING", "RUNNING", "QUEUED"]
    assert [job["jobID"] for job in cli_here.ok("get", "batch/*", "--count", "5")["jobs"]] == [
        ids[2]]
    cli_here.refused("404 No job found", 1, "get", "batch/*", "--count", "5")
    # Without --count, get prints the job itself, as before.
    one = jobs.create_job("single")
    assert cli_here.ok("get", "single")["jobID"] == one


def test_query_takes_a_job_id_or_sql(cli_here, jobs):
    job_id = jobs.create_job("q/one", {"k": "v"})
    assert cli_here.ok("query", str(job_id))["data"] == {"k": "v"}
    # A whole number is a jobID, however it is typed.
    assert cli_here.ok("query", f" 00{job_id} ")["jobID"] == job_id
    cli_here.refused("404 No job with this jobID", 1, "query", "42")
    assert cli_here.ok("query", "SELECT jobID, name, data FROM jobs;") == {
        "headers": ["jobID", "name", "data"], "rows": [[job_id, "q/one", '{"k":"v"}']]}
    # Anything else is SQL, refused as the server refuses it.
    cli_here.refused("402 Query Missing Semicolon", 2, "query", "one")
    cli_here.refused("402 Query Missing Semicolon", 2, "query", "SELECT 1")
    done = cli_here("query", "DELETE FROM jobs;")
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "402 Bad query: not authorized\n")
    assert jobs.query_job(job_id)["state"] == "QUEUED"


def test_a_refusal_carries_the_servers_explanation_in_the_library_and_the_cli(cli, jobs):
    # The library: the `error` header's text is the exception's detail.
    with pytest.raises(InvalidRequest) as refused:
        jobs.query("SELECT * FROM jobz;")
    error = refused.value
    assert (error.status, error.detail) == ("402 Bad query", "no such table: jobz")
    assert str(error) == "402 Bad query: no such table: jobz"
    # It survives pickling (a worker pool hands exceptions between processes).
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    # A refusal without an explanation reads as its status line alone.
    with pytest.raises(JobNotFound) as missing:
        jobs.query_job(42)
    assert (str(missing.value), missing.value.detail) == ("404 No job with this jobID", None)
    # The command, as a script runs it: the explanation on stderr, exit 2.
    cli.refused("402 Bad query: no such table: jobz", 2, "query", "SELECT * FROM jobz;")


def test_update_replaces_data_schedule_and_priority(cli_here, jobs):
    job_id = jobs.create_job("u", {"a": 1}, repeat="HOURLY")
    assert cli_here.ok(
        "update", str(job_id), "--data", '{"b": 2}', "--repeat", "DAILY", "--priority", "850",
        "--next-run", "2030-05-06 07:08:09",
    ) == {}
    job = jobs.query_job(job_id)
    assert (job["data"], job["repeat"], job["priority"], job["nextRun"]) == (
        {"b": 2}, "DAILY", 850, "2030-05-06 07:08:09")
    assert cli_here.ok("update", str(job_id), "--data", "{}", "--clear-repeat") == {}
    assert (jobs.query_job(job_id)["repeat"], jobs.query_job(job_id)["data"]) == ("", {})
    cli_here.refused("404 No job with this jobID", 1, "update", "999", "--data", "{}")
    cli_here.refused("402 Malformed repeat", 2, "update", str(job_id), "--data", "{}",
                     "--repeat", "sometimes")


def test_a_wrong_lease_id_is_refused_with_409_on_every_report(cli_here, jobs):
    job_id = jobs.create_job("leased", retry_after="+1 HOUR")
    lease = jobs.get_job("leased")["leaseID"]
    for args in (["finish", str(job_id)], ["fail", str(job_id)], ["retry", str(job_id)],
                 ["update", str(job_id), "--data", "{}"], ["touch", str(job_id)],
                 ["await-reply", str(job_id), "key-1"]):
        cli_here.refused("409 Lease expired", 3, *args, "--lease-id", NOT_A_LEASE)
    assert jobs.query_job(job_id)["state"] == "RUNQUEUED"
    assert cli_here.ok("finish", str(job_id), "--lease-id", lease) == {}
    cli_here.refused("404 No job with this jobID", 1, "query", str(job_id))


def test_fail_and_retry_take_their_lease_and_options(cli_here, jobs):
    failed, retried = jobs.create_jobs([{"name": "f"}, {"name": "r", "repeat": "HOURLY"}])
    leases = {job["jobID"]: job["leaseID"] for job in jobs.get_jobs("*", 2)}
    assert cli_here.ok("fail", str(failed), "--error", "disk full", "--data", '{"n": 1}',
                       "--lease-id", leases[failed]) == {}
    assert {k: jobs.failed_jobs()[0][k] for k in ("jobID", "lastError")} == {
        "jobID": failed, "lastError": "disk full"}
    assert jobs.query_job(failed)["data"] == {"n": 1}
    assert cli_here.ok(
        "retry", str(retried), "--next-run", "2031-02-03 04:05:06", "--ignore-repeat",
        "--name", "r2", "--priority", "0", "--data", '{"m": 2}', "--lease-id", leases[retried],
    ) == {}
    job = jobs.query_job(retried)
    assert (job["state"], job["nextRun"], job["name"], job["priority"], job["data"]) == (
        "QUEUED", "2031-02-03 04:05:06", "r2", 0, {"m": 2})


def test_touch_renews_a_lease_or_restarts_the_stale_count(cli_here, jobs):
    leased = jobs.create_job("t/leased", retry_after="+1 HOUR")
    running = jobs.create_job("t/running")
    job = jobs.get_job("t/leased")
    jobs.get_job("t/running")
    renewed = cli_here.ok("touch", str(leased), "--lease-id", job["leaseID"])
    assert list(renewed) == ["nextRun"] and renewed["nextRun"] >= job["nextRun"]
    assert jobs.query_job(leased)["nextRun"] == renewed["nextRun"]
    assert list(cli_here.ok("touch", str(running))) == ["staleAt"]
    queued = jobs.create_job("t/queued")
    cli_here.refused("405 Can only touch RUNNING or RUNQUEUED jobs", 3, "touch", str(queued))


def test_await_reply_parks_a_job_until_deliver(cli_here, jobs):
    job_id, other = jobs.create_jobs([{"name": "hook"}, {"name": "hook"}])
    leases = {job["jobID"]: job["leaseID"] for job in jobs.get_jobs("hook", 2)}
    parked = cli_here.ok("await-reply", str(job_id), "order-7", "--timeout", "600",
                         "--data", '{"order": 7}', "--lease-id", leases[job_id])
    assert parked["state"] == "WAITING" and parked["replyDeadline"]
    shown = jobs.query_job(job_id)
    assert (shown["state"], shown["replyKey"], shown["data"]) == ("WAITING", "order-7",
                                                                  {"order": 7})
    cli_here.refused("409 Another job waits on this key", 3, "await-reply", str(other), "order-7")
    assert cli_here.ok("deliver", "order-7", "--data", '{"paid": true}') == {"jobID": job_id}
    shown = jobs.query_job(job_id)
    assert (shown["state"], shown["data"]) == ("QUEUED", {"order": 7, "reply": {"paid": True}})
    cli_here.refused("405 Can only await a reply for RUNNING or RUNQUEUED jobs", 3,
                     "await-reply", str(job_id), "order-8")


def test_cancel_a_child(cli_here, jobs):
    parent = jobs.create_job("parent")
    jobs.get_job("parent")
    child = jobs.create_job("child", parent_job_id=parent)
    jobs.finish_job(parent)
    assert jobs.query_job(child)["state"] == "QUEUED"
    assert cli_here.ok("cancel", str(child)) == {}
    assert jobs.query_job(child)["state"] == "CANCELLED"
    assert jobs.query_job(parent)["state"] == "QUEUED"
    cli_here.refused("404 Invalid jobID - Cannot cancel a job with children", 1,
                     "cancel", str(parent))
    lone = jobs.create_job("lone")
    cli_here.refused("404 Invalid jobID - Cannot cancel a job without a parent", 1,
                     "cancel", str(lone))


def test_pause_resume_and_set_limit(cli_here, jobs):
    job_id = jobs.create_job("mail/send", cost=2)
    assert cli_here.ok("pause", "mail/*") == {}
    assert jobs.status()["paused"] == ["mail/*"]
    cli_here.refused("404 No job found", 1, "get", "mail/*")
    assert cli_here.ok("resume", "mail/*") == {}
    assert cli_here.ok("set-limit", "mail/*", "1") == {}
    assert jobs.status()["limits"] == {"mail/*": {"max": 1, "running": 0}}
    cli_here.refused("404 No job found", 1, "get", "mail/*")  # costs 2, the limit is 1
    assert cli_here.ok("set-limit", "mail/*", "0") == {}
    assert jobs.status()["limits"] == {}
    assert cli_here.ok("get", "mail/*")["jobID"] == job_id
    # A job that could never run under a limit is refused, by the server.
    assert cli_here.ok("set-limit", "mail/*", "1") == {}
    cli_here.refused("402 Cost 2 exceeds limit mail/* (max 1)", 2, "create", "mail/x",
                     "--cost", "2")


def test_set_limit_takes_a_rate_per_key_and_fair_and_create_a_key(cli_here, jobs):
    assert cli_here.ok("set-limit", "mail/*", "1", "--rate", "100/1m", "--per-key",
                       "--fair") == {}
    assert jobs.status()["limits"] == {"mail/*": {
        "max": 1, "rate": "100/1m", "perKey": True, "fair": True, "running": 0,
        "inWindow": 0, "keys": 0}}
    acme = cli_here.ok("create", "mail/a", "--key", "acme")["jobID"]
    cli_here.ok("create", "mail/b", "--key", "acme")
    globex = cli_here.ok("create", "mail/c", "--key", "globex")["jobID"]
    assert cli_here.ok("query", str(acme))["key"] == "acme"
    # One running job per key: acme's second waits.
    taken = cli_here.ok("get", "mail/*", "--count", "5")["jobs"]
    assert {job["jobID"] for job in taken} == {acme, globex}
    # A rate alone needs no MAX; each run replaces the whole limit.
    assert cli_here.ok("set-limit", "mail/*", "--rate", "2/1h") == {}
    assert jobs.status()["limits"]["mail/*"] == {"max": 0, "rate": "2/1h", "running": 2,
                                                    "inWindow": 0}
    assert cli_here.ok("set-limit", "mail/*", "--fair") == {}
    assert jobs.status()["limits"]["mail/*"] == {"max": 0, "fair": True, "running": 2}
    assert cli_here.ok("set-limit", "mail/*", "0") == {}
    assert jobs.status()["limits"] == {}


def test_create_from_takes_each_lines_key(cli_here, jobs, tmp_path):
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"name": "t/a", "key": "acme"}\n{"name": "t/b"}\n')
    first, second = cli_here.ok("create", "--from", str(lines))["jobIDs"]
    assert jobs.query_job(first)["key"] == "acme"
    assert "key" not in jobs.query_job(second)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "t/c"}\n{"name": "t/d", "key": "a\\tb"}\n')
    done = cli_here("create", "--from", str(bad))
    assert done.returncode == 2 and "402 Malformed key" in done.stderr, done
    # A batch is created all or none.
    assert jobs.status()["jobs"] == {"QUEUED": 2}


def test_ping_and_queues(cli_here, jobs, capsys):
    assert cli_here.ok("ping") == {}
    jobs.create_jobs([{"name": "email/send"}, {"name": "email/bounce"}, {"name": "report"}])
    body = cli_here.ok("queues", "--limit", "1")
    assert [(q["queue"], q["total"], q["jobs"]) for q in body["queues"]] == [
        ("email", 2, {"QUEUED": 2})]
    assert body["more"] == 1
    dead = run_here(capsys, "ping", "--server", f"127.0.0.1:{free_port()}")
    assert (dead.returncode, dead.stdout) == (5, "")
    assert dead.stderr.startswith("jobserver: cannot connect to 127.0.0.1:")


def test_finish_several_reports_each_job_and_exits_as_the_first_refused(cli_here, jobs):
    ids = jobs.create_jobs([{"name": "w"}, {"name": "w"}, {"name": "w"}])
    leases = [job["leaseID"] for job in jobs.get_jobs("w", 3)]
    first, second, third = ids
    done = cli_here("finish", *map(str, ids), "--data", '{"done": 1}',
                    "--lease-id", leases[0], "--lease-id", NOT_A_LEASE, "--lease-id", leases[2])
    assert done.returncode == 3
    assert json.loads(done.stdout) == {"results": [
        {"jobID": first, "status": "200 OK"},
        {"jobID": second, "status": "409 Lease expired"},
        {"jobID": third, "status": "200 OK"},
    ]}
    assert done.stderr == f"job {second}: 409 Lease expired\n"
    # The others were finished all the same; the refused one is untouched.
    assert jobs.query_job(second)["state"] == "RUNNING"
    cli_here.refused("404 No job with this jobID", 1, "query", str(first))
    done = cli_here("finish", str(second), "999999")
    assert (done.returncode, done.stderr) == (1, "job 999999: 404 No job with this jobID\n")
    assert json.loads(done.stdout)["results"][0] == {"jobID": second, "status": "200 OK"}
    more = jobs.create_jobs([{"name": "v"}, {"name": "v"}])
    jobs.get_jobs("v", 2)
    assert cli_here.ok("finish", *map(str, more)) == {"results": [
        {"jobID": more[0], "status": "200 OK"}, {"jobID": more[1], "status": "200 OK"}]}


# top.


def test_top_once_shows_the_headline_and_the_queues_with_their_ages(cli_here, jobs, server):
    waiting = jobs.create_job("email/send")
    jobs.create_jobs([{"name": "email/bounce"}, {"name": "report/daily"}])
    jobs.get_job("report/*")
    force(server.db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?",
          (fmt(utcnow() - timedelta(hours=2, minutes=5)), waiting))
    jobs.pause_jobs("email/*")
    jobs.set_limit("report/*", 4)
    done = cli_here("top", "--once")
    assert (done.returncode, done.stderr) == (0, "")
    assert "\x1b" not in done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].startswith("jobserver ") and f"at {cli_here.address}, up " in lines[0]
    assert lines[1] == "connections 2  waiting GetJobs 0  jobs 3: QUEUED 2, RUNNING 1"
    assert lines[2:5] == ["paused: email/*", "limits: report/* 1/4", ""]
    # Its jobs are held by the pause: not ready, so no age.
    assert lines[5].split() == [
        "QUEUE", "QUEUED", "RUNNING", "TOTAL", "OLDEST", "READY", "PAUSED"
    ]
    assert lines[6].split() == ["email", "2", "0", "2", "-", "2"]
    assert lines[7].split() == ["report", "0", "1", "1", "-", "0"]
    # What runs, and who took it (this client's library connection): the
    # longest first; then the idle workers.
    assert lines[8:10] == ["", "running: 1 of 1, the longest first"]
    assert lines[10].split() == ["JOB", "NAME", "WORKER", "RUNNING", "FOR", "LAST", "REPORT"]
    row = lines[11].split()
    assert row[:2] == [str(waiting + 2), "report/daily"] and row[2].startswith("127.0.0.1:")
    assert row[-1] == "ago"
    assert lines[12:] == ["idle workers: none waiting"]
    shorter = cli_here("top", "--once", "--limit", "1").stdout.splitlines()
    assert "... and 1 more queue (--limit)" in shorter


def test_top_once_shows_each_limits_rate_keys_and_fairness_with_their_use(cli_here, jobs):
    jobs.request("SetLimit", {"name": "api/*", "max": 2, "rate": "2/1h", "perKey": "true",
                              "fair": "true"})
    jobs.request("SetLimit", {"name": "hooks/*", "rate": "5/1m"})
    jobs.set_limit("report/*", 4)
    jobs.create_jobs([{"name": "api/x", "key": key} for key in "aaab"] + [{"name": "hooks/x"}])
    # a's rate is spent at 2 (its capacity too), b runs 1: 3 running, of 2 keys.
    assert len(jobs.get_jobs("api/*", 10)) == 3
    done = cli_here("top", "--once")
    assert (done.returncode, done.stderr) == (0, "")
    limits = next(line for line in done.stdout.splitlines() if line.startswith("limits: "))
    assert limits == (
        "limits: api/* 3 running (2 keys; 2 a key), rate 2 of 2/1h a key, fair; "
        "hooks/* 0 running, rate 0 of 5/1m; report/* 0/4"
    )


@pytest.mark.parametrize("seconds, shown", [
    (None, "-"), (0, "0.0s"), (12.345, "12.3s"), (59.96, "1m00s"), (184, "3m04s"),
    (3599.4, "59m59s"), (3599.6, "1h00m"), (86399, "23h59m"), (2 * 86400 + 3 * 3600, "2d03h"),
])
def test_top_shows_ages_to_a_useful_precision(seconds, shown):
    frame = top.render("h:1", datetime(2030, 1, 1, tzinfo=UTC), {}, {"queues": [
        {"queue": "q", "jobs": {"QUEUED": 1}, "total": 1, "oldestReadyAge": seconds}]})
    assert frame.splitlines()[-1].split()[-1] == shown


def test_top_cuts_long_names_and_shows_no_control_characters():
    frame = top.render("h:1", datetime(2030, 1, 1, tzinfo=UTC), {"version": "1\x1b[2J"}, {
        "queues": [{"queue": "x" * 40, "jobs": {"NEWSTATE": 2, "FAILED": 1, "QUEUED": 3},
                    "total": 6, "oldestReadyAge": None}], "more": 0})
    assert "\x1b" not in frame and frame.startswith("jobserver 1?[2J at h:1, up -")
    assert frame.splitlines()[-2].split() == ["QUEUE", "QUEUED", "FAILED", "NEWSTATE", "TOTAL",
                                             "OLDEST", "READY"]
    assert frame.splitlines()[-1].split() == ["x" * 29 + "...", "3", "1", "2", "6", "-"]


def test_top_shows_what_runs_by_whom_and_which_workers_wait_for_what():
    status = {"waitingByName": [
        {"name": "email/*", "waiting": 2}, {"name": "sms\x1b", "waiting": 1}]}
    running = {
        "jobs": [{"jobID": 7, "name": "report", "worker": "10.0.0.2:5000",
                  "runningSeconds": 312.5, "lastReport": "2030-01-01 00:00:00"}],
        "total": 3, "now": "2030-01-01 00:00:12",
    }
    frame = top.render("h:1", datetime(2030, 1, 1, tzinfo=UTC), status, {"queues": []}, running)
    lines = frame.splitlines()
    assert "\x1b" not in frame
    at = lines.index("running: 1 of 3, the longest first")
    assert lines[at + 2].split() == ["7", "report", "10.0.0.2:5000", "5m12s", "12.0s", "ago"]
    assert lines[-1] == "idle workers (waiting GetJobs by name): email/* 2, sms? 1"


def test_top_once_exits_as_the_client_commands_when_the_server_is_away(capsys):
    done = run_here(capsys, "top", "--once", "--server", f"127.0.0.1:{free_port()}")
    assert (done.returncode, done.stdout) == (5, "")
    assert done.stderr.startswith("jobserver: cannot connect to 127.0.0.1:")


class Output:
    """A subprocess's stdout, read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """SIGINT as a terminal's foreground program has it, for a child started
    meanwhile. A test run started in the background (`pytest ... &` in a
    script) ignores SIGINT, its xdist workers too, and a child inherits
    that: Python then sets no KeyboardInterrupt, and Ctrl-C cannot stop
    `top` (the kernel's SigIgn for it said so)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _wait_for_exit(proc: subprocess.Popen[str], sent: str) -> None:
    """Wait for `proc` to exit after `sent`; if it does not, fail with what
    would tell why: its state and signal masks (pending, blocked, ignored,
    caught) as the kernel keeps them, and what it wrote to stderr."""
    try:
        proc.wait(timeout=DEADLINE)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        with open(f"/proc/{proc.pid}/status") as status:
            kept = [
                line.strip() for line in status
                if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
            ]
    except OSError as error:
        kept = [f"no status: {error}"]
    proc.kill()
    proc.wait()
    err = proc.stderr.read() if proc.stderr is not None else ""
    pytest.fail(f"still running {DEADLINE} s after {sent}: {kept}; stderr: {err[-4000:]!r}")


def test_top_keeps_asking_a_server_that_went_away_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    with _sigint_not_ignored():
        top = subprocess.Popen(
            [sys.executable, "-m", "jobserver", "top", "--interval", "0.1",
             "--server", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(None),
        )
    server = None
    try:
        output = Output(top)
        until(lambda: output.text().count("no answer: cannot connect") >= 2, RUN_TIMEOUT,
              "two frames saying the server does not answer")
        server = ThreadServer(tmp_path / "jobs.db", port=port)
        Client(port=port, timeout=10).create_job("came/back")
        until(lambda: "\ncame " in output.text(), RUN_TIMEOUT, "a frame with the queue")
        top.send_signal(signal.SIGINT)
        _wait_for_exit(top, "SIGINT")
        output.thread.join(DEADLINE)
        assert top.stderr is not None
        err = top.stderr.read()
    finally:
        top.kill()
        if server is not None:
            server.stop()
    assert (top.returncode, err) == (0, "")
    text = output.text()
    assert "\x1b" not in text
    assert text.startswith(f"jobserver top: 127.0.0.1:{port}  ")
    assert "asking again every 0.1s; Ctrl-C to stop\n" in text
    # Frames one after another, a blank line between.
    assert "\n\njobserver top: " in text
    assert re.search(rf"\n\njobserver \S+ at 127\.0\.0\.1:{port}, up ", text)


@pytest.mark.parametrize("args", [
    ["create"],
    ["create", "x", "--priority", "7"],
    ["retry", "1", "--delay", "soon"],
    ["bogus"],
])
def test_usage_errors_exit_2(cli, args):
    done = cli(*args)
    assert (done.returncode, done.stdout) == (2, "")
    assert "usage:" in done.stderr


@pytest.mark.parametrize("args, refused_by", [
    (["serve", "--prot", "9000"], "jobserver serve"),
    (["create", "x", "--bogus"], "jobserver create"),
    (["ping", "--server", "127.0.0.1:1", "extra"], "jobserver ping"),
    (["--bogus", "ping"], "jobserver"),
])
def test_an_unknown_option_prints_its_subcommands_usage(args, refused_by):
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", *args], capture_output=True, text=True, timeout=60
    )
    unknown = " ".join(word for word in args if word in ("--prot", "9000", "--bogus", "extra"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"usage: {refused_by} ["), done.stderr
    assert done.stderr.endswith(f"{refused_by}: error: unrecognized arguments: {unknown}\n")


def test_server_error_exits_4():
    server = FakeServer([reply("503 Database unavailable: disk I/O error")])
    try:
        done = run("status", "--server", f"127.0.0.1:{server.port}")
    finally:
        server.stop()
    assert (done.returncode, done.stdout, done.stderr) == (
        4, "", "503 Database unavailable: disk I/O error\n")


def test_cannot_connect_exits_5():
    done = run("status", "--server", f"127.0.0.1:{free_port()}")
    assert (done.returncode, done.stdout) == (5, "")
    assert done.stderr.startswith("jobserver: cannot connect to 127.0.0.1:")


def test_bad_server_address_exits_2():
    done = run("status", "--server", "localhost:http")
    assert (done.returncode, done.stdout) == (2, "")
    assert "not a server address" in done.stderr


NEEDS_PORT = "a server address needs its port, HOST:PORT or [IPV6]:PORT (such as 127.0.0.1:8888)"


def test_a_server_without_its_port_is_a_usage_error_not_port_8888(capsys, caplog, monkeypatch):
    monkeypatch.delenv("JOBSERVER_SERVER", raising=False)
    for args in (["ping", "--server", "127.0.0.1"], ["top", "--once", "--server", "[::1]"],
                 ["worker-manager", "--worker-path", ".", "--server", "localhost"]):
        done = run_here(capsys, *args)
        assert (done.returncode, done.stdout) == (2, ""), done
        assert f"argument --server: {NEEDS_PORT}, not '{args[-1]}'" in done.stderr
    monkeypatch.setenv("JOBSERVER_SERVER", "127.0.0.1")
    done = run_here(capsys, "ping")
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"jobserver: $JOBSERVER_SERVER: {NEEDS_PORT}, not '127.0.0.1'\n")
    assert run_here(capsys, "worker-manager", "--worker-path", ".").returncode == 2
    assert f"$JOBSERVER_SERVER: {NEEDS_PORT}" in caplog.text
    # The library keeps its documented default port for a bare host.
    assert Client.from_address("127.0.0.1").port == 8888


def test_a_name_list_with_a_wildcard_in_it_is_refused_before_sending(capsys):
    # FailedJobs matches each name of a comma list exactly (as Bedrock
    # does): 'report/*' in a list would only ever take a job named
    # 'report/*'. GetJobs takes a list of patterns (get, the workers).
    for args in (["failed", "img/slow, report/?"], ["failed", "a,b,[rs]*"]):
        done = run_here(capsys, *args, "--server", "127.0.0.1:1")
        assert (done.returncode, done.stdout) == (2, ""), done
        assert "is a comma-separated list, and the names of a list are matched exactly here" in (
            done.stderr)
    glob = re.escape("[rs]*")
    assert re.search(f"so '{glob}' would only take a job named '{glob}' itself", done.stderr)
    # One pattern, a list of exact names, and a pattern ending in a comma
    # (one piece: a GLOB) are taken as they are.
    parser = build_parser()
    for pattern in ("report/*", "report/daily, img/slow", "report/*,", "*"):
        assert parser.parse_args(["get", pattern]).pattern == pattern
        assert parser.parse_args(["failed", pattern]).pattern == pattern
        args = parser.parse_args(["worker-manager", "--worker-path", ".", "--job-name", pattern])
        assert args.job_name == pattern
    for listed in ("report/*,img/slow", "a,b,[rs]*"):
        assert parser.parse_args(["get", listed]).pattern == listed
        args = parser.parse_args(["worker-manager", "--worker-path", ".", "--job-name", listed])
        assert args.job_name == listed


def test_server_from_the_environment(server):
    live = {"JOBSERVER_SERVER": f"127.0.0.1:{server.port}"}
    done = run("create", "from/env", env=live)
    assert (done.returncode, json.loads(done.stdout)) == (0, {"jobID": 1})
    dead = {"JOBSERVER_SERVER": f"127.0.0.1:{free_port()}"}
    assert run("status", env=dead).returncode == 5
    assert run("status", "--server", f"127.0.0.1:{server.port}", env=dead).returncode == 0


def test_the_client_commands_start_without_trio_the_server_or_the_worker_manager():
    # What a client command imports is what it costs to start (docs/benchmarks.md,
    # bench/startup.py); `jobserver --help` builds every parser.
    # ssl comes with a client that speaks TLS (test_tls_with_a_ca_file).
    code = (
        "import sys, jobserver.cli\n"
        "jobserver.cli.build_parser('')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'dateutil', 'ssl')\n"
        "             or m.startswith(('jobserver.server', 'jobserver.storage', 'jobserver.web',\n"
        "                              'jobserver.workers', 'jobserver.core.commands.params'))))\n"
        "from jobserver.client import AsyncClient, TrioClient\n"
        "print(AsyncClient.__module__, TrioClient.__module__, 'trio' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env=environment(None))
    assert (done.returncode, done.stderr) == (0, ""), done
    # The async clients are still there, TrioClient bringing trio once asked for.
    assert done.stdout == (
        "[]\njobserver.client.async_client jobserver.client.trio_client True\n"
    )


def test_help_documents_the_exit_statuses(capsys):
    done = run("--help")
    assert done.returncode == 0
    for line in ("1  not found (404)", "2  usage error", "3  the job's state", "4  server error",
                 "5  cannot connect"):
        assert line in done.stdout
    for command in (*CLIENT_COMMANDS, "top"):
        assert f"    {command} " in done.stdout
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0
        text = capsys.readouterr().out
        assert "--server HOST:PORT" in text and "JOBSERVER_SERVER" in text
        epilog = "5  with --once: cannot connect" if command == "top" else "5  cannot connect"
        assert epilog in text


# TLS.


def test_tls_with_a_ca_file(secure):
    running, files = secure
    cli = Cli(f"127.0.0.1:{running.port}")
    assert cli.ok("create", "secure/one", "--tls-ca", str(files.ca)) == {"jobID": 1}
    assert cli.ok("query", "1", "--tls", "--tls-ca", str(files.ca))["name"] == "secure/one"
    by_name = Cli(f"localhost:{running.port}")
    assert by_name.ok("status", "--tls-ca", str(files.ca))["jobs"] == {"QUEUED": 1}


def test_an_untrusted_certificate_is_exit_5_with_a_plain_message(secure):
    running, _ = secure
    done = run("status", "--tls", "--server", f"127.0.0.1:{running.port}")
    assert (done.returncode, done.stdout) == (5, "")
    assert done.stderr.startswith(f"jobserver: cannot connect to 127.0.0.1:{running.port}: "
                                  "the server's TLS certificate is not trusted (")
    assert "give that CA's certificate with --tls-ca FILE" in done.stderr


def test_a_ca_file_that_cannot_be_read_is_exit_2(tmp_path):
    done = run("status", "--tls-ca", str(tmp_path / "missing.pem"))
    assert (done.returncode, done.stdout) == (2, "")
    assert f"cannot read CA certificates from {tmp_path / 'missing.pem'}" in done.stderr


def test_a_plaintext_command_meeting_a_tls_server_says_to_use_tls(secure):
    running, _ = secure
    done = run("status", "--server", f"127.0.0.1:{running.port}")
    assert (done.returncode, done.stdout, done.stderr) == (
        5, "", f"jobserver: the server at 127.0.0.1:{running.port} requires TLS: use --tls\n")


def test_a_tls_command_meeting_a_plaintext_server_says_it_does_not_speak_tls(server):
    done = run("status", "--tls", "--server", f"127.0.0.1:{server.port}")
    assert (done.returncode, done.stdout) == (5, "")
    assert done.stderr.startswith(
        f"jobserver: the server at 127.0.0.1:{server.port} does not speak TLS")


CLIENT_COMMANDS = ("create", "get", "query", "update", "touch", "await-reply", "finish", "fail",
                   "retry", "cancel", "delete", "status", "queues", "ping", "failed", "requeue",
                   "pause", "resume", "set-limit", "deliver")


def option_entries(help_text: str) -> dict[str, str]:
    """Each option of a --help text with its help, on one line."""
    section = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("  -"):
            name, _, rest = line.strip().partition("  ")
            entries[name] = rest.strip()
            last = name
        else:
            entries[last] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", [*CLIENT_COMMANDS, "top", "worker-manager"])
def test_every_option_shows_one_sensible_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    done = run_here(capsys, command, "--help")
    assert done.returncode == 0
    for option, text in option_entries(done.stdout).items():
        if option == "-h, --help":
            continue
        if "(required)" in text:
            assert "default" not in text, (option, text)
        else:
            assert text.count("default") == 1 and "(default: " in text, (option, text)
        assert "None" not in text, (option, text)


def test_the_help_says_what_the_token_variable_holds():
    for command in ("status", "worker-manager"):
        text = " ".join(run(command, "--help").stdout.split())
        assert "$JOBSERVER_AUTH_TOKEN, which holds the token itself, not a file name" in text


def test_failed_points_to_jobserver_requeue():
    assert "jobserver requeue ID" in run("failed", "--help").stdout


def test_the_managers_log_level_shows_its_default_and_is_checked():
    text = " ".join(run("worker-manager", "--help").stdout.split())
    assert "--log-level LEVEL DEBUG, INFO, WARNING or ERROR (default: INFO)" in text
    done = run("worker-manager", "--worker-path", ".", "--log-level", "LOUD")
    assert done.returncode == 2
    assert "argument --log-level: invalid choice: 'LOUD'" in done.stderr


# Option ranges: refused by the parser, before anything is sent.

OUT_OF_RANGE = [
    (["get", "x", "--wait", "-1"], "argument --wait: must be a number from 0 to 3600, not '-1'"),
    (["get", "x", "--wait", "3600.5"], "argument --wait: must be a number from 0 to 3600"),
    (["get", "x", "--wait", "nan"], "argument --wait: must be a number from 0 to 3600"),
    (["failed", "--limit", "0"], "argument --limit: must be a whole number from 1 to 10000"),
    (["failed", "--limit", "10001"], "argument --limit: must be a whole number from 1 to 10000"),
    (["retry", "1", "--delay", "-1"],
     "argument --delay: must be a whole number from 0 to 99999999, not '-1'"),
    (["retry", "1", "--delay", "100000000"], "argument --delay: must be a whole number from 0"),
    (["retry", "1", "--delay", "1.5"], "argument --delay: must be a whole number from 0"),
    (["query", "0"],
     "argument ID|SQL: must be a whole number from 1 to 9223372036854775807, not '0'"),
    (["query", "-3"], "argument ID|SQL: must be a whole number from 1"),
    (["finish", "-3"], "argument ID: must be a whole number from 1"),
    (["delete", "9223372036854775808"], "argument ID: must be a whole number from 1"),
    (["requeue", "1", "0"], "argument ID: must be a whole number from 1"),
    (["fail", "x"], "argument ID: must be a whole number from 1"),
    (["create", "x", "--priority", "7"], "argument --priority: invalid choice: 7"),
    (["status", "--server", "127.0.0.1:70000"], "argument --server: not a server address"),
    (["status", "--server", "127.0.0.1:0"], "argument --server: not a server address"),
    (["create", "x", "--max-attempts", "0"],
     "argument --max-attempts: must be a whole number from 1 to 10000, not '0'"),
    (["create", "x", "--max-attempts", "10001"], "argument --max-attempts: must be a whole number"),
    (["create", "x", "--max-attempts", "2", "--retry-backoff", "linear"],
     "argument --retry-backoff: invalid choice: 'linear'"),
    (["create", "x", "--max-attempts", "2", "--retry-delay", "-1"],
     "argument --retry-delay: must be a number of seconds from 0 to 99999999 with at most 3 "
     "decimals, not '-1'"),
    (["create", "x", "--max-attempts", "2", "--retry-delay", "0.0001"],
     "argument --retry-delay: must be a number of seconds"),
    (["create", "x", "--max-attempts", "2", "--retry-max-delay", "100000000"],
     "argument --retry-max-delay: must be a number of seconds"),
    (["create", "x", "--retry-delay", "5"], "--retry-delay needs --max-attempts"),
    (["create", "x", "--retry-backoff", "fixed"], "--retry-backoff needs --max-attempts"),
    (["create", "x", "--no-overwrite"], "--no-overwrite needs --unique"),
    (["create", "x", "--time-zone", "UTC"], "--time-zone needs --time-windows"),
    (["create", "x", "--cost", "0"], "argument --cost: must be a whole number from 1 to 1000000"),
    (["create", "x", "--cost", "1000001"], "argument --cost: must be a whole number from 1"),
    (["create", "x", "--time-windows", "25:00-26:00"], "argument --time-windows: must be 1 to 20"),
    (["create", "x", "--time-windows", ",".join(["01:00-02:00"] * 21)],
     "argument --time-windows: must be 1 to 20 windows"),
    (["create", "x", "--time-windows", "01:00-02:00", "--time-zone", "Mars/Olympus"],
     "argument --time-zone: must be an IANA time zone"),
    (["create", "x", "--parent", "0"], "argument --parent: must be a whole number from 1"),
    (["get", "x", "--count", "0"], "argument --count: must be a whole number from 1 to 1000"),
    (["get", "x", "--count", "1001"], "argument --count: must be a whole number from 1 to 1000"),
    (["get", "x", "--priority", "1"], "argument --priority: invalid choice: 1"),
    (["update", "1"], "the following arguments are required: --data"),
    (["update", "1", "--data", "{}", "--repeat", "DAILY", "--clear-repeat"],
     "argument --clear-repeat: not allowed with argument --repeat"),
    (["touch", "1", "--lease-id", ""], "argument --lease-id: must be a lease token"),
    (["fail", "1", "--lease-id", "0123456789ABCDEF"], "argument --lease-id: must be a lease token"),
    (["finish", "1", "--lease-id", "0123456789abcde"],
     "argument --lease-id: must be a lease token"),
    (["finish", "1", "2", "--lease-id", "0123456789abcdef"],
     "2 IDs take 2 --lease-id, one per ID in the same order, or none; 1 given"),
    (["finish", *map(str, range(1, 1002))], "at most 1000 IDs, not 1001"),
    (["retry", "1", "--delay", "5", "--next-run", "2030-01-01"],
     "argument --next-run: not allowed with argument --delay"),
    (["await-reply", "1", ""], "argument KEY: must be a key of 1 to 255 bytes"),
    (["await-reply", "1", "k" * 256], "argument KEY: must be a key of 1 to 255 bytes"),
    (["await-reply", "1", "k", "--timeout", "0"],
     "argument --timeout: must be a whole number from 1 to 2592000, not '0'"),
    (["await-reply", "1", "k", "--timeout", "2592001"], "argument --timeout: must be a whole"),
    (["deliver", "", "--data", "{}"], "argument KEY: must be a key of 1 to 255 bytes"),
    (["pause", ""], "argument PATTERN: must be a GLOB pattern of 1 to 255 bytes"),
    (["resume", "p" * 256], "argument PATTERN: must be a GLOB pattern of 1 to 255 bytes"),
    (["set-limit", "a\tb", "1"], "argument PATTERN: must be a GLOB pattern"),
    (["set-limit", "a", "-1"], "argument MAX: must be a whole number from 0 to 1000000000"),
    (["set-limit", "a", "1000000001"], "argument MAX: must be a whole number from 0"),
    (["set-limit", "a"], "give MAX, --rate or --fair (MAX 0 alone removes the limit)"),
    (["set-limit", "a", "--per-key"], "give MAX, --rate or --fair"),
    (["set-limit", "a", "0", "--per-key"], "--per-key needs MAX above 0, --rate or --fair"),
    (["set-limit", "a", "--rate", "5/1w"],
     "argument --rate: must be N/DURATION, N 1 to 10000 per 1s to 1d (a number of s, m, h or "
     "d), such as 100/1m, not '5/1w'"),
    (["set-limit", "a", "--rate", "10001/1s"], "argument --rate: must be N/DURATION"),
    (["set-limit", "a", "--rate", "1/2d"], "argument --rate: must be N/DURATION"),
    (["set-limit", "a", "--rate", "0/1s"], "argument --rate: must be N/DURATION"),
    (["create", "x", "--key", "k" * 256],
     "argument --key: must be at most 255 bytes without control characters"),
    (["create", "x", "--key", "a\tb"], "argument --key: must be at most 255 bytes"),
    (["create", "--from", "-", "--key", "a"],
     "--from takes each job from its line: --key cannot go with it"),
    (["queues", "--limit", "0"], "argument --limit: must be a whole number from 1 to 1000"),
    (["top", "--interval", "0.05"], "argument --interval: must be a number from 0.1 to 3600"),
    (["top", "--interval", "3601"], "argument --interval: must be a number from 0.1 to 3600"),
    (["top", "--limit", "1001"], "argument --limit: must be a whole number from 1 to 1000"),
    (["worker-manager", "--worker-path", ".", "--max-workers", "0"],
     "argument --max-workers: must be a whole number of at least 1, not '0'"),
    (["worker-manager", "--worker-path", ".", "--max-load", "0"],
     "argument --max-load: must be a number above 0, not '0'"),
    (["worker-manager", "--worker-path", ".", "--max-load", "inf"],
     "argument --max-load: must be a number above 0"),
    (["worker-manager", "--worker-path", ".", "--worker-timeout", "0"],
     "argument --worker-timeout: must be a number above 0"),
    (["worker-manager", "--worker-path", ".", "--max-iterations", "0"],
     "argument --max-iterations: must be a whole number of at least 1"),
    (["worker-manager", "--worker-path", ".", "--grace", "-0.5"],
     "argument --grace: must be a number of at least 0, not '-0.5'"),
    (["worker-manager", "--worker-path", ".", "--touch-interval", "0"],
     "argument --touch-interval: must be a number above 0"),
    (["worker-manager", "--worker-path", ".", "--server", "localhost:65536"],
     "argument --server: not a server address"),
]


@pytest.mark.parametrize("args, message", OUT_OF_RANGE)
def test_options_out_of_range_are_usage_errors(args, message, capsys):
    done = run_here(capsys, *args)
    assert (done.returncode, done.stdout) == (2, "")
    assert message in done.stderr, done.stderr
    assert "usage:" in done.stderr


@pytest.mark.parametrize("args", [
    ["get", "nothing", "--wait", "0"],
    ["failed", "--limit", "10000"],
    ["query", "9223372036854775807"],
    ["get", "nothing", "--count", "1000"],
    ["set-limit", "p" * 255, "1000000000"],
    ["set-limit", "p", "0"],
    ["set-limit", "p", "--rate", "10000/1d", "--per-key", "--fair"],
    ["set-limit", "p", "1000000000", "--rate", "1/1s"],
    ["create", "x", "--key", "k" * 255],
    ["queues", "--limit", "1000"],
    ["top", "--once", "--limit", "1000", "--interval", "3600"],
    ["create", "x", "--cost", "1000000", "--max-attempts", "10000",
     "--retry-delay", "99999999.999"],
    ["await-reply", "1", "k" * 255, "--timeout", "2592000"],
])
def test_options_at_the_ends_of_their_ranges_are_taken(cli_here, args):
    done = cli_here(*args)
    assert done.returncode in (0, 1) and "usage:" not in done.stderr, done


def test_a_bad_server_in_the_environment_is_named():
    env = {"JOBSERVER_SERVER": "127.0.0.1:99999"}
    done = run("status", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("jobserver: $JOBSERVER_SERVER: not a server address")
    done = run("worker-manager", "--worker-path", ".", env=env)
    assert done.returncode == 2
    assert "$JOBSERVER_SERVER: not a server address" in done.stderr
