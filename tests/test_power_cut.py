"""Power cuts: a write is acknowledged only once it would survive one.

The server runs under powercut.so (tests/powercut/powercut.c), which keeps
the image a disk would hold after a power cut: each file as of its last
fsync or fdatasync, nothing written since. Eight client threads create jobs
(CreateJob, CreateJobs), take them (GetJob) and finish them (FinishJob),
keeping a ledger of every write the server answered with 200. At a random
count of acknowledged writes the server is killed with SIGKILL: the power
goes. The image must hold the database file and pass SQLite's
quick_check, and a plain server on it must hold every acknowledged write:

- every job an acknowledged CreateJob or CreateJobs made exists, unless a
  FinishJob of it was sent and its reply lost;
- every job whose GetJob was acknowledged is RUNNING (not handed out
  again), unless the same;
- every job whose FinishJob was acknowledged is gone.

Each round continues on the previous round's image, the first on an empty
directory (so the file's creation is under test too). The same load with
`--synchronous NORMAL`, which does not sync commits one by one, must lose
writes: the harness can see a loss. Run with -s to see the figures.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import LoggedProcess, ServerProcess
from powercut import DONE_PREFIX, PARTIAL_PREFIX, SHIM_FAILED, BuildFailed, Disk, build
from wire import Client, Reply, encode

THREADS = 8
ROUNDS = 3
# Acknowledged writes before the power goes, drawn anew each round. The
# first round, on a new file, ends before SQLite's first checkpoint (1000
# pages of WAL, some 400 writes here): the file then holds only what
# switching it to WAL mode wrote, and the rest is in the WAL. Later rounds
# pass one checkpoint or a few, and stay within a second or two.
FIRST_KILL_AFTER = (1, 100)
KILL_AFTER = (600, 2000)
# Far above the few seconds a round takes on a loaded machine.
ROUND_TIMEOUT = 60.0
CLIENT_TIMEOUT = 10.0
PATTERN = "power/*"


@dataclass
class Ledger:
    """What the server acknowledged, across rounds, and the kill switch of
    the round under way."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    created: set[int] = field(default_factory=set)
    handed_out: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    # FinishJobs sent whose reply never came: carried out or not.
    finish_unknown: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    writes: int = 0  # acknowledged in this round
    target: int = 0
    pull_the_plug: Callable[[], None] = lambda: None
    killed: threading.Event = field(default_factory=threading.Event)

    def arm(self, target: int, pull_the_plug: Callable[[], None]) -> None:
        with self.lock:
            self.writes, self.target, self.pull_the_plug = 0, target, pull_the_plug
            self.killed.clear()

    def acknowledged(self, record: set[int], ids: list[int]) -> None:
        with self.lock:
            record.update(ids)
            self.writes += 1
            # Pulled by the thread that read the reply, at once: waiting
            # for another thread to notice would leave time for more
            # commits, and for a checkpoint that syncs them all by chance.
            if self.writes == self.target:
                self.pull_the_plug()
                self.killed.set()


def client_thread(index: int, port: int, seed: int, ledger: Ledger) -> None:
    """Writes until the server dies under it."""
    rng = random.Random(seed)
    try:
        with Client(port, CLIENT_TIMEOUT) as client:
            while True:
                one_write(index, rng, client, ledger)
    except (ConnectionError, TimeoutError):
        return  # the power went: the reply to the request under way is lost
    except Exception as error:  # noqa: BLE001 - reported by the test
        with ledger.lock:
            ledger.errors.append(f"thread {index}: {error!r}")


