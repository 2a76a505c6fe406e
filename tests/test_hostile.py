"""Careless and hostile clients: timeouts, connection limits, garbage,
authentication and TLS. Nothing crashes, and other clients are served."""

from __future__ import annotations

import contextlib
import resource
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from harness import ThreadServer
from wire import Client

DEADLINE = 10.0


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator:
    started: list[ThreadServer] = []

    def make(**options: object) -> ThreadServer:
        running = ThreadServer(tmp_path / f"jobs{len(started)}.db", **options)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


def closed_within(client: Client, seconds: float = DEADLINE) -> bool:
    client.sock.settimeout(seconds)
    try:
        return client.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_an_idle_connection_is_closed(make_server):
    running = make_server(idle_timeout=0.3)
    with running.client() as idle:
        began = time.monotonic()
        assert closed_within(idle)
        assert time.monotonic() - began >= 0.25


def test_a_connection_in_use_is_not_idle(make_server):
    running = make_server(idle_timeout=0.5)
    with running.client() as busy:
        # Requests keep coming more often than the idle timeout: it stays open.
        for _ in range(6):
            assert busy.request("Ping").status == "200 OK"
            time.sleep(0.2)


def test_a_waiting_get_job_is_not_idle(make_server):
    running = make_server(idle_timeout=0.3)
    with running.client() as worker:
        reply = worker.request("GetJob", name="none", Connection="wait", timeout=1500)
        assert reply.status == "404 No job found"


def test_a_trickled_request_gets_408_and_others_are_served(make_server):
    running = make_server(request_timeout=1.0)
    with running.client() as slow, running.client() as other:
        slow.send(b"Cre")
        began = time.monotonic()
        # While the slow request hangs, another client is answered at once.
        assert other.request("Ping").status == "200 OK"
        slow.send(b"ateJob\nname: slow")
        reply = slow.read_reply()
        assert reply.status == "408 Request timeout"
        assert reply.headers.get("Connection") == "close"
        assert closed_within(slow)
        assert time.monotonic() - began < DEADLINE
        assert other.request("GetJob", name="*").status == "404 No job found"


def test_a_slow_but_steady_request_within_the_limit_is_answered(make_server):
    running = make_server(request_timeout=5.0)
    with running.client() as slow:
        for byte in b"Ping\n\n":
            slow.send(bytes([byte]))
            time.sleep(0.02)
        assert slow.read_reply().status == "200 OK"


def test_connections_past_the_limit_get_503(make_server):
    running = make_server(max_connections=3)
    held = [running.client() for _ in range(3)]
    try:
        for client in held:
            assert client.request("Ping").status == "200 OK"
        with running.client() as extra:
            reply = extra.read_reply()
            assert reply.status == "503 Too many connections"
            assert closed_within(extra)
    finally:
        for client in held:
            client.close()
    # Once they leave, new connections are served again.
    deadline = time.monotonic() + DEADLINE
    while True:
        with running.client() as again:
            again.send(b"Ping\r\n\r\n")
            if again.read_reply().status == "200 OK":
                break
        assert time.monotonic() < deadline


