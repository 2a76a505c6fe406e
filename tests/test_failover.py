"""Clients that follow nodes: the client library, the command line and the
workers given several server addresses spread over them, move to another
when one stops answering, and send a GetJob again (and nothing that may
have been carried out), through real sockets.

The last test is the whole story: three `jobserver serve` nodes on one
PostgreSQL schema, a Python worker and a worker manager (real processes)
draining a stream of jobs through all three, and one node killed with
SIGKILL in the middle.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pg
import pytest
import trio

from fake_server import NO_REPLY, FakeServer, reply
from harness import LoggedProcess, ManagerProcess, ServerProcess, ThreadServer
from helpers import free_port, free_ports, ok, until
from jobserver.cli import main
from jobserver.client import MAX_SERVERS, Client, ConnectionFailed, TrioClient, parse_servers
from jobserver.worker.settings import Settings

DEADLINE = 10.0


def address(port: int) -> str:
    return f"127.0.0.1:{port}"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ThreadServer]]:
    """Three servers, each on a SQLite file of its own: where a job was
    created says which server a client talked to."""
    running = [ThreadServer(tmp_path / f"jobs{i}.db") for i in range(3)]
    yield running
    for server in running:
        server.stop()


def job_count(server: ThreadServer) -> int:
    with server.client() as client:
        return sum(ok(client.request("Status")).json["jobs"].values())


# The list: what a client accepts.


def test_a_list_or_one_string_of_addresses_gives_the_same_servers():
    expected = (("10.0.0.1", 8888), ("::1", 9000), ("db", 8888))
    assert parse_servers(["10.0.0.1:8888", "[::1]:9000", ("db", 8888)]) == expected
    assert parse_servers("10.0.0.1:8888, [::1]:9000,db") == expected
    assert Client("10.0.0.1:8888,[::1]:9000,db:8888").servers.addresses == expected
    assert Client.from_address("10.0.0.1,[::1]:9000,db").servers.addresses == expected
    # One host, as before: its port apart, an IPv6 address whole.
    assert Client("::1", 9000).servers.addresses == (("::1", 9000),)


@pytest.mark.parametrize(
    "servers, message",
    [
        ([], "no server address given"),
        ("", "no server address given"),
        ("  ", "no server address given"),
        (
            [f"h{i}:1" for i in range(MAX_SERVERS + 1)],
            f"{MAX_SERVERS + 1} server addresses given: a client takes 1 to {MAX_SERVERS}",
        ),
        ("a:1,", "not a server address"),
        ("a:1,b:http", "not a server address"),
        ("a:1,b:70000", "not a server address"),
        (["a:1", ("b", 0)], "not a server address"),
        (["a:1", ("b", "2")], "not a server address"),
        ("a:1,b:2,a:1", "server address a:1 is listed twice"),
    ],
)
def test_a_list_that_cannot_be_used_is_refused_saying_why(servers, message):
    with pytest.raises(ValueError, match=message):
        parse_servers(servers)
    if isinstance(servers, str) and "," not in servers:
        return  # to a client, a host (as before)
    with pytest.raises(ValueError, match=message):
        Client(servers)


def test_sixteen_servers_are_taken():
    assert len(Client([f"h{i}:1" for i in range(MAX_SERVERS)]).servers.addresses) == MAX_SERVERS


# Spreading and failing over, on real servers.


def test_clients_made_one_after_another_spread_over_the_servers(servers):
    listed = [address(server.port) for server in servers]
    for _ in range(2 * len(servers)):
        with Client(listed, timeout=DEADLINE) as client:
            client.create_job("spread")
    assert [job_count(server) for server in servers] == [2, 2, 2]


def test_a_server_that_refuses_connections_is_passed_over(servers):
    live = servers[0]
    first, last = free_ports(2)
    listed = [address(first), address(live.port), address(last)]
    # Each starting place in the list, as clients made in turn start at each.
    for _ in range(len(listed)):
        with Client(listed, timeout=DEADLINE) as client:
            client.create_job("passed over")
            assert client.address == address(live.port)
    assert job_count(live) == len(listed)


def test_when_no_server_answers_the_failure_names_every_one():
    listed = [address(port) for port in free_ports(3)]
    with Client(listed, timeout=DEADLINE) as client, pytest.raises(ConnectionFailed) as failed:
        client.ping()
    text = str(failed.value)
    assert text.startswith("cannot connect to any of the 3 servers: "), text
    for each in listed:
        assert f"cannot connect to {each}: " in text, text


def on_the_fake_first(client: Client | TrioClient, fake: FakeServer) -> None:
    """Have the client's first connection go to the fake, listed first
    (white box: a client starts at the next server in its turn)."""
    assert client.servers.addresses[0] == ("127.0.0.1", fake.port)
    client.servers.first = 0


def test_a_write_whose_node_breaks_is_not_sent_again_and_the_next_goes_elsewhere(servers):
    fake = FakeServer([NO_REPLY])
    try:
        with Client([address(fake.port), address(servers[0].port)], timeout=DEADLINE) as client:
            on_the_fake_first(client, fake)
            with pytest.raises(ConnectionFailed, match="may have been carried out"):
                client.finish_job(1)
            assert client.create_job("surely") > 0
    finally:
        fake.stop()
    assert fake.methods() == [(0, "FinishJob")]
    assert job_count(servers[0]) == 1


def test_a_create_whose_node_breaks_is_sent_to_another_under_its_idempotency_key(servers):
    fake = FakeServer([NO_REPLY])
    try:
        with Client([address(fake.port), address(servers[0].port)], timeout=DEADLINE) as client:
            on_the_fake_first(client, fake)
            assert client.create_job("moved") > 0
            assert client.address == address(servers[0].port)
    finally:
        fake.stop()
    assert fake.methods() == [(0, "CreateJob")]
    assert job_count(servers[0]) == 1


def test_a_waiting_get_job_whose_node_breaks_is_sent_to_another(servers):
    fake = FakeServer([NO_REPLY])
    live = servers[0]
    with live.client() as maker:
        job_id = ok(maker.request("CreateJob", name="waited")).json["jobID"]
    try:
        with Client([address(fake.port), address(live.port)], timeout=DEADLINE) as client:
            on_the_fake_first(client, fake)
            job = client.get_job("waited", wait=5)
    finally:
        fake.stop()
    assert job is not None and job["jobID"] == job_id
    assert fake.methods() == [(0, "GetJob")]


async def test_the_trio_client_moves_on_the_same_way(servers):
    fake = FakeServer([NO_REPLY], [reply("200 OK", b"")])
    listed = [address(fake.port), address(servers[0].port), address(free_port())]
    try:
        async with TrioClient(listed, timeout=DEADLINE) as client:
            on_the_fake_first(client, fake)
            assert await client.get_jobs("nothing", 5, wait=0.2) == []
            assert client.address == address(servers[0].port)
            assert await client.create_job("trio") > 0
    finally:
        await trio.to_thread.run_sync(fake.stop)
    assert fake.methods() == [(0, "GetJobs")]


# The command line.


def run_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_takes_several_servers_and_passes_over_a_dead_one(
    servers, capsys, monkeypatch
):
    monkeypatch.delenv("JOBSERVER_SERVER", raising=False)
    live = servers[0]
    listed = f"{address(free_port())},{address(live.port)}"
    for _ in range(2):  # from each end of the list
        code, out, err = run_here(capsys, "create", "--server", listed, "cli")
        assert (code, err) == (0, ""), err
        assert json.loads(out)["jobID"] > 0
    monkeypatch.setenv("JOBSERVER_SERVER", listed)
    code, out, err = run_here(capsys, "status")
    assert (code, err) == (0, ""), err
    assert json.loads(out)["jobs"] == {"QUEUED": 2}


def test_top_takes_several_servers(servers, capsys):
    listed = f"{address(free_port())},{address(servers[0].port)}"
    for _ in range(2):  # from each end of the list
        code, out, err = run_here(capsys, "top", "--once", "--server", listed)
        assert (code, err) == (0, ""), err
        assert out.startswith("jobserver "), out


@pytest.mark.parametrize(
    "given, message",
    [
        ("127.0.0.1:1,", "not a server address"),
        ("127.0.0.1:1,127.0.0.1", "a server address needs its port"),
        ("127.0.0.1:1,127.0.0.1:1", "is listed twice"),
        (",".join(f"127.0.0.1:{i + 1}" for i in range(MAX_SERVERS + 1)), "a client takes 1 to 16"),
    ],
)
def test_a_bad_server_list_is_a_usage_error(capsys, monkeypatch, given, message):
    code, out, err = run_here(capsys, "ping", "--server", given)
    assert (code, out) == (2, "")
    assert "argument --server: " in err and message in err, err
    monkeypatch.setenv("JOBSERVER_SERVER", given)
    code, out, err = run_here(capsys, "ping")
    assert (code, out) == (2, "")
    assert err.startswith("jobserver: $JOBSERVER_SERVER: ") and message in err, err


def test_the_command_line_names_every_server_none_of_which_answers(capsys):
    listed = ",".join(address(port) for port in free_ports(2))
    code, out, err = run_here(capsys, "ping", "--server", listed)
    assert (code, out) == (5, "")
    assert err.startswith("jobserver: cannot connect to any of the 2 servers: "), err


# Three nodes, workers on all three, one killed.

NODES = 3
# Jobs come in batches of BATCH every BATCH_EVERY seconds, BATCHES in all.
BATCH, BATCH_EVERY, BATCHES = 5, 0.05, 60
# A job handed out in a reply the killed node never sent comes back when
# its lease runs out: short, so that the test is.
LEASE = "+2 SECONDS"
# Everything done this long after the last job was created, at most.
DRAIN = 20.0
# GetJobs the workers wait with once idle: the Python worker's (its first
# fetcher asks for every free slot, its second waits for one to come free)
# and the manager's.
FETCHERS = 2

PYTHON_WORKER = """
from pathlib import Path

