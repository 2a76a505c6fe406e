"""Backups only where the operator said (issue 23, finding 5).

Backup used to write wherever a client said, as the server's user: `/etc`
from loopback without a token, through a symbolic link, and the live
database's own `-journal`, after which Query, Queues and /metrics failed
until a restart. Now the client gives a name, the operator the directory
(--backup-dir, or DB.backups beside the database), no symbolic link is
followed, no file of the live database can be named, and over HTTP it
needs the token. Each attack goes to a real `jobserver serve` process.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ServerProcess
from helpers import create, ok
from jobserver.core.commands.backup import MALFORMED_NAME, NAME_RULE
from wire import Client

TIMEOUT = 10.0
TOKEN = "backup-token"
LIVE_SUFFIXES = ("", "-journal", "-wal", "-shm", ".lock", "-mj0123ABCD")

Start = Callable[..., ServerProcess]


def private_directory(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def listing(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def still_serves(client: Client) -> None:
    """What the journal attack broke: Query, Queues and writes."""
    ok(client.request("Query", query="SELECT COUNT(*) FROM jobs;"))
    ok(client.request("Queues"))
    create(client, "after")


@pytest.mark.parametrize(
    "name",
    ["/etc/x.db", "../x.db", "..", "sub/../x.db", "./x.db", "x.db/", "x/y.db", "C:\\x.db",
     ".x.db", "-x.db", "x" * 129, "x\\u0000.db", "x\\u000a.db", "caf\u00e9.db"],
)
def test_a_name_that_is_not_a_plain_name_writes_nothing(
    start_server: Start, tmp_path: Path, name: str
) -> None:
    server = start_server(tmp_path / "jobs.db")
    before = sorted(Path("/etc").iterdir())
    with server.client() as client:
        assert client.request("Backup", name=name).status == MALFORMED_NAME, name
        assert client.request("Backup", path=name).status.startswith(
            "402 Backup takes a name, not a path"
        )
        still_serves(client)
    assert sorted(Path("/etc").iterdir()) == before
    assert not (tmp_path / "x.db").exists() and not (tmp_path.parent / "x.db").exists()
    assert not (tmp_path / "jobs.db.backups").exists()


def test_the_default_directory_is_beside_the_database(start_server: Start, tmp_path: Path) -> None:
    server = start_server(tmp_path / "jobs.db")
    with server.client() as client:
        create(client, "kept")
        reply = ok(client.request("Backup", name="copy.db"))
    directory = tmp_path / "jobs.db.backups"
    assert reply.json["path"] == str(directory / "copy.db")
    assert (directory.stat().st_mode & 0o777, listing(directory)) == (0o700, ["copy.db"])
    assert (directory / "copy.db").stat().st_mode & 0o777 == 0o600


def test_a_symlink_planted_at_the_name_is_not_followed(start_server: Start, tmp_path: Path) -> None:
    directory = private_directory(tmp_path / "backups")
    target = tmp_path / "victim.conf"
    target.write_text("untouched\n")
    (directory / "copy.db").symlink_to(target)
    (directory / "dangling.db").symlink_to(tmp_path / "created-through-link")
    (directory / "journal.db-journal").symlink_to(tmp_path / "journal-through-link")
    server = start_server(tmp_path / "jobs.db", "--backup-dir", str(directory))
    with server.client() as client:
        for name in ("copy.db", "dangling.db", "journal.db"):
            assert client.request("Backup", name=name).status == "402 Backup file already exists"
        still_serves(client)
    assert target.read_text() == "untouched\n"
    assert not (tmp_path / "created-through-link").exists()
    assert not (tmp_path / "journal-through-link").exists()


def test_a_symlinked_backup_directory_is_refused(start_server: Start, tmp_path: Path) -> None:
    elsewhere = private_directory(tmp_path / "elsewhere")
    link = tmp_path / "backups"
    link.symlink_to(elsewhere, target_is_directory=True)
    refused = start_server(tmp_path / "jobs.db", "--backup-dir", str(link))
    assert refused.wait(TIMEOUT) == 2
    assert "is a symbolic link" in refused.log, refused.log
    # Made a link after the start: refused at the Backup.
    real = private_directory(tmp_path / "real")
    server = start_server(tmp_path / "jobs.db", "--backup-dir", str(real))
    real.rename(tmp_path / "moved")
    real.symlink_to(elsewhere, target_is_directory=True)
    with server.client() as client:
        status = client.request("Backup", name="copy.db").status
        assert status == f"500 Backup directory unusable: {real} is a symbolic link", status
        still_serves(client)
    assert listing(elsewhere) == [] and listing(tmp_path / "moved") == []
    # The default beside the database, too.
    (tmp_path / "other.db.backups").symlink_to(elsewhere, target_is_directory=True)
    other = start_server(tmp_path / "other.db")
    with other.client() as client:
        assert client.request("Backup", name="copy.db").status.endswith("is a symbolic link")
    assert listing(elsewhere) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_is_refused(
    start_server: Start, tmp_path: Path, mode: int
) -> None:
    shared = private_directory(tmp_path / "shared")
    shared.chmod(mode)
    refused = start_server(tmp_path / "jobs.db", "--backup-dir", str(shared))
    assert refused.wait(TIMEOUT) == 2
    assert "is writable by other users" in refused.log, refused.log


def test_a_missing_or_odd_backup_directory_stops_the_start(
    start_server: Start, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    for named, why in [(tmp_path / "missing", "does not exist"),
                       (tmp_path / "a-file", "is not a directory")]:
        refused = start_server(tmp_path / "jobs.db", "--backup-dir", str(named))
        assert refused.wait(TIMEOUT) == 2
        assert f"cannot use --backup-dir: {named} {why}" in refused.log, refused.log


@pytest.mark.parametrize("suffix", LIVE_SUFFIXES)
def test_no_file_of_the_live_database_is_a_backup_name(
    start_server: Start, tmp_path: Path, suffix: str
) -> None:
    """The backup directory is the database's own: the journal attack."""
    server = start_server(tmp_path / "jobs.db", "--backup-dir", str(tmp_path))
    with server.client() as client:
        create(client, "kept")
        before = listing(tmp_path)
        status = client.request("Backup", name=f"jobs.db{suffix}").status
        assert status == "402 Backup name is the live database's", status
        assert listing(tmp_path) == before
        still_serves(client)
        # Another name in the same directory is fine.
        assert ok(client.request("Backup", name="copy.db")).json["jobs"] == 2
        still_serves(client)
    # And a server started again on the database serves it.
    server.signal()
    assert server.wait(TIMEOUT) == 0, server.log
    again = start_server(tmp_path / "jobs.db", "--backup-dir", str(tmp_path))
    with again.client() as client:
        still_serves(client)
        names = ok(client.request("Query", query="SELECT name FROM jobs ORDER BY jobID;")).body
        assert b"kept" in names


