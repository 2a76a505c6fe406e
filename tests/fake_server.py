"""A scripted stand-in for the server, for failures a real one won't stage
on cue: a connection that breaks after the request, a reply the client
cannot read, a status line the server never sends."""

from __future__ import annotations

import socket
import threading

# Script entries, besides the bytes of a reply to send after reading a request.
NO_REPLY = None  # read the request, then close without a word
HANG_UP = "hang up"  # close now, before another request comes

OK = b"200 OK\r\nContent-Length: 0\r\n\r\n"


def reply(status: str, body: bytes = b"", *headers: str) -> bytes:
    head = status + "\r\n" + "".join(f"{header}\r\n" for header in headers)
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class FakeServer:
    """Listens on a loopback port and serves connections one after another.

    Connection number i follows scripts[i] (connections beyond the scripts
    get an empty one). Once its script is done, a connection stays open and
    silent: a further request is recorded but never answered, and the
    connection ends when the client closes it.
    """

    def __init__(self, *scripts: list[bytes | str | None]) -> None:
        self.scripts = scripts
        self.requests: list[tuple[int, bytes]] = []
        self.closed = 0
        self._changed = threading.Condition()
        self._stopping = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def methods(self) -> list[tuple[int, str]]:
        """(connection number, method line) of each request received."""
        return [(number, head.split(b"\r\n", 1)[0].decode()) for number, head in self.requests]

    def wait_closed(self, count: int, timeout: float = 5.0) -> None:
        """Until this many connections have been closed by either side."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.closed >= count, timeout)

    def stop(self) -> None:
        self._stopping = True
        # Closing the listener would not wake the thread blocked in accept().
        socket.create_connection(("127.0.0.1", self.port)).close()
        self._thread.join(10)
        self._listener.close()

    def _serve(self) -> None:
        number = 0
        while True:
            conn, _ = self._listener.accept()
            if self._stopping:
                conn.close()
                return
            script = self.scripts[number] if number < len(self.scripts) else []
            with conn:
                conn.settimeout(10)
                self._follow(number, conn, script)
            with self._changed:
                self.closed += 1
                self._changed.notify_all()
            number += 1

    def _follow(self, number: int, conn: socket.socket, script: list[bytes | str | None]) -> None:
        for step in script:
            if step == HANG_UP:
                return
            if not self._take_request(number, conn) or step is NO_REPLY:
                return
            assert isinstance(step, bytes)
            conn.sendall(step)
        while self._take_request(number, conn):
            pass  # silent until the client goes

    def _take_request(self, number: int, conn: socket.socket) -> bool:
        """Read one request head and record it; False at the end of the stream."""
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return False
            if not chunk:
                return False
            data += chunk
        with self._changed:
            self.requests.append((number, data))
            self._changed.notify_all()
        return True
