"""The two crashes that started the fault-isolation work, as they were found,
and the other ways a connection can end that must end only that connection.

Each test runs the server as users do, in its own process, so that a fault
that reached the accept loop shows as the process exiting.
"""

from __future__ import annotations

import importlib.util
import socket
import sqlite3
import ssl
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from helpers import until
from jobserver.core.commands import create as commands
from jobserver.core.engine.clock import SystemClock
from jobserver.core.engine.engine import Engine
from jobserver.core.engine.waiters import Phase
from jobserver.core.engine.work import Call, Tick
from jobserver.core.errors import CommandError
from jobserver.core.rules.selection import JobQuery
from jobserver.storage.sqlite import Store
from jobserver.wire.framing import Request
from tls_certs import make_certificates
from wire import Client

DEADLINE = 20.0


def alive_and_serving(server, neighbour: Client | None = None) -> None:
    assert server.proc.poll() is None, server.log
    with server.client() as fresh:
        assert fresh.request("Ping").status == "200 OK"
    if neighbour is not None:
        assert neighbour.request("Ping").status == "200 OK"


def waiting_get_jobs(server) -> int:
    with server.client() as admin:
        return admin.request("Status").json["waitingGetJobs"]


# Crash 1: a reset while a GetJob waits stopped the server (the reset came
# out of the read-ahead task wrapped in an ExceptionGroup).


@pytest.mark.parametrize("verb", ["GetJob", "GetJobs\nnumResults: 2"])
@pytest.mark.parametrize("linger", [False, True], ids=["close", "linger0"])
def test_a_reset_while_waiting_ends_only_that_connection(start_server, verb, linger):
    server = start_server()
    with server.client() as neighbour:
        assert neighbour.request("Ping").status == "200 OK"
        victim = socket.create_connection(("127.0.0.1", server.port))
        if linger:
            victim.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The Ping's reply stays unread, so even a plain close() is a reset.
        victim.sendall(f"Ping\n\n{verb}\nname: nothing\nConnection: wait\n\n".encode())
        until(lambda: waiting_get_jobs(server) == 1, DEADLINE, "the GetJob to wait")
        victim.close()
        until(lambda: waiting_get_jobs(server) == 0, DEADLINE, "the wait to end")
        alive_and_serving(server, neighbour)
        # A job created now goes to the neighbour, not to the dead waiter.
        assert neighbour.request("CreateJob", name="nothing").code == 200
        assert neighbour.request("GetJob", name="nothing").code == 200
    server.signal()
    assert server.wait() == 0, server.log
    assert "Traceback" not in server.log and " ERROR " not in server.log


# Crash 2: with TLS, any client that died while waiting stopped the server
# (SSLEOFError, no close_notify).

KILLED_TLS_WORKER = textwrap.dedent(
    """
    import os, socket, ssl, sys
    port, ca = int(sys.argv[1]), sys.argv[2]
    context = ssl.create_default_context(cafile=ca)
    sock = context.wrap_socket(
        socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
    )
    sock.sendall(b"GetJob\\r\\nname: work\\r\\nConnection: wait\\r\\n\\r\\n")
    print("waiting", flush=True)
    sys.stdin.readline()
    os._exit(0)
    """
)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    files = make_certificates(tmp_path)
    return files.cert, files.key, files.ca


