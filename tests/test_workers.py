"""The worker manager, end to end: a real server, the manager as its own
process, and real worker executables written into a temporary directory.

Nothing sleeps for a fixed time: tests wait for the manager's log lines,
for files the workers write, or for the server's state, each with a
deadline. Worker scripts are POSIX sh unless they need Python.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance_helpers import force
from harness import MANAGER, ThreadServer
from helpers import create, ok, until
from jobserver.client import Client as LibraryClient
from jobserver.wire.framing import RequestParser
from jobserver.workers.contract import Refused, find_worker, json_object, retry_options
from jobserver.workers.guard import Held, hand_back
from jobserver.workers.leases import touch_period
from jobserver.workers.manager import LOAD_NOTICE_INTERVAL, Every, Manager
from tls_certs import tls_server
from wire import Client, Reply

DEADLINE = 15.0
REPO = Path(__file__).resolve().parent.parent


def write_worker(directory: Path, name: str, body: str, shell: str = "/bin/sh") -> Path:
    path = directory / name
    path.write_text(f"#!{shell}\n{body}")
    path.chmod(0o755)
    return path


def wait_for_file(path: Path) -> str:
    """Shell lines that wait (at most DEADLINE seconds) until `path` exists."""
    return f"""
i=0
while [ ! -e {path} ] && [ $i -lt {int(DEADLINE * 20)} ]; do sleep 0.05; i=$((i + 1)); done
"""


def python_worker(directory: Path, name: str, body: str) -> Path:
    return write_worker(
        directory, name, "import json, os, sys, time\n" + body, shell=sys.executable
    )


def query(client: Client, job_id: int) -> Reply:
    return client.request("QueryJob", jobID=job_id)


def job(client: Client, job_id: int) -> dict[str, Any]:
    reply = query(client, job_id)
    assert reply.code == 200, reply
    return reply.json


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def waiting_get_jobs(client: Client) -> int:
    return client.request("Status").json["waitingGetJobs"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our own child) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


# Mapping job names to executables (no server needed).


@pytest.mark.parametrize(
    ("name", "worker"),
    [
        ("SendEmail", "SendEmail"),
        ("www-prod/SendEmail", "SendEmail"),
        ("a/b/SendEmail?to=ann", "SendEmail"),
        ("SendEmail?x/y", "SendEmail"),
    ],
)
def test_the_last_component_of_the_name_without_its_query_names_the_worker(workers, name, worker):
    write_worker(workers, "SendEmail", "exit 0\n")
    assert find_worker(str(workers.resolve()), name) == str(workers.resolve() / worker)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "last component is empty"),
        ("www/", "last component is empty"),
        ("?only", "last component is empty"),
        (".", "not a file name"),
        ("www/..", "not a file name"),
        (".hidden", "hidden"),
        ("a/.profile?x", "hidden"),
        ("back\\slash", "backslash"),
        ("nul\0byte", "NUL"),
        ("nul\0in/the/prefix/SendEmail", "NUL"),
        ("Missing", "no worker"),
    ],
)
def test_names_that_name_no_usable_worker_are_refused(workers, name, reason):
    write_worker(workers, ".hidden", "exit 0\n")
    with pytest.raises(Refused, match=reason):
        find_worker(str(workers.resolve()), name)


@pytest.mark.parametrize(
    ("stdout", "params"),
    [
        (b'{"delay": 5}', {"delay": 5, "ignore_repeat": True}),
        (
            b'{"nextRun": "2030-01-01 00:00:00"}',
            {"next_run": "2030-01-01 00:00:00", "ignore_repeat": True},
        ),
        (
            b'{"delay": 5, "nextRun": "2030-01-01"}',
            {"next_run": "2030-01-01", "ignore_repeat": True},
        ),
        (b'{"delay": -1}', {}),
        (b'{"delay": 1.5}', {}),
        (b'{"delay": true}', {}),
        (b"not json", {}),
        (b"", {}),
    ],
)
def test_retry_options_come_from_a_json_object_on_stdout(stdout, params):
    assert retry_options(stdout)[0] == params


@pytest.mark.parametrize(
    ("stdout", "data"),
    [
        (b'{"a": [1, 2.5, null], "b": "\\u00e9"}\n', {"a": [1, 2.5, None], "b": "\u00e9"}),
        (b"[1, 2]", None),
        (b'"text"', None),
        (b'{"a": NaN}', None),
        (b'{"a": Infinity}', None),
        (b"\xff", None),
        (b"[" * 100_000, None),
    ],
)
def test_only_a_strict_json_object_on_stdout_counts(stdout, data):
    assert json_object(stdout) == data


def test_a_worker_path_that_is_not_a_directory_is_exit_status_2(tmp_path):
    done = subprocess.run(
        [sys.executable, *MANAGER, "--worker-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 2
    assert "is not a directory" in done.stderr


# Results.


def test_exit_0_finishes_and_a_json_object_on_stdout_becomes_the_data(
    server, client, workers, manager
):
    python_worker(
        workers,
        "Echo",
        """
job = json.load(sys.stdin)
print(json.dumps({"seen": job["data"], "id": os.environ["JOB_ID"], "name": os.environ["JOB_NAME"],
                  "server": os.environ["JOBSERVER_SERVER"]}))
