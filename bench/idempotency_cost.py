"""What an idempotency key costs a lone CreateJob (protocol.md 14.22): 8
clients create jobs one request each, without keys and with a new key
each, on one server, three rounds in turn, on SQLite and on PostgreSQL.

    python bench/idempotency_cost.py [--creates 400]

Only the ratio of keyed to plain in one round means much: this machine is
shared. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers (a schema of its own, the server process, a plain
# client), which mypy does not check: they are not a package of the project's.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from wire import Client  # type: ignore[import-not-found]  # noqa: E402

CLIENTS = 8


def rate(port: int, prefix: str | None, creates: int) -> float:
    """Creates a second, `CLIENTS` clients of `creates` each; keyed unless
    `prefix` is None."""

    def run(number: int) -> None:
        with Client(port, 30) as client:
            for n in range(creates):
                params = {"name": "k"}
                if prefix is not None:
                    params["idempotencyKey"] = f"{prefix}-{number}-{n}"
                assert client.request("CreateJob", **params).status == "200 OK"

    threads = [threading.Thread(target=run, args=(n,)) for n in range(CLIENTS)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return CLIENTS * creates / (time.perf_counter() - began)


def rounds(port: int, backend: str, creates: int) -> None:
    for number in range(3):
        plain = rate(port, None, creates)
        keyed = rate(port, f"round{number}", creates)
        print(f"{backend}: plain {plain:,.0f}/s, keyed {keyed:,.0f}/s: {keyed / plain:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=400, metavar="N")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobserver-keys-bench-") as tmp:
        node = ServerProcess(Path(tmp) / "jobs.db")
        try:
            rounds(node.port, "sqlite", args.creates)
        finally:
            node.kill()
    pg.recreate_database()
    try:
        with pg.fresh_schema() as url:
            node = ServerProcess(url)
            try:
                rounds(node.port, "postgres", args.creates)
            finally:
                node.kill()
    finally:
        pg.drop_database()
    return 0


if __name__ == "__main__":
    sys.exit(main())
