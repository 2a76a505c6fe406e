"""Backups of a running server's database (the Backup command and
`jobserver backup`): a consistent copy under write load, a server started
on the copy, the refusals, who may ask, and PostgreSQL's answer.
tests/test_security_backup.py holds where a backup may not go."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pg
import pytest
import trio

from harness import ServerProcess, ThreadServer
from helpers import create, ok, outside_address, tmpfs, unprivileged, until
from jobserver.client import TrioClient
from jobserver.client.operating_calls import BACKUP_WAIT, backup
from jobserver.core.commands.backup import MALFORMED_NAME, cancelled
from jobserver.storage.backup_types import BackupDirectory, BackupFailed
from jobserver.storage.sqlite_backup import STOP_CHECK_STEPS
from jobserver.storage.sqlite_backup import backup as copy_database
from wire import Client

TIMEOUT = 10.0


def backups(db: Path) -> Path:
    """Where a server on `db` without --backup-dir writes its backups."""
    return Path(f"{db}.backups")


def stored_ids(db: Path) -> set[int]:
    """The jobIDs in a database file, read as it is on disk."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as copy:
        return {row[0] for row in copy.execute("SELECT jobID FROM jobs")}


def fill(client: Client, count: int, prefix: str = "old") -> None:
    """`count` jobs in one CreateJobs."""
    ok(client.request("CreateJobs", jobs=[{"name": f"{prefix}/{n}"} for n in range(count)]))


class Creator(threading.Thread):
    """Creates jobs one after another on its own connection until stopped,
    noting when each `200 OK` arrived."""

    def __init__(self, port: int, name: str) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.prefix = name
        self.acked: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.port, timeout=TIMEOUT) as client:
                while not self.stop.is_set():
                    job_id = create(client, f"{self.prefix}/{len(self.acked)}")
                    self.acked.append((time.monotonic(), job_id))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error