""",
    )
    write_worker(workers, "Plain", "cat >/dev/null; echo 'not a JSON object'\n")
    echo = create(client, "www-prod/Echo?lang=en", data={"n": 1}, repeat="FINISHED, +1 HOUR")
    plain = create(client, "Plain", data={"keep": True}, repeat="FINISHED, +1 HOUR")
    once = create(client, "Echo", data={"n": 2})
    running = manager(server.port)

    line = running.wait_for(rf"job {echo} www-prod/Echo\?lang=en finished in [\d.]+s")
    assert line
    running.wait_for(rf"job {plain} Plain finished in")
    running.wait_for(rf"job {once} Echo finished in")
    until(lambda: job(client, echo)["data"] != {"n": 1}, DEADLINE, "FinishJob of the repeating job")
    assert job(client, echo)["data"] == {
        "seen": {"n": 1},
        "id": str(echo),
        "name": "www-prod/Echo?lang=en",
        "server": f"127.0.0.1:{server.port}",
    }
    assert job(client, echo)["state"] == "QUEUED"
    until(lambda: job(client, plain)["state"] == "QUEUED", DEADLINE, "FinishJob of Plain")
    assert job(client, plain)["data"] == {"keep": True}
    until(lambda: query(client, once).code == 404, DEADLINE, "the non-repeating job to be deleted")


def test_exit_75_retries_with_the_delay_or_next_run_from_stdout(server, client, workers, manager):
    write_worker(workers, "Later", "cat >/dev/null; echo '{\"delay\": 30}'; exit 75\n")
    write_worker(
        workers,
        "Tomorrow",
        'cat >/dev/null; echo \'{"nextRun": "2030-01-01 04:00:00"}\'; exit 75\n',
    )
    later = create(client, "Later", data={"a": 1}, repeat="FINISHED, +1 DAY")
    tomorrow = create(client, "Tomorrow")
    before = datetime.now(UTC)
    running = manager(server.port)

    running.wait_for(rf"job {later} Later retried \(delay 30s\) in")
    running.wait_for(rf"job {tomorrow} Tomorrow retried \(nextRun 2030-01-01 04:00:00\) in")
    until(lambda: job(client, later)["state"] == "QUEUED", DEADLINE, "RetryJob of Later")
    retried = job(client, later)
    assert retried["data"] == {"a": 1}
    # The worker's delay wins over the job's repeat (+1 DAY).
    ahead = utc(retried["nextRun"]) - before
    assert timedelta(seconds=25) < ahead < timedelta(seconds=40)
    until(lambda: job(client, tomorrow)["state"] == "QUEUED", DEADLINE, "RetryJob of Tomorrow")
    assert job(client, tomorrow)["nextRun"] == "2030-01-01 04:00:00"


def test_other_exits_and_signals_fail_the_job_keeping_the_end_of_stderr(
    server, client, workers, manager
):
    # Far more stderr than is kept; and a flood on stdout, which is bounded.
    python_worker(
        workers,
        "Crash",
        """
sys.stdin.read()
sys.stdout.write("x" * 3_000_000)
sys.stderr.write("noise " * 50_000 + "Traceback: it broke")
sys.exit(3)
""",
    )
    write_worker(workers, "Segfault", "cat >/dev/null; echo 'about to crash' >&2; kill -SEGV $$\n")
    crash = create(client, "Crash", data={"orig": 1})
    segv = create(client, "Segfault")
    running = manager(server.port)

    running.wait_for(rf"job {crash} Crash failed \(exit status 3; no retry policy: FAILED\) in")
    running.wait_for(rf"job {segv} Segfault failed \(signal SIGSEGV; no retry policy: FAILED\) in")
    until(lambda: job(client, crash)["state"] == "FAILED", DEADLINE, "FailJob of Crash")
    data = job(client, crash)["data"]
    assert data["orig"] == 1
    assert data["error"]["exitStatus"] == 3
    assert data["error"]["stderr"].endswith("noise Traceback: it broke")
    assert len(data["error"]["stderr"]) == 2000
    until(lambda: job(client, segv)["state"] == "FAILED", DEADLINE, "FailJob of Segfault")
    assert job(client, segv)["data"] == {
        "error": {"signal": "SIGSEGV", "stderr": "about to crash\n"}
    }


def test_a_worker_past_the_timeout_is_killed_with_its_process_group_and_its_job_failed(
    server, client, workers, manager, tmp_path
):
    # It ignores SIGTERM (and so does its child), so only SIGKILL ends it.
    write_worker(
        workers,
        "Stuck",
        f"""
trap '' TERM
sleep 60 &
echo $! > {tmp_path}/child.pid
echo $$ > {tmp_path}/worker.pid
wait
""",
    )
    stuck = create(client, "Stuck", data={"x": 1}, repeat="FINISHED, +1 DAY")
    running = manager(server.port, "--worker-timeout", "1", "--max-iterations", "1")

    running.wait_for(
        rf"job {stuck} Stuck failed \(timed out after 1s \(worker killed\); "
        r"no retry policy: FAILED\) in"
    )
    assert running.wait(DEADLINE) == 0
    assert not alive(int((tmp_path / "worker.pid").read_text()))
    assert not alive(int((tmp_path / "child.pid").read_text()))
    # Without a retry policy a timeout fails the job like any failure,
    # repeat or not, and leaves its data as it was.
    failed = job(client, stuck)
    assert (failed["state"], failed["data"]) == ("FAILED", {"x": 1})
    [dead] = client.request("FailedJobs").json["jobs"]
    assert (dead["jobID"], dead["lastError"]) == (stuck, "timed out after 1s (worker killed)")


def test_a_timeout_is_a_failed_attempt_of_the_jobs_retry_policy(
    server, client, workers, manager, tmp_path
):
    starts = tmp_path / "starts"
    python_worker(
        workers,
        "Hangs",
        f"""
job = json.load(sys.stdin)
with open("{starts}", "a") as log:
    log.write(f"{{job['attempt']}} {{time.time()}}\\n")
