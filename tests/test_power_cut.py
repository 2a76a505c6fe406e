"""Power cuts: a write is acknowledged only once it would survive one.

powercut.so (tests/powercut/powercut.c) keeps the image a disk would hold
after a power cut: each file as of its last fsync or fdatasync, nothing
written since. These tests check the shim itself: it must lose what was
not synced, and only that.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from harness import START_TIMEOUT, LoggedProcess
from powercut import DONE_PREFIX, PARTIAL_PREFIX, BuildFailed, Disk, build

WRITER = """
import os, signal, sys

disk, outside = sys.argv[1:]

def write(name, data, sync=None, mode="wb", where=disk):
    with open(os.path.join(where, name), mode) as file:
        file.write(data)
        file.flush()
        if sync is not None:
            sync(file.fileno())

write("unsynced", b"lost")
write("synced", b"kept", os.fsync)
write("synced", b" then lost", mode="ab")
write("datasynced", b"kept", os.fdatasync)
write("existing", b" then lost", mode="ab")
write("deleted", b"synced", os.fsync)
os.unlink(os.path.join(disk, "deleted"))
write("moved", b"kept", os.fsync)
os.rename(os.path.join(disk, "moved"), os.path.join(disk, "renamed"))
write("moved unsynced", b"lost")
os.rename(os.path.join(disk, "moved unsynced"), os.path.join(disk, "renamed unsynced"))
write("outside", b"not modelled", os.fsync, where=outside)
print("written", file=sys.stderr, flush=True)
signal.pause()
"""


def test_the_shim_keeps_exactly_what_was_synced(powercut_shim: Path, tmp_path: Path) -> None:
    directory, outside = tmp_path / "disk", tmp_path / "outside"
    directory.mkdir()
    outside.mkdir()
    (directory / "existing").write_bytes(b"there before")
    disk = Disk(powercut_shim, directory, tmp_path / "shadow")
    writer = LoggedProcess(
        [*disk.wrapper(), sys.executable, "-c", WRITER, str(directory), str(outside)]
    )
    try:
        assert writer.matching("written", 1, START_TIMEOUT), writer.log
    finally:
        writer.kill()
    assert writer.proc.returncode == -signal.SIGKILL, writer.log
    # The program saw every write...
    assert contents(directory) == {
        "unsynced": b"lost",
        "synced": b"kept then lost",
        "datasynced": b"kept",
        "existing": b"there before then lost",
        "renamed": b"kept",
        "renamed unsynced": b"lost",
    }
    # ...the disk kept what was synced, as it was at the sync.
    assert contents(disk.image(tmp_path / "image")) == {
        "synced": b"kept",
        "datasynced": b"kept",
        "existing": b"there before",
        "renamed": b"kept",
    }
    # Nothing else: not the file outside the directory, no temporary copy.
    assert sorted(os.listdir(tmp_path / "shadow")) == sorted(contents(tmp_path / "image"))


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_an_image_takes_a_copy_completed_in_a_sync_cut_short(tmp_path: Path) -> None:
    """A kill in the middle of a sync leaves the shadow with a partial copy
    (the sync never returned: not durable) or a complete one not yet under
    its name (it is the file's image)."""
    directory = tmp_path / "disk"
    directory.mkdir()
    disk = Disk(tmp_path / "unused.so", directory, tmp_path / "shadow")
    for name, content in {
        "jobs.db": b"old",
        DONE_PREFIX + "jobs.db": b"new",
        "jobs.db-wal": b"old",
        PARTIAL_PREFIX + "jobs.db-wal": b"part",
        "jobs.db-shm": b"memory",
    }.items():
        (disk.shadow / name).write_bytes(content)
    assert contents(disk.image(tmp_path / "image")) == {"jobs.db": b"new", "jobs.db-wal": b"old"}


def test_without_gcc_the_shim_is_not_built_and_says_why(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildFailed, match="gcc not found"):
        build(tmp_path)
