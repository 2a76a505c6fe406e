"""jobserver's own scaling figures, measured by bench/run.py after the peers:

- take throughput with a large queue against a small one (cost must not
  grow with the queue),
- thousands of connections blocked in GetJob at once: all served, and the
  server's resident memory,
- Ping round trips on one connection while large batches commit on others
  (the event loop never waits for the disk).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from clients import JobserverClient

NAMES = 100


def server_env(root: Path) -> dict[str, str]:
    """The environment that makes a Python process import the jobserver
    package of the checkout at `root`, whatever the caller's PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(root)}


def fill(db: Path, jobs: int, root: Path) -> None:
    """Write `jobs` due jobs of 100 names straight into a new database:
    through the protocol a million would take minutes. This runs in a child
    process importing the checkout under test, so the database has the
    schema its server expects."""
    subprocess.run(
        [sys.executable, __file__, str(db), str(jobs)], env=server_env(root), check=True
    )


def _fill_here(db: Path, jobs: int) -> None:
    # Imported here, not at the top: only the child process of fill()
    # must see the jobserver under test.
    from jobserver.core.engine.context import Context
    from jobserver.model.jobs import NewJob
    from jobserver.model.times import utcnow
    from jobserver.storage.sqlite import Store

    store = Store(str(db))
    now = Context(store, utcnow())
    store.begin()
    new = [
        NewJob(name=f"bulk{n % NAMES}", next_run=now.now_ms,
               data='{"p":"' + "x" * 90 + '"}', priority=500)
        for n in range(jobs)
    ]
    store.create(new, created=now.now_s, state="QUEUED")
    store.commit()
    store.close()


def start_server(db: Path | str, port: int, root: Path, *options: str) -> subprocess.Popen:
    """Serve `db`, a SQLite file or a PostgreSQL URL, with the jobserver of
    the checkout at `root`."""
    return subprocess.Popen(
        [sys.executable, "-m", "jobserver", "serve", "--port", str(port), "--db", str(db),
         "--log-level", "WARNING", *options],
        cwd=root, env=server_env(root),
    )


def _taker(port: int, name: str, count: int, start: float, out: multiprocessing.Queue) -> None:
    client = JobserverClient(port)
    while time.time() < start:
        time.sleep(0.001)
    began = time.perf_counter()
    get = b"GetJob\r\nname: " + name.encode() + b"\r\n\r\n"
    for _ in range(count):
        status, body = client.request(get)
        assert status.startswith("200"), status
        job_id = body.split(b'"jobID":', 1)[1].split(b",", 1)[0]
        status, _ = client.request(b"FinishJob\r\njobID: " + job_id + b"\r\n\r\n")
        assert status.startswith("200"), status
    out.put((count, time.perf_counter() - began))


def take_rate(port: int, per_worker: int) -> float:
    """GetJob + FinishJob per second, 8 workers, each on its own name."""
    out: multiprocessing.Queue = multiprocessing.Queue()
    start = time.time() + 0.5
    procs = [
        multiprocessing.Process(target=_taker, args=(port, f"bulk{i}", per_worker, start, out))
        for i in range(8)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in results) / max(t for _, t in results)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def blocked_waiters(port: int, pid: int, count: int) -> tuple[int, float]:
    """Open `count` connections blocked in GetJob, then create as many
    jobs: return how many waiters got exactly one distinct job, and the
    server's RSS (MB) while they all waited."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1024), hard))
    request = b"GetJob\r\nname: blocked\r\nConnection: wait\r\ntimeout: 120000\r\n\r\n"
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request)
        socks.append(sock)
    _wait_for_waiters(port, count)
    rss = rss_mb(pid)
    producer = JobserverClient(port)
    batch = 500
    for first in range(0, count, batch):
        jobs = ",".join('{"name":"blocked"}' for _ in range(min(batch, count - first)))
        status, _ = producer.request(b"CreateJobs\r\njobs: [" + jobs.encode() + b"]\r\n\r\n")
        assert status.startswith("200"), status
    ids = set()
    for sock in socks:
        sock.settimeout(60)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += sock.recv(65536)
        if head.startswith(b"200"):
            ids.add(body.split(b'"jobID":', 1)[1].split(b",", 1)[0])
        sock.close()
    return len(ids), rss


def _wait_for_waiters(port: int, count: int) -> None:
    client = JobserverClient(port)
    deadline = time.time() + 120
    while time.time() < deadline:
        _, body = client.request(b"Status\r\n\r\n")
        if b'"waitingGetJobs":%d' % count in body:
            return
        time.sleep(0.2)
    raise RuntimeError("the waiters did not all register")


def _batcher(port: int, stop_at: float) -> None:
    client = JobserverClient(port)
    jobs = ",".join('{"name":"load","data":{"p":"' + "x" * 90 + '"}}' for _ in range(1000))
    request = b"CreateJobs\r\njobs: [" + jobs.encode() + b"]\r\n\r\n"
    while time.time() < stop_at:
        status, _ = client.request(request)
        assert status.startswith("200"), status


def ping_under_batches(port: int, seconds: float) -> tuple[float, float]:
    """Ping p50 and p99 (ms) while two clients commit 1000-job batches."""
    stop_at = time.time() + seconds
    loaders = [multiprocessing.Process(target=_batcher, args=(port, stop_at)) for _ in range(2)]
    for p in loaders:
        p.start()
    client = JobserverClient(port)
    samples = []
    time.sleep(0.5)
    while time.time() < stop_at - 0.2:
        began = time.perf_counter()
        client.request(b"Ping\r\n\r\n")
        samples.append((time.perf_counter() - began) * 1000)
        time.sleep(0.002)
    for p in loaders:
        p.join()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


if __name__ == "__main__":
    _fill_here(Path(sys.argv[1]), int(sys.argv[2]))