time.sleep(60)
""",
    )
    hangs = create(client, "Hangs", maxAttempts=2, retryBackoff="fixed", retryDelay=3)
    running = manager(server.port, "--worker-timeout", "0.5")

    running.wait_for(
        rf"job {hangs} Hangs failed \(timed out after 0.5s \(worker killed\); attempt", 2
    )
    until(
        lambda: job(client, hangs)["state"] == "FAILED",
        DEADLINE,
        "the second timeout to kill the job",
    )
    dead = job(client, hangs)
    assert (dead["attempt"], dead["lastError"]) == (2, "timed out after 0.5s (worker killed)")
    attempts = [line.split() for line in starts.read_text().splitlines()]
    assert [attempt for attempt, _ in attempts] == ["1", "2"]
    # The second attempt waited for the backoff (3 s) after the first timed out
    # (0.5 s after the manager started it; its log line is written once its
    # Python has started, up to half a second later on a busy machine).
    assert float(attempts[1][1]) - float(attempts[0][1]) >= 3 - 0.1
    # Dead for good: nothing runs it again.
    assert len(re.findall(rf"job {hangs} Hangs", running.log)) == 2


def test_missing_workers_and_unsafe_names_fail_the_job_and_run_nothing(
    server, client, workers, manager, tmp_path
):
    marker = tmp_path / "escaped"
    outside = write_worker(tmp_path, "evil", f"touch {marker}\n")
    write_worker(workers, ".hidden", f"touch {marker}\n")
    (workers / "Link").symlink_to(outside)
    (workers / "NotExecutable").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (workers / "Folder").mkdir()
    cases = {
        "NoSuchWorker": "no worker",
        "../evil": "no worker",  # only the last component counts: workers/evil
        ".hidden": "hidden",
        "x/..": "not a file name",
        "trailing/": "last component is empty",
        "Link": "outside the worker path",
        "NotExecutable": "not executable",
        "Folder": "not a file",
        # On the wire `\\` is one backslash (header values are unescaped).
        "back\\\\slash": "backslash",
    }
    ids = {create(client, name, data={"keep": 1}): reason for name, reason in cases.items()}
    # The server refuses control characters in names; a database written
    # before it did may still hold them.
    legacy = {
        # A NUL could not be passed in JOB_NAME.
        "nul\x00/Folder": "NUL",
        # A line break must not split the log line.
        "No\nSuch": "no worker",
    }
    for name, reason in legacy.items():
        job_id = create(client, "placeholder", data={"keep": 1})
        force(server.db, "UPDATE jobs SET name = ? WHERE jobID = ?", (name, job_id))
        ids[job_id] = reason
    running = manager(server.port, "--max-workers", "16", "--max-iterations", "1")
    assert running.wait(DEADLINE) == 0
    for job_id, reason in ids.items():
        failed = job(client, job_id)
        assert failed["state"] == "FAILED", failed
        assert failed["data"]["keep"] == 1
        assert reason in failed["data"]["error"], failed
        assert re.search(rf"job {job_id} .* failed \(.*{reason}", running.log)
    assert not marker.exists()
    assert re.search(
        r"job \d+ No\\nSuch failed \(no worker .*/No\\nSuch; no retry policy: FAILED\) in",
        running.log,
    )


def test_no_more_than_max_workers_run_at_once(server, client, workers, manager, tmp_path):
    spans = tmp_path / "spans"
    spans.mkdir()
    python_worker(
        workers,
        "Slow",
        f"""
start = time.monotonic()
time.sleep(0.3)
open("{spans}/" + os.environ["JOB_ID"], "w").write(f"{{start}} {{time.monotonic()}}")
""",
    )
    ids = [create(client, "Slow") for _ in range(6)]
    running = manager(server.port, "--max-workers", "2")
    running.wait_for(r"job \d+ Slow finished", count=6)
    intervals = [tuple(map(float, (spans / str(i)).read_text().split())) for i in ids]
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak == 2


def test_no_jobs_are_taken_while_the_load_average_is_at_or_above_max_load(
    server, client, workers, manager
):
    if os.getloadavg()[0] == 0:
        pytest.skip("the load average is exactly 0 here")
    write_worker(workers, "Never", "exit 0\n")
    never = create(client, "Never")
    running = manager(server.port, "--max-load", "1e-9")
    assert re.search(r"at most \d+ at once, load below 1e-09\n", running.log)
    running.wait_for(
        r"load average [\d.]+ is at or above --max-load 1e-09: taking no jobs until it drops"
    )
    assert waiting_get_jobs(client) == 0
    assert job(client, never)["state"] == "QUEUED"
    running.signal(signal.SIGTERM)
    assert running.wait(DEADLINE) == 0
    assert job(client, never)["state"] == "QUEUED"


def test_without_max_load_the_load_average_does_not_hold_jobs_back(
    server, client, workers, manager
):
    write_worker(workers, "Runs", "cat >/dev/null; exit 0\n")
    runs = create(client, "Runs")
    running = manager(server.port)
    assert re.search(r"at most \d+ at once, no load limit\n", running.log)
    running.wait_for(rf"job {runs} Runs finished in")
    assert "load average" not in running.log


def test_every_lets_a_thing_happen_at_most_once_per_interval():
    every = Every(60)
    assert [every.ready(t) for t in (100, 100, 159.9, 160, 200, 219.9, 220.5)] == [
        True, False, False, True, False, False, True
    ]


class LoadedManager(Manager):
    """A manager on a host whose load average is `load`."""

    load = 5.0

    def _load(self) -> float:
        return self.load


async def test_the_load_notice_is_logged_at_most_once_a_minute(autojump_clock, caplog, tmp_path):
    manager = LoadedManager(
        servers=(("127.0.0.1", 1),), directory=str(tmp_path), pattern="*", max_load=2.0,
        max_workers=3, worker_timeout=60, max_iterations=None, grace=0,
    )
    caplog.set_level("INFO", logger="jobserver.workers")
    started = trio.current_time()

    async def load_drops_after(seconds: float) -> None:
        await trio.sleep(seconds)
        manager.load = 1.0

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load_drops_after, 2.5 * LOAD_NOTICE_INTERVAL)
        assert await manager.free_slots() == 3
    waited = trio.current_time() - started
    assert 2.5 * LOAD_NOTICE_INTERVAL <= waited <= 2.5 * LOAD_NOTICE_INTERVAL + 1.5
    notices = [r.getMessage() for r in caplog.records if "load average" in r.getMessage()]
    # At 0, 60 and 120 seconds: three in two and a half minutes, not 150.
    assert notices == [
        "load average 5.00 is at or above --max-load 2: taking no jobs until it drops"
    ] * 3


def test_a_job_created_while_the_manager_waits_starts_at_once(
    server, client, workers, manager, tmp_path
):
    started = tmp_path / "started"
    python_worker(workers, "Quick", f'open("{started}", "w").write(str(time.time()))\n')
    manager(server.port)
    until(lambda: waiting_get_jobs(client) == 1, DEADLINE, "the manager's blocking GetJobs")
    created = time.time()
    create(client, "Quick")
    until(started.exists, 5, "the worker to start")
    until(lambda: started.read_text() != "", DEADLINE, "the worker to write its start time")
    assert float(started.read_text()) - created < 1.0


# Stopping.


def test_sigterm_lets_a_running_worker_finish_and_takes_no_more_jobs(
    server, client, workers, manager, tmp_path
):
    started, proceed = tmp_path / "started", tmp_path / "proceed"
    write_worker(
        workers,
        "Drain",
        f"""
