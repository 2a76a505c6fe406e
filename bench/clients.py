"""Plain-socket clients for the three peers bench/run.py compares.

Each client speaks its server's wire protocol directly, with no client
library, so the benchmark costs the same on the client side for every peer.
They all offer the same operations, one job at a time: put, take,
wait_take + done, wake_put.
"""

from __future__ import annotations

import socket

PAYLOAD = b"x" * 100


class Conn:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _fill_buf(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed")
        self.buf += chunk

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._fill_buf()
        head, self.buf = self.buf.split(marker, 1)
        return head

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill_buf()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data


class Client(Conn):
    """The operations every peer's client offers."""

    def put(self) -> None:
        raise NotImplementedError

    def take(self) -> bool:
        """Take one job and report it done; False when there was none."""
        raise NotImplementedError

    def wait_take(self) -> bytes:
        """Block until a job of the wake queue arrives; return its handle."""
        raise NotImplementedError

    def done(self, handle: bytes) -> None:
        raise NotImplementedError

    def wake_put(self) -> None:
        raise NotImplementedError


class JobserverClient(Client):
    def request(self, raw: bytes) -> tuple[str, bytes]:
        self.sock.sendall(raw)
        head = self.read_until(b"\r\n\r\n").decode()
        lines = head.split("\r\n")
        length = 0
        for line in lines[1:]:
            if line.startswith("Content-Length:"):
                length = int(line.split(":")[1])
        return lines[0], self.read_exact(length)

    def put(self) -> None:
        status, _ = self.request(
            b"CreateJob\r\nname: bench\r\ndata: {\"p\":\"" + PAYLOAD[:90] + b"\"}\r\n\r\n"
        )
        assert status.startswith("200"), status

    def take(self) -> bool:
        status, body = self.request(b"GetJob\r\nname: bench\r\n\r\n")
        if not status.startswith("200"):
            return False
        job_id = body.split(b'"jobID":', 1)[1].split(b",", 1)[0]
        status, _ = self.request(b"FinishJob\r\njobID: " + job_id + b"\r\n\r\n")
        assert status.startswith("200"), status
        return True

    def wait_take(self) -> bytes:
        status, body = self.request(
            b"GetJob\r\nname: wake\r\nConnection: wait\r\ntimeout: 10000\r\n\r\n"
        )
        assert status.startswith("200"), status
        return body.split(b'"jobID":', 1)[1].split(b",", 1)[0]

    def done(self, handle: bytes) -> None:
        self.request(b"FinishJob\r\njobID: " + handle + b"\r\n\r\n")

    def wake_put(self) -> None:
        status, _ = self.request(b"CreateJob\r\nname: wake\r\n\r\n")
        assert status.startswith("200"), status

class BeanstalkClient(Client):
    def cmd(self, raw: bytes) -> bytes:
        self.sock.sendall(raw)
        return self.read_until(b"\r\n")

    def put(self) -> None:
        reply = self.cmd(b"put 0 0 60 100\r\n" + PAYLOAD + b"\r\n")
        assert reply.startswith(b"INSERTED"), reply

    def take(self) -> bool:
        reply = self.cmd(b"reserve-with-timeout 0\r\n")
        if not reply.startswith(b"RESERVED"):
            return False
        job_id = self._reserved_id(reply)
        assert self.cmd(b"delete " + job_id + b"\r\n") == b"DELETED"
        return True

    def wait_take(self) -> bytes:
        self.cmd(b"watch wake\r\n")
        reply = self.cmd(b"reserve-with-timeout 10\r\n")
        assert reply.startswith(b"RESERVED"), reply
        return self._reserved_id(reply)

    def done(self, handle: bytes) -> None:
        self.cmd(b"delete " + handle + b"\r\n")

    def wake_put(self) -> None:
        self.cmd(b"use wake\r\n")
        reply = self.cmd(b"put 0 0 60 100\r\n" + PAYLOAD + b"\r\n")
        assert reply.startswith(b"INSERTED"), reply

    def _reserved_id(self, reply: bytes) -> bytes:
        """The job ID of a RESERVED line, after reading past its body."""
        _, job_id, size = reply.split()
        self.read_exact(int(size) + 2)
        return job_id

class RedisClient(Client):
    def cmd(self, *args: bytes) -> bytes:
        out = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        self.sock.sendall(out)
        return self.reply()

    def reply(self) -> bytes:
        line = self.read_until(b"\r\n")
        if line[:1] == b"$":
            n = int(line[1:])
            return b"" if n < 0 else self.read_exact(n + 2)[:-2]
        if line[:1] == b"*":
            n = int(line[1:])
            items = [self.reply() for _ in range(max(n, 0))]
            return items[-1] if items else b""
        assert line[:1] != b"-", line
        return line

    def put(self) -> None:
        self.cmd(b"LPUSH", b"bench", PAYLOAD)

    def take(self) -> bool:
        # The reliable-queue pattern, Redis' counterpart of reserve + delete:
        # move the job to a processing list, then remove it when done.
        item = self.cmd(b"LMOVE", b"bench", b"processing", b"RIGHT", b"LEFT")
        if not item:
            return False
        self.cmd(b"LREM", b"processing", b"1", item)
        return True

    def wait_take(self) -> bytes:
        item = self.cmd(b"BLMOVE", b"wake", b"wproc", b"RIGHT", b"LEFT", b"10")
        assert item, "BLMOVE timed out"
        return item

    def done(self, handle: bytes) -> None:
        self.cmd(b"LREM", b"wproc", b"1", handle)

    def wake_put(self) -> None:
        self.cmd(b"LPUSH", b"wake", PAYLOAD)


CLIENTS: dict[str, type[Client]] = {
    "jobserver": JobserverClient,
    "beanstalkd": BeanstalkClient,
    "redis": RedisClient,
}
