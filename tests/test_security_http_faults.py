"""The HTTP port is a failure domain per connection, as the wire port is
(tests/test_fault_matrix.py), proved over the same matrix of faults.

For plain TCP and TLS, a client process (tests/http_victim.py) brings its
HTTP connection to one stage of a request's life (idle, mid-head, mid-body,
waiting for the reply, mid-reply) and ends it in one of four ways: a close
(FIN), a reset, a half-close (after which it reads what is left), or
SIGKILL. After every case:

- the server process is alive and serves both ports: a neighbour HTTP
  connection, in the middle of a request of its own across the fault,
  gets its reply, and so do a new HTTP request and a wire client that
  was connected before the fault;
- the server has closed its end of the victim's connection, and logged
  no ERROR and no traceback.

One server process per transport serves all the cases, so a fault that
broke it would also fail every case after it. Then the requests that once
stopped the server (a WebSocket upgrade, h2c, HTTP/2's preface) are
refused with a 400 and the connection alone is closed; and, with that
refusal switched off in a server process of its own, the crash in
Hypercorn's WebSocket path that once stopped the server ends only its
connection, logged at most LOG_BURST times a minute.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import LISTENING, START_TIMEOUT, LoggedProcess, ServerProcess, ThreadServer
from helpers import create, locked, until
from jobserver.web import serving
from tcpstate import queues
from tls_certs import make_certificates
from wire import Client

ENDINGS = ("fin", "rst", "half", "kill")
TRANSPORTS = ("plain", "tls")
STAGES = ("idle", "mid-head", "mid-body", "before-reply", "large-reply")
VICTIM = Path(__file__).with_name("http_victim.py")
DEADLINE = 30.0
HTTP_LISTENING = re.compile(r"HTTP on [\d.]+:(\d+)")
# Enough to block the server in the middle of a response to a client that
# does not read (the victim's receive buffer is small).
LARGE_JOBS = 6
LARGE_DATA = 20_000


@dataclass
class HttpServer:
    """A server with both ports (a process of its own, but for the tests of
    time bounds), and clients of each."""

    proc: LoggedProcess | None
    ca: str | None
    db: Path
    port: int
    http_port: int

    @classmethod
    def of(cls, proc: LoggedProcess, ca: str | None, db: Path) -> HttpServer:
        return cls(
            proc, ca, db, _listening_port(proc, LISTENING), _listening_port(proc, HTTP_LISTENING)
        )

    def client(self) -> Client:
        return Client(self.port, DEADLINE, tls_ca=self.ca)

    def connect_http(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.http_port), timeout=DEADLINE)
        if self.ca is None:
            return raw
        context = ssl.create_default_context(cafile=self.ca)
        return context.wrap_socket(raw, server_hostname="localhost")

    def alive(self) -> bool:
        assert self.proc is not None
        return self.proc.proc.poll() is None


def _listening_port(proc: LoggedProcess, pattern: re.Pattern[str]) -> int:
    found = proc.matching(pattern, 1, START_TIMEOUT)
    match = pattern.search(found[0]) if found else None
    assert match is not None, proc.log
    return int(match.group(1))


def http_request(sock: socket.socket, raw: bytes) -> tuple[int, bytes]:
    """Send `raw`, read one response: (status code, body)."""
    sock.sendall(raw)
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {buffer!r}"
        buffer += chunk
    head, body = buffer.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection in the middle of a response"
        body += chunk
    return int(lines[0].split()[1]), body[:length]


def get(path: str, close: bool = True) -> bytes:
    connection = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{connection}\r\n".encode()


class Neighbour:
    """An HTTP connection in the middle of a request (POST /api/Ping, its
    body half sent) for the whole of a case: the server waits on it without
    a timeout, and it must get its reply once it sends the rest."""

    BODY = b"{" + b" " * 64 + b"}"

    def __init__(self, server: HttpServer) -> None:
        self.sock = server.connect_http()
        head = (
            "POST /api/Ping HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(self.BODY)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + self.BODY[:10])

    def finish(self) -> tuple[int, bytes]:
        try:
            return http_request(self.sock, self.BODY[10:])
        finally:
            self.sock.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def http_server(request, tmp_path_factory) -> Iterator[HttpServer]:
    folder = tmp_path_factory.mktemp(f"http-matrix-{request.param}")
    extra: list[str] = ["--http-port", "0", "--log-level", "DEBUG"]
    ca = None
    if request.param == "tls":
        files = make_certificates(folder)
        extra += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
        ca = str(files.ca)
    proc = ServerProcess(folder / "jobs.db", *extra)
    try:
        yield HttpServer.of(proc, ca, folder / "jobs.db")
    finally:
        proc.kill()


class Victim:
    def __init__(self, server: HttpServer, stage: str, name: str) -> None:
        command = [sys.executable, str(VICTIM), str(server.http_port), stage, name]
        if server.ca is not None:
            command += ["--tls-ca", server.ca]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), f"victim did not start: {line!r}"
        self.port = int(line.split()[1])
        self.received: list[int] = []

    def end(self, how: str) -> None:
        assert self.proc.stdin is not None
        if how == "kill":
            self.proc.send_signal(signal.SIGKILL)
            return
        self.proc.stdin.write(how + "\n")
        self.proc.stdin.flush()
        self._read_until("shut" if how == "half" else "done")

    def finish(self) -> None:
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


def wait_for_stage(server: HttpServer, victim: Victim, stage: str) -> None:
    """Until the server has read what the victim sent or, for a large
    reply, is stuck writing it."""

    def server_side():
        return queues(server.http_port, victim.port)

    if stage == "large-reply":
        def stuck() -> bool:
            sending, receiving = server_side(), queues(victim.port, server.http_port)
            return bool(sending and receiving and sending.send > 0 and receiving.receive > 0)

        until(stuck, DEADLINE, "the server to be stuck writing")
    else:
        def read() -> bool:
            sending, receiving = queues(victim.port, server.http_port), server_side()
            return bool(sending and receiving and sending.send == 0 and receiving.receive == 0)

        until(read, DEADLINE, "the server to read what the client sent")


def jobs_named(server: HttpServer, name: str) -> int:
    with server.client() as admin:
        reply = admin.request(
            "Query", query=f"SELECT COUNT(*) FROM jobs WHERE name = '{name}';", format="json"
        )
        return int(reply.json["rows"][0][0])


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_on_the_http_port_ends_only_its_own_connection(http_server, stage, ending):
    server = http_server
    name = f"http-matrix/{stage}/{ending}"
    log_before = len(server.proc.log)
    if stage == "large-reply":
        with server.client() as admin:
            for _ in range(LARGE_JOBS):
                create(admin, name, data={"x": "a" * LARGE_DATA})

    with server.client() as wire_neighbour:
        assert wire_neighbour.request("Ping").status == "200 OK"
        neighbour = Neighbour(server)
        hold = locked(server.db) if stage == "before-reply" else None
        if hold is not None:
            hold.__enter__()
        try:
            victim = Victim(server, stage, name)
            wait_for_stage(server, victim, stage)
            victim.end(ending)
        finally:
            if hold is not None:
                hold.__exit__(None, None, None)
        victim.finish()

        assert server.alive(), server.proc.log[log_before:]
        assert neighbour.finish()[0] == 200
        assert wire_neighbour.request("Ping").status == "200 OK"
        with server.connect_http() as fresh:
            assert http_request(fresh, get("/healthz"))[0] == 200
        if ending == "half":
            _check_half_close(stage, victim.received, server.proc.log[log_before:])
        if stage == "before-reply":
            # The request was read whole: it is carried out once, whether or
            # not its client stayed for the reply.
            until(lambda: jobs_named(server, name) == 1, DEADLINE, "the job to be created")
        elif stage == "mid-body":
            assert jobs_named(server, name) == 0

    until(lambda: queues(server.http_port, victim.port) is None, DEADLINE, "the server's close")
    log = server.proc.log[log_before:]
    assert " ERROR " not in log and "Traceback" not in log, log


def _check_half_close(stage: str, statuses: list[int], log: str) -> None:
    """A client that shuts its sending side gets nothing more than whole
    responses: the incomplete request's 400, or none."""
    if stage in ("mid-head", "mid-body"):
        assert statuses in ([], [400]), log
    else:
        assert set(statuses) <= {200}, log