cat >/dev/null
touch {started}
{wait_for_file(proceed)}
echo '{{"drained": true}}'
""",
    )
    drain = create(client, "Drain", repeat="FINISHED, +1 HOUR")
    running = manager(server.port, "--grace", "20")
    until(started.exists, DEADLINE, "the worker to start")
    running.signal(signal.SIGTERM)
    running.wait_for("received SIGTERM: taking no more jobs")
    until(lambda: waiting_get_jobs(client) == 0, DEADLINE, "the blocking GetJobs to be cancelled")
    late = create(client, "Drain")
    proceed.touch()
    assert running.wait(DEADLINE) == 0
    assert job(client, drain)["data"] == {"drained": True}
    assert job(client, late)["state"] == "QUEUED"
    assert re.search(rf"job {drain} Drain finished in", running.log)


def test_workers_still_running_after_the_grace_period_are_stopped_and_retried(
    server, client, workers, manager, tmp_path
):
    started, termed = tmp_path / "started", tmp_path / "termed"
    write_worker(
        workers,
        "Long",
        f"""
trap 'touch {termed}; exit 1' TERM
cat >/dev/null
touch {started}
sleep 60 &
wait
""",
    )
    long = create(client, "Long", data={"x": 1})
    running = manager(server.port, "--grace", "0.5")
    until(started.exists, DEADLINE, "the worker to start")
    running.signal(signal.SIGTERM)
    assert running.wait(DEADLINE) == 0
    assert termed.exists()  # it got SIGTERM first
    assert re.search(
        rf"job {long} Long still running at the end of the grace period, killed, retried",
        running.log,
    )
    retried = job(client, long)
    assert (retried["state"], retried["data"]) == ("QUEUED", {"x": 1})


def test_a_second_signal_kills_the_workers_and_exits_at_once(
    server, client, workers, manager, tmp_path
):
    pids = tmp_path / "pids"
    write_worker(
        workers,
        "Forever",
        f"""
cat >/dev/null
sleep 60 &
echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}
wait
""",
    )
    forever = create(client, "Forever")
    running = manager(server.port, "--grace", "60")
    until(pids.exists, DEADLINE, "the worker to start")
    running.signal(signal.SIGTERM)
    running.wait_for("received SIGTERM")
    running.signal(signal.SIGINT)
    assert running.wait(5) == 1
    assert not any(alive(int(pid)) for pid in pids.read_text().split())
    assert re.search(rf"job {forever} Forever abandoned", running.log)
    # Its guard hands the job back.
    running.wait_for(rf"worker guard: job {forever} handed back to the queue")
    assert job(client, forever)["state"] == "QUEUED"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600) | st.sampled_from([b"job 1 ab", b"done 1", b"group 9", b"reaped 9"]))
def test_the_guard_takes_only_the_lines_the_manager_writes(line):
    held = Held(jobs={1: "ab"}, groups={9})
    if not held.apply(line):
        assert held == Held(jobs={1: "ab"}, groups={9})


def test_the_guard_reads_its_lines_and_hands_back_only_jobs_still_held_by_their_lease(
    server, client
):
    held = Held()
    for line in [b"job 5 aa\n", b"group 77\n", b"job 6 bb\n", b"done 5\n", b"reaped 77\n"]:
        assert held.apply(line)
    assert held == Held(jobs={6: "bb"}, groups=set())
    for bad in [b"job 5\n", b"group 0\n", b"group 1\n", b"group -3\n",
                b"reaped 9223372036854775808\n", b"done 5 x\n", b"kill 5\n", b"job \xff 1\n",
                b""]:
        assert not held.apply(bad)
    ours, moved = create(client, "Mine"), create(client, "Moved")
    leases = {}
    for job_id in (ours, moved):
        taken = client.request("GetJob", name="Mine" if job_id == ours else "Moved",
                               includeLeaseID="true").json
        leases[job_id] = taken["leaseID"]
    # Requeued and handed to another worker since: its old lease is refused.
    assert client.request("RequeueJobs", jobIDs=str(moved)).status == "200 OK"
    assert client.request("GetJob", name="Moved").json["jobID"] == moved
    with LibraryClient("127.0.0.1", server.port, timeout=10) as library:
        hand_back(library, leases)
    assert job(client, ours)["state"] == "QUEUED"
    assert job(client, moved)["state"] == "RUNNING"


def test_workers_die_with_a_killed_manager_and_its_jobs_come_back_at_once(
    server, client, workers, manager, tmp_path
):
    # The first run hangs, with a child in its process group; the second finishes.
    pids, ran = tmp_path / "pids", tmp_path / "ran"
    write_worker(
        workers,
        "Slow",
        f"""
