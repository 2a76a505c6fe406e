"""Where a PostgreSQL wake's time goes: each step of it, timed inside the
nodes, from the CreateJob's send to the waiting worker holding its job.

    python bench/pg_wake_timeline.py                  # one node, 60 rounds
    python bench/pg_wake_timeline.py --nodes 2        # the wake across nodes
    python bench/pg_wake_timeline.py --gap 0.005      # rounds 5 ms apart

A worker waits on the first node (GetJob with Connection: wait) and a
producer sends one CreateJob to the last, `--gap` seconds after the worker
is back in its wait (30 ms by default: a queue at rest, as pg_peers.py's
idle latency has it; run.py's wake waits 5 ms). The nodes are started
with a sitecustomize module (written to a temporary folder and put on
their PYTHONPATH) that wraps the steps of a request's path and notes the
time of each, in memory, written out as the node exits: a request read,
the engine's batch begun and ended, the writer's thread begun and ended,
every statement sent and answered (psycopg's Cursor.execute), a waiting
GetJob's tries asked of the event loop from the thread, a notice heard
from another node, a reply sent. It wraps names of the code, so a step
renamed fails the node's start loudly. The noting costs a few
microseconds a step; the table gives, for each step, the median over
the rounds (the first five left out) of its time from the send.

Each round trip to PostgreSQL is two wake-ups of a process that was
waiting (the node's thread, then PostgreSQL's backend): on a virtual
machine whose cores sleep between rounds, each costs far more than the
same statement run in a tight loop (docs/benchmarks.md, "Where a wake's
time goes").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale
from run import DEFAULT_POSTGRES, start_jobserver_pg
from wire_client import Client

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 5
# What a traced node notes: (perf_counter_ns, "L" on the event loop's
# thread or "T" on another, the step).
TRACER = '''
import atexit, os, threading, time

if b"serve" in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
    _notes = []
    _loop = threading.get_ident()

    def _note(step):
        where = "L" if threading.get_ident() == _loop else "T"
        _notes.append((time.perf_counter_ns(), where, step))

    def _write():
        with open(os.path.join({out!r}, f"steps.{{os.getpid()}}"), "w") as f:
            for at, where, step in _notes:
                f.write(f"{{at}}\\t{{where}}\\t{{step}}\\n")

    atexit.register(_write)

    def _wrap(owner, name, label, is_async=False):
        inner = getattr(owner, name)
        if is_async:
            async def timed(*args, **kwargs):
                _note(label + ">")
                try:
                    return await inner(*args, **kwargs)
                finally:
                    _note(label + "<")
        else:
            def timed(*args, **kwargs):
                _note(label + ">")
                try:
                    return inner(*args, **kwargs)
                finally:
                    _note(label + "<")
        setattr(owner, name, timed)

    import psycopg

    _execute = psycopg.Cursor.execute

    def _statement(cursor, query, *args, **kwargs):
        text = query.decode() if isinstance(query, bytes) else str(query)
        label = "sql " + " ".join(text.split())[:32]
        _note(label + ">")
        try:
            return _execute(cursor, query, *args, **kwargs)
        finally:
            _note(label + "<")

    psycopg.Cursor.execute = _statement

    from jobserver.core.engine import batch, engine
    from jobserver.server import connection
    from jobserver.storage import postgres_listen

    _read = connection.Connection._next_request

    async def _next_request(self):
        request = await _read(self)
        if request is not None:
            _note("read " + request.verb)
        return request

    connection.Connection._next_request = _next_request
    _send = connection.Connection._send_at_once

    def _send_at_once(self, data):
        _note("reply " + bytes(data[:16]).split(b"\\r")[0].decode(errors="replace"))
        return _send(self, data)

    connection.Connection._send_at_once = _send_at_once
    _wrap(engine.Engine, "_run_batch", "batch", is_async=True)
    _wrap(batch.Batches, "_transact", "thread")
    _wrap(batch.Batches, "_woken_from_thread", "tries asked of the loop")
    _listen = postgres_listen.listen

    async def _listening(connect, channel, node, heard):
        def noted(*args):
            _note("notice heard")
            return heard(*args)

        return await _listen(connect, channel, node, noted)

    postgres_listen.listen = _listening
'''


def rounds_run(ports: list[int], rounds: int, gap: float) -> list[tuple[int, int]]:
    """(sent, held) perf_counter_ns pairs, one a round."""
    waiter = Client(ports[0], timeout=30)
    producer = Client(ports[-1])
    back_in_wait = threading.Event()
    held: list[int] = []

    def work() -> None:
        for _ in range(rounds):
            back_in_wait.set()
            status, body = waiter.request("GetJob", name="wake", Connection="wait", timeout=20_000)
            held.append(time.perf_counter_ns())
            if not status.startswith("200"):
                raise RuntimeError(f"GetJob: {status}")
            waiter.ok("FinishJob", jobID=json.loads(body)["jobID"])

    worker = threading.Thread(target=work)
    worker.start()
    sent: list[int] = []
    for _ in range(rounds):
        if not back_in_wait.wait(30):
            raise RuntimeError("the worker did not wait again")
        back_in_wait.clear()
        time.sleep(gap)
        sent.append(time.perf_counter_ns())
        producer.ok("CreateJob", name="wake", data={"p": "x"})
        while len(held) < len(sent) and worker.is_alive():
            time.sleep(0.0002)
    worker.join()
    return list(zip(sent, held, strict=True))


def timeline(out: Path, pids: list[int], rounds: list[tuple[int, int]]) -> list[str]:
    """The table's rows: each step's median time from the send."""
    notes: list[tuple[int, str, str]] = []
    for node, pid in enumerate(pids):
        for line in (out / f"steps.{pid}").read_text().splitlines():
            noted, thread, step = line.split("\t")
            notes.append((int(noted), f"node {node + 1} {thread}", step))
    notes.sort()
    times: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for sent, held in rounds[WARM_UP:]:
        seen: Counter[tuple[str, str]] = Counter()
        for noted_at, where, step in notes:
            if sent <= noted_at <= held:
                times[(where, step, seen[(where, step)])].append((noted_at - sent) / 1e3)
                seen[(where, step)] += 1
        times[("worker", "holds the job", 0)].append((held - sent) / 1e3)
    counted = len(rounds) - WARM_UP
    rows = sorted(
        (statistics.median(values), where, step, nth)
        for (where, step, nth), values in times.items()
        if len(values) >= 0.8 * counted
    )
    lines = ["| from the send (µs, median) | where | step |", "|---|---|---|"]
    lines += [f"| {at:,.0f} | {where} | {step}{f' ({nth + 1})' if nth else ''} |"
              for at, where, step, nth in rows]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--gap", type=float, default=0.03, help="seconds at rest before a send")
    parser.add_argument("--postgres", default=os.environ.get("JOBSERVER_BENCH_POSTGRES",
                                                             DEFAULT_POSTGRES))
    args = parser.parse_args()
    if args.rounds <= WARM_UP:
        parser.error(f"--rounds must be more than {WARM_UP}")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        (out / "sitecustomize.py").write_text(TRACER.format(out=str(out)))
        untraced = scale.server_env
        scale.server_env = lambda root: {**untraced(root), "PYTHONPATH": f"{root}:{out}"}
        peer = start_jobserver_pg(ROOT, args.postgres, "traced", args.nodes)
        try:
            rounds = rounds_run([node.port for node in peer.nodes], args.rounds, args.gap)
        finally:
            pids = [node.proc.pid for node in peer.nodes]
            peer.stop()
        print(f"{args.nodes} node(s), {args.rounds} rounds, {args.gap * 1e3:g} ms at rest; "
              f"the worker waits on node 1, the CreateJob goes to node {args.nodes}\n")
        print("\n".join(timeline(out, pids, rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
