"""Attacks on fault isolation, job ownership, the lock file and the clock.

Each test here reproduces, through a real `python -m jobserver serve`
process, a way the server was found to fail after the failure-domain work:
a start error blamed on the port, a clock that stops for good after one
failed transaction, jobs "put back" that stay RUNNING, an acknowledged
UpdateJob undone, Query and retention blind to a `//` path, and connections
left hanging past the file-descriptor limit.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from helpers import locked, until
from wire import Client, encode

DEADLINE = 15.0
# A reply this large (eight jobs of almost 1 MiB each) cannot fit in the
# kernel's buffers of a client that does not read: the server's write stalls.
BIG_DATA = {"pad": "x" * (1024 * 1024 - 20)}
BIG_JOBS = 8


def stalled_hand_out(server, admin: Client, name: str) -> tuple[socket.socket, list[int]]:
    """Jobs handed out in one reply that a client never reads: RUNNING, and
    still owned by the server's connection until the write times out."""
    ids = [
        admin.request("CreateJob", name=name, data=BIG_DATA).json["jobID"] for _ in range(BIG_JOBS)
    ]
    sleeper = socket.socket()
    sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sleeper.connect(("127.0.0.1", server.port))
    sleeper.sendall(f"GetJobs\r\nname: {name}\r\nnumResults: {BIG_JOBS}\r\n\r\n".encode())
    until(lambda: states(admin, ids) == {"RUNNING"}, DEADLINE, "the jobs to be handed out")
    return sleeper, ids


def states(admin: Client, ids: list[int]) -> set[str]:
    return {admin.request("QueryJob", jobID=i).json["state"] for i in ids}


# The lock file: a start error that is not the port's.


def test_a_db_in_a_missing_directory_is_a_clear_start_error(start_server, tmp_path: Path) -> None:
    db = tmp_path / "missing" / "jobs.db"
    server = start_server(db)
    assert server.wait(10) == 2, server.log
    assert "cannot listen" not in server.log, server.log
    assert str(db) in server.log, server.log
    assert "Traceback" not in server.log


def test_a_lock_path_that_is_a_directory_is_a_clear_start_error(
    start_server, tmp_path: Path
) -> None:
    (tmp_path / "jobs.db.lock").mkdir()
    server = start_server(tmp_path / "jobs.db")
    assert server.wait(10) == 2, server.log
    assert "cannot listen" not in server.log, server.log
    assert "jobs.db.lock" in server.log, server.log


# One failed transaction must not stop the clock: waiting GetJobs, leases,
# reply deadlines and --stale-after all hang on it.


