"""Proves that a plain `pip install jobserverd` works: run with the Python of
a fresh virtual environment into which only the built wheel was installed
(no extras, no checkout on the path), from outside the repository, so that
`jobserver` is the installed package. .ci/run does so:

    python smoke_wheel.py

It starts `jobserver serve` on a temporary SQLite file and a free port,
creates a job with a CRON repeat and takes it over the wire, uses the sync
client and the async client on asyncio and on trio, has `jobserver worker`
finish a job with a decorated handler and `jobserver worker-manager` one
with a program, and stops every process. Exits 0, or fails with a
traceback and the processes' logs. About 3 s; everything has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import trio

import jobserver
from jobserver.client import AsyncClient, Client, ConnectionFailed

# The `jobserver` command the wheel installed, beside this Python.
JOBSERVER = str(Path(sys.executable).parent / "jobserver")
# Longest any one step (the server's start, a job's finish, a stop) may take.
STEP_TIMEOUT = 20.0
HOST = "127.0.0.1"
# The decorated handler `jobserver worker` runs: it finishes its job with data.
WORKER_MODULE = textwrap.dedent(
    """
    from jobserver.worker import Worker

    worker = Worker()


    @worker.handler("smoke/worker")
    def double(data):
        return {"doubled": data["n"] * 2}
    """
)
# The program `jobserver worker-manager` runs for a job named smoke/Managed:
# it reads the job and prints its new data.
MANAGED_PROGRAM = "#!/bin/sh\ncat >/dev/null\necho '{\"managed\": true}'\n"


def check_installed() -> None:
    """The package is the wheel's, with its dashboard files and the plain
    dependencies the clients, the worker and CRON rules need."""
    package = Path(jobserver.__file__).parent
    assert "site-packages" in package.parts, f"jobserver imported from {package}"
    for name in ("templates/index.html", "templates/base.html", "static/dashboard.js"):
        assert (package / "web" / name).is_file(), f"the wheel lacks web/{name}"
    plain = [
        requirement
        for requirement in importlib.metadata.requires("jobserverd") or []
        if "extra ==" not in requirement
    ]
    for needed in ("trio", "anyio", "cronsim"):
        assert any(r.startswith(needed) for r in plain), f"{needed} is not a plain dependency"
    shown = subprocess.run(
        [JOBSERVER, "--version"], capture_output=True, text=True, timeout=STEP_TIMEOUT, check=True
    ).stdout.strip()
    assert shown == f"jobserver {importlib.metadata.version('jobserverd')}", shown


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def wait_for(what: str, done: Callable[[], bool]) -> None:
    """Polls `done()` until it is true, for at most STEP_TIMEOUT."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {STEP_TIMEOUT} s")
        time.sleep(0.05)


def has_started(server: subprocess.Popen[bytes], port: int) -> bool:
    if server.poll() is not None:
        raise RuntimeError(f"jobserver serve exited {server.returncode}")
    return answers_ping(port)


def answers_ping(port: int) -> bool:
    try:
        with Client(HOST, port, timeout=2) as jobs:
            jobs.ping()
    except (OSError, ConnectionFailed):
        return False
    return True


