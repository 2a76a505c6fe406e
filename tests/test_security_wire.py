"""The wire port against what a browser (and any HTTP client) can send it.

A web page on any site, opened in a browser on the server's machine, can
make the browser send HTTP to the wire port: a form, or fetch in no-cors
mode, with a body the page chose. Such a request must never act: the
server answers a request line of HTTP's own methods with one HTTP response
and closes the connection, before reading the body, whatever framing the
request claims. Bedrock's `CreateJob / HTTP/1.1` stays a command.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import ThreadServer
from helpers import chromium, ok
from jobserver.server.connection import CONNECTION_LINES_PER_MINUTE
from wire import Client

DEADLINE = 10.0
SMUGGLED = b"CreateJob\r\nname: smuggled\r\n\r\n"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db")
    yield running
    running.stop()


def jobs_named(client: Client, name: str) -> int:
    reply = ok(client.request("Query", query=f"SELECT COUNT(*) FROM jobs WHERE name = '{name}';"))
    return int(reply.body.decode().splitlines()[1])


def answer_and_close(server: ThreadServer, request: bytes) -> bytes:
    """Everything the server sends back until it closes the connection."""
    with server.client(timeout=DEADLINE) as client:
        client.send(request)
        received = b""
        while chunk := client.sock.recv(65536):
            received += chunk
        return received


def chunked(body: bytes) -> bytes:
    # A chunk that begins with a blank line: read as wire requests, the
    # size line would end a request of its own and the body become the next.
    data = b"\r\n" + body
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked(SMUGGLED),
        b"GET /?x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + SMUGGLED,
        b"post / HTTP/1.0\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
        b"OPTIONS / HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n\r\n" + SMUGGLED,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SMUGGLED,
        b" \rPOST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
        # What a rebinding page's fetch("/", {method: "CreateJob"}) sends.
        b"CreateJob / HTTP/1.1\r\nHost: rebind.example\r\nname: smuggled\r\n"
        b"Origin: http://rebind.example\r\nContent-Length: 0\r\n\r\n",
        b"CreateJob\r\nname: smuggled\r\noRiGiN \t: null\r\n\r\n" + SMUGGLED,
    ],
    ids=["chunked-post", "get", "post-lower-case", "preflight", "http2-preface", "stray-cr",
         "rebound-method", "origin-any-case"],
)
def test_an_http_request_is_answered_once_and_the_connection_closed(
    server: ThreadServer, request_bytes: bytes
) -> None:
    received = answer_and_close(server, request_bytes)
    assert received.startswith(b"HTTP/1.1 400 Bad Request\r\n"), received
    assert received.count(b"\r\n\r\n") == 1, received
    assert b"wire port" in received and b"smuggled" not in received
    with server.client() as client:
        assert jobs_named(client, "smuggled") == 0


def test_bedrock_style_method_lines_stay_commands(server: ThreadServer) -> None:
    with server.client() as client:
        ok(client.request("CreateJob / HTTP/1.1", name="bedrock"))
        ok(client.request("GetJob / HTTP/1.1", name="bedrock"))
        assert ok(client.request("Ping")).status == "200 OK"


# A real browser, on a page of another origin.


class _AttackPage(http.server.BaseHTTPRequestHandler):
    """Serves one page whose script posts to the target port."""

    html = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.html)))
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args: Any) -> None:
        pass


def _attack_page(target_port: int) -> str:
    body = SMUGGLED.decode().replace("\r\n", "\\r\\n")
    return f"""<!doctype html><title>a page elsewhere</title>
<form id=f method=post enctype=text/plain action="http://127.0.0.1:{target_port}/">
<input name="{body}" value="">
</form>
<script>
const target = "http://127.0.0.1:{target_port}/";
const tries = [
  fetch(target, {{method: "POST", mode: "no-cors", body: "{body}"}}),
  fetch(target, {{method: "POST", mode: "no-cors", body: "{body}",
                  headers: {{"Content-Type": "text/plain"}}}}),
  fetch(target + "?{body}", {{mode: "no-cors"}}),
];
Promise.allSettled(tries).then(() => {{ document.title = "done"; }});
</script>"""


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


def test_a_web_page_in_a_browser_cannot_act_on_the_wire_port(
    browser: Any, server: ThreadServer
) -> None:
    handler = type("Page", (_AttackPage,), {"html": _attack_page(server.port).encode()})
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{site.server_address[1]}/")
        page.wait_for_function("document.title === 'done'", timeout=DEADLINE * 1000)
        # The form too; whatever the browser makes of the answer.
        page.evaluate("document.getElementById('f').submit()")
        page.wait_for_load_state("load", timeout=DEADLINE * 1000)
    finally:
        page.close()
        site.shutdown()
    with server.client() as client:
        assert jobs_named(client, "smuggled") == 0
        assert ok(client.request("Ping")).status == "200 OK"


# The log, against a client that ends connections in ways the server logs.


def test_connections_ended_badly_cannot_flood_the_log(start_server: Any) -> None:
    server = start_server()
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64
    for _ in range(CONNECTION_LINES_PER_MINUTE + 50):
        with server.client() as client:
            client.send(hello)
            client.sock.recv(1024)
    with server.client() as client:
        ok(client.request("Ping"))
    lines = [line for line in server.log.splitlines() if "TLS handshake" in line]
    assert 1 <= len(lines) <= CONNECTION_LINES_PER_MINUTE, len(lines)


# Chromium's Private Network Access refuses a page's fetch to loopback;
# Firefox and Safari have no such check, so it is turned off here.
WITHOUT_PRIVATE_NETWORK_ACCESS = (
    "--disable-features=BlockInsecurePrivateNetworkRequests,"
    "PrivateNetworkAccessRespectPreflightResults,PrivateNetworkAccessSendPreflights,"
    "LocalNetworkAccessChecks"
)
# DNS rebinding: a page served from REBOUND:PORT, whose name then resolves
# to this machine, is same-origin with the wire port. Its fetch needs no
# preflight for a method of its choosing, so `CreateJob / HTTP/1.1`, as
# Bedrock's clients write it, reaches the server with headers the page set.
REBOUND = "rebind.example"
REBINDING_PAGE = """<!doctype html>
<script>
window.results = Promise.allSettled([
  fetch("/", {method: "CreateJob", headers: {name: "rebound"}}),
  fetch("/", {method: "CreateJob", headers: {name: "rebound"}, body: "x"}),
]).then(settled => settled.map(
  one => one.status === "fulfilled" ? one.value.status : "rejected"));
</script>
"""


@pytest.fixture
def rebinding_browser() -> Iterator[Any]:
    rule = f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"
    with chromium("--no-sandbox", rule, WITHOUT_PRIVATE_NETWORK_ACCESS) as launched:
        yield launched


def test_a_rebinding_page_cannot_send_a_command_as_a_method(
    rebinding_browser: Any, server: ThreadServer
) -> None:
    origin = f"http://{REBOUND}:{server.port}"
    page = rebinding_browser.new_page()
    try:
        page.route(
            f"{origin}/attack",
            lambda route: route.fulfill(body=REBINDING_PAGE, content_type="text/html"),
        )
        page.goto(f"{origin}/attack")
        # Told in HTTP, the fixed text that reflects nothing of the request.
        assert page.evaluate("window.results") == [400, 400]
    finally:
        page.close()
    with server.client() as client:
        assert jobs_named(client, "rebound") == 0
        assert ok(client.request("Ping")).status == "200 OK"
