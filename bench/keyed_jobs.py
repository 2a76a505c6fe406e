"""What a GetJob costs under per-key and fair limits (issue 35, items 3 and
4; protocol.md 14.23), on SQLite and on PostgreSQL:

- perkey: 100,000 held jobs of 1,000 keys (100 each, `t/x`) under a full
  per-key limit (`t/*`, max 1 per key, each key running one job);
- rate: the same under a spent per-key rate (`r/*`, 1 per hour per key,
  each key's one hand-out made);

each round creating one job of a key of its own (free) and timing the
`GetJob name: *` that should take it, against its peer in the same run:
the same GetJob on the same server with nothing held (the held jobs
cancelled);

- fair: a fair pattern (`f/*`) over 1,000 keys of 100 jobs each, created
  a key at a time: `GetJob name: f/*` one by one, then `GetJobs
  numResults: 100`, against the same calls on the same queue once the
  limit is removed.

Each figure is the median wall time and the server's CPU per call
(utime + stime from /proc/PID/stat, a clock tick is 10 ms, so over all
calls), and how many of the calls found what they should: a free job, or
any job for fair (a GetJob that answers 404 while jobs may run is counted
as missed, not timed apart).

    python bench/keyed_jobs.py [--rounds 50] [--fair-calls 300]
                               [--backend sqlite|postgres|both] [--shape perkey|rate|fair|all]

Nothing is asserted; this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from held_jobs import BATCH, clear, cpu_seconds

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers, which mypy does not check.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from wire import Client, encode  # type: ignore[import-not-found]  # noqa: E402

KEYS = 1000
PER_KEY = 100
# GetJobs of this many in the fair shape.
MANY = 100


def create_jobs(client: Client, jobs: list[dict[str, object]]) -> None:
    """CreateJobs of a thousand at a time, ten pipelined."""
    for at in range(0, len(jobs), BATCH * 10):
        chunk = jobs[at : at + BATCH * 10]
        requests = [
            encode("CreateJobs", {"jobs": json.dumps(chunk[i : i + BATCH])})
            for i in range(0, len(chunk), BATCH)
        ]
        client.send(b"".join(requests))
        for _ in requests:
            assert client.read_reply().code == 200


def take_all(client: Client, name: str) -> int:
    """GetJobs until none is found: how many were taken."""
    taken = 0
    while True:
        reply = client.request("GetJobs", name=name, numResults=1000)
        if reply.code != 200:
            return taken
        taken += len(reply.json["jobs"])


def hold_per_key(client: Client) -> str:
    """Each key runs one job under a per-key limit of one, and holds 100."""
    assert client.request("SetLimit", name="t/*", max=1, perKey="true").code == 200
    create_jobs(client, [{"name": "t/run", "key": f"k{i}"} for i in range(KEYS)])
    running = take_all(client, "t/*")
    create_jobs(client, [{"name": "t/x", "key": f"k{i}"} for _ in range(PER_KEY)
                         for i in range(KEYS)])
    return f"{running:,} keys running"


def hold_by_rate(client: Client) -> str:
    """Each key has had its one hand-out of the hour, and holds 100."""
    assert client.request("SetLimit", name="r/*", rate="1/1h", perKey="true").code == 200
    create_jobs(client, [{"name": "r/run", "key": f"k{i}"} for i in range(KEYS)])
    # Taken until none is found: a search may stop short of every key.
    handed = take_all(client, "r/*")
    create_jobs(client, [{"name": "r/x", "key": f"k{i}"} for _ in range(PER_KEY)
                         for i in range(KEYS)])
    return f"{handed:,} keys' windows spent"


def free_rounds(server: ServerProcess, client: Client, prefix: str, count: int,
                phase: str) -> tuple[float, float, int]:
    """Median ms of a GetJob * that should take a free key's job, server CPU
    ms a GetJob, and how many took it."""
    pid = server.proc.pid
    times = []
    cpu = 0.0
    found = 0
    for n in range(count):
        # A key of its own: one taken runs, and fills its key.
        key = f"free-{phase}-{n}"
        assert client.request("CreateJob", name=f"{prefix}/x", key=key).code == 200
        before = cpu_seconds(pid)
        began = time.perf_counter()
        reply = client.request("GetJob", name="*")
        times.append(time.perf_counter() - began)
        cpu += cpu_seconds(pid) - before
        if reply.code == 200 and reply.json.get("key") == key:
            found += 1
        elif reply.code == 200:
            raise AssertionError(f"took a held job: {reply.json}")
    return statistics.median(times) * 1000, cpu / count * 1000, found


def held_shape(backend: str, db: str, name: str, hold: Callable[[Client], str],
               prefix: str, count: int) -> None:
    server = ServerProcess(db)
    try:
        with server.client(timeout=600) as client:
            held = hold(client)
            held_ms, held_cpu, held_found = free_rounds(server, client, prefix, count, "held")
            clear(client)
            peer_ms, peer_cpu, peer_found = free_rounds(server, client, prefix, count, "peer")
        print(
            f"{backend} {name} ({held}): GetJob * over {KEYS * PER_KEY:,} held "
            f"{held_ms:.2f} ms (server CPU {held_cpu:.2f} ms, found the free job "
            f"{held_found}/{count}), nothing held {peer_ms:.2f} ms ({peer_cpu:.2f} ms, "
            f"{peer_found}/{count}): {held_ms / peer_ms:.1f}x",
            flush=True,
        )
    finally:
        server.kill()


def calls(server: ServerProcess, client: Client, verb: str, count: int,
          keys: list[str]) -> tuple[float, float, int]:
    """Median ms and server CPU ms of `count` GetJob (or GetJobs of MANY)
    `f/*`, and how many found a job; the keys handed out, in order, go to
    `keys`."""
    pid = server.proc.pid
    params: dict[str, object] = {"name": "f/*"}
    if verb == "GetJobs":
        params["numResults"] = MANY
    times = []
    cpu = 0.0
    found = 0
    for _ in range(count):
        before = cpu_seconds(pid)
        began = time.perf_counter()
        reply = client.request(verb, **params)
        times.append(time.perf_counter() - began)
        cpu += cpu_seconds(pid) - before
        if reply.code == 200:
            found += 1
            jobs = reply.json["jobs"] if verb == "GetJobs" else [reply.json]
            keys += [job.get("key", "") for job in jobs]
    return statistics.median(times) * 1000, cpu / count * 1000, found


def fair_shape(backend: str, db: str, count: int) -> None:
    """1,000 keys of 100 jobs under `fair`: `count` GetJobs of one, and on
    a queue made anew `count` GetJobs of 100; the same with the limit
    removed."""
    server = ServerProcess(db)
    try:
        with server.client(timeout=600) as client:
            Figure = tuple[float, float, int]
            figures: list[tuple[Figure, Figure, int, int]] = []
            for fair in (True, False):
                keys: list[str] = []
                measured: list[Figure] = []
                for verb in ("GetJob", "GetJobs"):
                    clear(client)
                    # Removed and set again: a new round, on a queue made anew.
                    assert client.request("SetLimit", name="f/*", max=0).code == 200
                    if fair:
                        assert client.request("SetLimit", name="f/*", fair="true").code == 200
                    create_jobs(client, [{"name": "f/x", "key": f"k{i}"} for i in range(KEYS)
                                         for _ in range(PER_KEY)])
                    measured.append(calls(server, client, verb, count, keys))
                figures.append((measured[0], measured[1], len(keys), len(set(keys))))
        (f1, fm, fn, fk), (p1, pm, _, _) = figures
        print(
            f"{backend} fair ({KEYS:,} keys of {PER_KEY}, a key at a time): {count} GetJob f/* "
            f"{f1[0]:.2f} ms (server CPU {f1[1]:.2f} ms, found a job {f1[2]}/{count}), "
            f"unlimited {p1[0]:.2f} ms ({p1[1]:.2f} ms): {f1[0] / p1[0]:.1f}x; {count} GetJobs "
            f"of {MANY} {fm[0]:.2f} ms (server CPU {fm[1]:.2f} ms, found jobs {fm[2]}/{count}), "
            f"unlimited {pm[0]:.2f} ms ({pm[1]:.2f} ms): {fm[0] / pm[0]:.1f}x; under fair "
            f"{fn:,} jobs handed out, of {fk:,} keys",
            flush=True,
        )
    finally:
        server.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, metavar="N")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--shape", choices=("perkey", "rate", "fair", "all"), default="all")
    parser.add_argument("--fair-calls", type=int, default=300, metavar="N",
                        help="GetJob and GetJobs calls of the fair shape (past 200 keys a "
                        "round is as long as a search can read)")
    args = parser.parse_args()
    held: tuple[tuple[str, Callable[[Client], str], str], ...] = (
        ("perkey", hold_per_key, "t"), ("rate", hold_by_rate, "r"),
    )

    def run(backend: str, db: str, shape: str) -> None:
        if shape == "fair":
            fair_shape(backend, db, args.fair_calls)
            return
        for name, hold, prefix in held:
            if name == shape:
                held_shape(backend, db, name, hold, prefix, args.rounds)

    shapes = ("perkey", "rate", "fair") if args.shape == "all" else (args.shape,)
    if args.backend in ("sqlite", "both"):
        for shape in shapes:
            with tempfile.TemporaryDirectory(prefix="jobserver-keyed-bench-") as tmp:
                run("sqlite", str(Path(tmp) / "jobs.db"), shape)
    if args.backend in ("postgres", "both"):
        for shape in shapes:
            pg.recreate_database()
            try:
                with pg.fresh_schema() as url:
                    run("postgres", url, shape)
            finally:
                pg.drop_database()
    return 0


if __name__ == "__main__":
    sys.exit(main())
