"""A plain wire client for the bench scripts that count what a real server
does per request (hops.py, pg_statements.py, syscalls.py): one socket, one request at a
time, no reconnects, nothing of the client library, so the server sees
exactly the requests the script sends."""

from __future__ import annotations

import json
import socket
from typing import Any


def encode(method: str, params: dict) -> bytes:
    lines = [method]
    for name, value in params.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, separators=(",", ":")).replace("\\", "\\\\")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Client:
    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, method: str, **params: object) -> None:
        self.sock.sendall(encode(method, params))

    def reply(self) -> tuple[str, bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return lines[0], body

    def request(self, method: str, **params: object) -> tuple[str, bytes]:
        self.send(method, **params)
        return self.reply()

    def ok(self, method: str, **params: object) -> Any:
        status, body = self.request(method, **params)
        if not status.startswith("200"):
            raise RuntimeError(f"{method}: {status} {body[:200]!r}")
        return json.loads(body) if body else {}

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buffer += chunk


# --- the server's log -----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