cat >/dev/null
if [ -e {ran} ]; then echo '{{"done": true}}'; exit 0; fi
touch {ran}
sleep 60 &
echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}
wait
""",
    )
    slow = create(client, "Slow", data={"x": 1}, repeat="FINISHED, +1 HOUR")
    first = manager(server.port)
    until(pids.exists, DEADLINE, "the worker to start")
    assert job(client, slow)["state"] == "RUNQUEUED"
    first.proc.kill()
    first.wait(DEADLINE)
    worker_pids = [int(pid) for pid in pids.read_text().split()]
    until(lambda: not any(alive(pid) for pid in worker_pids), DEADLINE,
          "the worker and its child to die with their manager")
    # Within seconds, where it would have waited for --stale-after (24 h).
    until(lambda: job(client, slow)["state"] == "QUEUED", DEADLINE, "the job to be handed back")
    assert job(client, slow)["data"] == {"x": 1}  # as it was, due now
    second = manager(server.port)
    second.wait_for(rf"job {slow} Slow finished in")
    until(lambda: job(client, slow)["data"] == {"done": True}, DEADLINE, "FinishJob")


def test_data_the_server_refuses_is_left_out_rather_than_losing_the_result(
    server, client, workers, manager
):
    # The job's data plus the error detail is over the server's 1 MiB limit.
    write_worker(workers, "Big", "cat >/dev/null; echo oops >&2; exit 1\n")
    big = create(client, "Big", data={"blob": "x" * (1024 * 1024 - 20)})
    running = manager(server.port)
    running.wait_for(
        rf"job {big} Big: the server refused FailJob "
        r"\(402 Data too large \(1048576 bytes at most\)\); "
        "sending it without data"
    )
    until(lambda: job(client, big)["state"] == "FAILED", DEADLINE, "the bare FailJob")
    assert job(client, big)["data"] == {"blob": "x" * (1024 * 1024 - 20)}


# The server going away.


def test_results_are_held_while_the_server_is_down_and_reported_once_it_is_back(
    start_server, tmp_path, workers, manager
):
    started, proceed = tmp_path / "started", tmp_path / "proceed"
    write_worker(
        workers,
        "Survivor",
        f"""
cat >/dev/null
touch {started}
{wait_for_file(proceed)}
echo '{{"after": "restart"}}'
""",
    )
    write_worker(workers, "Next", "cat >/dev/null; echo '{\"next\": true}'\n")
    first = start_server()
    port, db = first.port, first.db
    with first.client() as c:
        survivor = create(c, "Survivor", repeat="FINISHED, +1 HOUR")
    running = manager(port, "--max-workers", "2")
    until(started.exists, DEADLINE, "the worker to start")

    first.kill()
    running.wait_for(r"cannot get jobs \(.*\); running workers carry on, retrying with backoff")
    proceed.touch()
    running.wait_for(rf"job {survivor} Survivor finished in")
    running.wait_for(rf"cannot report job {survivor} .*holding 1 results")

    second = start_server(db, "--port", str(port))
    running.wait_for(rf"server 127.0.0.1:{port} reachable again; reported job {survivor}")
    running.wait_for(rf"server 127.0.0.1:{port} reachable again; taking jobs")
    with second.client() as c:
        assert job(c, survivor)["data"] == {"after": "restart"}
        assert job(c, survivor)["state"] == "QUEUED"
        # Fetching came back too.
        after = create(c, "Next", repeat="FINISHED, +1 HOUR")
        running.wait_for(rf"job {after} Next finished in")
        until(
            lambda: job(c, after)["data"] == {"next": True},
            DEADLINE,
            "the job created after the restart",
        )
    assert "already reported" not in running.log
    assert len(re.findall(rf"job {survivor} Survivor finished", running.log)) == 1


# The examples in examples/workers.


def test_the_example_workers(server, client, manager):
    examples = REPO / "examples" / "workers"
    email = create(
        client, "www-prod/SendEmail", data={"to": "ann@example.com"}, repeat="FINISHED, +1 HOUR"
    )
    resize = create(client, "ResizeImage", data={"path": "/nonexistent/cat.png"})
    before = datetime.now(UTC)
    running = manager(server.port, "--max-iterations", "1", worker_path=examples)
    assert running.wait(DEADLINE) == 0
    sent = job(client, email)
    assert sent["data"]["to"] == "ann@example.com"
    assert "sentAt" in sent["data"]
    retried = job(client, resize)
    assert retried["state"] == "QUEUED"
    assert timedelta(seconds=3) < utc(retried["nextRun"]) - before < timedelta(seconds=10)
    assert re.search(rf"job {resize} ResizeImage retried \(delay 5s\)", running.log)


def reported(request: bytes) -> tuple[str, list[int]]:
    """The verb of a request, and the jobs it reports on (finished, failed
    or put back)."""
    [parsed] = RequestParser().feed(request)
    if parsed.verb in ("FinishJob", "FailJob", "RetryJob"):
        return parsed.verb, [int(parsed.headers["jobid"])]
    if parsed.verb in ("FinishJobs", "FailJobs", "RetryJobs"):
        return parsed.verb, [element["jobID"] for element in json.loads(parsed.headers["jobs"])]
    return parsed.verb, []


class Relay:
    """A TCP proxy in front of the server: each request of a connection is
    passed on and its reply passed back, one at a time, through `exchange`."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(downstream,), daemon=True).start()

    def _relay(self, downstream: socket.socket) -> None:
        with downstream, socket.create_connection(("127.0.0.1", self.target)) as upstream:
            requests, replies = b"", Client.__new__(Client)
            replies.sock, replies.buffer = upstream, b""
            while True:
                while b"\r\n\r\n" not in requests:
                    chunk = downstream.recv(65536)
                    if not chunk:
                        return
                    requests += chunk
                request, requests = requests.split(b"\r\n\r\n", 1)
                request += b"\r\n\r\n"

                def forward(request: bytes = request) -> Reply:
                    upstream.sendall(request)
                    return replies.read_reply()

                answer = self.exchange(request, forward)
                if answer is None:
                    return
                head = [answer.status] + [f"{k}: {v}" for k, v in answer.headers.items()]
                downstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + answer.body)

    def exchange(self, request: bytes, forward: Callable[[], Reply]) -> Reply | None:
        """The reply to pass back, or None to cut the connection."""
        return forward()

    def close(self) -> None:
        self.listener.close()


