"""Notices from PostgreSQL are untrusted hints (issue 23, finding 3).

Any role that may connect to the queue's database may NOTIFY on its
channel. Whatever such a role sends, every node keeps serving: a payload
is bounded before it is parsed, checked strictly, logged a few times at
most however many arrive, and costs at worst an extra recheck.

The attacks go through a real PostgreSQL to real `jobserver serve`
processes, from a plain connection of the superuser and of a role that may
only connect; the parsing function is also fed arbitrary payloads directly.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit, urlunsplit

import pg
import psycopg
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ServerProcess
from helpers import create, ok, until
from jobserver.storage import postgres_listen, postgres_schema
from jobserver.storage.postgres_listen import BadNotice, Hint, read_notice
from wire import encode

DEADLINE = 20.0
# A role that may connect to the database and nothing more.
OUTSIDER = "jobserver_notice_outsider"
# The log lines a node may add while it is attacked: a bad notice is
# logged at most once a minute.
MAX_NEW_LOG_LINES = 4

ATTACKS = {
    "deep arrays": "[" * 7999,
    "deep objects": '{"a":' * 1599,
    "deep arrays in a list": '{"ready": ' + "[" * 3990 + "]" * 3990 + "}",
    "due an object": '{"ready": [], "due": {}}',
    "due not a time": '{"ready": [], "due": "not a time"}',
    "due an impossible time": '{"ready": [], "due": "2026-13-45 25:61:61"}',
    "due a number": '{"ready": [], "due": 1e400}',
    "ready a string": '{"ready": "x"}',
    "ready objects": '{"ready": [{}]}',
    "ready an overflowing number": '{"ready": [1e400]}',
    "ready a huge list of numbers": json.dumps({"ready": list(range(1500))}),
    "ready a lone surrogate": '{"ready": ["\\ud800"]}',
    "ready a control character": '{"ready": ["a\\u0000b"]}',
    "ready a name too long": json.dumps({"ready": ["x" * 256]}),
    "node not a string": '{"node": {}, "ready": null}',
    "ended not a list": '{"ready": [], "ended": 5}',
    "ended a string": '{"ready": [], "ended": ["7"]}',
    "ended a boolean": '{"ready": [], "ended": [true]}',
    "ended zero": '{"ready": [], "ended": [0]}',
    "ended past int64": '{"ready": [], "ended": [9223372036854775808]}',
    "ended a float": '{"ready": [], "ended": [1.5]}',
    "ended too many": '{"ready": [], "ended": [' + "1," * 3000 + "1]}",
    "a huge integer": "[" + "1" * 7997 + "]",
    "a list": "[]",
    "null": "null",
    "NaN": '{"ready": NaN}',
    "empty": "",
    "7999 bytes of text": "x" * 7999,
    "7999 bytes of string": '"' + "x" * 7997 + '"',
    "7999 bytes of escapes": '"' + "\\" * 7997 + '"',
}


# The parsing function, fed directly.


@pytest.mark.parametrize("payload", ATTACKS.values(), ids=ATTACKS.keys())
def test_an_attack_payload_is_a_bad_notice(payload: str) -> None:
    assert isinstance(read_notice(payload.encode(), "me"), BadNotice)


def test_non_utf8_bytes_are_a_bad_notice() -> None:
    assert read_notice(b'{"ready": ["\xff\xfe"]}', "me") == BadNotice("not UTF-8")


def test_a_payload_over_postgres_limit_is_refused_before_parsing() -> None:
    found = read_notice(b"[" * 100_000, "me")
    assert isinstance(found, BadNotice) and "bytes" in found.reason


ODD_NAME = "[" * 200 + '"\\{' * 10


@pytest.mark.parametrize(
    ("payload", "hint"),
    [
        # What PostgresStore.announce sends.
        ('{"node":"them","ready":["a","b"],"due":null}', Hint(frozenset({"a", "b"}), None)),
        ('{"node":"them","ready":null,"due":"2026-01-01 00:00:00.123"}',
         Hint(None, "2026-01-01 00:00:00.123")),
        # What jobserver_create_job sends (json_build_object's spacing).
        ('{"ready" : ["x"], "due" : null}', Hint(frozenset({"x"}), None)),
        ('{"ready" : [], "due" : "2030-05-01 08:00:00.000"}',
         Hint(frozenset(), "2030-05-01 08:00:00.000")),
        # Names may hold brackets, quotes and backslashes.
        (json.dumps({"ready": [ODD_NAME]}), Hint(frozenset([ODD_NAME]), None)),
        # Awaited jobs another node ended (AwaitJob), or "any of them".
        ('{"node":"them","ready":[],"due":null,"ended":[3,9]}',
         Hint(frozenset(), None, frozenset({3, 9}))),
        ('{"node":"them","ready":null,"due":null,"ended":null}', Hint(None, None, None)),
        # A node's own notice is nothing to do.
        ('{"node":"me","ready":["a"]}', postgres_listen.NOTHING),
    ],
)
def test_a_notice_of_jobserver_gives_its_hint(payload: str, hint: Hint) -> None:
    assert read_notice(payload.encode(), "me") == hint


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
NOTICE_LIKE = st.fixed_dictionaries(
    {},
    optional={"node": JSON | st.text(max_size=12), "ready": JSON | st.lists(st.text(max_size=30)),
              "due": JSON | st.text(max_size=30)},
)
PAYLOADS = st.one_of(
    st.binary(max_size=9000),
    st.text(max_size=2000).map(str.encode),
    JSON.map(lambda value: json.dumps(value).encode()),
    NOTICE_LIKE.map(lambda value: json.dumps(value).encode()),
    st.integers(1, 9000).map(lambda depth: (b"[" * depth)),
    st.tuples(st.sampled_from(["[", "{\"a\":", "[\"\\\\\",", "{\"ready\":"]), st.integers(1, 2000))
    .map(lambda pair: (pair[0] * pair[1]).encode()),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PAYLOADS)
def test_any_payload_gives_a_bounded_hint_or_a_bad_notice(payload: bytes) -> None:
    found = read_notice(payload, "me")
    if isinstance(found, BadNotice):
        assert found.reason
        return
    assert isinstance(found, Hint)
    if found.ready is not None:
        assert len(found.ready) <= postgres_listen.MAX_READY_NAMES
        for name in found.ready:
            assert isinstance(name, str) and 0 < len(name.encode()) <= 255
            assert not any(ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F for char in name)
    if found.due is not None:
        assert postgres_listen._STORED_TIME.fullmatch(found.due)


def test_reading_the_worst_payload_is_quick() -> None:
    """Brackets and escapes everywhere: the string-aware scan, bounded."""
    worst = ('"\\"[' * 2000)[:7999].encode()
    started = time.perf_counter()
    for _ in range(100):
        read_notice(worst, "me")
    assert (time.perf_counter() - started) / 100 < 0.01


# Through a real PostgreSQL, to real nodes.


@pytest.fixture
def queue_url() -> Iterator[str]:
    with pg.fresh_schema() as url:
        yield url


@pytest.fixture
def two_nodes(queue_url: str) -> Iterator[list[ServerProcess]]:
    nodes = [ServerProcess(queue_url), ServerProcess(queue_url)]
    try:
        for node in nodes:
            assert node.started, node.log
        # A node says it listens for clients before it listens for notices:
        # a wake-up each way shows both do.
        wake_seconds(nodes[0], nodes[1], "listening")
        wake_seconds(nodes[1], nodes[0], "listening")
        yield nodes
    finally:
        for node in nodes:
            node.kill()


@pytest.fixture(scope="module")
def outsider_url() -> str:
    """A role that may log in, and so LISTEN and NOTIFY, and nothing else."""
    url = pg.database_url()
    with psycopg.connect(url, autocommit=True) as db:
        exists = db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (OUTSIDER,)).fetchone()
        if not exists:
            db.execute(f"CREATE ROLE {OUTSIDER} LOGIN".encode())
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{OUTSIDER}@{parts.hostname}:{parts.port or 5432}"))


def channel_of(url: str) -> str:
    options = parse_qs(urlsplit(url).query)["options"][0]
    return postgres_schema.channel(options.removeprefix("-csearch_path="))


def notify(url: str, channel: str, payloads: list[str]) -> None:
    """Each payload, NOTIFY'd in a transaction of its own."""
    with psycopg.connect(url, autocommit=True) as db:
        for payload in payloads:
            db.execute("SELECT pg_notify(%s, %s)", (channel, payload))


