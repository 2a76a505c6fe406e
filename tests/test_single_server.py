"""One server per SQLite file: a second one refuses to start, naming the first."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from harness import ThreadServer
from jobserver.storage import lockfile


def test_a_second_server_on_the_same_file_refuses_to_start(start_server, tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    first = start_server(db)
    with first.client() as client:
        assert client.request("CreateJob", name="kept").status == "200 OK"
    second = start_server(db)
    assert second.wait(10) == 2, second.log
    assert not second.started
    assert str(db) in second.log
    assert f"pid {first.proc.pid}, serving 127.0.0.1:{first.port}" in second.log, second.log
    assert "Traceback" not in second.log
    # The first goes on as if nothing happened.
    with first.client() as client:
        assert client.request("GetJob", name="kept").status == "200 OK"


def test_the_same_file_by_another_path_is_the_same_file(start_server, tmp_path: Path) -> None:
    first = start_server(tmp_path / "jobs.db")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link.db").symlink_to(tmp_path / "jobs.db")
    second = start_server(tmp_path / "elsewhere" / "link.db")
    assert second.wait(10) == 2, second.log
    assert f"pid {first.proc.pid}" in second.log


def test_a_killed_server_leaves_no_lock_behind(start_server, tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    first = start_server(db)
    first.kill()
    # Its lock file stays, but the lock went with the process.
    assert (tmp_path / "jobs.db.lock").exists()
    second = start_server(db)
    assert second.started, second.log
    second.signal(signal.SIGTERM)
    assert second.wait(10) == 0
    # A clean stop removes the file.
    assert not (tmp_path / "jobs.db.lock").exists()


def test_servers_on_different_files_run_side_by_side(start_server, tmp_path: Path) -> None:
    one = start_server(tmp_path / "one.db")
    two = start_server(tmp_path / "two.db")
    assert one.started and two.started


def test_two_servers_in_one_process_are_refused_too(tmp_path: Path) -> None:
    first = ThreadServer(tmp_path / "jobs.db")
    try:
        with pytest.raises(RuntimeError, match="DatabaseInUse") as refused:
            ThreadServer(tmp_path / "jobs.db")
        assert f"pid {os.getpid()}" in str(refused.value)
    finally:
        first.stop()


def test_a_killed_servers_words_are_not_taken_for_the_new_holders(tmp_path: Path) -> None:
    # Until the new holder announces itself (after opening the database,
    # which can take long), a second server must not name the dead one.
    db = tmp_path / "jobs.db"
    (tmp_path / "jobs.db.lock").write_text("pid 999999\naddress 127.0.0.1:1\n")
    holder = lockfile.acquire(str(db))
    try:
        with pytest.raises(lockfile.DatabaseInUse) as refused:
            lockfile.acquire(str(db))
        assert "999999" not in str(refused.value)
        assert "it may still be starting" in str(refused.value)
    finally:
        holder.release()
