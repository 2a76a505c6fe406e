"""Count the system calls a real server makes per request, with strace.

    python bench/syscalls.py                      # 2,000 of each, this checkout
    python bench/syscalls.py -n 4000 --clients 8 --server-root DIR

Starts `jobserver serve` on a fresh SQLite file on disk (in --dir, default
the system's temporary directory; the script says which file system that
is, as a database on tmpfs syncs for nothing) with `--synchronous FULL`,
the default, and drives it over plain sockets (wire_client.py). After a
warm-up, each workload attaches `strace -f -c` to the server (every thread,
and any it starts), runs N operations, detaches and reads strace's counts:

- create, 1 client and N clients (threads here): CreateJob with 100 bytes
  of data;
- take, 1 client and N clients: GetJob + FinishJob of those jobs.

It prints, for each workload, the calls per operation by name (those that
make up at least 0.1 of a call per operation) and in all; a take is two
requests, so its column is per take, not per request. Everything the
server does while strace is attached is counted, its timers included, and
nothing else. strace stops the server at every call, so the server is slower
than without it and its group commits are fuller with many clients: the
counts for many clients are a lower bound on what an unslowed server does
per request, those for one client are the same either way. Nothing is
asserted; the counts move a little from run to run with how the requests
happen to fall into batches.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import wait_port
from scale import start_server
from wire_client import Client, free_port

ROOT = Path(__file__).resolve().parent.parent
DATA = {"p": "x" * 90}
SHOWN = 0.1  # calls per operation below this are only in the total
ATTACH_TIMEOUT = 30.0


def create(client: Client) -> None:
    client.ok("CreateJob", name="bench", data=DATA)


def take(client: Client) -> None:
    job = client.ok("GetJob", name="bench")
    client.ok("FinishJob", jobID=job["jobID"])


def in_threads(port: int, clients: int, each: int, run: Callable[[Client], None]) -> None:
    """`clients` connections, each doing `run` `each` times, all at once."""
    connections = [Client(port) for _ in range(clients)]
    go = threading.Barrier(clients)

    def loop(client: Client) -> None:
        go.wait()
        for _ in range(each):
            run(client)

    threads = [threading.Thread(target=loop, args=(c,)) for c in connections]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in connections:
        client.close()


# What `attach` has strace do by default: count the calls, by name.
COUNTING = ("-c", "-U", "name,calls,errors", "-S", "calls")


def attach(pid: int, out: Path, options: tuple[str, ...] = COUNTING) -> subprocess.Popen[str]:
    """strace on every thread of `pid` with `options`, writing to `out`, once
    it has attached (it says so on its standard error: "Process PID attached
    with 3 threads")."""
    tracer = subprocess.Popen(
        ["strace", "-f", *options, "-o", str(out), "-p", str(pid)],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert tracer.stderr is not None
    deadline = time.monotonic() + ATTACH_TIMEOUT
    while True:
        line = tracer.stderr.readline()
        if f"Process {pid} attached" in line:
            return tracer
        if not line or time.monotonic() > deadline:
            tracer.kill()
            raise SystemExit(f"strace did not attach to {pid}: {line.strip()}")


def detach(tracer: subprocess.Popen[str], out: Path) -> dict[str, int]:
    """Stop `tracer` and read its summary: calls by system call's name."""
    tracer.send_signal(signal.SIGINT)
    tracer.communicate(timeout=60)
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit():
            counts[fields[0]] = int(fields[1])
    return counts


def warmed(db: Path, root: Path, creates: int) -> tuple[subprocess.Popen[bytes], int]:
    """`jobserver serve` of the checkout at `root` on a new SQLite file at
    `db` (`--synchronous FULL`), once it has served `creates` CreateJobs and
    a hundred takes of them."""
    port = free_port()
    server = start_server(db, port, root, "--synchronous", "FULL")
    try:
        wait_port(port, server)
        warm = Client(port)
        for _ in range(creates):
            create(warm)
        for _ in range(100):
            take(warm)
        warm.close()
    except BaseException:
        server.terminate()
        server.wait()
        raise
    return server, port


def filesystem(directory: Path) -> str:
    """The type of the file system `directory` is on, from /proc/mounts."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(directory.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def table(results: list[tuple[str, int, dict[str, int]]]) -> None:
    names: set[str] = set()
    for _, ops, counts in results:
        names.update(n for n, c in counts.items() if n != "total" and c / ops >= SHOWN)
    order = sorted(names, key=lambda n: -max(c.get(n, 0) / ops for _, ops, c in results))
    labels = [label for label, _, _ in results]
    print(f"{'per operation':<16}" + "".join(f"{label:>16}" for label in labels))
    for name in [*order, "total"]:
        cells = "".join(f"{counts.get(name, 0) / ops:>16.2f}" for _, ops, counts in results)
        print(f"{name:<16}{cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="operations per workload (2000)")
    parser.add_argument("--clients", type=int, default=8, help="connections of the many (8)")
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, metavar="DIR",
        help="serve with the jobserver checkout at DIR (default: this one)",
    )
    parser.add_argument(
        "--dir", type=Path, default=None,
        help="where the database goes (default: the system's temporary directory)",
    )
    args = parser.parse_args()
    n, clients = args.n, args.clients
    each = n // clients
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        server, port = warmed(directory / "jobs.db", args.server_root.resolve(), creates=100)
        try:
            print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; database on "
                  f"{filesystem(directory)}; server of {args.server_root}")
            workloads: list[tuple[str, int, Callable[[], None]]] = [
                ("create c1", n, lambda: in_threads(port, 1, n, create)),
                ("take c1", n, lambda: in_threads(port, 1, n, take)),
                (f"create c{clients}", each * clients,
                 lambda: in_threads(port, clients, each, create)),
                (f"take c{clients}", each * clients,
                 lambda: in_threads(port, clients, each, take)),
            ]
            results = []
            for label, ops, run in workloads:
                out = directory / "strace.out"
                tracer = attach(server.pid, out)
                began = time.perf_counter()
                try:
                    run()
                finally:
                    counts = detach(tracer, out)
                took = time.perf_counter() - began
                print(f"{label}: {ops} in {took:.1f} s under strace", flush=True)
                results.append((label, ops, counts))
            table(results)
        finally:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
