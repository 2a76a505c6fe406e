"""What the wire port answers to an HTTP request (wire/framing.NotHttp).

The most likely first mistake is `curl localhost:8888/` or a browser
pointed at the wire port. A bare status line would read to them as
HTTP/0.9 (curl refuses it, Chromium shows ERR_INVALID_HTTP_RESPONSE), so
the answer is a valid HTTP/1.1 `400 Bad Request` whose text says where
HTTP is. It says only what the server's own settings say (the HTTP port,
whether it is TLS), never anything of the request: a page that made a
browser send it learns nothing it sent. The connection is then closed,
its body unread, as before: no framing an HTTP client claims can make a
body be read as commands.
"""

from __future__ import annotations

WIRE_PORT = (
    "This is jobserver's wire port: it speaks jobserver's text protocol "
    "(nc HOST PORT, then a command such as Ping and a blank line), not HTTP.\n"
)


def response(http_port: int | None, tls: bool, head_only: bool) -> bytes:
    """The whole HTTP/1.1 response; its body left out for a HEAD request."""
    body = (WIRE_PORT + _where_http_is(http_port, tls)).encode("ascii")
    head = (
        "HTTP/1.1 400 Bad Request\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        "Cache-Control: no-store\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    return head if head_only else head + body


def _where_http_is(http_port: int | None, tls: bool) -> str:
    if http_port is None:
        return (
            "This server serves no HTTP. For the HTTP API and the dashboard, start it "
            "with --http-port PORT (pip install 'jobserverd[web]').\n"
        )
    scheme = "https" if tls else "http"
    return (
        f"The HTTP API and the dashboard are on port {http_port} of this host: "
        f"{scheme}://HOST:{http_port}/\n"
    )
