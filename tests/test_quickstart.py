"""README's quickstart works as pasted: the nc session gets the answers
README shows (times aside), and the Python worker, saved as README says and
started with README's command, runs the job README's producer creates.

test_readme.py runs each Python example alone; these run the quickstart's
pieces together, as a reader does, against a real server."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_SERVER = "127.0.0.1:8888"
TIMEOUT = 30.0
_FENCE = re.compile(r"^```(?:python)?\n(.*?)^```$", re.S | re.M)
# A time as the server writes it, with or without milliseconds.
_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?")


def blocks_after(marker: str, count: int) -> list[str]:
    """The first `count` fenced blocks of README after the text `marker`."""
    text = README.read_text()
    assert marker in text, marker
    found = _FENCE.findall(text, text.index(marker))
    assert len(found) >= count, marker
    return found[:count]


def replies(raw: bytes) -> list[tuple[str, object]]:
    """Each reply's status line and its body (JSON read, times masked)."""
    answers: list[tuple[str, object]] = []
    while raw:
        head, raw = raw.split(b"\r\n\r\n", 1) if b"\r\n\r\n" in raw else raw.split(b"\n\n", 1)
        status, *headers = head.decode().splitlines()
        length = next(int(h.split(":")[1]) for h in headers if h.startswith("Content-Length"))
        body, raw = raw[:length].decode(), raw[length:]
        answers.append((status, json.loads(_TIME.sub("TIME", body)) if body else None))
    return answers


def test_the_nc_session_gets_the_answers_the_readme_shows(server):
    requests, answers = blocks_after("**2. Create, take and finish a job in nc.**", 2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as conn:
        conn.sendall(requests.encode())
        expected = replies(answers.encode())
        got = b""
        while len(replies_so_far := _whole_replies(got)) < len(expected):
            chunk = conn.recv(65536)
            assert chunk, (got, replies_so_far)
            got += chunk
    assert replies(got) == expected
    assert [status for status, _ in expected] == ["200 OK"] * 3


def _whole_replies(raw: bytes) -> list[tuple[str, object]]:
    """The replies read whole so far (none while one is cut short)."""
    try:
        return replies(raw)
    except (ValueError, StopIteration):
        return []


def test_the_python_worker_runs_the_job_the_producer_creates(server, tmp_path):
    worker_code, producer = blocks_after("**3. A worker in Python.**", 3)[0:3:2]
    assert worker_code.startswith("# tasks.py\n")
    assert "```\njobserver worker tasks:worker\n```" in README.read_text()
    (tmp_path / "tasks.py").write_text(worker_code)
    address = f"127.0.0.1:{server.port}"
    # README's command, with the test's server for the default address.
    worker = subprocess.Popen(
        [sys.executable, "-m", "jobserver", "worker", "tasks:worker", "--server", address],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(worker, lines), daemon=True).start()
    try:
        made = subprocess.run([sys.executable, "-c", producer.replace(EXAMPLE_SERVER, address)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
        assert made.returncode == 0, made.stderr
        created = re.fullmatch(r"created job (\d+)\n", made.stdout)
        assert created is not None, made.stdout
        job_id = int(created[1])
        wanted = ["sending a welcome to ann@example.com\n",
                  f"job {job_id} email/welcome finished in "]
        seen: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while wanted and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            seen.append(line)
            if wanted[0] in line:
                wanted.pop(0)
        assert not wanted, seen
    finally:
        worker.terminate()
        worker.wait(TIMEOUT)


def _read_lines(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.put(line)
