"""The server as users run it: `python -m jobserver serve` in its own process.

The `start_server` fixture starts the real command on a free port and a
temporary database and returns once it has logged that it is listening.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from wire import Client, Reply

RUN_TIMEOUT = 15.0


def netcat(client: Client, *lines: str) -> Reply:
    """Send a request the way `nc` does: bare `\\n` line endings."""
    client.send(("\n".join(lines) + "\n\n").encode("utf-8"))
    return client.read_reply()


def jobserver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobserver", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def ready(proc) -> None:
    """One round trip: the server is past start-up and handling requests."""
    with proc.client() as client:
        assert client.request("Ping").status == "200 OK"


# The sample session of the Bedrock::Jobs page.


def test_sample_session_of_the_bedrock_jobs_page(start_server):
    proc = start_server()
    with proc.client() as nc:
        reply = netcat(
            nc,
            "CreateJob",
            "name: CheckLiveness",
            'data: {"url":"http://bedrockdb.com"}',
            "repeat: finished, +1 minute",
        )
        assert reply.status == "200 OK"
        assert reply.headers == {"Content-Length": "11"}
        assert reply.body == b'{"jobID":1}'

        reply = netcat(nc, "GetJob", "name: CheckLiveness")
        assert reply.status == "200 OK"
        job = reply.json
        assert {k: job[k] for k in ("data", "jobID", "name")} == {
            "data": {"url": "http://bedrockdb.com"},
            "jobID": 1,
            "name": "CheckLiveness",
        }

        reply = netcat(
            nc, "UpdateJob", "jobID: 1", 'data: {"url":"http://bedrockdb.com","status":"CHECKING"}'
        )
        assert (reply.status, reply.body) == ("200 OK", b"")

        reply = netcat(nc, "QueryJob", "jobID: 1")
        assert reply.status == "200 OK"
        job = reply.json
        assert job["data"] == {"url": "http://bedrockdb.com", "status": "CHECKING"}
        assert (job["jobID"], job["name"], job["state"]) == (1, "CheckLiveness", "RUNNING")
        assert job["repeat"] == "FINISHED, +1 MINUTE"
        assert job["lastRun"] != ""
        assert utc(job["created"]) <= utc(job["lastRun"])

        before = datetime.now(UTC).replace(microsecond=0)
        reply = netcat(
            nc, "FinishJob", "jobID: 1", 'data: {"url":"http://bedrockdb.com","failCount":1}'
        )
        assert (reply.status, reply.body) == ("200 OK", b"")

        reply = netcat(nc, "GetJob", "name: *")
        assert (reply.status, reply.body) == ("404 No job found", b"")

        reply = netcat(nc, "Query: SELECT * FROM jobs;")
        assert reply.status == "200 OK"
        header, *rows = reply.body.decode().splitlines()
        columns = header.split("|")
        assert columns[:10] == [
            "created", "jobID", "state", "name", "nextRun", "lastRun",
            "repeat", "data", "priority", "parentJobID",
        ]
        assert len(rows) == 1
        row = dict(zip(columns, rows[0].split("|"), strict=True))
        assert (row["jobID"], row["state"], row["name"]) == ("1", "QUEUED", "CheckLiveness")
        assert row["repeat"] == "FINISHED, +1 MINUTE"
        assert json.loads(row["data"]) == {"url": "http://bedrockdb.com", "failCount": 1}
        next_run = utc(row["nextRun"])
        after = datetime.now(UTC)
        assert before + timedelta(minutes=1) <= next_run <= after + timedelta(minutes=1)

        # Blocking, not polling: a worker waits, another process queues.
        with proc.client() as worker:
            worker.send(b"GetJob\nname: SendEmail\nconnection: wait\ntimeout: 60000\n\n")
            reply = netcat(nc, "CreateJob", "name: SendEmail")
            assert (reply.status, reply.body) == ("200 OK", b'{"jobID":2}')
            reply = worker.read_reply()
            assert reply.status == "200 OK"
            job = reply.json
            assert {k: job[k] for k in ("data", "jobID", "name")} == {
                "data": {},
                "jobID": 2,
                "name": "SendEmail",
            }


# Stopping.


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_shuts_down_cleanly_and_logs_start_and_stop(start_server, tmp_path, signum):
    db = tmp_path / "signal.db"
    proc = start_server(db)
    ready(proc)
    proc.proc.send_signal(signum)
    assert proc.wait(5) == 0
    log = proc.log
    assert "Traceback" not in log
    assert f"received {signum.name}" in log
    start = [line for line in log.splitlines() if "listening" in line]
    assert len(start) == 1
    assert f"127.0.0.1:{proc.port}" in start[0]
    assert str(db) in start[0]
    stop = [line for line in log.splitlines() if "stopped" in line]
    assert len(stop) == 1
    assert f"127.0.0.1:{proc.port}" in stop[0]
    assert str(db) in stop[0]


def test_stop_signal_right_after_the_listening_line_shuts_down_cleanly(start_server, tmp_path):
    codes = []
    for n, signum in enumerate([signal.SIGTERM, signal.SIGINT] * 4):
        proc = start_server(tmp_path / f"early{n}.db")
        proc.proc.send_signal(signum)
        codes.append(proc.wait(5))
    assert codes == [0] * len(codes)


def test_stop_answers_a_waiting_get_job(start_server):
    proc = start_server()
    with proc.client() as worker:
        # The Ping's reply shows the connection is being served; the GetJob
        # sent with it is then already read, and waits.
        worker.send(
            b"Ping\r\n\r\n"
            b"GetJob\r\nname: never\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n"
        )
        assert worker.read_reply().status == "200 OK"
        proc.proc.send_signal(signal.SIGTERM)
        reply = worker.read_reply()
        assert reply.status == "404 No job found"
        assert reply.headers.get("Connection") == "close"
        assert worker.at_eof()
    assert proc.wait(5) == 0


def test_stop_closes_idle_connections(start_server):
    proc = start_server()
    with proc.client() as idle:
        assert idle.request("Ping").status == "200 OK"
        proc.proc.send_signal(signal.SIGTERM)
        assert idle.at_eof()
    assert proc.wait(5) == 0


# Durability.


def test_acknowledged_job_survives_kill_9_and_restart(start_server, tmp_path):
    db = tmp_path / "durable.db"
    first = start_server(db)
    with first.client() as client:
        reply = client.request("CreateJob", name="survivor", data={"keep": True}, jobPriority=1000)
        assert reply.status == "200 OK"
        job_id = reply.json["jobID"]
        running = client.request("CreateJob", name="taken").json["jobID"]
        assert client.request("GetJob", name="taken").json["jobID"] == running
    first.kill()
    assert first.proc.returncode == -signal.SIGKILL

    second = start_server(db)
    with second.client() as client:
        job = client.request("QueryJob", jobID=job_id).json
        assert (job["name"], job["data"], job["priority"], job["state"]) == (
            "survivor", {"keep": True}, 1000, "QUEUED",
        )
        assert client.request("QueryJob", jobID=running).json["state"] == "RUNNING"
        assert client.request("GetJob", name="survivor").json["jobID"] == job_id
        new_id = client.request("CreateJob", name="after").json["jobID"]
        assert new_id not in (job_id, running)


# The command line.


def test_help_lists_the_serve_command():
    result = jobserver("--help")
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_serve_help_lists_its_options():
    result = jobserver("serve", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--host", "--port", "--db"):
        assert option in result.stdout


def test_database_that_is_not_sqlite_is_refused_with_a_clear_message(tmp_path):
    db = tmp_path / "garbage.db"
    garbage = b"this is not a database\n" + bytes(range(256)) * 16
    db.write_bytes(garbage)
    result = jobserver("serve", "--port", "0", "--db", str(db))
    assert result.returncode == 2
    assert str(db) in result.stderr
    assert "not a database" in result.stderr
    assert "Traceback" not in result.stderr
    assert db.read_bytes() == garbage


def test_busy_port_is_refused_with_a_clear_message(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = jobserver("serve", "--port", str(port), "--db", str(tmp_path / "jobs.db"))
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr
    assert "in use" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    # The port is tried before the database is opened: nothing is created.
    assert not (tmp_path / "jobs.db").exists()


def test_help_creates_no_database_file(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jobserver", "--help"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=tmp_path,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr
    assert not list(Path(tmp_path).iterdir())
