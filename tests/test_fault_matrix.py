"""A connection is a failure domain, proved over a matrix of faults.

For plain TCP and TLS, a client process (tests/victim.py) brings its
connection to one stage of its life and then ends it in one of four ways:
a close (FIN), a reset (SO_LINGER 0), a half-close (shutdown of its sending
side, after which it reads what is left), or SIGKILL. After every case:

- the server process is alive and a connection opened before the fault is
  served normally;
- every job of the case is QUEUED, except jobs the client received whole
  (half-close), and in the pipelined stage jobs under a lease (RUNQUEUED);
  no job is left RUNNING without a client that has it;
- a job whose reply the client never took is logged as put back, once;
- the server has closed its end, and logged no ERROR.

One server process per transport serves all the cases, so a fault that
broke it would also fail every case after it. A node on PostgreSQL, with
its two writers, runs the stages that end through the engine's own work
(a waiting GetJob(s) leaving, a reply never taken put back), on plain TCP.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pg
import pytest

from harness import ServerProcess
from helpers import create, locked, until
from tcpstate import queues
from tls_certs import make_certificates
from victim import STAGES
from wire import Client

ENDINGS = ("fin", "rst", "half", "kill")
TRANSPORTS = ("plain", "tls")
VICTIM = Path(__file__).with_name("victim.py")
DEADLINE = 30.0

# Sizes that make the server block in the middle of writing: many times
# what the socket buffers take while the client does not read (the victim's
# receive buffer is small, and the server's send buffer does not grow
# while the client's window stays closed).
LARGE_JOBS = 6
LARGE_DATA = 20_000
PIPELINED_JOBS = 40
PIPELINED_DATA = 4_000


class MatrixServer:
    def __init__(self, proc: ServerProcess, ca: str | None) -> None:
        self.proc = proc
        self.ca = ca
        assert proc.port is not None
        self.port = proc.port

    def client(self, timeout: float = DEADLINE) -> Client:
        return Client(self.port, timeout, tls_ca=self.ca)

    def status(self) -> dict:
        with self.client() as admin:
            return admin.request("Status").json

    def alive(self) -> bool:
        return self.proc.proc.poll() is None


@pytest.fixture(scope="module", params=TRANSPORTS)
def matrix_server(request, tmp_path_factory) -> Iterator[MatrixServer]:
    folder = tmp_path_factory.mktemp(f"matrix-{request.param}")
    extra: list[str] = ["--log-level", "DEBUG"]
    ca = None
    if request.param == "tls":
        files = make_certificates(folder)
        extra += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
        ca = str(files.ca)
    proc = ServerProcess(folder / "jobs.db", *extra)
    try:
        yield MatrixServer(proc, ca)
    finally:
        proc.kill()


def create_jobs(server: MatrixServer, name: str, count: int, **params: object) -> list[int]:
    """`count` jobs named `name`, created over a connection of their own."""
    with server.client() as admin:
        return [create(admin, name, **params) for _ in range(count)]


def states(server: MatrixServer, ids: list[int]) -> dict[int, str]:
    with server.client() as admin:
        return {i: admin.request("QueryJob", jobID=i).json["state"] for i in ids}


class Victim:
    def __init__(self, server: MatrixServer, stage: str, name: str) -> None:
        command = [sys.executable, str(VICTIM), str(server.port), stage, name]
        if server.ca is not None:
            command += ["--tls-ca", server.ca]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), f"victim did not start: {line!r}"
        self.port = int(line.split()[1])
        self.received: dict = {"statuses": [], "jobIDs": []}

    def end(self, how: str) -> None:
        """End the connection; with `half`, return once it is shut down
        (the client then reads on until `finish`)."""
        assert self.proc.stdin is not None
        if how == "kill":
            self.proc.send_signal(signal.SIGKILL)
            # Until the process is gone, and its kernel has closed its
            # socket: a reply written before that went to an open socket,
            # which counts as received (server/peer.py), and its job stays
            # RUNNING until its lease ends.
            self.proc.wait(DEADLINE)
            return
        self.proc.stdin.write(how + "\n")
        self.proc.stdin.flush()
        self._read_until("shut" if how == "half" else "done")

    def finish(self) -> None:
        # Read to the end even if the process has exited: its last lines
        # are still in the pipe.
        self._read_until("done")
        code = self.proc.wait(DEADLINE)
        assert code in (0, -signal.SIGKILL), code

    def _read_until(self, word: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("got "):
                self.received = json.loads(line[4:])
            if line.strip() in (word, "done"):
                return


def wait_for_stage(server: MatrixServer, victim: Victim, stage: str, jobs: list[int]) -> None:
    """Until the server is where the stage says: it has read what was sent,
    it waits, or it is stuck writing."""

    def server_side():
        return queues(server.port, victim.port)

    if stage in ("waiting-getjob", "waiting-getjobs"):
        until(lambda: server.status()["waitingGetJobs"] == 1, DEADLINE, "the GetJob to wait")
    elif stage in ("large-reply", "pipelined"):
        def stuck() -> bool:
            sending, receiving = server_side(), queues(victim.port, server.port)
            return bool(sending and receiving and sending.send > 0 and receiving.receive > 0)

        until(stuck, DEADLINE, "the server to be stuck writing")
    else:
        def read() -> bool:
            # All sent by the client, acknowledged, and taken by the server.
            sending, receiving = queues(victim.port, server.port), server_side()
            return bool(sending and receiving and sending.send == 0 and receiving.receive == 0)

        until(read, DEADLINE, "the server to read what the client sent")


@pytest.fixture(scope="module")
def pg_matrix_server() -> Iterator[MatrixServer]:
    """A node on PostgreSQL, with its default two writers, plain TCP."""
    with pg.fresh_schema() as url:
        proc = ServerProcess(url, "--log-level", "DEBUG")
        try:
            yield MatrixServer(proc, None)
        finally:
            proc.kill()


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_ends_only_its_own_connection(matrix_server, stage, ending):
    _a_fault_ends_only_its_own_connection(matrix_server, stage, ending)


# The stages whose ending goes through the engine's own work, where a
# PostgreSQL node differs: a waiting GetJob(s) leaving the wait queue while
# its try may run in either of two writers, and a reply never taken whose
# jobs are put back. The transports are the same code on every backend.
PG_STAGES = ("waiting-getjob", "waiting-getjobs", "large-reply")


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stage", PG_STAGES)
def test_a_fault_ends_only_its_own_connection_on_postgresql(pg_matrix_server, stage, ending):
    _a_fault_ends_only_its_own_connection(pg_matrix_server, stage, ending)


def _a_fault_ends_only_its_own_connection(server: MatrixServer, stage: str, ending: str) -> None:
    name = f"matrix/{stage}/{ending}"
    log_before = len(server.proc.log)
    jobs: list[int] = []
    if stage == "before-reply":
        jobs = create_jobs(server, name, 1)
    elif stage == "large-reply":
        jobs = create_jobs(server, name, LARGE_JOBS, data={"x": "a" * LARGE_DATA})
    elif stage == "pipelined":
        jobs = create_jobs(
            server, name, PIPELINED_JOBS, data={"x": "p" * PIPELINED_DATA}, retryAfter="+1 HOUR"
        )

    with server.client() as neighbour:
        assert neighbour.request("Ping").status == "200 OK"
        baseline = server.status()["connections"]
        with _held_lock_if(stage == "before-reply", server) as lock:
            victim = Victim(server, stage, name)
            wait_for_stage(server, victim, stage, jobs)
            victim.end(ending)
            if lock is not None:
                lock.release()
            victim.finish()
        if stage == "waiting-getjob":
            jobs = create_jobs(server, name, 1)
        elif stage == "waiting-getjobs":
            jobs = create_jobs(server, name, 3)

        assert server.alive(), server.proc.log[log_before:]
        received = victim.received["jobIDs"]
        assert set(received) <= set(jobs)

        def settled() -> bool:
            found = states(server, jobs)
            for job_id, state in found.items():
                if job_id in received:
                    if state not in ("RUNNING", "RUNQUEUED"):
                        return False
                elif stage == "pipelined" and ending != "half":
                    if state not in ("QUEUED", "RUNQUEUED"):
                        return False
                elif state != "QUEUED":
                    return False
            return True

        try:
            until(settled, DEADLINE, f"the jobs of {name} to settle")
        except AssertionError as error:
            raise AssertionError(
                f"{error}: {states(server, jobs)}; the client got {victim.received}; "
                f"the server logged {server.proc.log[log_before:]}"
            ) from None
        final = states(server, jobs)
        if stage == "pipelined" and ending != "half":
            # The server blocked on some reply: that job, and those after it
            # that were never handed out, are in the queue.
            assert "QUEUED" in final.values()
        if ending == "half":
            _check_half_close_replies(stage, victim.received, jobs, server.proc.log[log_before:])

        # The neighbour, connected before the fault, is served as usual and
        # gets exactly the jobs that are back in the queue.
        queued = sorted(i for i, state in final.items() if state == "QUEUED")
        assert neighbour.request("Ping").status == "200 OK"
        if queued:
            reply = neighbour.request(
                "GetJobs", name=name, numResults=100, Connection="wait", timeout=20000
            )
            assert reply.code == 200, reply.status
            assert sorted(job["jobID"] for job in reply.json["jobs"]) == queued

        # The server has closed its end of the victim's connection.
        until(lambda: server.status()["connections"] == baseline, DEADLINE, "the close")
    _check_log(server, log_before, victim, stage, ending, jobs, received)


def _check_half_close_replies(stage: str, received: dict, jobs: list[int], log: str) -> None:
    statuses = received["statuses"]
    if stage in ("mid-head", "mid-body"):
        assert statuses == ["400 Incomplete request"], log
    elif stage in ("waiting-getjob", "waiting-getjobs"):
        # Documented: a half-close ends the wait, and says why.
        assert statuses == ["404 No job found"], log
    elif stage in ("before-reply", "large-reply"):
        assert statuses == ["200 OK"] and sorted(received["jobIDs"]) == jobs, log
    elif stage == "pipelined":
        assert statuses == ["200 OK"] * len(jobs), log
    else:
        assert statuses == [], log


def _check_log(server, log_before, victim, stage, ending, jobs, received) -> None:
    expects_put_back = stage in ("before-reply", "large-reply") and ending != "half"
    if expects_put_back:
        # The line comes through the server's stderr and a reader thread:
        # it can still be on its way once the close is counted (seen under
        # a load of 13 on two cores: the log after the fault was empty).
        until(
            lambda: f":{victim.port} " in server.proc.log[log_before:], DEADLINE, "the log line"
        )
    log = server.proc.log[log_before:]
    assert " ERROR " not in log and "Traceback" not in log, log
    lines = [line for line in log.splitlines() if f":{victim.port} " in line]
    # One line per ended connection, whatever ended it.
    assert len(lines) <= 1, lines
    put_back = re.search(r"before it took jobs? ([\d, ]+): put back", "\n".join(lines))
    if expects_put_back:
        assert put_back is not None, log
        assert sorted(int(i) for i in put_back.group(1).split(", ")) == jobs
    if ending == "half" and stage != "pipelined":
        assert put_back is None, log


class _Lock:
    def __init__(self, context) -> None:
        self._context = context
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._context.__exit__(None, None, None)


class _held_lock_if:
    """Another process holds the database's write lock, so that a request
    the server has read is held between its request and its reply."""

    def __init__(self, hold: bool, server: MatrixServer) -> None:
        self._hold = hold
        self._server = server
        self._lock: _Lock | None = None

    def __enter__(self) -> _Lock | None:
        if not self._hold:
            return None
        context = locked(self._server.proc.db)
        context.__enter__()
        self._lock = _Lock(context)
        return self._lock

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()