def wake_seconds(waiter: ServerProcess, creator: ServerProcess, name: str) -> float:
    """From a CreateJob on `creator` to the job in the hands of a GetJob
    waiting on `waiter`."""
    with waiter.client() as admin:
        before = ok(admin.request("Status")).json["waitingGetJobs"]
        worker = waiter.client(timeout=DEADLINE)
        worker.send(encode("GetJob", {"name": name, "Connection": "wait", "timeout": 15_000}))
        until(lambda: ok(admin.request("Status")).json["waitingGetJobs"] > before,
              DEADLINE, "the GetJob to wait")
    with worker, creator.client() as client:
        started = time.monotonic()
        job_id = create(client, name)
        reply = worker.read_reply()
        seconds = time.monotonic() - started
    assert reply.status == "200 OK" and reply.json["jobID"] == job_id, reply
    return seconds


def assert_still_serving(nodes: list[ServerProcess], logged: list[int]) -> None:
    """Each node lives, answers, hears the other promptly, and logged only
    a few lines more than `logged`."""
    for node in nodes:
        assert node.proc.poll() is None, node.log
        with node.client() as client:
            ok(client.request("Ping"))
    a, b = nodes
    # A flood may still be queued on a node's listening connection: one
    # wake-up each way, untimed, reads past it before the timed ones.
    wake_seconds(a, b, "drained")
    wake_seconds(b, a, "drained")
    wakes = [wake_seconds(a, b, "wake"), wake_seconds(b, a, "wake"), wake_seconds(a, b, "wake")]
    # Left to the one-second fallback, two of three wake-ups would hardly
    # all come this fast.
    assert statistics.median(wakes) < 0.25, wakes
    for node, before in zip(nodes, logged, strict=True):
        added = node.log.splitlines()[before:]
        assert len(added) <= MAX_NEW_LOG_LINES, "\n".join(added)
        assert "Traceback" not in node.log, node.log


