"""How long a client command takes, start to exit: Python's start-up, the
imports, one request.

    python bench/startup.py                  # 20 runs of each command
    python bench/startup.py --runs 50 --server-root ../other-checkout

Starts `jobserver serve` on a fresh SQLite file, then runs each command as
a new process, one after another (its bytecode compiled once, in a
warm-up run, as an installed package has it), and prints, for each, the
median (and min, max) of the wall time from start to exit and of the CPU
time (user + system) the process used: `jobserver --help`, `ping`,
`create` and `query ID`, with `python -c pass` as the floor no command can
go below.
`--server-root DIR` runs the commands of the checkout at DIR instead (the
server stays this checkout's): run it on two branches to compare them in
one sitting, as start-up times drift with the machine's load. Nothing is
recorded, and no test asserts a time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import free_port, wait_port
from scale import server_env, start_server

ROOT = Path(__file__).resolve().parent.parent


def commands(port: int) -> dict[str, list[str]]:
    server = ["--server", f"127.0.0.1:{port}"]
    jobserver = [sys.executable, "-m", "jobserver"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "jobserver --help": [*jobserver, "--help"],
        "jobserver ping": [*jobserver, "ping", *server],
        "jobserver create": [*jobserver, "create", "bench/startup", *server],
        "jobserver query 1": [*jobserver, "query", "1", *server],
    }


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv`, which must exit 0."""
    cpu = child_cpu()
    began = time.perf_counter()
    # In `cwd`, away from any checkout: `python -m` imports from its
    # working directory before PYTHONPATH.
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - began, child_cpu() - cpu


def measure(
    argv: list[str], env: dict[str, str], cwd: str, runs: int
) -> tuple[list[float], list[float]]:
    one_run(argv, env, cwd)  # a warm-up: the page cache, .pyc files
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = one_run(argv, env, cwd)
        walls.append(wall)
        cpus.append(cpu)
    return walls, cpus


def milliseconds(values: list[float]) -> str:
    median = statistics.median(values) * 1000
    return f"{median:7.0f} ({min(values) * 1000:.0f} to {max(values) * 1000:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (default: 20)")
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, metavar="DIR",
        help="run the commands of the jobserver checkout at DIR (default: this one)",
    )
    args = parser.parse_args()
    env = server_env(args.server_root.resolve())
    # The environment could name another server; the commands say theirs.
    env.pop("JOBSERVER_SERVER", None)
    # Bytecode as an installed package has it: compiled once (in the
    # warm-up), into a directory of the run's own, not into the checkout.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        server = start_server(Path(tmp) / "jobs.db", port, ROOT)
        try:
            wait_port(port, server)
            print(f"{args.runs} runs each, {os.cpu_count()} CPUs, load average "
                  f"{os.getloadavg()[0]:.1f}; commands of {args.server_root}")
            print(f"{'command':<20} {'wall ms: median (min to max)':<30} "
                  "cpu ms: median (min to max)")
            for name, argv in commands(port).items():
                walls, cpus = measure(argv, env, tmp, args.runs)
                print(f"{name:<20} {milliseconds(walls):<30} {milliseconds(cpus)}")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