def test_a_tls_worker_killed_while_waiting_ends_only_its_connection(
    start_server, tls_files, tmp_path
):
    cert, key, ca = tls_files
    server = start_server(tmp_path / "jobs.db", "--tls-cert", str(cert), "--tls-key", str(key))
    with Client(server.port, DEADLINE, tls_ca=str(ca)) as neighbour:
        assert neighbour.request("Ping").status == "200 OK"
        worker = subprocess.Popen(
            [sys.executable, "-c", KILLED_TLS_WORKER, str(server.port), str(ca)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline() == "waiting\n"
        until(lambda: _tls_waiting(server.port, ca) == 1, DEADLINE, "the GetJob to wait")
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.wait(DEADLINE) == 0
        until(lambda: _tls_waiting(server.port, ca) == 0, DEADLINE, "the wait to end")
        assert server.proc.poll() is None, server.log
        assert neighbour.request("CreateJob", name="work").code == 200
        reply = neighbour.request("GetJob", name="work")
        assert reply.code == 200, reply.status
    server.signal()
    assert server.wait() == 0, server.log
    assert "Traceback" not in server.log and " ERROR " not in server.log


def _tls_waiting(port: int, ca: Path) -> int:
    with Client(port, DEADLINE, tls_ca=str(ca)) as admin:
        return admin.request("Status").json["waitingGetJobs"]


# Talking the wrong transport gets a plain answer, not silence.


def test_plain_text_to_a_tls_port_is_told_so(start_server, tls_files, tmp_path):
    cert, key, _ = tls_files
    server = start_server(tmp_path / "jobs.db", "--tls-cert", str(cert), "--tls-key", str(key))
    with server.client() as plain:
        plain.send(b"Ping\r\n\r\n")
        reply = plain.read_reply()
        assert reply.status == "400 This port requires TLS"
        assert reply.headers.get("Connection") == "close"
        assert plain.at_eof()
    until(lambda: "plain text on a TLS port" in server.log, DEADLINE, "the log")
    assert server.proc.poll() is None


def test_a_tls_handshake_on_a_plain_port_is_closed(start_server, tls_files):
    server = start_server()
    _, _, ca = tls_files
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as raw,
        pytest.raises(ssl.SSLError, match="WRONG_VERSION_NUMBER"),
    ):
        context.wrap_socket(raw, server_hostname="localhost")
    # What it was told, in plain text, had it been looking.
    with server.client() as plain:
        plain.send(b"\x16\x03\x01\x00\x05hello")
        assert plain.read_reply().status == "400 This port does not speak TLS"
        assert plain.at_eof()
    until(lambda: "TLS handshake on a plain-text port" in server.log, DEADLINE, "the log")
    alive_and_serving(server)


# A request cut short by the client closing its side gets a status line.


def test_a_half_closed_incomplete_request_is_answered(start_server):
    server = start_server()
    with server.client() as client:
        client.send(b"Ping\n")  # no blank line: the request never ends
        client.sock.shutdown(socket.SHUT_WR)
        reply = client.read_reply()
        assert reply.status == "400 Incomplete request"
        assert client.at_eof()


# A client that stops reading in the middle of a reply is found out within
# the request timeout, and the jobs in that reply go back to the queue.


def test_a_client_that_stops_reading_a_reply_loses_its_jobs(start_server, tmp_path):
    server = start_server(tmp_path / "jobs.db", "--request-timeout", "1")
    with server.client() as admin:
        ids = [
            admin.request("CreateJob", name="big", data={"x": "b" * 100_000}).json["jobID"]
            for _ in range(5)
        ]
        sleeper = socket.socket()
        sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sleeper.connect(("127.0.0.1", server.port))
        sleeper.sendall(b"GetJobs\r\nname: big\r\nnumResults: 5\r\n\r\n")

        def back() -> bool:
            states = {admin.request("QueryJob", jobID=i).json["state"] for i in ids}
            return states == {"QUEUED"} and "put back" in server.log

        until(back, DEADLINE, "the jobs to come back")
        sleeper.close()
    assert "ended (the client stopped taking its reply)" in server.log
    alive_and_serving(server)


# The engine hands out outcomes on the event loop; one hand-out that fails
# must not end the trio run, and those after it still run. The two tests
# give an Engine a method of their own, which a compiled one (setup.py)
# does not take: they run on the pure build, the one .ci/run's whole
# suite runs on.
_ENGINE = importlib.util.find_spec("jobserver.core.engine.engine")
pure_engine_only = pytest.mark.skipif(
    _ENGINE is None or not str(_ENGINE.origin).endswith(".py"),
    reason="a compiled Engine's methods cannot be replaced",
)


@pure_engine_only
async def test_a_failing_hand_out_stays_its_own(tmp_path):
    store = Store(str(tmp_path / "jobs.db"))
    engine = Engine(store, SystemClock())
    engine.start()

    def explode(result: object) -> None:
        raise RuntimeError("a broken hand-out")

    engine._ticked = explode
    engine.submit(Tick())
    with trio.fail_after(DEADLINE):
        assert await engine.call(lambda ctx: 2) == 2
        assert await engine.call(lambda ctx: 3) == 3
    await engine.stop()
    store.close()


# What the last outcomes submit while the engine stops (a waiting GetJob's
# jobs given back) still runs: no job is left RUNNING by a shutdown.


@pure_engine_only
async def test_work_submitted_while_the_engine_stops_still_runs(tmp_path):
    store = Store(str(tmp_path / "jobs.db"))
    engine = Engine(store, SystemClock())
    engine.start()
    ran: list[str] = []

    def then_submit(result: object) -> None:
        engine.submit(Call(lambda ctx: ran.append("late")))

    engine._ticked = then_submit
    engine.submit(Call(lambda ctx: ran.append("first")))
    engine.submit(Tick())
    with trio.fail_after(DEADLINE):
        await engine.stop()
    assert ran == ["first", "late"]
    store.close()


# A waiting GetJob tried inside a transaction that then fails is answered
# all the same, and tried again later: a try that never reports back would
# hold its GetJob for good.


async def test_a_try_in_a_failed_transaction_is_still_answered(tmp_path):
    store = Store(str(tmp_path / "jobs.db"))
    engine = Engine(store, SystemClock())
    engine.start()
    query = JobQuery(("ready",), (), None, 1)
    handed: list[object] = []
    answered = trio.Event()

    async def wait() -> None:
        handed.append(await engine.wait(query, DEADLINE))
        answered.set()

    def idle() -> bool:
        return [w.phase for w in engine.waits.everyone()] == [Phase.IDLE]

    def make_ready(ctx) -> None:
        ctx.scheduled("ready", ctx.now_ms)

    commit = store.commit

    def fail_once() -> None:
        store.commit = commit
        raise sqlite3.OperationalError("disk I/O error")

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            nursery.start_soon(wait)
            # Tried once on arrival, and found nothing.
            while not idle():  # noqa: ASYNC110 - the wait queue has no event for it
                await trio.sleep(0.01)
            store.commit = fail_once
            with pytest.raises(CommandError, match=r"^503"):
                await engine.call(make_ready)
            assert store.commit == commit and not handed
            # The failed try left the waiter idle: the next job is its.
            create = Request("CreateJob", {"name": "ready"})
            await engine.call(lambda ctx: commands.create_job(ctx, create))
            await answered.wait()
            nursery.cancel_scope.cancel()
    assert handed[0] is not None
    await engine.stop()
    store.close()