def log_lines(nodes: list[ServerProcess]) -> list[int]:
    return [len(node.log.splitlines()) for node in nodes]


@pytest.mark.parametrize("sender", ["superuser", "outsider"])
def test_attack_notices_leave_every_node_serving(
    two_nodes: list[ServerProcess], queue_url: str, outsider_url: str, sender: str
) -> None:
    url = queue_url if sender == "superuser" else outsider_url
    logged = log_lines(two_nodes)
    notify(url, channel_of(queue_url), list(ATTACKS.values()))
    # A notice sent after the attacks, heard only once they were read.
    assert_still_serving(two_nodes, logged)
    for node in two_nodes:
        assert node.matching("ignored a notice", 1, DEADLINE), node.log


def test_postgres_refuses_non_utf8_payloads(queue_url: str) -> None:
    """So such bytes reach a node only from a database in another encoding
    (read_notice refuses them: test_non_utf8_bytes_are_a_bad_notice)."""
    with psycopg.connect(queue_url, autocommit=True) as db, pytest.raises(psycopg.DataError):
        db.execute(b"SELECT pg_notify(%s, E'\\xff\\xfe')", (channel_of(queue_url),))


def ping_latencies(node: ServerProcess, stop: threading.Event) -> list[float]:
    latencies: list[float] = []
    with node.client() as client:
        while not stop.is_set():
            started = time.monotonic()
            ok(client.request("Ping"))
            latencies.append(time.monotonic() - started)
    return latencies


def flooded(
    nodes: list[ServerProcess], url: str, sql: str, channel: str
) -> list[float]:
    """Run the flooding statement while a client pings the first node; the
    Ping latencies seen until the nodes have read the flood."""
    stop = threading.Event()
    result: list[list[float]] = []
    pinger = threading.Thread(target=lambda: result.append(ping_latencies(nodes[0], stop)))
    pinger.start()
    try:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(sql.encode(), (channel,))
            # The nodes read notices in order: once this one wakes a
            # waiter, the flood has been read.
        wake_seconds(nodes[0], nodes[1], "after-flood")
    finally:
        stop.set()
        pinger.join(DEADLINE)
    return result[0]


