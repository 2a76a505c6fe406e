"""Count the instructions a real server executes per request, with callgrind.

    python bench/instructions.py                      # this checkout
    python bench/instructions.py --server-root DIR -n 2000

Timings on a shared machine move by a quarter between runs; instruction
counts do not. The server (`python -m jobserver serve`, with the database in
/dev/shm where there is one, so that every sync is quick and takes the same
path each run) runs under `valgrind --tool=callgrind`; this script drives
it over plain sockets (wire_client.py). After a warm-up, each workload
zeroes the counters (`callgrind_control -z`), runs N operations and dumps
them (`callgrind_control -d`):

- create, 1 client: CreateJob with 100 bytes of data;
- take, 1 client: GetJob + FinishJob of those jobs;
- create and take with 8 clients (threads here, N in all): under valgrind
  the server is the slow side, so its batches are nearly full;
- wake (N/10 rounds): a GetJob waiting with `Connection: wait`, a
  CreateJob on another connection, the hand-out and a FinishJob.

The figure is instructions per operation in user space: the interpreter,
SQLite and the C library, all threads of the server (the kernel's work and
the time spent waiting are not counted). A wake round includes the pause
while the GetJob waits (0.2 s of an idle server).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wire_client import Client, free_port

DATA = {"p": "x" * 90}
WAKE_PAUSE = 0.2


def create(client: Client) -> None:
    client.ok("CreateJob", name="bench", data=DATA)


def take(client: Client, name: str = "bench", wait: bool = False) -> None:
    params: dict[str, object] = {"name": name}
    if wait:
        params.update({"Connection": "wait", "timeout": 60000})
    job = client.ok("GetJob", **params)
    client.ok("FinishJob", jobID=job["jobID"])


def in_turn(run: Callable[[Client], None], client: Client, times: int) -> None:
    for _ in range(times):
        run(client)


def in_threads(port: int, each: int, run: Callable[[Client], None]) -> None:
    def loop() -> None:
        client = Client(port)
        for _ in range(each):
            run(client)
        client.close()

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def wake_rounds(port: int, rounds: int) -> None:
    waiter, creator = Client(port), Client(port)
    for _ in range(rounds):
        worker = threading.Thread(target=take, args=(waiter, "wake", True))
        worker.start()
        time.sleep(WAKE_PAUSE)  # the GetJob is waiting by then
        creator.ok("CreateJob", name="wake")
        worker.join()


def start(
    root: Path | None, out: Path, database: Path | str, patience: float = 300
) -> tuple[subprocess.Popen[bytes], int]:
    """`jobserver serve` on `database` (a file, or a PostgreSQL URL) under
    callgrind, once it answers a Ping (within `patience` seconds)."""
    port = free_port()
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = str(root)
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.out",
         sys.executable, "-m", "jobserver", "serve", "--port", str(port), "--db", str(database)],
        # `python -m` puts its working directory first on the path, before
        # PYTHONPATH: the checkout's own directory, or one with no jobserver.
        cwd=root or out, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + patience
    while True:
        try:
            Client(port).ok("Ping")
            return server, port
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("the server did not start under valgrind") from None
            time.sleep(0.5)


def counted(out: Path, server: subprocess.Popen[bytes], name: str, run: Callable[[], None]) -> int:
    """The instructions the server executed while `run` ran."""
    pid = str(server.pid)
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
    run()
    subprocess.run(["callgrind_control", "-d", name, pid], check=True, capture_output=True)
    return dumped(out, name)


def dumped(out: Path, name: str) -> int:
    """The instruction total of the dump named `name`."""
    for path in out.glob("callgrind.out.*"):
        text = path.read_text(errors="replace")
        if f"Trigger: dump {name}\n" in text:
            for line in text.splitlines():
                if line.startswith("summary:"):
                    return int(line.split()[1])
    raise SystemExit(f"no callgrind dump named {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-root", type=Path, help="the checkout to run (default: PYTHONPATH's)"
    )
    parser.add_argument("-n", type=int, default=1000, help="operations per workload")
    args = parser.parse_args()
    n = args.n
    shm = Path("/dev/shm")
    with (
        tempfile.TemporaryDirectory() as out_dir,
        tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as db_dir,
    ):
        out = Path(out_dir)
        server, port = start(args.server_root, out, Path(db_dir) / "bench.db")
        try:
            client = Client(port)
            in_turn(create, client, 100)
            in_turn(take, client, 100)
            workloads: list[tuple[str, int, Callable[[], None]]] = [
                ("create, 1 client", n, lambda: in_turn(create, client, n)),
                ("take, 1 client", n, lambda: in_turn(take, client, n)),
                ("create, 8 clients", n - n % 8, lambda: in_threads(port, n // 8, create)),
                ("take, 8 clients", n - n % 8, lambda: in_threads(port, n // 8, take)),
                ("wake round", n // 10, lambda: wake_rounds(port, n // 10)),
            ]
            for index, (label, ops, run) in enumerate(workloads):
                total = counted(out, server, f"w{index}", run)
                print(f"{label:20} {total / ops:>12,.0f} instructions/op", flush=True)
        finally:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
