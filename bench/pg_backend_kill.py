"""The PostgreSQL backend-kill chaos run, at length and several times:
tests/test_pg_chaos.py's scenario (tests/pg_chaos.py), as a third party's
harness runs it (pg_terminate_backend of the node's active and
idle-in-transaction backends, twice a second by default), for longer.

    python bench/pg_backend_kill.py [--runs 3] [--seconds 60] [--kill-every 0.5]
        [--producers 2] [--workers 2] [--server-root DIR] [--postgres URL]

Each run starts a node (`jobserver serve`) on a schema of its own, loads it
with producers (CreateJobs of 5) and workers (waiting GetJobs, FinishJobs
and FailJobs), two of each by default, terminates the node's backends for `--seconds`,
drains what is left, and holds every reply against the table: jobs
acknowledged and lost, jobs written behind a 5xx, reports undone or
applied behind a 5xx, jobs left RUNNING. It prints each run's counts and
violations, and exits 1 if any run had one. `--server-root` runs another
checkout's server (say, the commit before a fix) against the same checks.
Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers (a schema per run, the server process, the chaos run),
# which mypy does not check: they are not a package of the project's.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from pg_chaos import (  # type: ignore[import-not-found]  # noqa: E402
    Chaos,
    new_application,
    with_application,
)


def one_run(
    seconds: float, kill_every: float, producers: int, workers: int
) -> tuple[str, list[str]]:
    application = new_application()
    with pg.fresh_schema() as url:
        node = ServerProcess(with_application(url, application))
        try:
            chaos = Chaos(node.port or 0, url, application, kill_every)
            violations = chaos.run(seconds, producers, workers)
            if node.proc.poll() is not None:
                violations.append(f"the node died:\n{node.log}")
            return chaos.summary(), violations
        finally:
            node.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--producers", type=int, default=2, metavar="N")
    parser.add_argument("--workers", type=int, default=2, metavar="N")
    parser.add_argument("--server-root", type=Path, help="the checkout whose server runs")
    parser.add_argument("--postgres", help="the PostgreSQL server (default: the tests')")
    args = parser.parse_args()
    if args.server_root is not None:
        # The server process (`python -m jobserver`, which looks in its
        # working directory first) imports jobserver from there.
        root = str(args.server_root.resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")])
        )
        os.chdir(root)
    if args.postgres:
        os.environ["JOBSERVER_TEST_POSTGRES"] = args.postgres
    pg.recreate_database()
    failed = 0
    try:
        for number in range(1, args.runs + 1):
            began = time.monotonic()
            summary, violations = one_run(
                args.seconds, args.kill_every, args.producers, args.workers
            )
            took = time.monotonic() - began
            print(f"run {number}: {took:.0f} s; {summary}")
            for violation in violations:
                print(f"  VIOLATION {violation}")
            print(f"  {len(violations)} violations")
            failed += bool(violations)
    finally:
        pg.drop_database()
    print(f"{failed} of {args.runs} runs had violations")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