from jobserver.worker import Worker

worker = Worker(jobs="fo/*")


@worker.handler("fo/*")
async def step(data, job):
    with open({done!r}, "a") as done:
        done.write(f"{{job.id}}\\n")
"""

# Its line also says which servers the manager gave it.
MANAGED_WORKER = """#!/bin/sh
echo "$JOB_ID $JOBSERVER_SERVER" >> {done}
"""


@pytest.fixture
def nodes() -> Iterator[list[ServerProcess]]:
    with pg.fresh_schema() as url, ThreadPoolExecutor(NODES) as pool:
        started = list(pool.map(lambda _: ServerProcess(url), range(NODES)))
        try:
            for node in started:
                assert node.started, "a node did not start:\n" + node.log
            yield started
        finally:
            for node in started:
                node.kill()


def waiting(node: ServerProcess) -> int:
    with node.client() as client:
        return int(ok(client.request("Status")).json["waitingGetJobs"])


def left(node: ServerProcess) -> dict[str, int]:
    with node.client() as client:
        jobs: dict[str, int] = ok(client.request("Status")).json["jobs"]
        return jobs


def done_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def done_ids(path: Path) -> set[int]:
    return {int(line[0]) for line in done_lines(path)}


class Creator:
    """A stream of jobs made through a client of all the nodes, in a thread.
    A CreateJobs whose node dies under it may or may not have been carried
    out: it is not counted, and the next goes to another node."""

    def __init__(self, listed: str) -> None:
        self.listed = listed
        self.acknowledged: set[int] = set()
        self.uncertain = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with Client.from_address(self.listed, timeout=DEADLINE) as client:
            for _ in range(BATCHES):
                jobs = [{"name": "fo/step", "retryAfter": LEASE}] * BATCH
                try:
                    self.acknowledged.update(client.create_jobs(jobs))
                except ConnectionFailed:
                    self.uncertain += 1
                time.sleep(BATCH_EVERY)

    def join(self) -> None:
        self.thread.join(DEADLINE + BATCHES * BATCH_EVERY)
        assert not self.thread.is_alive()


def python_worker(tmp_path: Path, listed: str, done: Path) -> LoggedProcess:
    (tmp_path / "fo_worker.py").write_text(PYTHON_WORKER.format(done=str(done)))
    return LoggedProcess(
        [
            sys.executable,
            "-m",
            "jobserver",
            "worker",
            "fo_worker:worker",
            "--server",
            listed,
            "--concurrency",
            "4",
            "--grace",
            "1",
        ]
    )


def managed_workers(tmp_path: Path, port: int, listed: str, done: Path) -> ManagerProcess:
    directory = tmp_path / "workers"
    directory.mkdir()
    script = directory / "step"
    script.write_text(MANAGED_WORKER.format(done=done))
    script.chmod(0o755)
    # The last --server wins: the one listing every node.
    return ManagerProcess(
        port, directory, "--server", listed, "--job-name", "fo/*", "--max-workers", "4"
    )


def stop(worker: LoggedProcess) -> None:
    if worker.proc.poll() is None:
        worker.signal(signal.SIGTERM)
        try:
            worker.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            worker.kill()


def test_workers_keep_running_while_one_of_three_nodes_is_killed(nodes, tmp_path, monkeypatch):
    listed = ",".join(address(node.port) for node in nodes if node.port)
    done = tmp_path / "done"
    monkeypatch.chdir(tmp_path)  # where the Python worker's module is
    workers: list[LoggedProcess] = []
    try:
        workers.append(python_worker(tmp_path, listed, done))
        workers.append(managed_workers(tmp_path, nodes[0].port or 0, listed, done))
        until(lambda: sum(map(waiting, nodes)) >= FETCHERS, DEADLINE, "the workers to wait")
        creator = Creator(listed)
        until(lambda: len(done_ids(done)) >= 3 * BATCH, DEADLINE, "jobs to be done")
        # A node that workers wait on, while jobs flow.
        victim = until(
            lambda: next((node for node in nodes if waiting(node)), None),
            DEADLINE,
            "a waiting GetJob on some node",
        )
        victim.signal(signal.SIGKILL)
        assert victim.wait(DEADLINE) == -signal.SIGKILL
        survivors = [node for node in nodes if node is not victim]
        killed_at = len(done_ids(done))
        creator.join()
        assert creator.acknowledged, "no job was created"
        until(
            lambda: creator.acknowledged <= done_ids(done),
            DRAIN,
            "every acknowledged job to be done",
        )
        # The GetJobs that waited on the killed node wait on the others now.
        until(lambda: sum(map(waiting, survivors)) >= FETCHERS, DEADLINE, "workers to wait again")
        until(lambda: left(survivors[0]) == {}, DEADLINE, "no job left in the queue")
        for worker in workers:
            assert worker.proc.poll() is None, "a worker ended:\n" + worker.log
        # Workers the manager starts are given every node, for their own requests.
        assert {tuple(line[1:]) for line in done_lines(done)} == {(), (listed,)}
    finally:
        for worker in workers:
            stop(worker)
            print(worker.log)  # shown if the test fails
    print(
        f"{len(creator.acknowledged)} jobs acknowledged, {creator.uncertain} batches "
        f"uncertain, {killed_at} done before the kill, {len(done_ids(done))} done in all"
    )
    assert killed_at < len(creator.acknowledged), "the node died after the work was over"
    for worker in workers:
        assert "Traceback" not in worker.log, worker.log
        # A GetJobs that lost its node was sent to another at once, not
        # given up and retried after a backoff wait.
        assert "cannot get jobs" not in worker.log, worker.log


def test_the_python_workers_settings_take_a_list():
    assert Settings(servers="a:1,b:2").addresses == (("a", 1), ("b", 2))
    assert Settings(servers=[("a", 1)], host="ignored").addresses == (("a", 1),)
    assert Settings(host="::1", port=9000).addresses == (("::1", 9000),)
    with pytest.raises(ValueError, match="listed twice"):
        Settings(servers=["a:1", "a:1"])
    with pytest.raises(ValueError, match="a client takes 1 to 16"):
        Settings(servers=[f"h:{i + 1}" for i in range(MAX_SERVERS + 1)])


def test_servers_of_a_list_each_hold_their_own_order():
    # White box: the rotation tries each server once from the first, and a
    # client that moves on never starts at the server it leaves.
    client = Client(["a:1", "b:1", "c:1"])
    tried = [client.address for _ in client.servers.rotation()]
    assert sorted(tried) == ["a:1", "b:1", "c:1"]
    for _ in range(20):
        now = client.address
        client.switch_server()
        assert client.servers.first != client.servers.current
        assert [client.address for _ in client.servers.rotation()][-1] == now
    # Clients made in turn start at each server in turn.
    assert {Client(["a:1", "b:1"]).address for _ in range(2)} == {"a:1", "b:1"}