class ReplyDropper(Relay):
    """Forwards the first report of each finished job (FinishJob or
    FinishJobs), waits for the server's reply, and then cuts the connection
    instead of passing the reply on: the report was carried out, but the
    manager cannot know."""

    def __init__(self, port: int) -> None:
        self.dropped: list[int] = []
        super().__init__(port)

    def exchange(self, request: bytes, forward: Callable[[], Reply]) -> Reply | None:
        reply = forward()
        _, jobs = reported(request)
        if any(job_id not in self.dropped for job_id in jobs):
            self.dropped.extend(jobs)
            return None
        return reply


class ReportGate(Relay):
    """Holds the first FinishJob until `open()`, so that the results of
    jobs that end meanwhile wait together; records every report. With
    `knows_finish_jobs` false it answers FinishJobs as an older server
    would, without passing it on; with `lose_batch`, it cuts the connection
    instead of passing on the reply to the first FinishJobs."""

    def __init__(self, port: int, knows_finish_jobs: bool = True, lose_batch: bool = False) -> None:
        self.knows_finish_jobs = knows_finish_jobs
        self.lose_batch = lose_batch
        self.reports: list[tuple[str, list[int]]] = []
        self.held = threading.Event()  # the first FinishJob has arrived
        self.opened = threading.Event()
        super().__init__(port)

    def open(self) -> None:
        self.opened.set()

    def exchange(self, request: bytes, forward: Callable[[], Reply]) -> Reply | None:
        verb, jobs = reported(request)
        if jobs:
            self.reports.append((verb, jobs))
        if verb == "FinishJob" and not self.held.is_set():
            self.held.set()
            assert self.opened.wait(DEADLINE), "the gate was never opened"
        if verb == "FinishJobs" and not self.knows_finish_jobs:
            return Reply("430 Unrecognized command", {"Content-Length": "0"}, b"")
        reply = forward()
        if verb == "FinishJobs" and self.lose_batch:
            self.lose_batch = False
            return None
        return reply


def test_a_report_whose_reply_was_lost_is_sent_again_and_not_applied_twice(
    server, client, workers, manager
):
    write_worker(workers, "Done", "cat >/dev/null; echo '{\"done\": 1}'\n")
    once = create(client, "Done")
    repeating = create(client, "Done", repeat="FINISHED, +1 HOUR")
    proxy = ReplyDropper(server.port)
    try:
        running = manager(proxy.port)
        # Sent again: the job is gone (404) or no longer RUNNING (405).
        running.wait_for(rf"job {once} Done: already reported \(404 No job with this jobID")
        running.wait_for(
            rf"job {repeating} Done: already reported "
            r"\(405 Can only retry/finish RUNNING and RUNQUEUED jobs"
        )
    finally:
        proxy.close()
    assert sorted(proxy.dropped) == sorted([once, repeating])
    assert query(client, once).code == 404
    assert job(client, repeating)["data"] == {"done": 1}
    assert job(client, repeating)["state"] == "QUEUED"
    assert "refused" not in running.log


# Results that wait together go as one FinishJobs.


def _gated_jobs(client: Client, workers: Path, release: Path) -> tuple[int, list[int]]:
    """A job whose worker ends at once, and three whose workers end when
    `release` exists, each leaving its jobID in its data."""
    write_worker(workers, "Quick", "cat >/dev/null\n")
    held_body = wait_for_file(release) + 'echo "{\\"held\\": $JOB_ID}"\n'
    write_worker(workers, "Held", "cat >/dev/null\n" + held_body)
    quick = create(client, "Quick")
    return quick, [create(client, "Held", repeat="FINISHED, +1 HOUR") for _ in range(3)]


def test_results_that_wait_together_are_reported_in_one_finish_jobs(
    server, client, workers, manager, tmp_path
):
    release = tmp_path / "release"
    quick, held = _gated_jobs(client, workers, release)
    gate = ReportGate(server.port)
    try:
        running = manager(gate.port, "--max-workers", "4", "--job-name", "Quick,Held")
        assert gate.held.wait(DEADLINE), "no FinishJob came"
        until(lambda: all(job(client, j)["state"] == "RUNQUEUED" for j in held), DEADLINE,
              "the held jobs to run")
        # Meanwhile another worker takes one of them (renamed, so that the
        # manager's free slot does not): its result will be refused.
        ok(client.request("RequeueJobs", jobIDs=str(held[0]), name="Stolen"))
        assert ok(client.request("GetJob", name="Stolen")).json["jobID"] == held[0]
        release.touch()
        running.wait_for(r"job \d+ Held finished in", count=3)
        gate.open()
        running.wait_for(
            rf"job {held[0]} Held: FinishJob refused \(409 Lease expired\): another worker"
        )
        for taken in held[1:]:
            until(lambda taken=taken: job(client, taken)["data"] == {"held": taken}, DEADLINE,
                  "the batch to be finished")
    finally:
        gate.open()
        gate.close()
    assert gate.reports[0] == ("FinishJob", [quick])
    [(verb, batch)] = gate.reports[1:]
    assert verb == "FinishJobs" and sorted(batch) == held
    assert job(client, held[0])["state"] == "RUNNING"
    assert query(client, quick).code == 404


