"""A client process for the HTTP fault matrix (tests/test_security_http_faults.py):
victim.py's counterpart for the HTTP port. It brings a connection to one
stage of an HTTP request's life, says so, and then ends it as told.

    python http_victim.py PORT STAGE NAME [--tls-ca FILE]

Prints `ready <local port>`, then reads `fin`, `rst` or `half` from
standard input as victim.py does (the harness may SIGKILL it instead).
After `half` it prints `shut`, reads everything the server still sends and
prints `got <JSON>`: the status codes of the whole responses it received.
Last it prints `done`.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys

from victim import connect, end

STAGES = ("idle", "mid-head", "mid-body", "before-reply", "large-reply")


def request(path: str, document: dict, length: int | None = None) -> tuple[bytes, bytes]:
    """(head, body) of a POST of `document` as JSON; `length` overrides
    the Content-Length the head announces."""
    body = json.dumps(document).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    ).encode()
    return head, body


def set_up(sock: socket.socket, stage: str, name: str) -> None:
    if stage == "idle":
        return
    if stage == "mid-head":
        head, _ = request("/api/Ping", {})
        sock.sendall(head[: len(head) // 2])
    elif stage == "mid-body":
        head, body = request("/api/CreateJob", {"name": name}, length=1000)
        sock.sendall(head + body)
    elif stage == "before-reply":
        head, body = request("/api/CreateJob", {"name": name})
        sock.sendall(head + body)
    elif stage == "large-reply":
        query = f"SELECT data FROM jobs WHERE name = '{name}';"
        head, body = request("/api/Query", {"query": query, "format": "json"})
        sock.sendall(head + body)
    else:
        raise SystemExit(f"unknown stage {stage}")


def read_all(sock: socket.socket) -> list[int]:
    """The status codes of every whole response until the server closes."""
    buffer = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except (ConnectionError, ssl.SSLError, OSError):
            break
        if not chunk:
            break
        buffer += chunk
    statuses = []
    while b"\r\n\r\n" in buffer:
        head, rest = buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            int(line.split(":", 1)[1]) for line in lines
            if line.lower().startswith("content-length:")
        )
        if len(rest) < length:
            break
        buffer = rest[length:]
        statuses.append(int(lines[0].split()[1]))
    return statuses


def main() -> None:
    port, stage, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ca = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--tls-ca" else None
    sock = connect(port, ca, small_buffer=stage == "large-reply")
    set_up(sock, stage, name)
    print(f"ready {sock.getsockname()[1]}", flush=True)
    how = sys.stdin.readline().strip()
    if how == "half":
        socket.socket.shutdown(sock, socket.SHUT_WR)
        print("shut", flush=True)
        print("got " + json.dumps(read_all(sock)), flush=True)
        sock.close()
    else:
        end(sock, how)
    print("done", flush=True)


if __name__ == "__main__":
    main()
