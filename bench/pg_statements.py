"""Count the SQL statements PostgreSQL executes for each jobserver command.

    PYTHONPATH=/path/to/checkout python bench/pg_statements.py
    python bench/pg_statements.py --server-root /path/to/checkout
    python bench/pg_statements.py --postgres postgresql://postgres@127.0.0.1:5432/postgres

It talks to the server only through the CLI (`python -m jobserver serve`)
and the wire protocol, so the same script measures any checkout: the
jobserver that runs is the one the environment imports (PYTHONPATH), or
the checkout named by --server-root.

How the statements are counted: the script creates a fresh database
(jobserver_stmts_<pid>) on the server named by --postgres (a superuser's
URL naming an existing database; default $JOBSERVER_BENCH_POSTGRES, else
postgres@127.0.0.1:5432/postgres, trust auth), and turns on
`log_statement = 'all'` for that database only (ALTER DATABASE ... SET;
it goes away when the database is dropped at the end, no server-wide
setting is touched). pg_stat_statements would need shared_preload_libraries
and a restart, so the server's own log is read instead: the file named by
pg_current_logfile() when the logging collector runs, else the file the
server's stderr goes to (/proc/self/fd/2 of the script's own backend, which
inherits the postmaster's stderr), or --log-file. The file is read through
SQL (pg_stat_file, pg_read_binary_file) as the superuser, so the script
needs no access to it. Only lines naming the database count
(log_line_prefix must hold %d), as `statement:` or `execute <name>:`
entries: one per statement executed, with the simple or the extended
query protocol alike (a prepared statement's every execution counts).

A node is started on the database (`serve --db URL --port N`), Pinged until
it answers, then left alone for --startup-wait seconds so that its start-up
statements are not counted. The idle node's statements are counted over a
few 1-second windows and printed: its background work (on PostgreSQL, a
recheck transaction every second and a retention probe every 5 s at
47ac46a). Each workload is then counted from just before its request is
sent until --settle seconds after its reply, so statements the node runs
after replying because of the command (such as a recheck its own NOTIFY
asks for) count too. To keep the timers out, each window starts right
after a background transaction has ended (the log shows its COMMIT and
then nothing for 30 ms; if none comes within 1.5 s, the window starts
anyway, and the header says how many did). Each workload runs --repeat
times on an emptied queue; the table gives the median run, and the counts
of every run when they differ.

Workloads: CreateJob x1; GetJob x1 (one job queued); FinishJob x1;
CreateJobs of 100 jobs; GetJobs numResults 100 (100 queued); FinishJobs of
those 100; a waiting GetJob (Connection: wait) on one connection served by
a CreateJob on another (counted from the GetJob's sending to its reply,
with the part before the CreateJob, the waiter's first look, shown apart).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from wire_client import Client, free_port

DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
# Waiting for the end of a background transaction (Runner.sync): at most
# this long, and this long without a new statement after its COMMIT.
SYNC_TIMEOUT = 1.5
QUIET = 0.03


class StatementLog:
    """The part of PostgreSQL's log written since mark(), read through SQL."""

    ENTRY = re.compile(r"LOG:\s+(?:statement|execute [^:]*):\s?(.*)$")

    def __init__(self, admin: psycopg.Connection, database: str, path: str | None) -> None:
        self.admin = admin
        self.database = database
        self.path = path or self._find()
        self.offset = 0

    def _find(self) -> str:
        current = self.admin.execute("SELECT pg_current_logfile('stderr')").fetchone()[0]  # type: ignore[index]
        if current:
            if not current.startswith("/"):
                data = self.admin.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
                current = f"{data}/{current}"
            return current
        # No logging collector: the postmaster's stderr, which every backend
        # (this one too) inherits. stat() and open() follow the /proc link.
        return "/proc/self/fd/2"

    def size(self) -> int:
        return self.admin.execute("SELECT size FROM pg_stat_file(%s)", (self.path,)).fetchone()[0]  # type: ignore[index]

    def mark(self) -> None:
        self.offset = self.size()

    def since_mark(self) -> list[str]:
        """The statements of our database logged since mark()."""
        end = self.size()
        if end <= self.offset:
            return []
        data = self.admin.execute(
            "SELECT pg_read_binary_file(%s, %s, %s)", (self.path, self.offset, end - self.offset)
        ).fetchone()[0]  # type: ignore[index]
        statements = []
        needle = f"@{self.database} "
        for line in bytes(data).decode("utf-8", "replace").split("\n"):
            if not line or line[0] in " \t":
                continue  # the continuation of a multi-line entry
            head, sep, _ = line.partition("LOG:")
            if not sep or (needle not in head and self.database not in head):
                continue
            match = self.ENTRY.search(line)
            if match:
                statements.append(match.group(1))
        return statements