def test_a_finish_jobs_whose_reply_was_lost_is_sent_again_and_not_applied_twice(
    server, client, workers, manager, tmp_path
):
    release = tmp_path / "release"
    _, held = _gated_jobs(client, workers, release)
    gate = ReportGate(server.port, lose_batch=True)
    try:
        running = manager(gate.port, "--max-workers", "4")
        assert gate.held.wait(DEADLINE), "no FinishJob came"
        release.touch()
        running.wait_for(r"job \d+ Held finished in", count=3)
        gate.open()
        running.wait_for(r"cannot report job \d+ .*holding 3 results")
        # Each job, queued again for its next run by the first FinishJobs:
        running.wait_for(
            r"job \d+ Held: already reported "
            r"\(405 Can only retry/finish RUNNING and RUNQUEUED jobs after a reply was lost\)",
            count=3,
        )
    finally:
        gate.open()
        gate.close()
    [first, again] = gate.reports[1:]
    assert first == again and first[0] == "FinishJobs" and sorted(first[1]) == held
    for taken in held:
        assert job(client, taken)["data"] == {"held": taken}
    assert "refused" not in running.log


def test_a_server_without_finish_jobs_gets_each_result_alone(
    server, client, workers, manager, tmp_path
):
    release = tmp_path / "release"
    quick, held = _gated_jobs(client, workers, release)
    gate = ReportGate(server.port, knows_finish_jobs=False)
    try:
        running = manager(gate.port, "--max-workers", "4")
        assert gate.held.wait(DEADLINE), "no FinishJob came"
        release.touch()
        running.wait_for(r"job \d+ Held finished in", count=3)
        gate.open()
        running.wait_for(
            r"does not take FinishJobs \(430 Unrecognized command\); reporting each job alone"
        )
        for taken in held:
            until(lambda taken=taken: job(client, taken)["data"] == {"held": taken}, DEADLINE,
                  "each result to be reported")
    finally:
        gate.open()
        gate.close()
    assert gate.reports[0] == ("FinishJob", [quick])
    verbs = [verb for verb, _ in gate.reports]
    assert verbs == ["FinishJob", "FinishJobs", "FinishJob", "FinishJob", "FinishJob"]
    assert [jobs for _, jobs in gate.reports[2:]] == [[j] for j in gate.reports[1][1]]
    assert "refused" not in running.log


def test_failures_and_retries_that_wait_together_go_as_one_fail_jobs_and_one_retry_jobs(
    server, client, workers, manager, tmp_path
):
    """A burst of failures costs what a burst of successes costs: the
    reports that wait together go as one request per kind, not one each."""
    release = tmp_path / "release"
    write_worker(workers, "Quick", "cat >/dev/null\n")
    write_worker(workers, "Broken", "cat >/dev/null\n" + wait_for_file(release) + "exit 3\n")
    write_worker(
        workers, "Later",
        "cat >/dev/null\n" + wait_for_file(release) + "echo '{\"delay\": 3600}'; exit 75\n",
    )
    quick = create(client, "Quick")
    broken = [create(client, "Broken", maxAttempts=5, retryDelay=3600) for _ in range(3)]
    later = [create(client, "Later") for _ in range(2)]
    gate = ReportGate(server.port)
    try:
        running = manager(gate.port, "--max-workers", "6", "--job-name", "Quick,Broken,Later")
        assert gate.held.wait(DEADLINE), "no FinishJob came"
        until(lambda: all(job(client, j)["state"] == "RUNQUEUED" for j in [*broken, *later]),
              DEADLINE, "the jobs to run")
        release.touch()
        running.wait_for(r"job \d+ (Broken failed|Later retried)", count=5)
        gate.open()
        for failed in broken:
            until(lambda failed=failed: job(client, failed)["state"] == "QUEUED", DEADLINE,
                  "the failures to be reported")
        for retried in later:
            until(lambda retried=retried: job(client, retried)["state"] == "QUEUED", DEADLINE,
                  "the retries to be reported")
    finally:
        gate.open()
        gate.close()
    assert gate.reports[0] == ("FinishJob", [quick])
    assert sorted((verb, sorted(ids)) for verb, ids in gate.reports[1:]) == [
        ("FailJobs", broken), ("RetryJobs", later),
    ]
    assert {job(client, j)["attempt"] for j in broken} == {1}
    assert "refused" not in running.log


def test_a_lease_is_renewed_until_the_report_reaches_the_server(
    server, client, workers, manager
):
    """A report that waits (behind others, or through an outage) keeps its
    job's lease: nobody else is handed the job meanwhile, and the report is
    taken when it arrives, not refused for a lease that ran out."""
    write_worker(workers, "Quick", "cat >/dev/null; exit 0\n")
    job_id = create(client, "Quick", retryAfter="+2 SECONDS", repeat="FINISHED, +1 HOUR")
    gate = ReportGate(server.port)
    try:
        running = manager(gate.port, "--max-workers", "1")
        assert gate.held.wait(DEADLINE), "no FinishJob came"
        # The worker has ended and its report waits at the gate for longer
        # than the lease: renewals keep the job from being handed out.
        waited = time.monotonic() + 3.5
        while time.monotonic() < waited:
            assert client.request("GetJob", name="Quick").status == "404 No job found"
            time.sleep(0.05)
        gate.open()
        until(lambda: job(client, job_id)["state"] == "QUEUED", DEADLINE, "the report")
    finally:
        gate.open()
        gate.close()
    assert "refused" not in running.log and "lost its lease" not in running.log


# Leases: renewed while the worker runs, and carried by every report.