def test_the_clock_fires_again_after_a_tick_failed(start_server, tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    server = start_server(db)
    due = datetime.now(UTC) + timedelta(seconds=2)
    with server.client() as admin, server.client(DEADLINE + 10) as worker:
        first_run = due.strftime("%Y-%m-%d %H:%M:%S")
        assert admin.request("CreateJob", name="later", firstRun=first_run).code == 200
        worker.send(
            encode(
                "GetJob", {"name": "later", "Connection": "wait", "timeout": int(DEADLINE * 1000)}
            )
        )
        until(
            lambda: admin.request("Status").json["waitingGetJobs"] == 1,
            DEADLINE,
            "the GetJob to wait",
        )
        # The database is locked when the job falls due: the tick that
        # would hand it to the waiting worker fails (busy timeout).
        with locked(db):
            until(lambda: "transaction failed" in server.log, DEADLINE, "the tick to fail")
        began = time.monotonic()
        reply = worker.read_reply()
        assert reply.status == "200 OK", (reply.status, server.log)
        assert time.monotonic() - began < DEADLINE - 5
    assert server.proc.poll() is None


# "Put back" must mean put back, also when the database was busy.


def test_jobs_put_back_while_the_database_is_locked_come_back(start_server, tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    server = start_server(db, "--request-timeout", "1")
    with server.client() as admin:
        sleeper, ids = stalled_hand_out(server, admin, "big")
        with locked(db):
            until(lambda: "put back" in server.log, DEADLINE, "the write to time out")
            until(lambda: "transaction failed" in server.log, DEADLINE, "the give-back to fail")
        until(lambda: states(admin, ids) == {"QUEUED"}, DEADLINE, "the jobs to come back")
        sleeper.close()


# A give-back undoes the hand-out, and only the hand-out.


def test_a_give_back_keeps_an_update_acknowledged_meanwhile(start_server, tmp_path: Path) -> None:
    server = start_server(tmp_path / "jobs.db", "--request-timeout", "1")
    with server.client() as admin:
        sleeper, ids = stalled_hand_out(server, admin, "big")
        # While the reply is stuck, someone updates a running job.
        reply = admin.request("UpdateJob", jobID=ids[0], data={"progress": "updated"})
        assert reply.status == "200 OK"
        until(lambda: states(admin, ids) == {"QUEUED"}, DEADLINE, "the jobs to come back")
        job = admin.request("QueryJob", jobID=ids[0]).json
        assert list(job["data"]) == ["progress"], "the update was undone"
        sleeper.close()


# Query and retention open the database by URI: a path starting with two
# slashes must not become a URI authority.


def test_query_works_on_a_db_path_with_a_leading_double_slash(start_server, tmp_path: Path) -> None:
    db = Path("/" + str(tmp_path.resolve())) / "jobs.db"
    assert str(db).startswith("//")
    server = start_server(db)
    with server.client() as admin:
        assert admin.request("CreateJob", name="one").code == 200
        reply = admin.request("Query", query="SELECT count(*) AS n FROM jobs;")
        assert (reply.status, reply.body) == ("200 OK", b"n\n1\n"), reply


# More clients than file descriptors: each is answered, served or refused
# with 503, not left in the listen backlog while the log fills with errors.

FILE_LIMIT = 200
NOFILE_WRAPPER = (
    sys.executable, "-c",
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, {FILE_LIMIT})); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


def test_clients_beyond_the_file_limit_are_refused_not_left_hanging(
    start_server, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "jobs.db", wrapper=NOFILE_WRAPPER)
    clients = [Client(server.port, timeout=DEADLINE) for _ in range(FILE_LIMIT + 50)]
    try:
        answers: dict[str, int] = {}
        for client in clients:
            client.send(b"Ping\r\n\r\n")
        for client in clients:
            status = client.read_reply().status
            answers[status] = answers.get(status, 0) + 1
    finally:
        for client in clients:
            client.close()
    assert set(answers) == {"200 OK", "503 Too many connections"}, answers
    assert "accept failed" not in server.log, server.log[-500:]

    def served() -> bool:
        # The refused connections close a moment after their clients do.
        with server.client() as fresh:
            return fresh.request("Ping").status == "200 OK"

    until(served, DEADLINE, "a fresh connection to be served")


# A client that took its reply keeps its job, however it closes afterwards.
# One that half-closed (as `nc -N` does) and then resets once it has read
# the reply (SO_LINGER 0, or unread data left behind) must not see its job
# handed to the next worker: the reply reached it and was acknowledged.

RESET_AFTER_READING_ROUNDS = 20


def test_a_half_closed_worker_that_resets_after_reading_keeps_its_job(
    start_server, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "jobs.db")
    given_back = []
    with server.client() as admin:
        for round_ in range(RESET_AFTER_READING_ROUNDS):
            name = f"taken-{round_}"
            job_id = admin.request("CreateJob", name=name).json["jobID"]
            worker = Client(server.port, timeout=DEADLINE)
            worker.send(encode("GetJob", {"name": name}))
            worker.sock.shutdown(socket.SHUT_WR)
            assert worker.read_reply().json["jobID"] == job_id
            worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            worker.close()
            # The server has finished with the connection once it is gone.
            until(lambda: admin.request("Status").json["connections"] == 1, DEADLINE, "the close")
            if admin.request("QueryJob", jobID=job_id).json["state"] != "RUNNING":
                given_back.append(job_id)
    assert given_back == [], f"jobs handed out again while their worker had them: {given_back}"
