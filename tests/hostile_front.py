"""A server that is broken or hostile, on real loopback connections: a
front for a real server that passes every request to it and its reply
back, except the GetJobs that find a bad reply queued
(`answer_get_jobs_with`). Such a GetJobs never reaches the server, so no
job is taken for it, and the client gets the bad reply instead. So a test
shows a worker keeping its running jobs, and going on taking new ones,
across the replies a real server never sends.

FLOOD, as a bad reply: a head announcing a body of 100 GB, then zeros for
as long as the client reads them, up to FLOOD_CAP; `flooded` holds, for each
flood, the bytes the client took before it closed the connection."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress

FLOOD = "flood"
FLOOD_HEAD = b"200 OK\r\nContent-Length: 100000000000\r\n\r\n"
# A client that reads a flood to the end has failed: far more than any
# bound a client keeps (and the socket buffers between) would let through.
FLOOD_CAP = 256 * 1024 * 1024
_ZEROS = bytes(65536)


def reply(status: str, body: bytes = b"") -> bytes:
    return f"{status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


class HostileFront:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._guard = threading.Lock()
        self._bad: list[bytes | str] = []
        self._open: set[socket.socket] = set()
        self.answered = 0  # bad replies sent
        self.connections = 0  # accepted so far
        self.flooded: list[int] = []  # bytes of each flood sent before the client closed
        threading.Thread(target=self._accept, daemon=True).start()

    def answer_get_jobs_with(self, *replies: bytes | str) -> None:
        """Answer the next GetJobs (one each) with these, in turn."""
        with self._guard:
            self._bad.extend(replies)

    def close(self) -> None:
        self.listener.close()
        with self._guard:
            dropped = list(self._open)
        _drop(*dropped)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._guard:
                self.connections += 1
                self._open |= {client, server}
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        """Requests to the server, or a bad reply instead. A client's
        requests have no bodies, and it sends the next only after a reply."""
        buffered = b""
        with suppress(OSError):
            while chunk := client.recv(65536):
                buffered += chunk
                while b"\r\n\r\n" in buffered:
                    head, _, buffered = buffered.partition(b"\r\n\r\n")
                    bad = self._take_bad(head)
                    if bad is None:
                        server.sendall(head + b"\r\n\r\n")
                    elif bad == FLOOD:
                        self._flood(client)
                        _drop(client, server)
                        return
                    else:
                        assert isinstance(bad, bytes)
                        client.sendall(bad)
            # A half-close (the worker ending a waiting GetJobs) goes on to
            # the server, which answers, then closes.
            server.shutdown(socket.SHUT_WR)

    def _replies(self, server: socket.socket, client: socket.socket) -> None:
        with suppress(OSError):
            while chunk := server.recv(65536):
                client.sendall(chunk)
        _drop(server, client)

    def _take_bad(self, head: bytes) -> bytes | str | None:
        if not head.lstrip().startswith(b"GetJobs"):
            return None
        with self._guard:
            if not self._bad:
                return None
            self.answered += 1
            return self._bad.pop(0)

    def _flood(self, client: socket.socket) -> None:
        sent = 0
        with suppress(OSError):
            client.sendall(FLOOD_HEAD)
            while sent < FLOOD_CAP:
                client.sendall(_ZEROS)
                sent += len(_ZEROS)
        with self._guard:
            self.flooded.append(sent)


def _drop(*sockets: socket.socket) -> None:
    for sock in sockets:
        # shutdown wakes a pump blocked in recv; close alone would not.
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