def kind(statement: str) -> str:
    words = statement.strip().lstrip("(").split()
    if not words:
        return "?"
    first = words[0].upper().rstrip(";")
    if (
        first in ("ROLLBACK", "RELEASE")
        and len(words) > 1
        and words[1].upper() in ("TO", "SAVEPOINT")
    ):
        return f"{first} {words[1].upper()}"
    if first == "SELECT" and len(words) > 1 and words[1].lower().startswith("pg_notify"):
        return "SELECT pg_notify"
    return first


def ends_transaction(statement: str) -> bool:
    """Whether the last statement of a query (one line of the log, the
    simple protocol's several statements among them: `...; COMMIT`) ends
    its transaction."""
    last = statement.strip().rstrip(";").rsplit(";", 1)[-1]
    return kind(last) in ("COMMIT", "ROLLBACK", "END")


# --- the run ---------------------------------------------------------------


def start_node(url: str, root: Path | None, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ)
    cwd = None
    if root is not None:
        env["PYTHONPATH"] = str(root)
        cwd = root
    out = log.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobserver",
            "serve",
            "--port",
            str(port),
            "--db",
            url,
            "--log-level",
            "WARNING",
        ],
        cwd=cwd,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            client = Client(port, timeout=5)
            status, _ = client.request("Ping")
            client.close()
            if status.startswith("200"):
                return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not answer Ping within 60 s")