def test_a_backup_under_write_load_holds_every_acknowledged_job_and_serves(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = start_server()
    assert server.port is not None
    creators = [Creator(server.port, f"load{n}") for n in range(2)]
    for creator in creators:
        creator.start()
    until(lambda: all(len(c.acked) >= 100 for c in creators), TIMEOUT, "jobs to be created")
    copy = backups(tmp_path / "jobs.db") / "copy.db"
    with server.client() as client:
        sent = time.monotonic()
        reply = ok(client.request("Backup", name="copy.db"))
    answered = len(creators[0].acked)
    # Creates go on after the backup, on the same connections.
    until(lambda: len(creators[0].acked) > answered + 20, TIMEOUT, "more creates")
    for creator in creators:
        creator.stop.set()
        creator.join(TIMEOUT)
        assert creator.error is None, creator.error
    acked = {job_id for creator in creators for _, job_id in creator.acked}
    before = {job_id for creator in creators for at, job_id in creator.acked if at < sent}
    in_copy = stored_ids(copy)
    assert before <= in_copy
    assert in_copy <= acked and in_copy != acked
    assert set(reply.json) == {"bytes", "jobs", "name", "path", "seconds"}
    assert (reply.json["bytes"], reply.json["jobs"]) == (copy.stat().st_size, len(in_copy))
    assert reply.json["path"] == str(copy) and reply.json["name"] == "copy.db"
    assert reply.json["seconds"] >= 0
    assert backups(tmp_path / "jobs.db").stat().st_mode & 0o777 == 0o700
    assert "Traceback" not in server.log and " ERROR " not in server.log, server.log

    restored = start_server(copy)
    with restored.client() as client:
        listed = ok(client.request("Query", query="SELECT jobID FROM jobs;", format="json"))
        assert {row[0] for row in listed.json["rows"]} == in_copy
        taken = ok(client.request("GetJob", name="load*")).json
        assert taken["jobID"] in in_copy
        ok(client.request("FinishJob", jobID=taken["jobID"]))
        assert create(client, "after/restore") > max(in_copy)


class HeldBackup:
    """Wraps a store's backup so that, once the copy is under way (its first
    question whether to stop), it waits until the test releases it."""

    def __init__(self, store: Any) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self._backup = store.backup
        store.backup = self

    def __call__(self, directory: BackupDirectory, name: str, stopped: Callable[[], bool]) -> Any:
        def held() -> bool:
            if not self.entered.is_set():
                self.entered.set()
                self.release.wait(TIMEOUT)
            return stopped()

        return self._backup(directory, name, held)


def test_the_writer_goes_on_during_a_backup_which_copies_one_moment(tmp_path: Path) -> None:
    running = ThreadServer(tmp_path / "jobs.db")
    held = HeldBackup(running.server.store)
    copy = backups(tmp_path / "jobs.db") / "copy.db"
    try:
        with running.client() as client:
            # Enough rows that VACUUM INTO asks whether to stop before it ends.
            fill(client, 3 * STOP_CHECK_STEPS // 10)
        with Client(running.port, timeout=TIMEOUT) as backing_up:
            backing_up.send(b"Backup\r\nname: copy.db\r\n\r\n")
            assert held.entered.wait(TIMEOUT), "the backup never started copying"
            with running.client() as client:
                during = {create(client, "new") for _ in range(20)}
                ok(client.request("DeleteJob", jobID=1))
                refused = client.request("Backup", name="second.db")
                assert refused.status == "409 Backup already running"
            held.release.set()
            reply = ok(backing_up.read_reply())
        assert reply.json["jobs"] == 3 * STOP_CHECK_STEPS // 10
        in_copy = stored_ids(copy)
        assert 1 in in_copy and not in_copy & during
        assert not (backups(tmp_path / "jobs.db") / "second.db").exists()
    finally:
        held.release.set()
        running.stop()


def test_refusals_leave_files_as_they_were(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    directory = tmp_path / "backups"
    directory.mkdir(mode=0o700)
    server = start_server(
        tmp_path / "jobs.db", "--backup-dir", str(directory), wrapper=unprivileged()
    )
    existing = directory / "existing.db"
    existing.write_bytes(b"keep me")
    (directory / "stray.db-journal").write_bytes(b"a journal")
    (directory / "logged.db-wal").write_bytes(b"a log")
    cases = {
        "": "402 Missing name",
        "existing.db": "402 Backup file already exists",
        "stray.db": "402 Backup file already exists",
        "logged.db": "402 Backup file already exists",
        "sub/copy.db": MALFORMED_NAME,
        str(tmp_path / "copy.db"): MALFORMED_NAME,
        "..": MALFORMED_NAME,
        ".hidden": MALFORMED_NAME,
        "x" * 129: MALFORMED_NAME,
        # A NUL, sent as \u0000 (protocol.md 1.3).
        "a\\u0000b": MALFORMED_NAME,
    }
    before = sorted(tmp_path.rglob("*"))
    with server.client() as client:
        create(client, "kept")
        for name, status in cases.items():
            assert client.request("Backup", name=name).status == status, name
        moved = client.request("Backup", path=str(tmp_path / "copy.db")).status
        assert moved.startswith("402 Backup takes a name, not a path"), moved
        assert ok(client.request("QueryJob", jobID=1)).json["name"] == "kept"
        assert ok(client.request("Backup", name="x" * 128)).json["jobs"] == 1
    assert sorted(tmp_path.rglob("*")) == sorted([*before, directory / ("x" * 128)])
    assert existing.read_bytes() == b"keep me"


def test_a_copy_that_fails_is_a_5xx_and_leaves_no_file(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "64k") as small:
        small.chmod(0o700)
        running = ThreadServer(tmp_path / "jobs.db", backup_dir=str(small))
        try:
            with running.client() as client:
                fill(client, 2000)
                reply = client.request("Backup", name="copy.db")
                assert reply.status == "500 Backup failed: database or disk is full"
                assert not list(small.iterdir())
                # The server goes on: it creates, and backs up once there is room.
                create(client, "after")
                subprocess.run(["mount", "-o", "remount,size=16m", str(small)], check=True)
                assert ok(client.request("Backup", name="copy.db")).json["jobs"] == 2001
        finally:
            running.stop()


@pytest.mark.parametrize("phase", ["copying", "checking"])
def test_a_copy_stops_when_asked_and_leaves_no_file(tmp_path: Path, phase: str) -> None:
    """What a shutdown does to a backup under way (the server's `stopped`
    is the request's cancellation), while SQLite writes the copy or while
    it checks it."""
    running = ThreadServer(tmp_path / "jobs.db")
    try:
        with running.client() as client:
            fill(client, 3 * STOP_CHECK_STEPS // 10)
    finally:
        running.stop()
    copy = tmp_path / "copies" / "copy.db"
    copy.parent.mkdir(mode=0o700)
    # SQLite writes the copy under a journal of its own, gone once it is written.
    journal = Path(f"{copy}-journal")

    def stopped() -> bool:
        return journal.exists() == (phase == "copying")

    with pytest.raises(BackupFailed, match=r"^stopped$"):
        copies = BackupDirectory(str(copy.parent))
        copy_database(str(tmp_path / "jobs.db"), copies, copy.name, stopped)
    assert not list(copy.parent.iterdir())


async def test_a_cancelled_request_tells_its_backup_to_stop() -> None:
    """The dispatcher's `stopped` for a backup's thread: true once the
    request is cancelled, as a shutdown cancels the requests still running."""
    told = threading.Event()

    def copying() -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not told.is_set():
            if cancelled():
                told.set()
            time.sleep(0.001)

    with trio.move_on_after(0.01):
        await trio.to_thread.run_sync(copying)
    assert told.is_set()


def _http_backup(running: ThreadServer, host: str, name: str, **headers: str) -> int:
    url = f"http://{host}:{running.server.http_port}/api/Backup"
    request = urllib.request.Request(
        url, data=json.dumps({"name": name}).encode(), method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    # Straight to the server, whatever proxy the environment names.
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(request, timeout=TIMEOUT) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("token", [None, "s3cret"], ids=["no token", "a token"])
def test_a_remote_client_may_back_up_only_with_a_token(
    tmp_path: Path, token: str | None
) -> None:
    address = outside_address()
    if address is None:
        pytest.skip("no non-loopback interface on this machine")
    running = ThreadServer(tmp_path / "jobs.db", host="0.0.0.0", http_port=0, auth_token=token)
    auth = {} if token is None else {"authToken": token}
    bearer = {} if token is None else {"Authorization": f"Bearer {token}"}
    expected = "401 Unauthorized" if token is None else "200 OK"
    # Over HTTP a browser could send it: only with the token, from anywhere.
    http_expected = 403 if token is None else 200
    copies = backups(tmp_path / "jobs.db")
    try:
        until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
        with Client(running.port, host=address) as remote:
            reply = remote.request("Backup", auth, name="wire.db")
            assert reply.status == expected
        assert _http_backup(running, address, "http.db", **bearer) == http_expected
        assert (copies / "wire.db").exists() == (copies / "http.db").exists() == bool(token)
        # On this machine, no token is needed on the wire port (but one is
        # checked if the server has one).
        with Client(running.port) as local:
            ok(local.request("Backup", auth, name="local.db"))
        assert _http_backup(running, "127.0.0.1", "local-http.db", **bearer) == http_expected
    finally:
        running.stop()


def test_postgresql_answers_use_pg_dump(tmp_path: Path) -> None:
    with pg.fresh_schema() as url:
        running = ThreadServer(url)
        try:
            with running.client() as client:
                reply = client.request("Backup", name="copy.db")
        finally:
            running.stop()
    assert reply.status == (
        "501 Backup is for SQLite: back up PostgreSQL with pg_dump (docs/backups.md)"
    )
    assert not list(tmp_path.iterdir())


def test_a_database_in_memory_has_no_file_to_back_up(tmp_path: Path) -> None:
    running = ThreadServer(Path(":memory:"))
    try:
        with running.client() as client:
            reply = client.request("Backup", name="copy.db")
    finally:
        running.stop()
    assert reply.status == "501 The database is in memory: there is no file to back up"
    assert not list(tmp_path.iterdir())


def test_the_cli_backs_up_by_name_into_the_backup_directory(tmp_path: Path) -> None:
    directory = tmp_path / "nightly"
    directory.mkdir(mode=0o700)
    running = ThreadServer(tmp_path / "jobs.db", backup_dir=str(directory))
    try:
        with running.client() as client:
            fill(client, 5)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "jobserver", "backup", *args]
            return subprocess.run(
                [*command, "--server", f"127.0.0.1:{running.port}"],
                cwd=tmp_path, capture_output=True, text=True, timeout=30,
            )

        done = cli("copy.db")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert (result["path"], result["jobs"]) == (str(directory / "copy.db"), 5)
        assert result["bytes"] == (directory / "copy.db").stat().st_size
        again = cli("copy.db")
        assert (again.returncode, again.stderr) == (2, "402 Backup file already exists\n")
        a_path = cli(str(tmp_path / "elsewhere.db"))
        assert (a_path.returncode, a_path.stderr) == (2, MALFORMED_NAME + "\n")
        live = [tmp_path / f"jobs.db{suffix}" for suffix in ("", "-wal", "-shm", ".lock")]
        assert sorted(tmp_path.iterdir()) == sorted([directory, *live])
    finally:
        running.stop()


async def test_the_trio_client_backs_up(tmp_path: Path) -> None:
    running = ThreadServer(tmp_path / "jobs.db")
    try:
        async with TrioClient("127.0.0.1", running.port) as client:
            await client.create_job("one")
            result = await client.backup("copy.db")
        assert result["jobs"] == 1 and stored_ids(backups(tmp_path / "jobs.db") / "copy.db") == {1}
    finally:
        running.stop()


def test_the_library_waits_for_a_backup_past_its_timeout() -> None:
    """A backup's reply comes once the whole database is copied and
    checked: the clients wait for it BACKUP_WAIT longer than for others."""
    assert backup("copy.db").wait_seconds == BACKUP_WAIT
