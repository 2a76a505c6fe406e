"""Count the jobserver function calls a real server makes to serve one request.

    PYTHONPATH=/path/to/checkout python bench/hops.py
    python bench/hops.py --server-root /path/to/checkout
    python bench/hops.py --postgres postgresql://postgres@127.0.0.1:5432/postgres

It uses only the CLI and the wire protocol, so the same script measures any
checkout: the jobserver that runs is the one the environment imports
(PYTHONPATH), or the checkout named by --server-root.

The server is `python -m jobserver serve --port N --db DB`, run through a
small wrapper (written to a temporary file) that, before handing over to
the CLI with runpy, installs a profile function in every thread
(sys.setprofile and threading.setprofile, so trio's worker threads have it
too). It records the 'call' events of Python code whose file is inside the
jobserver package, but only while recording is on: SIGUSR1 turns it on
(and, when on, adds a phase mark), SIGUSR2 turns it off and writes what was
recorded to a file. Calls of C functions, and of code outside the package
(trio, psycopg, sqlite3, the standard library), are not counted; jobserver
code they call back is. A generator or coroutine counts as called when it
starts; its later resumptions (every `await` that suspends, trio's
scheduling) are counted apart as resumes, not as calls.

Workloads, on an idle server with no other client (default: a fresh SQLite
database in a temporary directory, `--synchronous FULL` as the server
defaults; --postgres URL: a fresh PostgreSQL database made and dropped on
that server):

(a) CreateJob: recording on, one CreateJob, its reply, recording off;
(b) waiting GetJob: recording on, GetJob with `Connection: wait` on one
    connection, a pause (its first look at the queue; a phase mark), a
    CreateJob of a matching job on a second connection, the GetJob's
    reply, recording off. The CreateJob's own serving is part of it; the
    figures after the mark are shown apart too.

The signals go out only once the server is quiet, and recording stops as
soon as the reply is read, so what is counted is the request's work plus
whatever the server did between the signal and the request's arrival and
between its reply and the stop signal (a connection going back to read;
on PostgreSQL, perhaps its one-second recheck: see the idle figures,
counted the same way with no request). Each workload runs --repeat times
(default 3); the figures are the medians, and the lists are the median
run's (by number of calls).

Figures per workload:
- calls: jobserver functions called (started), in all threads;
- resumes: generator and coroutine resumptions, counted apart;
- distinct functions: (file, qualified name) pairs;
- distinct files;
- zigzags: in the order of the calls, a call into a file F after the calls
  had gone on in other files since the last call in F (consecutive calls in
  one file are one stay; each stay in a file already visited is one
  zigzag);
and the distinct (file, function) pairs in the order first called.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from wire_client import Client, free_port

WRAPPER = r"""
import dis, json, os, runpy, signal, sys, threading

import jobserver

PKG = os.path.dirname(os.path.abspath(jobserver.__file__)) + os.sep
OUT = os.environ["HOPS_OUT"]
GENERATORS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
on = False
events = []
starts = {}  # code -> offset of its first RESUME: a frame at or before it is starting


def start_offset(code):
    offset = starts.get(code)
    if offset is None:
        offset = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
        starts[code] = offset
    return offset


def profile(frame, event, arg):
    if not on or event != "call":
        return
    code = frame.f_code
    name = code.co_filename
    if not name.startswith(PKG):
        return
    kind = "call"
    if code.co_flags & GENERATORS and frame.f_lasti > start_offset(code):
        kind = "resume"
    events.append((kind, threading.get_ident(), name[len(PKG):], code.co_qualname))


def usr1(signum, frame):
    global on
    if on:
        events.append(("mark", 0, "", ""))
    else:
        events.clear()
        on = True


def usr2(signum, frame):
    global on
    on = False
    taken = list(events)
    events.clear()
    with open(OUT + ".tmp", "w") as f:
        json.dump(taken, f)
    os.replace(OUT + ".tmp", OUT)