def which_jobserver(root: Path | None) -> str:
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = str(root)
    out = subprocess.run(
        [sys.executable, "-c", "import jobserver, os; print(os.path.dirname(jobserver.__file__))"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


class Runner:
    def __init__(self, log: StatementLog, port: int, settle: float) -> None:
        self.log = log
        self.port = port
        self.settle = settle
        self.a = Client(port)
        self.b = Client(port)
        self.synced = self.unsynced = 0

    def sync(self) -> None:
        """Wait until a transaction of the node's background work (a timer,
        such as the PostgreSQL node's fallback recheck every second) has
        just ended, so that the next window is clear of it: poll the log for
        a COMMIT or ROLLBACK followed by a quiet spell. Gives up after
        SYNC_TIMEOUT seconds (a node with no timers)."""
        self.log.mark()
        deadline = time.monotonic() + SYNC_TIMEOUT
        seen, changed = 0, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.01)
            statements = self.log.since_mark()
            now = time.monotonic()
            if len(statements) != seen:
                seen, changed = len(statements), now
            elif (
                statements
                and now - changed >= QUIET
                and ends_transaction(statements[-1])
            ):
                self.synced += 1
                return
        self.unsynced += 1

    def counted(self, action: Callable[[], Any]) -> tuple[list[str], Any]:
        self.sync()
        self.log.mark()
        result = action()
        time.sleep(self.settle)
        return self.log.since_mark(), result

    def idle(self, seconds: float) -> list[str]:
        self.log.mark()
        time.sleep(seconds)
        return self.log.since_mark()

    def run_once(self, rep: int) -> dict[str, tuple[list[str], int]]:
        a, b = self.a, self.b
        one = f"stmts/one/{rep}"
        many = f"stmts/many/{rep}"
        waited = f"stmts/wait/{rep}"
        out: dict[str, tuple[list[str], int]] = {}

        stmts, _ = self.counted(lambda: a.ok("CreateJob", name=one, data={"n": 1}))
        out["CreateJob x1"] = (stmts, 1)
        stmts, job = self.counted(lambda: a.ok("GetJob", name=one))
        out["GetJob x1 (1 queued)"] = (stmts, 1)
        stmts, _ = self.counted(lambda: a.ok("FinishJob", jobID=job["jobID"]))
        out["FinishJob x1"] = (stmts, 1)

        batch = [{"name": many, "data": {"n": n}} for n in range(100)]
        stmts, _ = self.counted(lambda: a.ok("CreateJobs", jobs=batch))
        out["CreateJobs x100"] = (stmts, 100)
        stmts, got = self.counted(lambda: a.ok("GetJobs", name=many, numResults=100))
        if len(got["jobs"]) != 100:
            raise RuntimeError(f"GetJobs handed out {len(got['jobs'])} jobs, not 100")
        out["GetJobs x100 (100 queued)"] = (stmts, 100)
        finish = [{"jobID": j["jobID"]} for j in got["jobs"]]
        stmts, done = self.counted(lambda: a.ok("FinishJobs", jobs=finish))
        bad = [r for r in done.get("results", []) if not str(r.get("status")).startswith("200")]
        if bad:
            raise RuntimeError(f"FinishJobs: {bad[:3]}")
        out["FinishJobs x100"] = (stmts, 100)

        # The waiting GetJob: its first look, then the CreateJob that wakes it.
        self.sync()
        self.log.mark()
        a.send("GetJob", name=waited, Connection="wait", timeout=20000)
        time.sleep(self.settle)  # the first look is over, the request waits
        first_look = self.log.since_mark()
        b.ok("CreateJob", name=waited, data={"n": 1})
        status, body = a.reply()
        if not status.startswith("200"):
            raise RuntimeError(f"waiting GetJob: {status}")
        time.sleep(self.settle)
        stmts = self.log.since_mark()
        out["waiting GetJob + CreateJob"] = (stmts, 1)
        out["  of which the waiter's first look"] = (first_look, 1)
        # Not counted: the job is finished so that the queue is empty again.
        b.ok("FinishJob", jobID=json.loads(body)["jobID"])
        time.sleep(self.settle)
        return out


def summarize(kinds: Counter) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--postgres",
        default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES),
        help="a superuser's URL naming an existing database (default: %(default)s)",
    )
    parser.add_argument(
        "--server-root", type=Path, help="the checkout to run (default: PYTHONPATH's)"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds counted after a reply")
    parser.add_argument("--startup-wait", type=float, default=2.0)
    parser.add_argument("--idle-seconds", type=int, default=5)
    parser.add_argument("--log-file", help="the server's log file, as the server sees it")
    parser.add_argument("--show", action="store_true", help="print every statement counted")
    args = parser.parse_args()
    root = args.server_root.resolve() if args.server_root else None

    name = f"jobserver_stmts_{os.getpid()}"
    url = urlunsplit(urlsplit(args.postgres)._replace(path=f"/{name}"))
    admin = psycopg.connect(args.postgres, autocommit=True, connect_timeout=5)
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    proc = None
    workdir = Path(tempfile.mkdtemp(prefix="pg_statements_"))
    try:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET log_statement = 'all'").format(sql.Identifier(name))
        )
        prefix = admin.execute("SHOW log_line_prefix").fetchone()[0]  # type: ignore[index]
        if "%d" not in prefix:
            raise SystemExit(f"log_line_prefix {prefix!r} lacks %d: cannot tell databases apart")
        log = StatementLog(admin, name, args.log_file)
        log.mark()  # fails here if the log cannot be read
        version = admin.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]

        proc, port = start_node(url, root, workdir / "server.log")
        time.sleep(args.startup_wait)
        runner = Runner(log, port, args.settle)
        idle_runs = [runner.idle(1.0) for _ in range(args.idle_seconds)]
        idle = [len(run) for run in idle_runs]

        runs = [runner.run_once(rep) for rep in range(args.repeat)]
        runner.a.close()
        runner.b.close()

        print(f"jobserver: {which_jobserver(root)}")
        print(f"PostgreSQL {version}, database {name}, log read from {log.path}")
        print(
            f"one node; {args.repeat} runs per workload, median shown; window = request to "
            f"reply + {args.settle} s"
        )
        print(
            f"idle node, statements in each of {len(idle)} 1-second windows (background work, "
            f"not counted below): {idle}"
        )
        print(
            f"windows started right after a background transaction: {runner.synced} of "
            f"{runner.synced + runner.unsynced} (the others waited {SYNC_TIMEOUT} s for one)"
        )
        print()
        header = f"{'workload':36} {'stmts':>6} {'per job':>8}  kinds (median run)   [all runs]"
        print(header)
        print("-" * len(header))
        details = []
        for workload in runs[0]:
            counts = [len(run[workload][0]) for run in runs]
            jobs = runs[0][workload][1]
            med = statistics.median(counts)
            # The kinds of the run whose count is the median.
            pick = sorted(range(len(runs)), key=lambda i: counts[i])[len(runs) // 2]
            kinds = Counter(kind(s) for s in runs[pick][workload][0])
            spread = "" if len(set(counts)) == 1 else f"   {counts}"
            print(f"{workload:36} {med:>6g} {med / jobs:>8.2f}  {summarize(kinds)}{spread}")
            if args.show:
                details.append((workload, runs[pick][workload][0]))
        if args.show:
            details.insert(0, ("idle windows", [s for run in idle_runs for s in run]))
        for workload, statements in details:
            print(f"\n== {workload}")
            for s in statements:
                print("   ", s[:200])
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        admin.close()


if __name__ == "__main__":
    sys.exit(main())
