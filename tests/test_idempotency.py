"""Idempotency keys (protocol.md 14.22): a CreateJob or CreateJobs sent
again with the key of one already done creates nothing and gets the same
reply, on any node; a key is refused for a request with other
parameters, checked, kept for --idempotency-keep and then forgotten.
And the clients that use them: the library, which sends a create again
after its reply is lost, and the command line."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_cli import Cli

from harness import ThreadServer
from helpers import ok, until
from jobserver import client as jobclient
from jobserver.core.commands import idempotency
from jobserver.core.errors import CommandError
from jobserver.wire.framing import Request
from jobserver.wire.limits import MAX_IDEMPOTENCY_KEY
from relay import Relay
from wire import Client

pytestmark = pytest.mark.backends(nodes=True)

DEADLINE = 15.0


def names(client: Client) -> list[tuple[int, str]]:
    """The jobID and name of every job waiting, in jobID order (taking them)."""
    reply = client.request("GetJobs", name="*", numResults=1000)
    if reply.status == "404 No job found":
        return []
    return sorted((job["jobID"], job["name"]) for job in ok(reply).json["jobs"])


def job_names(client: Client) -> list[str]:
    """The names of every job waiting, in jobID order (taking them)."""
    return [name for _, name in names(client)]


def test_a_create_sent_again_with_its_key_creates_nothing_and_gets_the_same_reply(server):
    with server.client() as client, server.client() as other:
        first = ok(client.request("CreateJob", name="once", idempotencyKey="order-17"))
        again = ok(other.request("CreateJob", name="once", idempotencyKey="order-17"))
        assert again.json == first.json
        jobs = [{"name": "batch", "data": {"n": n}} for n in range(3)]
        many = ok(client.request("CreateJobs", jobs=jobs, idempotencyKey="import-1"))
        assert ok(other.request("CreateJobs", jobs=jobs, idempotencyKey="import-1")).json == (
            many.json
        )
        # Keys are the queue's: the same text for another command is another
        # request, and a request without a key is always done.
        ok(client.request("CreateJob", name="once"))
        assert job_names(client) == ["once", "batch", "batch", "batch", "once"]


def test_a_key_sent_with_other_parameters_is_refused_and_creates_nothing(server):
    with server.client() as client:
        ok(client.request("CreateJob", name="a", data={"to": "ann"}, idempotencyKey="k"))
        for reused in (
            {"name": "a", "data": {"to": "bob"}},
            {"name": "b", "data": {"to": "ann"}},
            {"name": "a", "data": {"to": "ann"}, "jobPriority": 1000},
        ):
            reply = client.request("CreateJob", idempotencyKey="k", **reused)
            assert reply.status == "409 Idempotency key used by another request", reply
        reply = client.request("CreateJobs", jobs=[{"name": "a"}], idempotencyKey="k")
        assert reply.status == "409 Idempotency key used by another request", reply
        assert job_names(client) == ["a"]


def test_a_refused_request_keeps_no_key(server):
    with server.client() as client:
        bad = [{"name": "fine"}, {"name": "bad", "jobPriority": 7}]
        assert client.request("CreateJobs", jobs=bad, idempotencyKey="k").status == (
            "402 Invalid priority value"
        )
        # Fixed and sent again under the same key, it is done.
        good = [{"name": "fine"}, {"name": "bad", "jobPriority": 750}]
        ok(client.request("CreateJobs", jobs=good, idempotencyKey="k"))
        assert job_names(client) == ["fine", "bad"]


def test_a_keyed_create_refused_for_its_parameters_writes_nothing(backend, server):
    """Its parameters are checked before its key is claimed: a write, then
    a refusal, makes the writer run its whole batch again with savepoints
    (a flood of malformed keyed creates cost neighbours a sixth of their
    throughput)."""
    if backend != "sqlite":
        pytest.skip("the same code on every backend; one is enough")
    store = server.server.core.store
    with server.client() as client:
        before = store.total_changes
        for bad in ({"jobPriority": 7}, {"firstRun": "someday"}, {"data": "[1]"}):
            reply = client.request("CreateJob", name="x", idempotencyKey="k", **bad)
            assert reply.status.startswith("402 "), reply
        many = [{"name": "a"}, {"name": "b", "jobPriority": 7}]
        assert client.request("CreateJobs", jobs=many, idempotencyKey="k2").status == (
            "402 Invalid priority value"
        )
        assert store.total_changes == before


def test_keys_are_checked(server):
    with server.client() as client:
        for key, status in (
            ("x" * (MAX_IDEMPOTENCY_KEY + 1), "402 IdempotencyKey too large (255 bytes at most)"),
            ("a\tb", "402 Malformed idempotencyKey"),
            ("é" * 128, "402 IdempotencyKey too large (255 bytes at most)"),
        ):
            assert client.request("CreateJob", name="x", idempotencyKey=key).status == status
        # The longest, in any script, and an empty one (no key at all).
        ok(client.request("CreateJob", name="x", idempotencyKey="é" * 127 + "k"))
        ok(client.request("CreateJob", name="x", idempotencyKey=""))
        ok(client.request("CreateJob", name="x", idempotencyKey=""))
        assert job_names(client) == ["x", "x", "x"]


def test_one_key_sent_to_every_node_at_once_creates_the_jobs_once(server):
    jobs = [{"name": "race", "data": {"n": n}} for n in range(5)]
    clients = [server.client() for _ in range(6)]
    start = threading.Barrier(len(clients))
    replies: list[Any] = [None] * len(clients)

    def send(index: int) -> None:
        start.wait(DEADLINE)
        replies[index] = clients[index].request("CreateJobs", jobs=jobs, idempotencyKey="race")

    threads = [threading.Thread(target=send, args=(n,)) for n in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    try:
        assert {ok(reply).body for reply in replies} == {replies[0].body}
        assert job_names(clients[0]) == ["race"] * 5
    finally:
        for client in clients:
            client.close()


# Keys outlive neither --idempotency-keep nor the pruner.


@pytest.fixture
def brief(db) -> Iterator[ThreadServer]:
    """A server that keeps keys for a second, and prunes every tenth."""
    running = ThreadServer(db, idempotency_keep=1.0, prune_interval=0.1)
    yield running
    running.stop()


def kept_keys(db: Path) -> int:
    with closing(sqlite3.connect(db)) as file:
        return int(file.execute("SELECT COUNT(*) FROM idempotency").fetchone()[0])


def test_a_key_is_forgotten_after_its_keep(backend, db, brief):
    if backend != "sqlite":
        pytest.skip("the keep is the same code on every backend; one is enough")
    with brief.client() as client:
        first = ok(client.request("CreateJob", name="kept", idempotencyKey="k")).json
        assert kept_keys(db) == 1
        until(lambda: kept_keys(db) == 0, DEADLINE, "the pruner to forget the key")
        second = ok(client.request("CreateJob", name="kept", idempotencyKey="k")).json
        assert second != first
        assert job_names(client) == ["kept", "kept"]


def test_query_does_not_read_the_keys(backend, server):
    """Keys are the clients' own: Query reads the job tables, on SQLite as
    on PostgreSQL (whose Query role may read nothing else)."""
    with server.client() as client:
        ok(client.request("CreateJob", name="x", idempotencyKey="customer-42"))
        reply = client.request("Query", query="SELECT idempotencyKey FROM idempotency;")
        assert reply.status == "402 Bad query", reply
        assert b"customer-42" not in reply.body


# The key's parser, on any text.


@given(st.text(max_size=300))
def test_a_key_is_taken_exactly_when_it_is_1_to_255_bytes_without_control_characters(text):
    request = Request("CreateJob", {"idempotencykey": text})
    size = len(text.encode("utf-8", "surrogatepass"))
    control = any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF
                  for c in text)
    try:
        key = idempotency.key_of(request)
    except CommandError as refused:
        assert size > MAX_IDEMPOTENCY_KEY or control, refused.status
        return
    if not text:
        assert key is None
    else:
        assert key == text and size <= MAX_IDEMPOTENCY_KEY and not control


# The clients.


@pytest.fixture
def relay(server) -> Iterator[Relay]:
    """A relay in front of the first node, that a test can cut."""
    cutter = Relay(("127.0.0.1", server.port))
    yield cutter
    cutter.close()


def test_the_client_sends_a_create_again_when_its_reply_is_lost(relay):
    with jobclient.Client("127.0.0.1", relay.port, timeout=DEADLINE) as jobs:
        relay.cut_at(b"CreateJobs", reaches=True)
        created = jobs.create_jobs([{"name": "lost"}, {"name": "lost"}])
        assert relay.was_cut.is_set()
        relay.cut_at(b"CreateJob\r", reaches=True)
        one = jobs.create_job("lost too")
        assert relay.was_cut.is_set()
        taken = jobs.get_jobs("lost*", 10)
    assert sorted(job["jobID"] for job in taken) == sorted([*created, one])


async def test_the_async_client_sends_a_create_again_when_its_reply_is_lost(relay):
    async with jobclient.AsyncClient("127.0.0.1", relay.port, timeout=DEADLINE) as jobs:
        relay.cut_at(b"CreateJob\r", reaches=True)
        one = await jobs.create_job("lost", idempotency_key="mine")
        assert relay.was_cut.is_set()
        # Its own key: sent again by hand, still one job.
        assert await jobs.create_job("lost", idempotency_key="mine") == one
        assert [job["jobID"] for job in await jobs.get_jobs("lost", 10)] == [one]


def test_a_lost_reply_with_the_server_out_of_reach_is_a_failure_that_was_sent(relay):
    with jobclient.Client("127.0.0.1", relay.port, timeout=DEADLINE) as jobs:
        relay.cut_at(b"CreateJob\r", reaches=True, stay_cut=True)
        with pytest.raises(jobclient.ConnectionFailed) as failed:
            jobs.create_job("maybe", idempotency_key="k-1")
        assert failed.value.sent
        relay.restore()
        # Sent again by hand with its key: done once.
        job_id = jobs.create_job("maybe", idempotency_key="k-1")
        assert [job["jobID"] for job in jobs.get_jobs("maybe", 10)] == [job_id]


def test_the_command_line_creates_at_most_once_under_a_key(server, relay, tmp_path):
    cli = Cli(f"127.0.0.1:{relay.port}")
    first = cli.ok("create", "cli", "--idempotency-key", "nightly-2026-11-29")
    assert cli.ok("create", "cli", "--idempotency-key", "nightly-2026-11-29") == first
    lines = tmp_path / "jobs.jsonl"
    lines.write_text("".join(f'{{"name": "line", "data": {{"n": {n}}}}}\n' for n in range(3)))
    # The reply of the import's batch is lost: the command sends it again.
    relay.cut_at(b"CreateJobs", reaches=True)
    imported = cli.ok("create", "--from", str(lines), "--idempotency-key", "import")
    assert relay.was_cut.is_set()
    # Run again, the import creates nothing.
    assert cli.ok("create", "--from", str(lines), "--idempotency-key", "import") == imported
    # The server out of reach after it has the request: the message says how
    # to run it again without creating the job twice.
    relay.cut_at(b"CreateJob\r", reaches=True, stay_cut=True)
    result = cli("create", "uncertain")
    assert result.returncode == 5, result
    assert "may or may not have been created" in result.stderr, result.stderr
    key = result.stderr.rsplit("--idempotency-key ", 1)[1].split()[0]
    relay.restore()
    created = cli.ok("create", "uncertain", "--idempotency-key", key)
    with server.client() as client:
        uncertain = [job_id for job_id, name in names(client) if name == "uncertain"]
    assert uncertain == [created["jobID"]]
