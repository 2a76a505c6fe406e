"""The command-line client: `python -m jobserver create/get/...` as scripts
run it, against a real server. Each run checks stdout, stderr and the exit
status together."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from fake_server import FakeServer, reply
from jobserver.cli import main
from jobserver.client import Client

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


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


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


@pytest.fixture
def cli(server) -> Cli:
    return Cli(f"127.0.0.1:{server.port}")


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


def test_requeue_revives_failed_jobs_and_may_rename_them(cli, jobs):
    ids = jobs.create_jobs([{"name": "w"}, {"name": "w"}, {"name": "w"}])
    assert len(jobs.get_jobs("w", 3)) == 3
    for job_id in ids:
        jobs.fail_job(job_id, error="broken")
    assert [job["jobID"] for job in cli.ok("failed")["jobs"]] == ids
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
    cli.refused("402 Malformed firstRun", 2, "create", "x", "--first-run", "soon")
    assert jobs.status()["jobs"] == {}


@pytest.mark.parametrize("data", ["[1]", "{bad", '"text"', '{"x": NaN}'])
def test_data_must_be_a_json_object(cli, jobs, data):
    done = cli("create", "x", "--data", data)
    assert (done.returncode, done.stdout) == (2, "")
    assert "--data: must be a JSON object" in done.stderr
    assert jobs.status()["jobs"] == {}


@pytest.mark.parametrize("args", [
    ["query", "one"],
    ["create"],
    ["create", "x", "--priority", "7"],
    ["retry", "1", "--delay", "soon"],
    ["bogus"],
])
def test_usage_errors_exit_2(cli, args):
    done = cli(*args)
    assert (done.returncode, done.stdout) == (2, "")
    assert "usage:" in done.stderr


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


def test_server_from_the_environment(server):
    live = {"JOBSERVER_SERVER": f"127.0.0.1:{server.port}"}
    done = run("create", "from/env", env=live)
    assert (done.returncode, json.loads(done.stdout)) == (0, {"jobID": 1})
    dead = {"JOBSERVER_SERVER": f"127.0.0.1:{free_port()}"}
    assert run("status", env=dead).returncode == 5
    assert run("status", "--server", f"127.0.0.1:{server.port}", env=dead).returncode == 0


def test_help_documents_the_exit_statuses(capsys):
    done = run("--help")
    assert done.returncode == 0
    for line in ("1  not found (404)", "2  usage error", "3  the job's state", "4  server error",
                 "5  cannot connect"):
        assert line in done.stdout
    for command in ("create", "get", "query", "finish", "fail", "retry", "delete", "status",
                    "failed", "requeue", "deliver"):
        assert command in done.stdout
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0
        text = capsys.readouterr().out
        assert "--server HOST:PORT" in text and "JOBSERVER_SERVER" in text
        assert "5  cannot connect" in text


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


CLIENT_COMMANDS = ("create", "get", "query", "finish", "fail", "retry", "delete", "status",
                   "failed", "requeue", "deliver")


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


@pytest.mark.parametrize("command", [*CLIENT_COMMANDS, "worker-manager"])
def test_every_option_shows_one_sensible_default(command):
    done = run(command, "--help")
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
    (["query", "0"], "argument ID: must be a whole number from 1 to 9223372036854775807, not '0'"),
    (["finish", "-3"], "argument ID: must be a whole number from 1"),
    (["delete", "9223372036854775808"], "argument ID: must be a whole number from 1"),
    (["requeue", "1", "0"], "argument ID: must be a whole number from 1"),
    (["fail", "x"], "argument ID: must be a whole number from 1"),
    (["create", "x", "--priority", "7"], "argument --priority: invalid choice: 7"),
    (["status", "--server", "127.0.0.1:70000"], "argument --server: not a server address"),
    (["status", "--server", "127.0.0.1:0"], "argument --server: not a server address"),
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
def test_options_out_of_range_are_usage_errors(args, message):
    done = run(*args)
    assert (done.returncode, done.stdout) == (2, "")
    assert message in done.stderr, done.stderr
    assert "usage:" in done.stderr


@pytest.mark.parametrize("args", [
    ["get", "nothing", "--wait", "0"],
    ["failed", "--limit", "10000"],
    ["query", "9223372036854775807"],
])
def test_options_at_the_ends_of_their_ranges_are_taken(cli, args):
    done = cli(*args)
    assert done.returncode in (0, 1) and "usage:" not in done.stderr, done


def test_a_bad_server_in_the_environment_is_named():
    env = {"JOBSERVER_SERVER": "127.0.0.1:99999"}
    done = run("status", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("jobserver: $JOBSERVER_SERVER: not a server address")
    done = run("worker-manager", "--worker-path", ".", env=env)
    assert done.returncode == 2
    assert "$JOBSERVER_SERVER: not a server address" in done.stderr