def one_write(index: int, rng: random.Random, client: Client, ledger: Ledger) -> None:
    draw = rng.random()
    if draw < 0.35:
        reply = expect(client.request("CreateJob", name=f"power/{index}", data={"by": index}))
        ledger.acknowledged(ledger.created, [reply.json["jobID"]])
    elif draw < 0.5:
        jobs = [{"name": f"power/{index}", "data": {"n": n}} for n in range(rng.randint(2, 5))]
        reply = expect(client.request("CreateJobs", jobs=jobs))
        ledger.acknowledged(ledger.created, reply.json["jobIDs"])
    else:
        reply = client.request("GetJob", name=PATTERN)
        if reply.status == "404 No job found":
            return
        job_id = expect(reply).json["jobID"]
        ledger.acknowledged(ledger.handed_out, [job_id])
        # Some jobs stay RUNNING for good: their hand-out must last too.
        if rng.random() < 0.85:
            finish(client, job_id, ledger)


def finish(client: Client, job_id: int, ledger: Ledger) -> None:
    with ledger.lock:
        ledger.finish_unknown.add(job_id)
    expect(client.request("FinishJob", jobID=job_id))
    with ledger.lock:
        ledger.finish_unknown.discard(job_id)
    ledger.acknowledged(ledger.finished, [job_id])


def expect(reply: Reply) -> Reply:
    if reply.status != "200 OK":
        raise AssertionError(f"{reply.status} {reply.body!r}")
    return reply


@dataclass
class Round:
    acknowledged: int  # writes acknowledged in the round
    # The database file's size at the start of the round, then the image's
    # database file and WAL, in bytes: only a checkpoint syncs the database
    # file again, so it grows in the image only when one ran.
    sizes: tuple[int, int, int]
    # What the image lacks, by kind: jobID lists.
    found: dict[str, list[int]]

    @property
    def losses(self) -> int:
        return sum(len(ids) for ids in self.found.values())


def power_cut_rounds(
    shim: Path, root: Path, start_server: Callable[..., ServerProcess], *extra: str
) -> list[Round]:
    """ROUNDS times: a server on the disk, the load, the power cut at a
    random moment, and the image checked by a plain server."""
    ledger = Ledger()
    rng = random.Random()
    directory = root / "disk-0"
    directory.mkdir()
    rounds = []
    reported: set[int] = set()  # a job lost stays lost in later rounds
    for number in range(ROUNDS):
        disk = Disk(shim, directory, root / f"shadow-{number}")
        start_size = size(directory / "jobs.db")
        server = start_server(directory / "jobs.db", *extra, wrapper=disk.wrapper())
        assert server.started, server.log
        target = rng.randint(*(KILL_AFTER if number else FIRST_KILL_AFTER))
        run_until_the_power_goes(server, ledger, target, rng)
        image = disk.image(root / f"disk-{number + 1}")
        assert (image / "jobs.db").is_file(), f"no database file: {os.listdir(image)}"
        sizes = (start_size, size(image / "jobs.db"), size(image / "jobs.db-wal"))
        assert quick_check(image, root / f"scratch-{number}") == ["ok"]
        found = compare(image, ledger, start_server)
        found = {kind: [i for i in ids if i not in reported] for kind, ids in found.items()}
        reported.update(*found.values())
        rounds.append(Round(ledger.writes, sizes, found))
        directory = image
    return rounds


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def run_until_the_power_goes(
    server: ServerProcess, ledger: Ledger, target: int, rng: random.Random
) -> None:
    assert server.port is not None
    ledger.arm(target, lambda: server.signal(signal.SIGKILL))
    threads = [
        threading.Thread(
            target=client_thread, args=(n, server.port, rng.randrange(2**32), ledger), daemon=True
        )
        for n in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    killed = ledger.killed.wait(ROUND_TIMEOUT)
    if not killed:
        server.signal(signal.SIGKILL)
    code = server.wait()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT * 2)
    assert not any(thread.is_alive() for thread in threads), "a client thread is stuck"
    assert not ledger.errors, ledger.errors
    assert killed, f"{ledger.writes} of {ledger.target} writes in {ROUND_TIMEOUT}s:\n{server.log}"
    assert code == -signal.SIGKILL, (
        f"exit status {code} (the shim's failure is {SHIM_FAILED}):\n{server.log}"
    )