SWITCHES = {
    "websocket": (
        b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: x\r\nSec-WebSocket-Version: 13\r\n\r\ngarbage after the upgrade"
    ),
    "websocket-on-api": (
        b"GET /api/Ping HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"
    ),
    "h2c": (
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    ),
    "h2c-with-body": (
        b"POST /api/Ping HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ),
    "http2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    "connect": b"CONNECT localhost:443 HTTP/1.1\r\nHost: localhost:443\r\n\r\n",
}


@pytest.mark.parametrize("switch", SWITCHES)
def test_a_request_to_switch_protocols_is_refused_and_the_server_lives_on(
    http_server, switch
) -> None:
    server = http_server
    log_before = len(server.proc.log)
    neighbour = Neighbour(server)
    for _ in range(3):
        with server.connect_http() as sock:
            code, body = http_request(sock, SWITCHES[switch])
            assert code == 400
            assert "HTTP/1.1 only" in json.loads(body)["error"]
            # The connection is closed after the refusal.
            assert sock.recv(100) == b""
    assert server.alive(), server.proc.log[log_before:]
    assert neighbour.finish()[0] == 200
    with server.client() as wire:
        assert wire.request("Ping").status == "200 OK"
    log = server.proc.log[log_before:]
    assert " ERROR " not in log and "Traceback" not in log, log


def test_tls_offers_http_1_1_alone(http_server) -> None:
    """ALPN never selects h2: a client that offers it gets HTTP/1.1."""
    server = http_server
    if server.ca is None:
        pytest.skip("ALPN is TLS's")
    context = ssl.create_default_context(cafile=server.ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    raw = socket.create_connection(("127.0.0.1", server.http_port), timeout=DEADLINE)
    with context.wrap_socket(raw, server_hostname="localhost") as sock:
        assert sock.selected_alpn_protocol() == "http/1.1"
        assert http_request(sock, get("/healthz"))[0] == 200


# A server whose refusal of protocol switches is switched off, so that
# Hypercorn's own WebSocket path runs: with `garbage after the upgrade`, it
# raises h11.LocalProtocolError (the crash that stopped the whole server).
UNGUARDED = (
    "import sys\n"
    "from jobserver.web import serving\n"
    "serving._asks_to_switch = lambda request: False\n"
    "from jobserver.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_crash_inside_hypercorn_ends_only_its_connection(tmp_path: Path) -> None:
    proc = LoggedProcess([
        sys.executable, "-c", UNGUARDED, "serve", "--port", "0", "--http-port", "0",
        "--db", str(tmp_path / "jobs.db"),
    ])
    try:
        server = HttpServer.of(proc, None, tmp_path / "jobs.db")
        neighbour = Neighbour(server)
        burst = serving.LOG_BURST

        def errors() -> list[str]:
            return [line for line in proc.log.splitlines() if " ERROR " in line]

        def crash() -> None:
            with server.connect_http() as sock:
                sock.sendall(SWITCHES["websocket"])
                # The server ends the connection, whatever it said first.
                assert closed_by_server(sock, DEADLINE)

        with server.client() as wire_neighbour:
            # Not every try crashes (Hypercorn may answer first): enough to
            # fill the log's allowance, then as many more.
            for _ in range(200):
                if len(errors()) >= burst:
                    break
                crash()
            for _ in range(2 * burst):
                crash()
            assert proc.proc.poll() is None, proc.log
            assert neighbour.finish()[0] == 200
            assert wire_neighbour.request("Ping").status == "200 OK"
            with server.connect_http() as fresh:
                assert http_request(fresh, get("/healthz"))[0] == 200
        # Every failure ended its own connection; the log took LOG_BURST of
        # them in this minute (the connection's line, or Hypercorn's own for
        # the application), and no more.
        failed = errors()
        assert len(failed) == burst, failed
        assert any("HTTP connection from 127.0.0.1:" in line for line in failed), failed
    finally:
        proc.kill()


# Time bounds, on a server in this process with short ones -------------------


@pytest.fixture
def quick_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setattr(serving, "BODY_SECONDS", 1.0)
    monkeypatch.setattr(serving, "SEND_PIECE_SECONDS", 1.0)
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    try:
        until(lambda: running.server.http_port, DEADLINE, "the HTTP side to listen")
        yield HttpServer(None, None, tmp_path / "jobs.db", running.port, running.server.http_port)
    finally:
        running.stop()


def closed_by_server(sock: socket.socket, bound: float) -> bool:
    """Whether the server closes `sock` within `bound` seconds (reading and
    dropping whatever it sends first)."""
    sock.settimeout(bound)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_body_that_trickles_past_the_bound_loses_its_connection(quick_server) -> None:
    server = quick_server
    with server.connect_http() as slow:
        slow.sendall(
            b"POST /api/CreateJob HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"name\""
        )
        assert closed_by_server(slow, DEADLINE)
    # A body that arrives within the bound, in pieces, is served.
    with server.connect_http() as prompt:
        body = b'{"name": "prompt"}'
        prompt.sendall(
            b"POST /api/CreateJob HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5]
        )
        prompt.sendall(body[5:])
        assert read_response(prompt)[0] == 200
    with server.client() as wire:
        assert wire.request("Ping").status == "200 OK"


def test_a_client_that_stops_reading_a_response_loses_its_connection(quick_server) -> None:
    server = quick_server
    with server.client() as admin:
        for _ in range(8):
            create(admin, "big", data={"x": "b" * 200_000})
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", server.http_port))
    with raw:
        body = json.dumps({"query": "SELECT data FROM jobs;", "format": "json"}).encode()
        raw.sendall(
            b"POST /api/Query HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        local = raw.getsockname()[1]
        # The server gives up on the stalled response and closes its end.
        until(lambda: queues(server.http_port, local) is None, DEADLINE, "the server's close")
    with server.connect_http() as fresh:
        assert http_request(fresh, get("/healthz"))[0] == 200


def test_a_client_that_stops_reading_does_not_hold_up_shutdown(tmp_path: Path) -> None:
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    try:
        until(lambda: running.server.http_port, DEADLINE, "the HTTP side to listen")
        with running.client() as admin:
            for _ in range(12):
                create(admin, "huge", data={"x": "h" * 1_000_000})
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", running.server.http_port))
        body = json.dumps({"query": "SELECT data FROM jobs;", "format": "json"}).encode()
        raw.sendall(
            b"POST /api/Query HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        local = raw.getsockname()[1]

        def stuck() -> bool:
            sending = queues(running.server.http_port, local)
            receiving = queues(local, running.server.http_port)
            return bool(sending and receiving and sending.send > 0 and receiving.receive > 0)

        until(stuck, DEADLINE, "the server to be stuck writing")
    except BaseException:
        running.stop()
        raise
    began = time.monotonic()
    running.stop()
    # The grace period, not the time a stalled piece of a response is given.
    assert time.monotonic() - began < serving.GRACE_SECONDS + 5
    raw.close()


def test_a_tls_handshake_that_does_not_finish_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "TLS_HANDSHAKE_SECONDS", 1.0)
    files = make_certificates(tmp_path)
    running = ThreadServer(
        tmp_path / "jobs.db", http_port=0, tls_cert=str(files.cert), tls_key=str(files.key)
    )
    try:
        until(lambda: running.server.http_port, DEADLINE, "the HTTP side to listen")
        port = running.server.http_port
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as silent:
            assert closed_by_server(silent, DEADLINE)
        # Half a ClientHello, then nothing.
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as partial:
            partial.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            assert closed_by_server(partial, DEADLINE)
        # Plain HTTP on the TLS port is closed too.
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as plain:
            plain.sendall(get("/healthz"))
            assert closed_by_server(plain, DEADLINE)
        server = HttpServer(None, str(files.ca), tmp_path / "jobs.db", running.port, port)
        with server.connect_http() as good:
            assert http_request(good, get("/healthz"))[0] == 200
    finally:
        running.stop()


# --max-http-connections: each connection holds a file descriptor, which
# the wire port needs too.


@pytest.mark.parametrize("transport", ["plain", "tls"])
def test_connections_past_the_most_are_answered_503(tmp_path: Path, transport: str) -> None:
    certs = None
    if transport == "tls":
        (tmp_path / "tls").mkdir()
        certs = make_certificates(tmp_path / "tls")
    tls = {"tls_cert": str(certs.cert), "tls_key": str(certs.key)} if certs else {}
    running = ThreadServer(tmp_path / "jobs.db", http_port=0, max_http_connections=2, **tls)
    try:
        until(lambda: running.server.http_port, DEADLINE, "the HTTP side to listen")
        server = HttpServer(
            None, str(certs.ca) if certs else None, tmp_path / "jobs.db", running.port,
            running.server.http_port,
        )
        held = [server.connect_http() for _ in range(2)]
        for sock in held:
            # The middle of a head: the connection is in use.
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        until(lambda: _refused(server), DEADLINE, "a third connection to be refused")
        with server.client() as wire:
            assert wire.request("Ping").status == "200 OK"
        held.pop().close()
        until(lambda: not _refused(server), DEADLINE, "a connection to be served again")
        for sock in held:
            sock.close()
    finally:
        running.stop()


def _refused(server: HttpServer) -> bool:
    """Whether a new connection is answered 503 (else it must be served)."""
    with server.connect_http() as sock:
        status, body = http_request(sock, get("/healthz"))
    if status == 503:
        assert b"too many HTTP connections" in body
        return True
    assert status == 200, (status, body)
    return False


def test_a_connection_whose_client_has_finished_sending_is_closed_at_once(
    quick_server,
) -> None:
    """Nothing can follow a client's FIN, so there is nothing to keep the
    connection for (before, it stayed open for the keep-alive timer, 5 s);
    a request it sent before is still answered."""
    with quick_server.connect_http() as idle:
        idle.shutdown(socket.SHUT_WR)
        assert closed_by_server(idle, 2.0)
    with quick_server.connect_http() as asked:
        asked.sendall(get("/healthz", close=False))
        asked.shutdown(socket.SHUT_WR)
        assert read_response(asked)[0] == 200
        assert closed_by_server(asked, 2.0)
