"""A TCP relay that a test can cut: the network failing, on real
connections to a real server (a node's to PostgreSQL, a client's to a
node).

`cut` drops every relayed connection and closes each new one at once
until `restore`. `cut_at` arms a cut of the next connection that sends
some bytes (a COMMIT in PostgreSQL's protocol, `cut_at_commit`; a
command's verb in jobserver's): either they reach the server and its
reply is lost (`reaches=True`: the server acts, the client cannot know),
or they never leave the relay (`reaches=False`).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

# The text of a COMMIT in PostgreSQL's Parse or Query message.
COMMIT = b"COMMIT\x00"
# PostgreSQL's ReadyForQuery message (its status byte follows): sent once
# everything before it is done, a COMMIT included.
READY_FOR_QUERY = b"Z\x00\x00\x00\x05"
# How long the relay lets the server work on what it forwarded before the
# connection is cut, when the cut does not wait for a sign of the
# server's answer: a request on loopback takes milliseconds.
WORK_SECONDS = 0.5
# How long it waits for that sign: cut earlier, a COMMIT that PostgreSQL
# had not read yet on a busy machine was aborted, not committed (the node
# asked, found it in progress, and ended its backend).
ANSWER_SECONDS = 10.0
# How often a pump that waits for the answer looks for it.
POLL_SECONDS = 0.02


@dataclass
class _Link:
    """One relayed connection's state shared by its two pumps."""

    # Set once an armed cut took this connection: the server's bytes are
    # dropped from then on.
    dropped: threading.Event = field(default_factory=threading.Event)
    # What shows that the server answered what the cut let through
    # (empty: nothing does; the cut comes WORK_SECONDS after), and
    # whether it has come.
    answer: bytes = b""
    answered: threading.Event = field(default_factory=threading.Event)


class Relay:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._guard = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        # An armed cut: the bytes it waits for, whether they reach the
        # server, whether the relay stays cut afterwards, and what shows the
        # server has answered them.
        self._armed: tuple[bytes, bool, bool, bytes] | None = None
        # Set once an armed cut has happened.
        self.was_cut = threading.Event()
        # Every byte sent to the server, in the order it was relayed (the
        # connections' interleaved): what a node sent, and how.
        self.sent = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def to(cls, url: str) -> Relay:
        parts = urlsplit(url)
        return cls((parts.hostname or "127.0.0.1", parts.port or 5432))

    def url(self, url: str) -> str:
        """`url`, through this proxy."""
        parts = urlsplit(url)
        user = f"{parts.username}@" if parts.username else ""
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def cut(self) -> None:
        with self._guard:
            self._cut = True
            dropped = list(self._open)
        self._drop(*dropped)

    def restore(self) -> None:
        with self._guard:
            self._cut = False

    def cut_at_commit(self, reaches: bool, stay_cut: bool = False) -> None:
        """Cut the next connection that sends PostgreSQL a COMMIT (`cut_at`);
        one that reaches it is cut once PostgreSQL has answered it."""
        self.cut_at(COMMIT, reaches, stay_cut, answer=READY_FOR_QUERY)

    def cut_at(
        self, marker: bytes, reaches: bool, stay_cut: bool = False, answer: bytes = b""
    ) -> None:
        """Cut the next connection that sends `marker`, as it sends it
        (`reaches`: after the server has it, its reply never coming back:
        the cut comes when the server's reply holds `answer`, if given, else
        WORK_SECONDS later); with `stay_cut`, every connection is refused
        from then on, until `restore`."""
        with self._guard:
            self.was_cut.clear()
            self._armed = (marker, reaches, stay_cut, answer)

    def close(self) -> None:
        self.cut()
        self.listener.close()

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
                relayed = not self._cut
                if relayed:
                    self._open |= {client, server}
            if not relayed:
                self._drop(client, server)
                continue
            link = _Link()
            threading.Thread(
                target=self._pump_requests, args=(client, server, link), daemon=True
            ).start()
            threading.Thread(
                target=self._pump_replies, args=(server, client, link), daemon=True
            ).start()

    def _pump_requests(self, source: socket.socket, sink: socket.socket, link: _Link) -> None:
        armed: tuple[bool, bool] | None = None
        cut_at = 0.0
        with suppress(OSError):
            while chunk := self._next_chunk(source, cut_at, link.answered):
                if armed is None:
                    armed = self._take_armed(chunk, link)
                    if armed is not None:
                        link.dropped.set()
                        if not armed[0]:
                            break
                        # The rest of the messages (a COMMIT's Execute, the
                        # Sync) may follow in later chunks: relayed too.
                        wait = ANSWER_SECONDS if link.answer else WORK_SECONDS
                        cut_at = time.monotonic() + wait
                with self._guard:
                    self.sent += chunk
                sink.sendall(chunk)
        if armed is not None:
            if armed[1]:
                self.cut()
            self.was_cut.set()
        self._drop(source, sink)

    @staticmethod
    def _next_chunk(source: socket.socket, cut_at: float, answered: threading.Event) -> bytes:
        """The next bytes from `source`; none once `cut_at` (if set) has
        passed or the server has answered."""
        if not cut_at:
            return source.recv(65536)
        while not answered.is_set():
            left = cut_at - time.monotonic()
            if left <= 0:
                return b""
            source.settimeout(min(left, POLL_SECONDS))
            try:
                return source.recv(65536)
            except TimeoutError:
                continue
        return b""

    def _pump_replies(self, source: socket.socket, sink: socket.socket, link: _Link) -> None:
        # The end of the bytes seen before (an answer may come split in two).
        tail = b""
        with suppress(OSError):
            while chunk := source.recv(65536):
                if not link.dropped.is_set():
                    sink.sendall(chunk)
                elif link.answer:
                    if link.answer in tail + chunk:
                        link.answered.set()
                    tail = chunk[-len(link.answer):]
        self._drop(source, sink)

    def _take_armed(self, chunk: bytes, link: _Link) -> tuple[bool, bool] | None:
        with self._guard:
            if self._armed is None or self._armed[0] not in chunk:
                return None
            _, reaches, stay_cut, link.answer = self._armed
            self._armed = None
            return reaches, stay_cut

    def _drop(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with self._guard:
                self._open.discard(sock)
            # shutdown wakes the pump blocked in recv; close alone would not.
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