signal.signal(signal.SIGUSR1, usr1)
signal.signal(signal.SIGUSR2, usr2)
threading.setprofile(profile)
sys.setprofile(profile)
sys.argv = ["jobserver", *sys.argv[1:]]
runpy.run_module("jobserver", run_name="__main__", alter_sys=True)
"""

DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


class Server:
    def __init__(self, db: str, root: Path | None, workdir: Path) -> None:
        self.out = workdir / "events.json"
        wrapper = workdir / "hops_wrapper.py"
        wrapper.write_text(WRAPPER)
        env = dict(os.environ, HOPS_OUT=str(self.out))
        if root is not None:
            env["PYTHONPATH"] = str(root)
        self.port = free_port()
        self.log = (workdir / "server.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(wrapper),
                "serve",
                "--port",
                str(self.port),
                "--db",
                db,
                "--log-level",
                "WARNING",
            ],
            cwd=root or workdir,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited: {(workdir / 'server.log').read_text()[-2000:]}"
                )
            try:
                c = Client(self.port, timeout=5)
                c.ok("Ping")
                c.close()
                break
            except (OSError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def start(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs once the event loop wakes to it

    def mark(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.05)

    def stop(self) -> list[tuple[str, int, str, str]]:
        if self.out.exists():
            self.out.unlink()
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not self.out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the server wrote no events")
            time.sleep(0.01)
        return [tuple(e) for e in json.loads(self.out.read_text())]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def figures(events: list) -> dict:
    calls = [(f, q) for kind, _, f, q in events if kind == "call"]
    resumes = sum(1 for e in events if e[0] == "resume")
    order: list[tuple[str, str]] = []
    seen = set()
    for pair in calls:
        if pair not in seen:
            seen.add(pair)
            order.append(pair)
    zigzags = 0
    visited: set[str] = set()
    previous = None
    for f, _ in calls:
        if f != previous:
            if f in visited:
                zigzags += 1
            visited.add(f)
            previous = f
    files = []
    for f, _ in order:
        if f not in files:
            files.append(f)
    return {
        "calls": len(calls),
        "resumes": resumes,
        "functions": len(order),
        "files": len(files),
        "zigzags": zigzags,
        "order": order,
        "file_order": files,
        "threads": len({t for kind, t, _, _ in events if kind != "mark"}),
    }


def split_at_mark(events: list) -> tuple[list, list]:
    for i, e in enumerate(events):
        if e[0] == "mark":
            return events[:i], events[i + 1 :]
    return events, []


def quiet(seconds: float = 0.5) -> None:
    time.sleep(seconds)


def run_create(server: Server, client: Client, rep: int) -> list:
    quiet()
    server.start()
    client.ok("CreateJob", name=f"hops/create/{rep}", data='{"n":1}')
    events = server.stop()
    # Not counted: the queue is emptied again.
    job = client.ok("GetJob", name=f"hops/create/{rep}")
    client.ok("FinishJob", jobID=job["jobID"])
    return events


def run_wait(server: Server, a: Client, b: Client, rep: int, pause: float) -> list:
    quiet()
    name = f"hops/wait/{rep}"
    server.start()
    a.send("GetJob", name=name, Connection="wait", timeout=20000)
    time.sleep(pause)  # its first look at the queue is over; it waits
    server.mark()
    b.ok("CreateJob", name=name, data='{"n":1}')
    status, body = a.reply()
    events = server.stop()
    if not status.startswith("200"):
        raise RuntimeError(f"waiting GetJob: {status}")
    b.ok("FinishJob", jobID=json.loads(body)["jobID"])
    return events


def run_idle(server: Server, seconds: float) -> list:
    quiet()
    server.start()
    time.sleep(seconds)
    return server.stop()


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["calls"])[len(runs) // 2]


def report(title: str, runs: list[dict], show_order: bool = True) -> list[str]:
    keys = ("calls", "resumes", "functions", "files", "zigzags")
    lines = [f"== {title}"]
    for key in keys:
        values = [r[key] for r in runs]
        lines.append(f"  {key:10} {statistics.median(values):>7g}   runs: {values}")
    if show_order:
        m = median_run(runs)
        lines.append(f"  distinct files in the order first called ({m['files']}):")
        lines += [f"    {f}" for f in m["file_order"]]
        lines.append(f"  distinct (file, function) in the order first called ({m['functions']}):")
        lines += [f"    {n:3}. {f}  {q}" for n, (f, q) in enumerate(m["order"], 1)]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-root", type=Path, help="the checkout to run (default: PYTHONPATH's)"
    )
    parser.add_argument(
        "--postgres",
        help="a superuser URL: serve a fresh PostgreSQL database "
        "made (and dropped) on that server instead of SQLite",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--pause",
        type=float,
        default=0.2,
        help="seconds between the waiting GetJob and the CreateJob",
    )
    args = parser.parse_args()
    root = args.server_root.resolve() if args.server_root else None

    workdir = Path(tempfile.mkdtemp(prefix="hops_"))
    admin = dbname = None
    if args.postgres:
        import psycopg
        from psycopg import sql

        dbname = f"jobserver_hops_{os.getpid()}"
        admin = psycopg.connect(args.postgres, autocommit=True, connect_timeout=5)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(dbname))))
        db = urlunsplit(urlsplit(args.postgres)._replace(path=f"/{dbname}"))
    else:
        db = str(workdir / "hops.db")
    server = None
    try:
        server = Server(db, root, workdir)
        time.sleep(1.0)  # start-up work is over
        a, b = Client(server.port), Client(server.port)
        a.ok("Ping")
        b.ok("Ping")
        # Warm-up, not counted: first-use imports and caches.
        run_create(server, a, -1)
        run_wait(server, a, b, -1, args.pause)

        idle = [figures(run_idle(server, 0.3)) for _ in range(args.repeat)]
        creates = [figures(run_create(server, a, rep)) for rep in range(args.repeat)]
        waits_raw = [run_wait(server, a, b, rep, args.pause) for rep in range(args.repeat)]
        waits = [figures(e) for e in waits_raw]
        first_looks = [figures(split_at_mark(e)[0]) for e in waits_raw]
        wakes = [figures(split_at_mark(e)[1]) for e in waits_raw]
        a.close()
        b.close()

        env = dict(os.environ)
        if root is not None:
            env["PYTHONPATH"] = str(root)
        where = subprocess.run(
            [
                sys.executable,
                "-c",
                "import jobserver, os; print(os.path.dirname(jobserver.__file__))",
            ],
            env=env,
            cwd=root or workdir,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"jobserver: {where}")
        database = "PostgreSQL (fresh database)" if args.postgres else "SQLite (fresh file)"
        print(
            f"database: {database}; "
            f"{args.repeat} runs per workload, medians; Python {sys.version.split()[0]}"
        )
        print()
        out = []
        out += report("idle server, 0.3 s recorded with no request (noise)", idle, show_order=False)
        out += report("(a) CreateJob x1", creates)
        out += report(
            "(b) waiting GetJob woken by a CreateJob on another connection (whole)", waits
        )
        out += report(
            "(b1) of which: the GetJob's arrival and first look, before the CreateJob",
            first_looks,
            show_order=False,
        )
        out += report(
            "(b2) of which: the CreateJob, the wake, and the GetJob's reply",
            wakes,
            show_order=False,
        )
        print("\n".join(out))
        return 0
    finally:
        if server is not None:
            server.close()
        if admin is not None:
            from psycopg import sql

            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(str(dbname))
                )
            )
            admin.close()


if __name__ == "__main__":
    sys.exit(main())