def test_the_lease_of_a_long_running_worker_is_renewed_until_it_reports(
    server, client, workers, manager
):
    write_worker(workers, "Slow", "cat >/dev/null; sleep 3.5; echo '{\"done\": true}'\n")
    job_id = create(client, "Slow", retryAfter="+2 SECONDS", repeat="FINISHED, +1 HOUR")
    running = manager(server.port, "--max-workers", "1")
    until(lambda: job(client, job_id)["state"] == "RUNQUEUED", DEADLINE, "the job to be handed out")
    # The lease is two seconds (one to two, as the server counts from the
    # start of the second); the worker runs for 3.5: only renewals keep the
    # job from being handed to someone else meanwhile.
    while not re.search(rf"job {job_id} Slow finished", running.log):
        assert client.request("GetJob", name="Slow").status == "404 No job found"
        time.sleep(0.05)
    until(lambda: job(client, job_id)["state"] == "QUEUED", DEADLINE, "FinishJob")
    assert job(client, job_id)["data"] == {"done": True}
    assert "lost its lease" not in running.log and "cannot renew" not in running.log
    assert "refused" not in running.log


def test_a_result_for_a_job_another_worker_has_now_is_dropped(
    server, client, workers, manager, tmp_path
):
    gate, stdin = tmp_path / "go", tmp_path / "stdin.json"
    write_worker(workers, "Gated", f"cat >{stdin}\n" + wait_for_file(gate) + "exit 0\n")
    job_id = create(client, "Gated")
    running = manager(server.port, "--max-workers", "1")
    until(lambda: json_object(stdin.read_bytes()) if stdin.exists() else False,
          DEADLINE, "the worker to read its job")
    assert len(json_object(stdin.read_bytes())["leaseID"]) == 16
    # Requeued and taken by someone else while the worker still runs.
    assert client.request("RequeueJobs", jobIDs=str(job_id)).status == "200 OK"
    mine = client.request("GetJob", name="Gated", includeLeaseID="true").json["leaseID"]
    gate.touch()
    running.wait_for(
        rf"job {job_id} Gated: FinishJob refused \(409 Lease expired\): another worker has the job"
    )
    assert job(client, job_id)["state"] == "RUNNING"
    assert client.request("FinishJob", jobID=job_id, leaseID=mine).status == "200 OK"


@pytest.mark.parametrize("retry_after, period", [
    ("+5 MINUTES", 30),  # at most --touch-interval
    ("+61 SECONDS", 20),  # a third of the shortest lease, 60 s
    ("+4 SECONDS", 1),
    ("+1 SECOND", 0.1),  # nothing is safe: as often as is sensible
    ("START OF DAY, +1 DAY", 30),  # its length depends on the moment
])
def test_leases_are_renewed_after_a_third_of_their_shortest_length(retry_after, period):
    assert touch_period(retry_after, 30) == pytest.approx(period)


def test_the_manager_sends_its_token_to_a_server_that_wants_one(workers, manager, tmp_path):
    running = ThreadServer(tmp_path / "auth.db", auth_token="w0rk")
    try:
        token = tmp_path / "token"
        token.write_text("w0rk")
        write_worker(workers, "Done", "cat >/dev/null; exit 0\n")
        started = tmp_path / "started"
        write_worker(workers, "Hang", f"cat >/dev/null; touch {started}; exec sleep 60\n")
        with running.client() as c:
            job_id = c.request("CreateJob", name="Done", authToken="w0rk").json["jobID"]
            managed = manager(running.port, "--auth-token-file", str(token))
            managed.wait_for(rf"job {job_id} Done finished in")
            until(
                lambda: c.request("QueryJob", jobID=job_id, authToken="w0rk").code == 404,
                DEADLINE,
                "the job to be finished and deleted",
            )
            # The guard sends the token too, when it hands back a killed manager's job.
            hung = c.request("CreateJob", name="Hang", authToken="w0rk").json["jobID"]
            until(started.exists, DEADLINE, "the worker to start")
            managed.proc.kill()
            until(
                lambda: c.request("QueryJob", jobID=hung, authToken="w0rk").json["state"]
                == "QUEUED",
                DEADLINE,
                "the guard to hand the job back",
            )
    finally:
        running.stop()


def test_the_manager_speaks_tls_with_tls_ca(workers, manager, tmp_path):
    write_worker(workers, "Done", "cat >/dev/null; echo '{\"secure\": true}'\n")
    started = tmp_path / "started"
    write_worker(workers, "Hang", f"cat >/dev/null; touch {started}; exec sleep 60\n")
    with (
        tls_server(tmp_path / "tls") as (running, files),
        LibraryClient("127.0.0.1", running.port, timeout=10, tls=files.ca) as jobs,
    ):
        job_id = jobs.create_job("Done", repeat="FINISHED, +1 HOUR")
        managed = manager(running.port, "--tls-ca", str(files.ca))
        assert f"server 127.0.0.1:{running.port} (TLS)" in managed.log
        managed.wait_for(rf"job {job_id} Done finished in")
        until(lambda: jobs.query_job(job_id)["data"] == {"secure": True}, DEADLINE, "FinishJob")
        # The guard speaks TLS too, when it hands back a killed manager's job.
        hung = jobs.create_job("Hang")
        until(started.exists, DEADLINE, "the worker to start")
        managed.proc.kill()
        until(lambda: jobs.query_job(hung)["state"] == "QUEUED", DEADLINE, "the hand-back")


def test_a_manager_that_cannot_set_up_tls_says_why_and_exits_2(workers, tmp_path):
    with tls_server(tmp_path / "tls") as (running, _):
        done = subprocess.run(
            [sys.executable, *MANAGER, "--worker-path", str(workers),
             "--server", f"127.0.0.1:{running.port}", "--tls"],
            capture_output=True, text=True, timeout=DEADLINE,
        )
    assert done.returncode == 2
    assert "cannot get jobs: cannot connect to" in done.stderr
    assert "certificate is not trusted" in done.stderr and "--tls-ca FILE" in done.stderr
    missing = subprocess.run(
        [sys.executable, *MANAGER, "--worker-path", str(workers), "--tls-ca",
         str(tmp_path / "missing.pem")],
        capture_output=True, text=True, timeout=DEADLINE,
    )
    assert missing.returncode == 2
    assert "cannot use --tls-ca: cannot read CA certificates from" in missing.stderr
