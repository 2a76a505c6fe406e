"""`jobserver serve` checks every option's range before it opens anything.

A value out of range ends the command with exit status 2 and argparse's
message on stderr, before it creates the database or listens. Each case
is read by the command's own parser in the test's process (a process of
its own each cost a second of CPU under the suite's load); one runs the
real command.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobserver.cli import build_parser, main

RUN_TIMEOUT = 30.0


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


OUT_OF_RANGE = [
    ("--port", "70000", "must be a whole number from 0 to 65535"),
    ("--port", "-1", "must be a whole number from 0 to 65535"),
    ("--port", "http", "must be a whole number from 0 to 65535"),
    ("--max-connections", "0", "must be a whole number from 1 to 1000000"),
    ("--max-connections", "1000001", "must be a whole number from 1 to 1000000"),
    ("--idle-timeout", "0", "must be a number of seconds above 0 and at most 86400"),
    ("--idle-timeout", "inf", "must be a number of seconds above 0 and at most 86400"),
    ("--idle-timeout", "86401", "must be a number of seconds above 0 and at most 86400"),
    ("--request-timeout", "-5", "must be a number of seconds above 0 and at most 3600"),
    ("--request-timeout", "nan", "must be a number of seconds above 0 and at most 3600"),
    ("--request-timeout", "3601", "must be a number of seconds above 0 and at most 3600"),
    ("--query-timeout", "-1", "must be a number of seconds above 0 and at most 3600"),
    ("--query-timeout", "0", "must be a number of seconds above 0 and at most 3600"),
    ("--query-timeout", "1e9", "must be a number of seconds above 0 and at most 3600"),
    ("--keep-finished", "3651d", "must be a duration from 0 to 3650d"),
    ("--keep-finished", "-1", "must be a duration from 0 to 3650d"),
    ("--keep-finished", "3w", "must be a duration from 0 to 3650d"),
    ("--keep-failed", "999999999d", "must be a duration from 0 to 3650d"),
    ("--reply-grace", "0", "must be a duration from 1s to 30d"),
    ("--reply-grace", "31d", "must be a duration from 1s to 30d"),
    ("--limit", "email/*=0", "not a limit: '0' (MAX 1 to 1,000,000,000, rate:N/DURATION"),
    ("--limit", "email/*", "not PATTERN=MAX (or rate:N/DURATION ...)"),
    ("--limit", "api/*=rate:5/1w", "not a rate (N/DURATION, as 100/1m)"),
    ("--limit", "*" * 33 + "=1", "a pattern SetLimit refuses: 402 Name too complex (32 wildcards"),
    ("--limit", "[" + "a" * 65 + "]=1", "a pattern SetLimit refuses: 402 Name too complex (64"),
    ("--limit", "a" * 256 + "=1", "a pattern SetLimit refuses: 402 Name too large (255 bytes"),
    ("--log-level", "verbose", "invalid choice"),
    ("--synchronous", "OFF", "invalid choice"),
]


def parse_serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[object, str, str]:
    """`jobserver serve ARGS` read by the command's parser, here: the exit
    status it ends with ("taken" if it takes them), its stdout and stderr."""
    try:
        build_parser().parse_args(["serve", *args])
        code: object = "taken"
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("option", "value", "message"), OUT_OF_RANGE)
def test_an_option_out_of_range_exits_2_before_starting(
    tmp_path, capsys, option, value, message
):
    db = tmp_path / "jobs.db"
    code, out, err = parse_serve(capsys, "--port", "0", "--db", str(db), f"{option}={value}")
    assert code == 2, (code, err)
    assert f"argument {option}: {message}" in err, err
    assert out == "" and "Traceback" not in err
    assert not db.exists()


def test_the_command_itself_exits_2_on_an_option_out_of_range(tmp_path):
    db = tmp_path / "jobs.db"
    option, value, message = OUT_OF_RANGE[0]
    done = serve("--port", "0", "--db", str(db), f"{option}={value}")
    assert done.returncode == 2, done
    assert f"argument {option}: {message}" in done.stderr, done.stderr
    assert done.stdout == ""
    assert "listening" not in done.stderr and "Traceback" not in done.stderr
    assert not db.exists()


def test_values_at_the_edges_of_the_ranges_are_served(start_server, tmp_path):
    proc = start_server(
        tmp_path / "jobs.db",
        "--max-connections", "1000000",
        "--idle-timeout", "86400",
        "--request-timeout", "0.5",
        "--query-timeout", "3600",
        "--keep-finished", "3650d",
        "--keep-failed", "0",
        "--reply-grace", "1s",
        "--log-level", "debug",
    )
    with proc.client() as client:
        assert client.request("Ping").status == "200 OK"


def test_help_shows_one_sensible_default_for_every_option():
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", "--help"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, done
    # Each option's entry starts on a line of its own, indented by two.
    entries = re.split(r"\n  (?=-)", done.stdout.split("options:", 1)[1])
    options = [" ".join(entry.split()) for entry in entries if entry.startswith("--")]
    assert len(options) >= 16
    for entry in options:
        assert entry.count("(default:") == 1, entry
        for odd in ("None", "False", "[]", "3600.0"):
            assert odd not in entry, entry
    assert any("--keep-failed" in e and "(default: kept until deleted" in e for e in options)
    assert any("--reply-grace" in e and "(default: 1h)" in e for e in options)


def test_every_serve_option_is_in_the_docs_table_with_its_range():
    page = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    table = page.split("## `jobserver serve`", 1)[1].split("\n\n", 2)[1]
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", "--help"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )
    assert table.startswith("| option | default | range | |")
    for option in sorted(set(re.findall(r"--[a-z][a-z-]+", done.stdout)) - {"--help"}):
        # The option's own row: the one that names it in its first column.
        rows = [
            line for line in table.splitlines()
            if line.startswith("|") and f"`{option}" in line.split("|")[1]
        ]
        assert len(rows) == 1, option
        cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
        assert len(cells) == 4 and cells[1] and cells[2], rows[0]


def test_a_db_url_of_an_unknown_scheme_is_refused_naming_the_known_ones(
    tmp_path, monkeypatch, capsys
):
    # Taken as a SQLite path, 'postgresq://...' became a directory 'postgresq:'
    # and a lock file's odd error.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--port", "0", "--db", "postgresq://ann:s3cret@db.example/jobs"])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert (
        "argument --db: postgresq://... is no database URL this server knows: give "
        "postgresql://... or postgres://... for PostgreSQL, or a SQLite file's path"
    ) in error
    assert "s3cret" not in error  # the URL's password is never repeated
    assert list(tmp_path.iterdir()) == []
    # What each backend takes goes through unchanged.
    (tmp_path / "odd:").mkdir()
    for db in ("postgresql://ann@db/jobs", "postgres://db/jobs", "jobs.db", "./odd://name"):
        assert build_parser().parse_args(["serve", "--db", db]).db == db


@pytest.mark.parametrize("where, reason", [
    ("a-file/jobs.db", "{tmp}/a-file is not a directory"),
    ("a-file/deeper/jobs.db", "{tmp}/a-file is not a directory"),
    ("missing/deeper/jobs.db", "the directory {tmp}/missing/deeper does not exist"),
    ("a-directory", "{tmp}/a-directory is a directory"),
])
def test_a_db_path_that_cannot_hold_a_file_is_a_usage_error(tmp_path, where, reason):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-directory").mkdir()
    done = serve("--port", "0", "--db", str(tmp_path / where))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: jobserver serve ")
    assert done.stderr.endswith(
        f"argument --db: cannot put a database at {tmp_path / where}: "
        f"{reason.format(tmp=tmp_path)}\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-directory", "a-file"]


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` read-only to this process: its mode for a user, the immutable
    attribute for root (whom modes do not stop); skips where neither works."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("root, and no chattr +i here: nothing makes a path read-only to root")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_db_directory_or_file_is_named_with_its_reason(tmp_path):
    # SQLite says "unable to open database file" or "attempt to write a
    # readonly database" whatever the cause.
    closed = tmp_path / "closed"
    closed.mkdir()
    with read_only(closed):
        done = serve("--port", "0", "--db", str(closed / "jobs.db"))
    assert done.returncode == 2, done.stderr
    assert (
        f"cannot use '{closed / 'jobs.db'}' as a job database: the directory {closed} is not "
        "writable by this server (SQLite creates the database's -wal and -shm files beside "
        "it) (SQLite: unable to open database file)"
    ) in done.stderr
    kept = tmp_path / "kept.db"
    kept.write_bytes(b"")
    with read_only(kept):
        done = serve("--port", "0", "--db", str(kept))
    assert done.returncode == 2, done.stderr
    assert (
        f"cannot use '{kept}' as a job database: the file {kept} is read-only to this server "
        "(SQLite: attempt to write a readonly database)"
    ) in done.stderr


def test_a_db_that_is_a_symbolic_link_is_served_from_the_file_it_names(start_server, tmp_path):
    # SQLite keeps its log beside the file a link points to: syncing one
    # beside the link answered every write 503.
    real = tmp_path / "data" / "jobs.db"
    real.parent.mkdir()
    link = tmp_path / "jobs-link.db"
    link.symlink_to(real)
    server = start_server(link)
    with server.client() as client:
        reply = client.request("CreateJob", name="linked")
        assert reply.status == "200 OK", reply
        assert client.request("Status").json["database"]["path"] == str(real)
    assert f"--db {link} is a symbolic link: serving {real}" in server.log
    assert (real.parent / "jobs.db-wal").exists() and link.is_symlink()
    assert not (tmp_path / "jobs-link.db-wal").exists()


def test_a_serve_process_keeps_what_it_loaded_out_of_the_collectors_walks():
    # In a process of its own: the collector's settings are the process's.
    probe = (
        "import gc; from jobserver.cli import collector; before = gc.get_freeze_count(); "
        "collector.tune_for_a_server(); print(before, gc.get_freeze_count(), gc.get_threshold()[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    before, frozen, threshold = map(int, done.stdout.split())
    assert before == 0 and frozen > 10_000
    assert threshold == 10_000