@contextlib.contextmanager
def running(command: list[str], log: Path, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A `jobserver` process, stopped with SIGTERM at the end (its log
    printed if the block failed); it must exit 0."""
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        yield process
    except BaseException:
        process.kill()
        process.wait(STEP_TIMEOUT)
        print(f"--- {' '.join(command)}\n{log.read_text()}", file=sys.stderr)
        raise
    process.send_signal(signal.SIGTERM)
    status = process.wait(STEP_TIMEOUT)
    assert status == 0, f"jobserver {command[1]} exited {status}:\n{log.read_text()}"


def over_the_wire(port: int) -> None:
    """CreateJob with a CRON repeat and GetJob, as `nc` would send them."""
    with socket.create_connection((HOST, port), timeout=STEP_TIMEOUT) as conn:
        conn.sendall(
            b"CreateJob\r\nname: smoke/cron\r\nrepeat: CRON */5 * * * *\r\n"
            b"firstRun: 2020-01-01 00:00:00\r\n\r\n"
            b"GetJob\r\nname: smoke/cron\r\n\r\n"
        )
        replies = read_replies(conn, 2)
    (created, created_body), (got, got_body) = replies
    assert created.startswith("200"), created
    assert got.startswith("200"), got
    assert got_body["jobID"] == created_body["jobID"]
    assert got_body["repeat"] == "CRON */5 * * * *", got_body


def read_replies(conn: socket.socket, count: int) -> list[tuple[str, dict[str, object]]]:
    """`count` replies: each a status line, headers, and a JSON body of
    Content-Length bytes."""
    buffer = b""
    replies: list[tuple[str, dict[str, object]]] = []
    while len(replies) < count:
        while b"\r\n\r\n" not in buffer:
            buffer += receive(conn)
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        status, *lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines)
        length = int(headers.get("Content-Length", "0"))
        while len(buffer) < length:
            buffer += receive(conn)
        body, buffer = buffer[:length], buffer[length:]
        replies.append((status, json.loads(body) if body else {}))
    return replies


def receive(conn: socket.socket) -> bytes:
    chunk = conn.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection")
    return chunk


def with_the_sync_client(port: int) -> None:
    with Client(HOST, port, timeout=STEP_TIMEOUT) as jobs:
        job_id = jobs.create_job("smoke/sync", {"n": 1})
        job = jobs.get_job("smoke/sync")
        assert job is not None and job["jobID"] == job_id, job
        jobs.finish_job(job_id, lease_id=job.get("leaseID"))
        assert jobs.query_job(job_id)["state"] == "FINISHED"


async def with_the_async_client(port: int) -> None:
    """The async client, on whichever event loop runs it (asyncio or trio)."""
    async with AsyncClient(HOST, port, timeout=STEP_TIMEOUT) as jobs:
        job_id = await jobs.create_job("smoke/async", {"n": 2})
        job = await jobs.get_job("smoke/async", wait=STEP_TIMEOUT)
        assert job is not None and job["jobID"] == job_id, job
        await jobs.finish_job(job_id, lease_id=job.get("leaseID"))


def with_the_worker(port: int, workdir: Path) -> None:
    """`jobserver worker` runs a decorated handler, which finishes a job."""
    (workdir / "smoke_jobs.py").write_text(WORKER_MODULE)
    with Client(HOST, port, timeout=STEP_TIMEOUT) as jobs:
        job_id = jobs.create_job("smoke/worker", {"n": 21})
        command = [JOBSERVER, "worker", "--server", f"{HOST}:{port}", "smoke_jobs:worker"]
        with running(command, workdir / "worker.log", workdir):
            wait_for("the worker's job", lambda: jobs.query_job(job_id)["state"] == "FINISHED")
        assert jobs.query_job(job_id)["data"] == {"doubled": 42}


def with_the_worker_manager(port: int, workdir: Path) -> None:
    """`jobserver worker-manager` runs a program, which finishes a job."""
    programs = workdir / "workers"
    programs.mkdir()
    (programs / "Managed").write_text(MANAGED_PROGRAM)
    (programs / "Managed").chmod(0o755)
    with Client(HOST, port, timeout=STEP_TIMEOUT) as jobs:
        job_id = jobs.create_job("smoke/Managed", {"n": 3})
        command = [JOBSERVER, "worker-manager", "--server", f"{HOST}:{port}",
                   "--worker-path", str(programs), "--job-name", "smoke/*"]
        with running(command, workdir / "worker-manager.log", workdir):
            wait_for("the manager's job", lambda: jobs.query_job(job_id)["state"] == "FINISHED")
        assert jobs.query_job(job_id)["data"] == {"managed": True}


def main() -> None:
    started = time.monotonic()
    check_installed()
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary)
        port = free_port()
        # Finished jobs kept, so that their state and data can be checked.
        database = str(workdir / "jobs.db")
        command = [JOBSERVER, "serve", "--port", str(port), "--db", database]
        command += ["--keep-finished", "1h"]
        with running(command, workdir / "serve.log", workdir) as server:
            wait_for("the server's start", lambda: has_started(server, port))
            over_the_wire(port)
            with_the_sync_client(port)
            asyncio.run(with_the_async_client(port))
            trio.run(with_the_async_client, port)
            with_the_worker(port, workdir)
            with_the_worker_manager(port, workdir)
    print(f"the wheel works: {time.monotonic() - started:.1f} s ({os.path.basename(sys.prefix)})")


if __name__ == "__main__":
    main()