def quick_check(image: Path, scratch: Path) -> list[str]:
    """SQLite's quick_check of the image, run on a copy: the server must be
    the first to open the image itself."""
    shutil.copytree(image, scratch)
    db = sqlite3.connect(scratch / "jobs.db")
    try:
        return [row[0] for row in db.execute("PRAGMA quick_check")]
    finally:
        db.close()


def compare(
    image: Path, ledger: Ledger, start_server: Callable[..., ServerProcess]
) -> dict[str, list[int]]:
    """A plain server opens the image; the acknowledged writes it lacks."""
    checker = start_server(image / "jobs.db")
    assert checker.started, checker.log
    assert checker.port is not None
    ids = sorted(ledger.created | ledger.handed_out | ledger.finished)
    states = query_states(checker.port, ids)
    checker.signal(signal.SIGTERM)
    assert checker.wait() == 0, checker.log
    found: dict[str, list[int]] = {"lost": [], "hand-out undone": [], "finish undone": []}
    for job_id in ids:
        state = states[job_id]
        if job_id in ledger.finished:
            if state is not None:
                found["finish undone"].append(job_id)
        elif job_id in ledger.finish_unknown:
            continue
        elif state is None:
            found["lost"].append(job_id)
        elif job_id in ledger.handed_out and state != "RUNNING":
            found["hand-out undone"].append(job_id)
    return found


def query_states(port: int, ids: list[int]) -> dict[int, str | None]:
    """QueryJob for each id, pipelined: its state, or None when there is none."""
    states: dict[int, str | None] = {}
    with Client(port, timeout=30) as client:
        for start in range(0, len(ids), 200):
            batch = ids[start : start + 200]
            client.send(b"".join(encode("QueryJob", {"jobID": job_id}) for job_id in batch))
            for job_id in batch:
                reply = client.read_reply()
                if reply.status == "404 No job with this jobID":
                    states[job_id] = None
                else:
                    states[job_id] = expect(reply).json["state"]
    return states


def report(title: str, rounds: list[Round], began: float) -> None:
    figures = "; ".join(
        f"{r.acknowledged} writes acknowledged, database file {r.sizes[0] // 1024}"
        f" -> {r.sizes[1] // 1024} KiB, WAL {r.sizes[2] // 1024} KiB, "
        + ", ".join(f"{kind} {len(ids)}" for kind, ids in r.found.items())
        for r in rounds
    )
    print(f"\n{title}: {len(rounds)} power cuts in {time.monotonic() - began:.1f}s: {figures}")


def test_the_server_loses_no_acknowledged_write_in_a_power_cut(
    powercut_shim: Path, start_server, tmp_path: Path
) -> None:
    began = time.monotonic()
    rounds = power_cut_rounds(powercut_shim, tmp_path, start_server)
    report("synchronous FULL", rounds, began)
    assert [r.found for r in rounds] == [
        {"lost": [], "hand-out undone": [], "finish undone": []}
    ] * ROUNDS


def test_without_a_sync_per_commit_a_power_cut_loses_acknowledged_writes(
    powercut_shim: Path, start_server, tmp_path: Path
) -> None:
    """The harness can fail: `--synchronous NORMAL` syncs the WAL only at
    checkpoints, so what was acknowledged since the last one is lost. (One
    round may lose nothing, if its kill follows a checkpoint's commit;
    all of them, practically never.)"""
    began = time.monotonic()
    rounds = power_cut_rounds(powercut_shim, tmp_path, start_server, "--synchronous", "NORMAL")
    report("synchronous NORMAL", rounds, began)
    assert sum(r.losses for r in rounds) > 0, [r.found for r in rounds]


# The shim itself: it must lose what was not synced, and only that.

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
        assert writer.matching("written", 1, ROUND_TIMEOUT), writer.log
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
