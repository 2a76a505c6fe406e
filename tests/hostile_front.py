"""A server that is broken or hostile, on real loopback connections: a
front for a real server that passes every request to it and its reply
back, except the requests that find a bad reply queued for their
command (`answer_with`; `answer_get_jobs_with` for GetJobs). Such a
request never reaches the server (a GetJobs takes no job, a FinishJob
finishes nothing), and the client gets the bad reply instead. So a test
shows a worker keeping its running jobs, and going on taking new ones,
across the replies a real server never sends.

`double_jobs()`: from then on each GetJobs goes to the server, and its
reply comes back with each job listed twice, until one such reply has
held a job.

FLOOD, as a bad reply: a head announcing a body of 100 GB, then zeros for
as long as the client reads them, up to FLOOD_CAP; `flooded` holds, for each
flood, the bytes the client took before it closed the connection."""

from __future__ import annotations

import json
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
        self._bad: dict[bytes, list[bytes | str]] = {}  # by command, lowercased
        self._doubling = False  # double_jobs() until a reply held a job
        self._open: set[socket.socket] = set()
        self.answered = 0  # bad replies sent
        self.connections = 0  # accepted so far
        self.flooded: list[int] = []  # bytes of each flood sent before the client closed
        threading.Thread(target=self._accept, daemon=True).start()

    def answer_get_jobs_with(self, *replies: bytes | str) -> None:
        """Answer the next GetJobs (one each) with these, in turn."""
        self.answer_with("GetJobs", *replies)

    def answer_with(self, command: str, *replies: bytes | str) -> None:
        """Answer the next requests of `command` (one each) with these, in turn."""
        with self._guard:
            self._bad.setdefault(command.lower().encode(), []).extend(replies)

    def double_jobs(self) -> None:
        """List each job twice in the server's replies to GetJobs, until
        one such reply has held a job (counted in `answered`)."""
        with self._guard:
            self._doubling = True

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
            # Set while the reply on its way is to be doubled: a client sends
            # its next request only after the reply to the last.
            doubled = threading.Event()
            threading.Thread(
                target=self._requests, args=(client, server, doubled), daemon=True
            ).start()
            threading.Thread(
                target=self._replies, args=(server, client, doubled), daemon=True
            ).start()

    def _requests(
        self, client: socket.socket, server: socket.socket, doubled: threading.Event
    ) -> None:
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
                        if self._doubles(head):
                            doubled.set()
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

    def _replies(
        self, server: socket.socket, client: socket.socket, doubled: threading.Event
    ) -> None:
        buffered = b""
        with suppress(OSError):
            while chunk := server.recv(65536):
                if not doubled.is_set():
                    client.sendall(chunk)
                    continue
                buffered += chunk
                whole = _whole_reply(buffered)
                if whole is not None:
                    doubled.clear()
                    client.sendall(self._double(*whole))
                    buffered = b""
        _drop(server, client)

    def _command(self, head: bytes) -> bytes:
        return head.split(maxsplit=1)[0].lower() if head.strip() else b""

    def _take_bad(self, head: bytes) -> bytes | str | None:
        with self._guard:
            queued = self._bad.get(self._command(head))
            if not queued:
                return None
            self.answered += 1
            return queued.pop(0)

    def _doubles(self, head: bytes) -> bool:
        with self._guard:
            return self._doubling and self._command(head) == b"getjobs"

    def _double(self, status: str, body: bytes) -> bytes:
        """The reply `status`, `body` with each job in it listed twice."""
        jobs = json.loads(body)["jobs"] if status.startswith("200 ") else []
        if not jobs:
            return reply(status, body)
        with self._guard:
            self._doubling = False
            self.answered += 1
        return reply(status, json.dumps({"jobs": [job for job in jobs for _ in (1, 2)]}).encode())

    def _flood(self, client: socket.socket) -> None:
        sent = 0
        with suppress(OSError):
            client.sendall(FLOOD_HEAD)
            while sent < FLOOD_CAP:
                client.sendall(_ZEROS)
                sent += len(_ZEROS)
        with self._guard:
            self.flooded.append(sent)


def _whole_reply(received: bytes) -> tuple[str, bytes] | None:
    """The status line and body of the reply `received` holds, once whole."""
    head, found, body = received.partition(b"\r\n\r\n")
    if not found:
        return None
    lines = head.decode().split("\r\n")
    name = "content-length:"
    length = sum(int(line[len(name):]) for line in lines if line.lower().startswith(name))
    return (lines[0], body) if len(body) >= length else None


def _drop(*sockets: socket.socket) -> None:
    for sock in sockets:
        # shutdown wakes a pump blocked in recv; close alone would not.
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
