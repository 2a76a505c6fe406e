"""Plain-socket clients for the three peers bench/run.py compares.

Each client speaks its server's wire protocol directly, with no client
library, so the benchmark costs the same on the client side for every peer.
They all offer the same operations:

- put, take, wait_take + done, wake_put: one job at a time;
- fill and drain_batch: the bulk drain, each peer's natural way of moving
  many jobs per round trip (the docstrings say which).
"""

from __future__ import annotations

import json
import os
import socket

PAYLOAD = b"x" * 100
# The bulk drain's sizes: jobs per create request, jobs per take request.
FILL_BATCH = 1000
DRAIN_BATCH = 100


class Unsupported(Exception):
    """The server does not know a command the scenario needs."""


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

    def fill(self) -> None:
        """Queue FILL_BATCH drain jobs in one round trip."""
        raise NotImplementedError

    def drain_batch(self) -> int:
        """Take up to DRAIN_BATCH drain jobs and report them all done;
        return how many there were (0: the queue is empty)."""
        raise NotImplementedError

    def check_drain(self) -> None:
        """Raise Unsupported if the server cannot run drain_batch, before
        the benchmark spends a minute filling the queue for it."""


_DRAIN_JOBS = ",".join(
    '{"name":"drain","data":{"p":"' + "x" * 90 + '"}}' for _ in range(FILL_BATCH)
)


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

    def fill(self) -> None:
        """One CreateJobs with FILL_BATCH jobs."""
        status, _ = self.request(b"CreateJobs\r\njobs: [" + _DRAIN_JOBS.encode() + b"]\r\n\r\n")
        assert status.startswith("200"), status

    def drain_batch(self) -> int:
        """One GetJobs for up to DRAIN_BATCH jobs, then one FinishJobs
        reporting all of them."""
        status, body = self.request(
            b"GetJobs\r\nname: drain\r\nnumResults: %d\r\n\r\n" % DRAIN_BATCH
        )
        if status.startswith("404"):
            return 0
        assert status.startswith("200"), status
        ids = [job["jobID"] for job in json.loads(body)["jobs"]]
        results = self._finish_jobs(ids)
        assert all(r["status"] == "200 OK" for r in results), results
        return len(ids)

    def check_drain(self) -> None:
        # No job has this ID, so a server that knows FinishJobs changes
        # nothing and answers 200 with a 404 result.
        self._finish_jobs([2**62])

    def _finish_jobs(self, ids: list[int]) -> list[dict[str, object]]:
        jobs = ",".join(f'{{"jobID":{i}}}' for i in ids)
        status, body = self.request(b"FinishJobs\r\njobs: [" + jobs.encode() + b"]\r\n\r\n")
        if status.startswith("430"):
            raise Unsupported(f"FinishJobs: {status}")
        assert status.startswith("200"), status
        results: list[dict[str, object]] = json.loads(body)["results"]
        return results


class BeanstalkClient(Client):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.drain_tube = False

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

    def _select_drain_tube(self) -> None:
        """Put into and take from the drain tube only, once per connection."""
        if self.drain_tube:
            return
        assert self.cmd(b"use drain\r\n") == b"USING drain"
        assert self.cmd(b"watch drain\r\n").startswith(b"WATCHING")
        assert self.cmd(b"ignore default\r\n").startswith(b"WATCHING")
        self.drain_tube = True

    def _reserved_id(self, reply: bytes) -> bytes:
        """The job ID of a RESERVED line, after reading past its body."""
        _, job_id, size = reply.split()
        self.read_exact(int(size) + 2)
        return job_id

    def fill(self) -> None:
        """beanstalkd has no bulk put: FILL_BATCH puts sent in one write,
        then their replies read."""
        self._select_drain_tube()
        self.sock.sendall((b"put 0 0 60 100\r\n" + PAYLOAD + b"\r\n") * FILL_BATCH)
        for _ in range(FILL_BATCH):
            reply = self.read_until(b"\r\n")
            assert reply.startswith(b"INSERTED"), reply

    def drain_batch(self) -> int:
        """DRAIN_BATCH reserve-with-timeout 0 sent in one write, then the
        deletes of the jobs reserved, in one write."""
        self._select_drain_tube()
        self.sock.sendall(b"reserve-with-timeout 0\r\n" * DRAIN_BATCH)
        ids = []
        for _ in range(DRAIN_BATCH):
            reply = self.read_until(b"\r\n")
            if reply.startswith(b"RESERVED"):
                ids.append(self._reserved_id(reply))
            else:
                assert reply == b"TIMED_OUT", reply
        self.sock.sendall(b"".join(b"delete " + i + b"\r\n" for i in ids))
        for _ in ids:
            assert self.read_until(b"\r\n") == b"DELETED"
        return len(ids)


class RedisClient(Client):
    def cmd(self, *args: bytes) -> bytes:
        self.sock.sendall(self._encode(args))
        return self.reply()

    @staticmethod
    def _encode(args: tuple[bytes, ...]) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

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

    def fill(self) -> None:
        """One LPUSH with FILL_BATCH values."""
        self.cmd(b"LPUSH", b"drain", *([PAYLOAD] * FILL_BATCH))

    def drain_batch(self) -> int:
        """The reliable-queue pattern in bulk: DRAIN_BATCH LMOVEs into this
        worker's own processing list sent in one write, then one DEL of
        that list reports them all done. (LPOP with a count would be one
        command, but a worker that died would lose its jobs.)"""
        processing = b"dproc:%d" % os.getpid()
        move = self._encode((b"LMOVE", b"drain", processing, b"RIGHT", b"LEFT"))
        self.sock.sendall(move * DRAIN_BATCH)
        taken = sum(1 for _ in range(DRAIN_BATCH) if self.reply())
        if taken:
            self.cmd(b"DEL", processing)
        return taken


CLIENTS: dict[str, type[Client]] = {
    "jobserver": JobserverClient,
    "beanstalkd": BeanstalkClient,
    "redis": RedisClient,
}