def test_the_live_database_by_another_path_is_refused_too(
    start_server: Start, tmp_path: Path
) -> None:
    """--db reaches the database through a linked directory; --backup-dir
    names the real one: still the database's own directory."""
    real = private_directory(tmp_path / "data")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    server = start_server(tmp_path / "link" / "jobs.db", "--backup-dir", str(real))
    with server.client() as client:
        create(client, "kept")
        for name in ("jobs.db-journal", "jobs.db-wal", "jobs.db"):
            status = client.request("Backup", name=name).status
            assert status == "402 Backup name is the live database's", (name, status)
        still_serves(client)


def test_job_text_cannot_become_lines_of_a_chosen_file(start_server: Start, tmp_path: Path) -> None:
    """A FailJob error with newlines is stored as it is, and so is in a
    backup; but the backup lands only in the backup directory, under a
    plain name, as a new file of mode 0600: never a crontab, a profile or
    a configuration file the client picks."""
    server = start_server(tmp_path / "jobs.db")
    payload = "\n* * * * * root touch /tmp/pwned\n"
    with server.client() as client:
        job = create(client, "evil")
        ok(client.request("GetJob", name="evil"))
        ok(client.request("FailJob", jobID=job, error=payload.replace("\n", "\\n")))
        for name in ("/etc/cron.d/x", "../../etc/cron.d/x", "cron.d/x"):
            assert client.request("Backup", name=name).status == MALFORMED_NAME
        copy = Path(ok(client.request("Backup", name="x")).json["path"])
    assert copy.parent == tmp_path / "jobs.db.backups"
    assert not Path("/etc/cron.d/x").exists()
    with sqlite3.connect(f"file:{copy}?mode=ro", uri=True) as db:
        assert db.execute("SELECT lastError FROM jobs").fetchone()[0] == payload


