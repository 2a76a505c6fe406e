"""A deliberately small, independent client for tests: plain sockets, and a
reply reader that does not share code with the server's parser."""

from __future__ import annotations

import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: str
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> int:
        return int(self.status.split(" ", 1)[0])

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    def __init__(
        self, port: int, timeout: float = 10.0, host: str = "127.0.0.1", tls_ca: str | None = None
    ) -> None:
        """`tls_ca`: speak TLS, trusting the certificates this CA file signed."""
        self.sock = socket.create_connection((host, port), timeout=timeout)
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=tls_ca)
            self.sock = context.wrap_socket(self.sock, server_hostname="localhost")
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def request(self, method: str, headers: dict[str, Any] | None = None, **params: Any) -> Reply:
        self.send(encode(method, {**(headers or {}), **params}))
        return self.read_reply()

    def read_reply(self) -> Reply:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("utf-8").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(": ")
            headers[name] = value
        length = int(headers["Content-Length"])
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Reply(lines[0], headers, body)

    def at_eof(self) -> bool:
        """True when the server has closed the connection."""
        if self.buffer:
            return False
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buffer += chunk


def encode(method: str, params: dict[str, Any]) -> bytes:
    lines = [method]
    for name, value in params.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value).replace("\\", "\\\\")
        elif isinstance(value, bool):
            value = "true" if value else "false"
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
