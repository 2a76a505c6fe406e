"""What a wildcard GetJob costs when held jobs lie in front of the free one
(issue 35, item 1; protocol.md 14.7), on SQLite and on PostgreSQL:

- names: 100,000 held jobs in 100 names, 1,000 each, half of the names
  under a full concurrency limit of their own, half paused;
- unique: 100,000 held jobs, each of a name of its own, under one full
  limit (`rep/*`) and one pause (`thumb/*`);

each against its peer measured in the same run: the same GetJob on the
same server with nothing held (the held jobs deleted). A round creates one
free job and times the `GetJob name: *` that takes it: the median wall
time, and the server's CPU per GetJob (utime + stime from /proc/PID/stat,
a clock tick is 10 ms, so over all rounds).

    python bench/held_jobs.py [--rounds 50] [--backend sqlite|postgres|both]

Nothing is asserted; this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers, which mypy does not check.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from wire import Client, encode  # type: ignore[import-not-found]  # noqa: E402

HELD = 100_000
NAMES = 100
BATCH = 1000
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def create_all(client: Client, names: list[str]) -> None:
    for at in range(0, len(names), BATCH * 10):
        chunk = names[at : at + BATCH * 10]
        requests = [
            encode("CreateJobs", {"jobs": json.dumps([{"name": n} for n in chunk[i : i + BATCH]])})
            for i in range(0, len(chunk), BATCH)
        ]
        client.send(b"".join(requests))
        for _ in requests:
            assert client.read_reply().code == 200


def hold_by_names(client: Client) -> None:
    """100 names of 1,000 held jobs each: limits of 1, full, and pauses."""
    for k in range(NAMES):
        if k % 2:
            assert client.request("PauseJobs", name=f"held{k}/*").code == 200
        else:
            assert client.request("SetLimit", name=f"held{k}/*", max=1).code == 200
            assert client.request("CreateJob", name=f"held{k}/running").code == 200
            assert client.request("GetJob", name=f"held{k}/running").code == 200
    per_name = HELD // NAMES
    create_all(client, [f"held{k}/x" for _ in range(per_name) for k in range(NAMES)])


def hold_unique(client: Client) -> None:
    """100,000 held jobs, each of a name of its own."""
    assert client.request("SetLimit", name="rep/*", max=1).code == 200
    assert client.request("PauseJobs", name="thumb/*").code == 200
    assert client.request("CreateJob", name="rep/running").code == 200
    assert client.request("GetJob", name="rep/running").code == 200
    create_all(client, [f"{('rep', 'thumb')[i % 2]}/{i}" for i in range(HELD)])


def clear(client: Client) -> None:
    """The peer: the same server with nothing held."""
    for state_query in ("CancelQueuedJobs",):
        while True:
            reply = client.request(state_query, name="*", limit=1000)
            if not reply.json or not reply.json.get("acted"):
                break


def rounds(server: ServerProcess, client: Client, count: int) -> tuple[float, float]:
    """Median ms of a GetJob * that finds the free job, and server CPU ms a GetJob."""
    pid = server.proc.pid
    times = []
    cpu = 0.0
    for n in range(count):
        assert client.request("CreateJob", name=f"free/{n}").code == 200
        before = cpu_seconds(pid)
        began = time.perf_counter()
        reply = client.request("GetJob", name="*")
        times.append(time.perf_counter() - began)
        cpu += cpu_seconds(pid) - before
        assert reply.code == 200 and reply.json["name"] == f"free/{n}", reply.status
    return statistics.median(times) * 1000, cpu / count * 1000


def shape(backend: str, db: str, name: str, hold: Callable[[Client], None], count: int) -> None:
    server = ServerProcess(db)
    try:
        with server.client(timeout=600) as client:
            hold(client)
            held_ms, held_cpu = rounds(server, client, count)
            clear(client)
            peer_ms, peer_cpu = rounds(server, client, count)
        print(
            f"{backend} {name}: GetJob * over {HELD:,} held {held_ms:.2f} ms "
            f"(server CPU {held_cpu:.2f} ms), nothing held {peer_ms:.2f} ms "
            f"({peer_cpu:.2f} ms): {held_ms / peer_ms:.1f}x",
            flush=True,
        )
    finally:
        server.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, metavar="N")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    args = parser.parse_args()
    shapes = (("names", hold_by_names), ("unique", hold_unique))
    if args.backend in ("sqlite", "both"):
        for name, hold in shapes:
            with tempfile.TemporaryDirectory(prefix="jobserver-held-bench-") as tmp:
                shape("sqlite", str(Path(tmp) / "jobs.db"), name, hold, args.rounds)
    if args.backend in ("postgres", "both"):
        for name, hold in shapes:
            pg.recreate_database()
            try:
                with pg.fresh_schema() as url:
                    shape("postgres", url, name, hold, args.rounds)
            finally:
                pg.drop_database()
    return 0


if __name__ == "__main__":
    sys.exit(main())