def test_a_thousand_connections_at_once(make_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    running = make_server()
    clients = [running.client() for _ in range(1000)]
    try:
        for client in clients:
            client.send(b"Ping\r\n\r\n")
        assert all(client.read_reply().status == "200 OK" for client in clients)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize(
    "garbage",
    [
        bytes(range(256)) * 4 + b"\n\n",
        b"\x00\x00\x00\n\n",
        b"\xff\xfe\xfd\n\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_garbage_never_hurts_the_server(server, garbage):
    with server.client() as bad:
        bad.send(garbage)
        bad.sock.settimeout(2)
        try:
            data = bad.sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            data = b""
        # Whatever it got was a status line of the protocol, HTTP's 400 for
        # an HTTP request (protocol.md 1.2), or nothing.
        http = garbage.startswith(b"GET ") and data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert data == b"" or data[:3].isdigit() or http, data
    with server.client() as good:
        assert good.request("Ping").status == "200 OK"


HOSTILE = "'; DROP TABLE jobs; -- \" %_*?[ ) OR 1=1"


def test_sql_metacharacters_in_every_field_are_just_text(client):
    reply = client.request(
        "CreateJob", name=HOSTILE, data={HOSTILE: HOSTILE}, firstRun=HOSTILE
    )
    assert reply.status == "402 Malformed firstRun"
    reply = client.request("CreateJob", name=HOSTILE, data={HOSTILE: HOSTILE})
    job_id = reply.json["jobID"]
    for field in ("repeat", "retryAfter", "jobPriority", "parentJobID"):
        assert client.request("CreateJob", name="x", **{field: HOSTILE}).code == 402
    job = client.request("QueryJob", jobID=job_id).json
    assert (job["name"], job["data"]) == (HOSTILE, {HOSTILE: HOSTILE})
    taken = client.request("GetJob", name=HOSTILE)
    # As a GLOB the text is a pattern; as an exact name in a list it matches.
    assert taken.status in ("200 OK", "404 No job found")
    listed = client.request("GetJob", name=f"{HOSTILE},other")
    assert listed.status in ("200 OK", "404 No job found")
    assert client.request("QueryJob", jobID=job_id).status == "200 OK"


def test_a_pathological_pattern_does_not_stall_others(server, client):
    client.request("CreateJobs", jobs=[{"name": "a" * 200} for _ in range(50)])
    with server.client() as other:
        began = time.monotonic()
        reply = client.request("GetJob", name="*a*a*a*a*a*a*a*a*a*a*a*a*b")
        assert reply.status == "404 No job found"
        assert other.request("Ping").status == "200 OK"
        assert time.monotonic() - began < DEADLINE


# Authentication.


def test_with_a_token_every_request_must_carry_it(make_server):
    running = make_server(auth_token="s3cret-token")
    with running.client() as c:
        assert c.request("Ping").status == "401 Unauthorized"
        assert c.request("CreateJob", name="x").status == "401 Unauthorized"
        assert c.request("CreateJob", name="x", authToken="wrong").status == "401 Unauthorized"
        reply = c.request("CreateJob", name="x", authToken="s3cret-token")
        assert reply.status == "200 OK"
        # Nothing was created by the refused requests.
        assert (
            c.request("GetJob", name="*", authToken="s3cret-token").json["jobID"]
            == reply.json["jobID"]
        )
        assert c.request("GetJob", name="*", authToken="s3cret-token").status == "404 No job found"


def test_without_a_token_option_the_header_is_ignored(client):
    assert client.request("Ping", authToken="anything").status == "200 OK"


# TLS.


def certificate_files(tmp_path: Path) -> tuple[trustme.CA, Path, Path]:
    """A certificate authority made now, and a certificate of the server's
    own from it, written where `serve --tls-cert/--tls-key` read them."""
    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    certificate.cert_chain_pems[0].write_to_path(cert)
    certificate.private_key_pem.write_to_path(key)
    return authority, cert, key


@contextlib.contextmanager
def tls_connection(port: int, authority: trustme.CA) -> Iterator[ssl.SSLSocket]:
    """A TLS connection to the server, trusting `authority`."""
    context = ssl.create_default_context()
    authority.configure_trust(context)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        yield tls


def test_tls_with_a_certificate_made_now(make_server, tmp_path):
    authority, cert, key = certificate_files(tmp_path)
    running = make_server(tls_cert=str(cert), tls_key=str(key))
    with tls_connection(running.port, authority) as tls:
        tls.sendall(b"CreateJob\r\nname: secure\r\n\r\n")
        data = b""
        while b'"jobID"' not in data:
            data += tls.recv(4096)
        assert data.startswith(b"200 OK\r\n")
    # A client that does not speak TLS gets nothing it could mistake for a reply.
    with running.client() as plain:
        plain.send(b"Ping\r\n\r\n")
        plain.sock.settimeout(DEADLINE)
        try:
            answer = plain.sock.recv(100)
        except OSError:
            answer = b""
        assert not answer.startswith(b"200")


def test_tls_read_deadlines_fire_too(make_server, tmp_path):
    """A read under TLS is stopped at its deadline as a plain one is: a
    trickled request gets its 408 in TLS, and an idle connection is closed."""
    authority, cert, key = certificate_files(tmp_path)
    running = make_server(tls_cert=str(cert), tls_key=str(key), request_timeout=0.5,
                          idle_timeout=0.5)
    with tls_connection(running.port, authority) as tls:
        tls.sendall(b"CreateJob\r\nname: slow")
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
        assert data.startswith(b"408 Request timeout\r\n")
    with tls_connection(running.port, authority) as tls:
        began = time.monotonic()
        assert tls.recv(1) == b""
        assert time.monotonic() - began >= 0.4


# Binding to other addresses.


def test_binding_beyond_loopback_without_a_token_warns(start_server, tmp_path):
    proc = start_server(tmp_path / "jobs.db", "--host", "0.0.0.0")
    assert "without --auth-token-file" in proc.log
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    quiet = start_server(tmp_path / "b.db", "--host", "0.0.0.0", "--auth-token-file", str(token))
    assert "without --auth-token-file" not in quiet.log
    with quiet.client() as c:
        assert c.request("Ping").status == "401 Unauthorized"
        assert c.request("Ping", authToken="t0ken").status == "200 OK"


def test_the_client_cli_and_manager_send_the_token(make_server, tmp_path, monkeypatch):
    import subprocess
    import sys

    from jobserver.client import Client as Library
    from jobserver.client import MalformedRequest

    running = make_server(auth_token="t0k")
    with Library("127.0.0.1", running.port, auth_token="t0k") as good:
        job_id = good.create_job("authorized")
    with Library("127.0.0.1", running.port) as anonymous, pytest.raises(MalformedRequest):
        anonymous.ping()
    token = tmp_path / "token"
    token.write_text("t0k\n")
    command = [sys.executable, "-m", "jobserver", "query", str(job_id),
               "--server", f"127.0.0.1:{running.port}"]
    assert subprocess.run(command, capture_output=True, timeout=30).returncode != 0
    result = subprocess.run([*command, "--auth-token-file", str(token)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("JOBSERVER_AUTH_TOKEN", "t0k")
    assert subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def test_requests_trickled_without_pause_get_408_within_a_sweep(make_server):
    """A client that sends a byte of its request as fast as it can: its reads
    are each under way when a sweep looks, or just done, and a deadline
    already past is seen by the read that follows it (a sweep that finds the
    task awake stops nothing), so the 408 comes within the request timeout
    and a sweep, not whenever a sweep happens to catch a read."""
    running = make_server(request_timeout=1.0, idle_timeout=30.0)
    clients = [running.client() for _ in range(6)]
    stop = threading.Event()
    sent_at: dict[int, float] = {}

    def trickle(index: int, client: Client) -> None:
        client.send(b"CreateJob\nname: ")
        sent_at[index] = time.monotonic()
        with contextlib.suppress(OSError):
            while not stop.is_set():
                client.sock.send(b"x")
                time.sleep(0.0001)

    threads = [
        threading.Thread(target=trickle, args=(i, c), daemon=True) for i, c in enumerate(clients)
    ]
    try:
        for thread in threads:
            thread.start()
        for index, client in enumerate(clients):
            reply = client.read_reply()
            assert reply.status == "408 Request timeout"
            # 1 s of timeout and a second for a loaded machine; without the
            # check before each read, a sweep or more went by (2.2 to 2.7 s).
            assert time.monotonic() - sent_at[index] < 2.0
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE)
        for client in clients:
            client.close()