def http_backup(
    port: int, name: str, headers: dict[str, str], path: str = "/api/Backup"
) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps({"name": name}).encode(),
        method="POST", headers={"Content-Type": "application/json", **headers},
    )
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(request, timeout=TIMEOUT) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


HTTP_PORT = re.compile(r"HTTP on \S+:(\d+)")


def http_port(server: ServerProcess) -> int:
    found = server.matching(HTTP_PORT, 1, TIMEOUT)
    assert found, server.log
    match = HTTP_PORT.search(found[0])
    assert match is not None
    return int(match.group(1))


def test_backup_over_http_needs_the_token(start_server: Start, tmp_path: Path) -> None:
    """Even from loopback: a page in a browser on this machine can POST."""
    plain = start_server(tmp_path / "plain.db", "--http-port", "0")
    code, text = http_backup(http_port(plain), "copy.db", {})
    assert code == 403 and "needs the token" in text, (code, text)
    # A path that the wire would read as Backup all the same (`Backup x`).
    for path in ("/api/Backup%20", "/api/backup%20x", "/api/Backup%09"):
        code, text = http_backup(http_port(plain), "copy.db", {}, path)
        assert (code, text) == (404, '{"status":"430 Unrecognized command"}'), path
    assert not (tmp_path / "plain.db.backups").exists()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    guarded = start_server(
        tmp_path / "guarded.db", "--http-port", "0", "--auth-token-file", str(token_file)
    )
    port = http_port(guarded)
    assert http_backup(port, "copy.db", {})[0] == 401
    assert http_backup(port, "copy.db", {"Authorization": "Bearer wrong"})[0] == 401
    assert not (tmp_path / "guarded.db.backups").exists()
    code, text = http_backup(port, "copy.db", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200, text
    assert (tmp_path / "guarded.db.backups" / "copy.db").exists()


def test_a_flood_of_refused_backups_leaves_the_server_serving(
    start_server: Start, tmp_path: Path
) -> None:
    server = start_server(tmp_path / "jobs.db", "--backup-dir", str(tmp_path))
    with server.client() as client:
        for attempt in range(300):
            name = ["jobs.db-journal", "../x", "/etc/passwd", "jobs.db"][attempt % 4]
            assert client.request("Backup", name=name).status.startswith("402 "), name
        still_serves(client)
    assert server.proc.poll() is None
    assert "Traceback" not in server.log
    assert os.path.exists(tmp_path / "jobs.db") and not os.path.exists(tmp_path / "x")


def test_a_default_directory_planted_by_another_user_is_refused(
    start_server: Start, tmp_path: Path
) -> None:
    """--db in a directory others may write (such as /tmp): someone there
    may make DB.backups first, as theirs, or as a link."""
    planted = tmp_path / "jobs.db.backups"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    server = start_server(tmp_path / "jobs.db")
    with server.client() as client:
        status = client.request("Backup", name="copy.db").status
        assert status == f"500 Backup directory unusable: {planted} belongs to another user"
        still_serves(client)
    assert listing(planted) == []


@settings(max_examples=2000, deadline=None)
@given(st.text(max_size=200) | st.from_regex(NAME_RULE, fullmatch=True))
def test_every_name_the_rule_takes_is_a_plain_new_file_name(name: str) -> None:
    if not NAME_RULE.fullmatch(name):
        return
    assert os.path.basename(name) == name and name not in (".", "..")
    assert not name.startswith((".", "-")) and "\0" not in name and "/" not in name
    assert 1 <= len(name.encode()) <= 128
