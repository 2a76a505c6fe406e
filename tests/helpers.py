"""Helpers the tests share: requests that must succeed, waiting for a
condition, another process holding a database's write lock, a small
file system, and a server that file modes hold back even as root."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from wire import Client, Reply

T = TypeVar("T")

# How often `until` looks again: often enough not to slow tests down, seldom
# enough not to load the server it asks.
POLL_INTERVAL = 0.01


def free_ports(count: int) -> list[int]:
    """`count` different ports nothing listens on, just released by the
    kernel: bound all at once, since two probes one after the other may be
    given the same port."""
    probes = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    """A port nothing listens on, just released by the kernel."""
    return free_ports(1)[0]


def ok(reply: Reply) -> Reply:
    """The reply, which must be `200 OK`."""
    assert reply.status == "200 OK", f"{reply.status} {reply.body!r}"
    return reply


def create(client: Client, name: str = "job", **params: Any) -> int:
    """CreateJob, which must succeed; the new job's ID."""
    reply = ok(client.request("CreateJob", name=name, **params))
    assert set(reply.json) == {"jobID"}, reply.json
    job_id = reply.json["jobID"]
    assert isinstance(job_id, int) and job_id > 0, job_id
    return job_id


def all_ok(port: int, requests: list[bytes], connections: int = 16) -> None:
    """Send the requests over `connections` connections at once, each its
    share pipelined, and check every reply is `200 OK`. A connection's
    requests are answered one transaction after another, so thousands of
    set-up requests on one connection cost a commit (and a sync) each; on
    several, the server commits them in shared batches."""
    shares = [requests[at::connections] for at in range(connections)]
    failures: list[BaseException] = []

    def run(share: list[bytes]) -> None:
        try:
            with Client(port, timeout=120) as client:
                client.send(b"".join(share))
                for _ in share:
                    ok(client.read_reply())
        except BaseException as failure:  # noqa: BLE001 -- raised in the caller
            failures.append(failure)

    threads = [threading.Thread(target=run, args=(share,)) for share in shares if share]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def until(check: Callable[[], T], timeout: float, what: str) -> T:
    """Call `check` until it returns something true, and return that; fail
    after `timeout` seconds, saying `what` was waited for."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_INTERVAL)


def answer_waits(ask: Callable[[], object], seconds: float) -> list[float]:
    """How long each answer took, sorted, asking again and again for
    `seconds` (a neighbour's view of a server under attack)."""
    waits = []
    until_at = time.monotonic() + seconds
    while time.monotonic() < until_at:
        began = time.monotonic()
        ask()
        waits.append(time.monotonic() - began)
    return sorted(waits)


def assert_answering(waits: list[float], what: str, ninth: float, worst: float) -> None:
    """Nine answers in ten within `ninth` seconds, and all within `worst`."""
    at_ninth = waits[int(0.9 * (len(waits) - 1))]
    assert at_ninth < ninth and waits[-1] < worst, (
        f"{what}: 90% within {at_ninth:.3f}s, worst {waits[-1]:.3f}s of {len(waits)}"
    )


LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
print("released", flush=True)
"""


@contextmanager
def locked(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the database's write lock until the block ends."""
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert locker.stdout is not None and locker.stdin is not None
    try:
        assert locker.stdout.readline() == "locked\n"
        yield locker
        locker.stdin.write("\n")
        locker.stdin.flush()
        assert locker.stdout.readline() == "released\n"
        assert locker.wait(10) == 0
    finally:
        if locker.poll() is None:
            locker.kill()
            locker.wait()


@contextmanager
def tmpfs(mountpoint: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `mountpoint` (root only: skips the test
    where mounting is not possible)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


WITHOUT_OVERRIDE = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def unprivileged() -> list[str]:
    """A wrapper (ServerProcess's `wrapper`) under which file modes hold:
    as root, setpriv without the capabilities that override them."""
    if os.geteuid() != 0:
        return []
    probe = subprocess.run([*WITHOUT_OVERRIDE, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("running as root without setpriv: file modes would be ignored")
    return WITHOUT_OVERRIDE


class HeldSync:
    """Wraps a store's sync so a test decides when it may proceed."""

    def __init__(self, store: Any) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self._sync = store.sync
        store.sync = self  # type: ignore[method-assign]

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(10), "the test never released the sync"
        self._sync()


def outside_address() -> str | None:
    """This machine's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


# Debian's Chromium, driven by Playwright (the pip package alone; its own
# browsers are never installed).
CHROMIUM = "/usr/bin/chromium"


@contextmanager
def chromium(*args: str) -> Iterator[Any]:
    """A headless Chromium launched with `args`. Without Chromium or
    Playwright the test is skipped, or fails under
    JOBSERVER_REQUIRE_BROWSER=1 (as in CI)."""
    missing = ""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "Playwright is not installed (pip install playwright)"
    if not missing and not os.access(CHROMIUM, os.X_OK):
        missing = f"no {CHROMIUM} (apt-get install chromium)"
    if missing:
        if os.environ.get("JOBSERVER_REQUIRE_BROWSER") == "1":
            pytest.fail(f"JOBSERVER_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield launched
        finally:
            launched.close()


def importable_module(
    directory: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str
) -> Path:
    """Write `source` as `module`.py in `directory` and put the directory on
    PYTHONPATH, so that worker processes started by the test import it."""
    (directory / f"{module}.py").write_text(source)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])
    )
    return directory
