"""jobserver's side of bench/pg_peers.py: one process doing one shape over
the wire (bench/wire_client.py, plain sockets, no client library), told when
to start on stdin, reporting on stdout (the protocol is in
bench/pg_peers_drivers.py's docstring).

    python jobserver_driver.py MODE [ARGS]   with BENCH_PORT
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wire_client import Client

PORT = int(os.environ["BENCH_PORT"])
DATA = {"p": "x" * 90}
# Jobs per GetJobs in the drain, as in bench/run.py.
DRAIN_BATCH = 100
# Connections the drain's one process takes jobs on, each in a thread of its
# own (pg_peers.py's --jobserver-connections): while one waits for its
# batch's commit, another's batch is in the same or the next one.
DRAIN_CONNECTIONS = int(os.environ["BENCH_JOBSERVER_CONNECTIONS"])


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    sys.stdin.readline()


def single(count: str) -> None:
    client = Client(PORT)
    say("ready")
    wait_go()
    for _ in range(int(count)):
        client.ok("CreateJob", name="enq", data=DATA)
    say("done")
    wait_go()


def batch(count: str, size: str, task: str) -> None:
    client = Client(PORT)
    jobs = [{"name": task, "data": DATA}] * int(size)
    say("ready")
    wait_go()
    for _ in range(int(count)):
        client.ok("CreateJobs", jobs=jobs)
    say("done")
    wait_go()


def drain(count: str) -> None:
    clients = [Client(PORT) for _ in range(DRAIN_CONNECTIONS)]
    taken = [0] * len(clients)

    def take(n: int) -> None:
        client = clients[n]
        while True:
            status, body = client.request("GetJobs", name="noop", numResults=DRAIN_BATCH)
            if status.startswith("404"):
                return
            ids = [job["jobID"] for job in _json(status, body)["jobs"]]
            results = client.ok("FinishJobs", jobs=[{"jobID": i} for i in ids])["results"]
            if any(r["status"] != "200 OK" for r in results):
                raise RuntimeError(f"FinishJobs: {results}")
            taken[n] += len(ids)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(len(clients))]
    say("ready")
    wait_go()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    say(f"done {sum(taken)}")
    wait_go()


def _json(status: str, body: bytes) -> dict:
    if not status.startswith("200"):
        raise RuntimeError(f"{status} {body[:200]!r}")
    result: dict = json.loads(body)
    return result


def work() -> None:
    client = Client(PORT, timeout=120)

    def serve() -> None:
        while True:
            status, body = client.request(
                "GetJob", name="wake", Connection="wait", timeout=60_000
            )
            started = time.monotonic_ns()
            if status.startswith("200"):
                say(f"started {started}")
                client.ok("FinishJob", jobID=_json(status, body)["jobID"])

    threading.Thread(target=serve, daemon=True).start()
    say("ready")
    wait_go()


def produce() -> None:
    client = Client(PORT)
    say("ready")
    while sys.stdin.readline():
        sent = time.monotonic_ns()
        client.ok("CreateJob", name="wake", data=DATA)
        say(f"sent {sent}")


MODES: dict[str, Callable[..., None]] = {
    "single": single, "batch": batch, "drain": drain, "work": work, "produce": produce,
}

if __name__ == "__main__":
    MODES[sys.argv[1]](*sys.argv[2:])
