"""A client process for the chaos test: random commands until its time is up.

    python chaos_client.py PORT SECONDS SEED [--tls-ca FILE]

It prints one JSON line per event, flushed at once, so that a harness that
kills it with SIGKILL at any moment still knows everything up to the kill:

- `{"e": "ask", "n": N}` before a GetJob(s) for up to N jobs is sent, and
  `{"e": "got", "ids": [...], "leased": [...]}` once its reply is read
  (`leased`: those of the jobs that have a retryAfter);
- `{"e": "created", "id": ID}` once a CreateJob is acknowledged;
- `{"e": "release", "id": ID, "how": VERB}` before a report on a job it
  holds is sent, and `{"e": "reported", "id": ID, "how": VERB, "code": C}`
  once it is answered;
- `{"e": "r"}` for every other request answered.

When its time is up it reports every job it still holds, prints
`{"e": "done"}` and exits 0.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import sys
import time

from wire import Client, encode

NAMES = ("chaos/a", "chaos/b", "chaos/c")
LEASE = "+2 SECONDS"


def say(**event: object) -> None:
    print(json.dumps({**event, "t": time.monotonic()}), flush=True)


class Worker:
    def __init__(self, port: int, ca: str | None, rng: random.Random) -> None:
        self.port = port
        self.ca = ca
        self.rng = rng
        self.conn = self._connect()
        # jobID -> leaseID of the jobs this process holds.
        self.held: dict[int, str] = {}

    def _connect(self) -> Client:
        return Client(self.port, 30.0, tls_ca=self.ca)

    def reconnect(self, how: str) -> None:
        """End the connection abruptly or politely, then open a new one."""
        sock = self.conn.sock
        if how == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "half":
            socket.socket.shutdown(sock, socket.SHUT_WR)
        sock.close()
        self.conn = self._connect()

    def step(self) -> None:
        choice = self.rng.random()
        if choice < 0.25:
            self.create()
        elif choice < 0.50:
            self.take()
        elif choice < 0.75 and self.held:
            self.report()
        elif choice < 0.82:
            self.pipeline()
        elif choice < 0.87 and self.held:
            self.touch_or_update()
        elif choice < 0.90:
            self.reconnect(self.rng.choice(["fin", "rst", "half"]))
        else:
            self.look()

    def create(self) -> None:
        params: dict[str, object] = {
            "name": self.rng.choice(NAMES),
            "data": {"n": self.rng.random()},
        }
        if self.rng.random() < 0.4:
            params["retryAfter"] = LEASE
        if self.rng.random() < 0.3:
            params["maxAttempts"] = 3
            params["retryBackoff"] = "fixed"
            params["retryDelay"] = 0
        reply = self.conn.request("CreateJob", **params)
        if reply.code == 200:
            say(e="created", id=reply.json["jobID"])

    def take(self) -> None:
        count = self.rng.choice([1, 1, 3])
        params: dict[str, object] = {
            "name": self.rng.choice([*NAMES, "chaos/*"]),
            "includeLeaseID": "true",
        }
        if count > 1:
            params["numResults"] = count
        if self.rng.random() < 0.5:
            params.update(Connection="wait", timeout=self.rng.choice([0, 200, 800]))
        say(e="ask", n=count)
        reply = self.conn.request("GetJobs" if count > 1 else "GetJob", **params)
        if reply.code != 200:
            say(e="got", ids=[])
            return
        jobs = reply.json["jobs"] if count > 1 else [reply.json]
        for job in jobs:
            self.held[job["jobID"]] = job["leaseID"]
        say(
            e="got",
            ids=[job["jobID"] for job in jobs],
            leased=[job["jobID"] for job in jobs if job["retryAfter"]],
        )

    def report(self, job_id: int | None = None) -> None:
        if job_id is None:
            job_id = self.rng.choice(list(self.held))
        lease = self.held.pop(job_id)
        how = self.rng.choice(["FinishJob", "FinishJob", "FailJob", "RetryJob"])
        say(e="release", id=job_id, how=how)
        reply = self.conn.request(how, jobID=job_id, leaseID=lease)
        say(e="reported", id=job_id, how=how, code=reply.code)

    def touch_or_update(self) -> None:
        job_id = self.rng.choice(list(self.held))
        if self.rng.random() < 0.5:
            self.conn.request("TouchJob", jobID=job_id, leaseID=self.held[job_id])
        else:
            self.conn.request(
                "UpdateJob", jobID=job_id, leaseID=self.held[job_id], data={"progress": 1}
            )
        say(e="r")

    def pipeline(self) -> None:
        """Several requests in one write, then their replies."""
        requests = [("Ping", {}), ("Status", {}), ("CreateJob", {"name": self.rng.choice(NAMES)})]
        self.rng.shuffle(requests)
        self.conn.send(b"".join(encode(verb, params) for verb, params in requests))
        for verb, _ in requests:
            reply = self.conn.read_reply()
            if verb == "CreateJob" and reply.code == 200:
                say(e="created", id=reply.json["jobID"])
            else:
                say(e="r")

    def look(self) -> None:
        verb = self.rng.choice(["Ping", "Status", "QueryJob", "FailedJobs"])
        params = {"jobID": self.rng.randint(1, 200)} if verb == "QueryJob" else {}
        self.conn.request(verb, **params)
        say(e="r")


def main() -> None:
    port, seconds, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    ca = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--tls-ca" else None
    worker = Worker(port, ca, random.Random(seed))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        worker.step()
    for job_id in list(worker.held):
        worker.report(job_id)
    say(e="done")


if __name__ == "__main__":
    main()