def test_a_flood_of_bad_notices_is_a_few_log_lines(
    two_nodes: list[ServerProcess], queue_url: str, outsider_url: str
) -> None:
    logged = log_lines(two_nodes)
    latencies = flooded(
        two_nodes, outsider_url,
        "SELECT pg_notify(%s, repeat('[', 100) || i) FROM generate_series(1, 100000) AS i",
        channel_of(queue_url),
    )
    print(f"Ping during 100,000 bad notices: max {max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 0.5, sorted(latencies)[-10:]
    assert_still_serving(two_nodes, logged)


def test_a_flood_of_notices_naming_many_names_stays_cheap(
    two_nodes: list[ServerProcess], queue_url: str, outsider_url: str
) -> None:
    """Each notice lists about 300 names, as many as fit; a waiting GetJob
    with a pattern makes every name be matched."""
    logged = log_lines(two_nodes)
    waiter = two_nodes[0].client(timeout=DEADLINE)
    waiter.send(encode("GetJob", {"name": "never-*", "Connection": "wait", "timeout": 15_000}))
    with waiter:
        latencies = flooded(
            two_nodes, outsider_url,
            "SELECT pg_notify(%s, json_build_object('ready', (SELECT json_agg("
            "'flood-' || i || '-' || j) FROM generate_series(1, 300) AS j))::text) "
            "FROM generate_series(1, 3000) AS i",
            channel_of(queue_url),
        )
    print(f"Ping during 3,000 notices of 300 names: max {max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 0.5, sorted(latencies)[-10:]
    assert_still_serving(two_nodes, logged)


# The listener itself: an exception in handling a notice ends nothing.


async def test_a_failing_handler_ends_neither_the_listener_nor_its_caller(queue_url: str) -> None:
    channel = channel_of(queue_url)
    heard: dict[str, trio.Event] = {"anything": trio.Event()}

    def failing(ready: set[str] | None, due: str | None, ended: object = None) -> None:
        for name in ready if ready is not None else ["anything"]:
            heard.setdefault(name, trio.Event()).set()
        raise RuntimeError("a bug in the wait queue")

    def connect() -> psycopg.Connection[object]:
        return psycopg.connect(queue_url, autocommit=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(postgres_listen.listen, connect, channel, "me", failing)
        with trio.fail_after(DEADLINE):
            await heard["anything"].wait()  # the first recheck: listening
            for turn in range(5):
                name = f"job-{turn}"
                heard[name] = trio.Event()
                notice = json.dumps({"ready": [name]})
                await trio.to_thread.run_sync(notify, queue_url, channel, [notice])
                await heard[name].wait()
        nursery.cancel_scope.cancel()


def test_a_flood_of_notices_that_ask_for_rechecks_is_coalesced(
    two_nodes: list[ServerProcess], queue_url: str, outsider_url: str
) -> None:
    """`ready: null` and a `due` long past each ask a node to look at
    everything: ten times a second at most, whatever arrives."""
    logged = log_lines(two_nodes)
    with two_nodes[0].client(timeout=DEADLINE) as waiter:
        waiter.send(encode("GetJob", {"name": "never", "Connection": "wait", "timeout": 15_000}))
        latencies = flooded(
            two_nodes, outsider_url,
            "SELECT pg_notify(%s, CASE WHEN i %% 2 = 0 "
            "THEN json_build_object('node', 'n' || i, 'ready', NULL)::text "
            "ELSE json_build_object('ready', json_build_array('n' || i), "
            "'due', '1970-01-01 00:00:00')::text END) "
            "FROM generate_series(1, 50000) AS i",
            channel_of(queue_url),
        )
    print(f"Ping during 50,000 recheck notices: max {max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 0.5, sorted(latencies)[-10:]
    assert_still_serving(two_nodes, logged)
