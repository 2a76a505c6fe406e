"""Files the server makes, against other users of the machine: a new
database (and SQLite's -wal and -shm beside it) is readable by the
server's user alone, whatever the umask; a file that exists keeps the
mode its owner gave it."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

from harness import ThreadServer
from helpers import ok


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_log_are_private(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    old = os.umask(0o022)
    try:
        running = ThreadServer(db)
    finally:
        os.umask(old)
    try:
        with running.client() as client:
            ok(client.request("CreateJob", name="private"))
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert mode(path) == 0o600, path
    finally:
        running.stop()


def test_an_existing_database_keeps_its_mode(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    sqlite3.connect(db).close()
    db.chmod(0o640)
    running = ThreadServer(db)
    try:
        with running.client() as client:
            ok(client.request("CreateJob", name="shared"))
        assert mode(db) == 0o640
    finally:
        running.stop()


def test_a_token_file_other_users_can_read_is_warned_of(start_server, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o644)
    shared = start_server(tmp_path / "a.db", "--auth-token-file", str(token))
    assert "can be read by other users" in shared.log
    token.chmod(0o600)
    private = start_server(tmp_path / "b.db", "--auth-token-file", str(token))
    assert "can be read by other users" not in private.log
    with private.client() as client:
        assert client.request("Ping", authToken="t0ken").status == "200 OK"


def test_a_short_token_is_warned_of(start_server, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    short = start_server(tmp_path / "a.db", "--auth-token-file", str(token))
    assert "has 5 characters" in short.log
    token.write_text("0123456789abcdef0123456789abcdef\n")
    long_enough = start_server(tmp_path / "b.db", "--auth-token-file", str(token))
    assert "characters: use a long random one" not in long_enough.log
