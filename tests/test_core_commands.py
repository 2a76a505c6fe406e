"""End-to-end tests of the core commands over a real loopback socket.

Each test talks to a real server (the `server` fixture: trio in a thread, a
real SQLite file or PostgreSQL schema; tests of refused requests share one
per backend, conftest's `untouched` and `shared`) and reads the replies as a
client would. Bodies are
checked as JSON; status lines are checked exactly.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from helpers import create
from jobserver.wire.limits import MAX_BODY, MAX_HEADERS, MAX_LINE
from wire import Client, Reply, encode

# The same protocol on every backend, and through any of three nodes.
pytestmark = pytest.mark.backends(nodes=True)

QUERY_KEYS = {
    "created", "data", "jobID", "lastRun", "name", "nextRun",
    "priority", "repeat", "retryAfter", "state",
}
GET_KEYS = QUERY_KEYS - {"state"}


# Helpers.


def utc(text: str) -> datetime:
    """A time as the server writes it (`YYYY-MM-DD HH:MM:SS[.mmm]`, UTC)."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def now() -> datetime:
    return datetime.now(UTC)


def query(client: Client, job_id: int) -> dict[str, Any]:
    reply = client.request("QueryJob", jobID=job_id)
    assert reply.status == "200 OK", reply
    return reply.json


def get_job(client: Client, name: str = "*", **params: Any) -> dict[str, Any]:
    reply = client.request("GetJob", name=name, **params)
    assert reply.status == "200 OK", reply
    return reply.json


def assert_error(reply: Reply, status: str) -> None:
    """An error reply: exact status line and an empty body."""
    assert reply.status == status, reply
    assert reply.body == b""
    assert reply.headers.get("Content-Length") == "0"


def assert_queue_empty(client: Client) -> None:
    assert_error(client.request("GetJob", name="*"), "404 No job found")


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


# Ping, unknown verbs, reply format.


def test_ping_answers_200_ok_with_empty_body(client):
    reply = client.request("Ping")
    assert reply.status == "200 OK"
    assert reply.body == b""
    assert reply.headers == {"Content-Length": "0"}


@pytest.mark.parametrize("verb", ["Frobnicate", "GETJOBX", "Create Job"])
def test_unknown_verb_is_430_unrecognized_command(untouched, verb):
    assert_error(untouched.request(verb, name="x"), "430 Unrecognized command")
    assert untouched.request("Ping").status == "200 OK"


def test_create_job_reply_is_bare_status_content_length_and_json_body(client):
    client.send(b"CreateJob\r\nname: first\r\n\r\n")
    expected = b'200 OK\r\nContent-Length: 11\r\n\r\n{"jobID":1}'
    assert recv_exactly(client.sock, len(expected)) == expected


def test_error_reply_is_bare_status_with_zero_content_length(client):
    client.send(b"QueryJob\r\njobID: 5\r\n\r\n")
    expected = b"404 No job with this jobID\r\nContent-Length: 0\r\n\r\n"
    assert recv_exactly(client.sock, len(expected)) == expected


# CreateJob.


def test_create_job_stores_a_queued_job_with_defaults(client):
    before = now().replace(microsecond=0)
    job_id = create(client, "plain")
    after = now()
    job = query(client, job_id)
    assert set(job) == QUERY_KEYS
    assert job["jobID"] == job_id
    assert job["name"] == "plain"
    assert job["state"] == "QUEUED"
    assert job["data"] == {}
    assert job["priority"] == 500
    assert job["repeat"] == ""
    assert job["retryAfter"] == ""
    assert job["lastRun"] == ""
    assert before <= utc(job["created"]) <= after
    assert before <= utc(job["nextRun"]) <= after


def test_create_job_ids_increase_and_are_never_reused(client):
    first = create(client)
    assert client.request("DeleteJob", jobID=first).status == "200 OK"
    second = create(client)
    assert second > first


def test_create_job_keeps_data_as_json(client):
    data = {"url": "http://x.y/", "n": 1.5, "list": [1, None, True], "nested": {"é": "ü"}}
    job_id = create(client, data=data)
    assert query(client, job_id)["data"] == data


@pytest.mark.parametrize("headers", [{}, {"name": ""}, {"data": {"a": 1}}])
def test_create_job_without_name_is_402_missing_name(untouched, headers):
    assert_error(untouched.request("CreateJob", headers), "402 Missing name")
    assert_queue_empty(untouched)


def test_create_job_name_of_255_bytes_is_accepted(client):
    name = "n" * 255
    job_id = create(client, name)
    assert query(client, job_id)["name"] == name


@pytest.mark.parametrize("name", ["n" * 256, "é" * 128], ids=["256-ascii", "256-bytes-utf8"])
def test_create_job_name_over_255_bytes_is_402_name_too_large(untouched, name):
    reply = untouched.request("CreateJob", name=name)
    assert_error(reply, "402 Name too large (255 bytes at most)")
    assert_queue_empty(untouched)


@pytest.mark.parametrize("priority", [0, 250, 500, 750, 850, 1000])
def test_create_job_accepts_each_valid_priority(shared, priority):
    job_id = create(shared, jobPriority=priority)
    assert query(shared, job_id)["priority"] == priority


@pytest.mark.parametrize("header", ["jobPriority", "priority"])
@pytest.mark.parametrize("value", ["111", "-500", "1001", "1e3"])
def test_create_job_invalid_priority_is_402(untouched, header, value):
    reply = untouched.request("CreateJob", {header: value}, name="p")
    assert_error(reply, "402 Invalid priority value")
    assert_queue_empty(untouched)


def test_create_job_priority_header_is_a_fallback_for_job_priority(client):
    job_id = create(client, priority=1000)
    assert query(client, job_id)["priority"] == 1000


def test_create_job_job_priority_wins_over_priority(client):
    job_id = create(client, jobPriority=250, priority=1000)
    assert query(client, job_id)["priority"] == 250


@pytest.mark.parametrize(
    "data", ["blabla", "[]", "NaN", '{"a": NaN}', "", '"text"', "1", "null", '{"a":1', "{'a':1}"]
)
def test_create_job_data_not_a_json_object_is_402(untouched, data):
    reply = untouched.request("CreateJob", name="d", data=data)
    assert_error(reply, "402 Data is not a valid JSON Object")
    assert_queue_empty(untouched)


@pytest.mark.parametrize(
    "repeat",
    [
        "bogus",
        "FINISHED",
        "FINISHED,",
        "LATER, +1 HOUR",
        "FINISHED, +1 FORTNIGHT",
        "FINISHED, 1 HOUR",
    ],
)
def test_create_job_malformed_repeat_is_402(untouched, repeat):
    assert_error(untouched.request("CreateJob", name="r", repeat=repeat), "402 Malformed repeat")
    assert_queue_empty(untouched)


@pytest.mark.parametrize("first_run", ["tomorrow", "2024-13-45", "2024-02-30 10:00:00", "12:99"])
def test_create_job_malformed_first_run_is_402(untouched, first_run):
    reply = untouched.request("CreateJob", name="f", firstRun=first_run)
    assert_error(reply, "402 Malformed firstRun")
    assert_queue_empty(untouched)


def test_create_job_bad_input_stores_nothing(client):
    bad = [
        {"data": "[]"},
        {"jobPriority": "111"},
        {"repeat": "sometimes"},
        {"firstRun": "never"},
        {"name": "x" * 300},
    ]
    for params in bad:
        assert client.request("CreateJob", {"name": "bad", **params}).code == 402
    assert_queue_empty(client)
    assert_error(client.request("QueryJob", jobID=1), "404 No job with this jobID")
    # The failures left no gap and no half-written row: the next job is whole.
    job_id = create(client, "good")
    assert query(client, job_id)["name"] == "good"


def test_create_job_with_http_suffix_on_method_line(client):
    client.send(b"CreateJob / HTTP/1.1\r\nname: httpish\r\n\r\n")
    reply = client.read_reply()
    assert reply.status == "200 OK"
    assert query(client, reply.json["jobID"])["name"] == "httpish"
    client.send(b"GetJob / HTTP/1.1\r\nname: httpish\r\n\r\n")
    assert client.read_reply().json["name"] == "httpish"


def test_verbs_are_case_insensitive(client):
    reply = client.request("createjob", name="lower")
    assert reply.status == "200 OK"
    assert client.request("QUERYJOB", jobID=reply.json["jobID"]).json["name"] == "lower"


def test_header_names_are_case_insensitive(client):
    client.send(
        b'CreateJob\r\nNAME: shout\r\nDATA: {"a":1}\r\nJobPriority: 1000\r\nREPEAT: hourly\r\n\r\n'
    )
    job_id = client.read_reply().json["jobID"]
    client.send(f"queryjob\r\nJOBID: {job_id}\r\n\r\n".encode())
    job = client.read_reply().json
    assert (job["name"], job["data"]) == ("shout", {"a": 1})
    assert (job["priority"], job["repeat"]) == (1000, "HOURLY")


def test_header_values_are_backslash_unescaped(client):
    # The client doubles JSON's backslashes; the server undoes one level.
    client.send(
        # (A name may not hold a control character such as a tab.)
        b"CreateJob\r\nname: back\\\\slash caf\\u00e9\r\n"
        b'data: {"q":"say \\\\"hi\\\\"","nl":"a\\\\nb","u":"\\\\u00e9"}\r\n\r\n'
    )
    reply = client.read_reply()
    assert reply.status == "200 OK", reply
    job = query(client, reply.json["jobID"])
    assert job["name"] == "back\\slash caf\u00e9"
    assert job["data"] == {"q": 'say "hi"', "nl": "a\nb", "u": "é"}


def test_json_with_single_backslashes_is_corrupted_and_rejected(client):
    # `\"` unescapes to `"`, which ends the string early: not JSON any more.
    client.send(b'CreateJob\r\nname: naive\r\ndata: {"a":"x\\"y"}\r\n\r\n')
    assert_error(client.read_reply(), "402 Data is not a valid JSON Object")
    assert_queue_empty(client)


def test_future_first_run_is_not_handed_out(client):
    first_run = stamp(now() + timedelta(days=1))
    job_id = create(client, "later", firstRun=first_run)
    assert_error(client.request("GetJob", name="later"), "404 No job found")
    job = query(client, job_id)
    assert job["state"] == "QUEUED"
    assert job["nextRun"] == first_run


def test_past_first_run_is_handed_out(client):
    job_id = create(client, "overdue", firstRun="2020-01-01 00:00:00")
    assert get_job(client, "overdue")["jobID"] == job_id


@pytest.mark.parametrize(
    "given, stored",
    [
        ("2031-03-04T05:06:07+02:00", "2031-03-04 03:06:07"),
        ("2031-03-04 05:06:07-05:30", "2031-03-04 10:36:07"),
        ("2031-03-04T05:06:07Z", "2031-03-04 05:06:07"),
        ("2031-03-04 05:06:07", "2031-03-04 05:06:07"),
        ("2031-03-04", "2031-03-04 00:00:00"),
    ],
)
def test_first_run_is_stored_as_utc(shared, given, stored):
    job_id = create(shared, firstRun=given)
    assert query(shared, job_id)["nextRun"] == stored


# GetJob.


def test_get_job_reply_has_exactly_nine_keys_with_the_row_before_dequeue(client):
    job_id = create(client, "worker", data={"k": "v"}, jobPriority=750)
    job = get_job(client, "worker")
    assert set(job) == GET_KEYS
    assert list(job) == sorted(job, key=str.lower)
    assert job["jobID"] == job_id
    assert job["name"] == "worker"
    assert job["data"] == {"k": "v"}
    assert job["priority"] == 750
    assert job["lastRun"] == ""
    assert (job["repeat"], job["retryAfter"]) == ("", "")


def test_get_job_marks_the_job_running_with_last_run(client):
    job_id = create(client, "worker")
    before = now().replace(microsecond=0)
    get_job(client, "worker")
    job = query(client, job_id)
    assert job["state"] == "RUNNING"
    assert before <= utc(job["lastRun"]) <= now()


def test_get_job_hands_a_job_out_once(client):
    create(client, "once")
    get_job(client, "once")
    assert_error(client.request("GetJob", name="once"), "404 No job found")


def test_get_job_on_empty_queue_is_404(client):
    assert_error(client.request("GetJob", name="*"), "404 No job found")


@pytest.mark.parametrize("headers", [{}, {"name": ""}])
def test_get_job_without_name_is_402_missing_name(shared, headers):
    job_id = create(shared, "x")
    assert_error(shared.request("GetJob", headers), "402 Missing name")
    assert query(shared, job_id)["state"] == "QUEUED"


def test_get_job_pattern_over_12750_bytes_is_402_name_too_large(shared):
    job_id = create(shared, "x")
    assert_error(
        shared.request("GetJob", name="x" * 12751), "402 Name too large (12750 bytes at most)"
    )
    assert query(shared, job_id)["state"] == "QUEUED"


@pytest.mark.parametrize("num_results", ["1", "5", ""])
def test_get_job_with_num_results_is_402_and_dequeues_nothing(shared, num_results):
    job_id = create(shared, "n")
    reply = shared.request("GetJob", name="n", numResults=num_results)
    assert_error(reply, "402 Cannot use numResults with GetJob; try GetJobs")
    assert query(shared, job_id)["state"] == "QUEUED"


def test_get_job_invalid_job_priority_is_402(shared):
    job_id = create(shared, "n")
    assert_error(shared.request("GetJob", name="n", jobPriority=111), "402 Invalid priority value")
    assert query(shared, job_id)["state"] == "QUEUED"


def test_get_job_hands_out_highest_priority_first(client):
    ids = {p: create(client, "prio", jobPriority=p) for p in (0, 500, 250, 1000, 750, 850)}
    order = [get_job(client, "prio")["jobID"] for _ in ids]
    assert order == [ids[p] for p in (1000, 850, 750, 500, 250, 0)]
    assert_queue_empty(client)


def test_get_job_same_priority_oldest_next_run_first(client):
    newest = create(client, "age")  # nextRun = now
    middle = create(client, "age", firstRun="2020-01-02 00:00:00")
    oldest = create(client, "age", firstRun="2020-01-01 00:00:00")
    order = [get_job(client, "age")["jobID"] for _ in range(3)]
    assert order == [oldest, middle, newest]


def test_get_job_same_priority_and_time_in_creation_order(client):
    ids = [create(client, "fifo") for _ in range(5)]
    assert [get_job(client, "fifo")["jobID"] for _ in ids] == ids


def test_get_job_same_priority_and_next_run_by_name_then_job_id(client):
    # protocol.md 4.4: priority, then oldest nextRun, then name, then jobID.
    when = "2020-01-01 00:00:00"
    zeta = create(client, "zeta", firstRun=when)
    alpha_1 = create(client, "alpha", firstRun=when)
    alpha_2 = create(client, "alpha", firstRun=when)
    assert [get_job(client)["jobID"] for _ in range(3)] == [alpha_1, alpha_2, zeta]


def test_get_job_priority_beats_age(client):
    old_low = create(client, "mix", jobPriority=0, firstRun="2000-01-01")
    new_high = create(client, "mix", jobPriority=1000)
    assert get_job(client, "mix")["jobID"] == new_high
    assert get_job(client, "mix")["jobID"] == old_low


def test_get_job_job_priority_filters(client):
    create(client, "f", jobPriority=1000)
    low = create(client, "f", jobPriority=0)
    assert get_job(client, "f", jobPriority=0)["jobID"] == low
    assert_error(client.request("GetJob", name="f", jobPriority=0), "404 No job found")


def test_get_job_pattern_is_a_case_sensitive_glob(client):
    report = create(client, "Report/daily")
    create(client, "task7")
    assert_error(client.request("GetJob", name="report*"), "404 No job found")
    assert get_job(client, "Rep*")["jobID"] == report
    assert_error(client.request("GetJob", name="task"), "404 No job found")
    assert get_job(client, "task[0-9]")["name"] == "task7"


def test_get_job_glob_question_mark_matches_one_character(client):
    create(client, "ab")
    assert_error(client.request("GetJob", name="a??"), "404 No job found")
    assert get_job(client, "a?")["name"] == "ab"


def test_get_job_comma_list_of_names_is_exact_and_of_patterns_is_patterns(client):
    abc = create(client, "abc")
    b = create(client, "b")
    star = create(client, "a*")
    other = create(client, "c")
    # Bedrock's list of exact names: `abcd` takes no `abc`.
    assert get_job(client, "abcd, b")["jobID"] == b
    # A list with a wildcard in a piece is a list of GLOB patterns: `a*`
    # takes `abc` and `a*` alike. Jobs created in the same millisecond tie
    # on nextRun; the order between names is not the point here.
    taken = {get_job(client, "a*, zz")["jobID"], get_job(client, "zz,a*")["jobID"]}
    assert taken == {abc, star}
    assert_error(client.request("GetJob", name="a*,b"), "404 No job found")
    assert query(client, other)["state"] == "QUEUED"
    assert get_job(client, "a*,c")["jobID"] == other


# QueryJob.


def test_query_job_has_exactly_ten_keys(client):
    job_id = create(client, "q", data={"x": [1, 2]}, repeat="finished, +1 hour", jobPriority=850)
    reply = client.request("QueryJob", jobID=job_id)
    assert reply.status == "200 OK"
    job = reply.json
    assert set(job) == QUERY_KEYS
    assert list(job) == sorted(job, key=str.lower)
    assert job["data"] == {"x": [1, 2]}
    assert job["repeat"] == "FINISHED, +1 HOUR"
    assert job["priority"] == 850


@pytest.mark.parametrize("command", ["QueryJob", "FinishJob", "DeleteJob", "UpdateJob"])
def test_missing_job_id_is_402(shared, command):
    job_id = create(shared)
    assert_error(shared.request(command, data={}), "402 Missing jobID")
    assert_error(shared.request(command, jobID="", data={}), "402 Missing jobID")
    assert query(shared, job_id)["state"] == "QUEUED"


@pytest.mark.parametrize("command", ["QueryJob", "FinishJob", "DeleteJob", "UpdateJob"])
@pytest.mark.parametrize("job_id", ["007", "1.0", "abc", "+1", "1e0", "9223372036854775808"])
def test_malformed_job_id_is_402(shared, command, job_id):
    created = create(shared)
    assert_error(shared.request(command, jobID=job_id, data={}), "402 Malformed jobID")
    # "1.0", "+1" or "1e0" read leniently would name job 1: the shared
    # server's first job, which stays QUEUED as every job there does.
    for job in (1, created):
        assert query(shared, job)["state"] == "QUEUED"


@pytest.mark.parametrize("command", ["QueryJob", "FinishJob", "DeleteJob", "UpdateJob"])
@pytest.mark.parametrize("job_id", ["2", "9223372036854775807"])
def test_unknown_job_id_is_404(client, command, job_id):
    create(client)
    assert_error(client.request(command, jobID=job_id, data={}), "404 No job with this jobID")


# FinishJob.


def test_finish_job_deletes_a_job_without_repeat(client):
    job_id = create(client, "one-off")
    get_job(client, "one-off")
    reply = client.request("FinishJob", jobID=job_id)
    assert reply.status == "200 OK"
    assert reply.body == b""
    assert_error(client.request("QueryJob", jobID=job_id), "404 No job with this jobID")
    assert_error(client.request("FinishJob", jobID=job_id), "404 No job with this jobID")


def test_finish_job_of_a_queued_job_is_405(client):
    job_id = create(client, "waiting")
    reply = client.request("FinishJob", jobID=job_id)
    assert_error(reply, "405 Can only retry/finish RUNNING and RUNQUEUED jobs")
    assert query(client, job_id)["state"] == "QUEUED"


def test_finish_job_with_bad_data_changes_nothing(client):
    job_id = create(client, "running", data={"keep": 1}, repeat="HOURLY")
    get_job(client, "running")
    reply = client.request("FinishJob", jobID=job_id, data="[1]")
    assert_error(reply, "402 Data is not a valid JSON Object")
    job = query(client, job_id)
    assert (job["state"], job["data"]) == ("RUNNING", {"keep": 1})


def test_finish_job_with_empty_data_keeps_the_data(client):
    job_id = create(client, "running", data={"keep": 1}, repeat="HOURLY")
    get_job(client, "running")
    reply = client.request("FinishJob", jobID=job_id, data="")
    assert reply.status == "200 OK", reply
    assert query(client, job_id)["data"] == {"keep": 1}


def test_finish_job_repeat_finished_requeues_one_hour_after_finish(client):
    job_id = create(client, "rep", repeat="finished, +1 hour", data={"n": 0})
    get_job(client, "rep")
    before = now().replace(microsecond=0)
    assert client.request("FinishJob", jobID=job_id, data={"n": 1}).status == "200 OK"
    after = now()
    job = query(client, job_id)
    assert job["state"] == "QUEUED"
    assert job["data"] == {"n": 1}
    assert job["repeat"] == "FINISHED, +1 HOUR"
    assert before + timedelta(hours=1) <= utc(job["nextRun"]) <= after + timedelta(hours=1)
    assert_error(client.request("GetJob", name="rep"), "404 No job found")


def test_finish_job_repeat_scheduled_counts_from_next_run(client):
    scheduled = now().replace(microsecond=0) - timedelta(minutes=30)
    job_id = create(client, "sched", repeat="SCHEDULED, +1 HOUR", firstRun=stamp(scheduled))
    get_job(client, "sched")
    assert client.request("FinishJob", jobID=job_id).status == "200 OK"
    job = query(client, job_id)
    assert job["state"] == "QUEUED"
    assert job["nextRun"] == stamp(scheduled + timedelta(hours=1))


def test_finish_job_repeat_started_counts_from_last_run(client):
    job_id = create(client, "started", repeat="STARTED, +1 HOUR", firstRun="2020-01-01 00:00:00")
    get_job(client, "started")
    last_run = query(client, job_id)["lastRun"]
    assert client.request("FinishJob", jobID=job_id).status == "200 OK"
    job = query(client, job_id)
    assert job["state"] == "QUEUED"
    assert job["nextRun"] == stamp(utc(last_run) + timedelta(hours=1))


def test_finish_job_canned_hourly_is_finished_plus_one_hour(client):
    job_id = create(client, "canned", repeat="hourly")
    get_job(client, "canned")
    before = now().replace(microsecond=0)
    client.request("FinishJob", jobID=job_id)
    job = query(client, job_id)
    assert job["repeat"] == "HOURLY"
    assert before + timedelta(hours=1) <= utc(job["nextRun"]) <= now() + timedelta(hours=1)


def test_finish_job_data_delete_true_deletes_a_repeating_job(client):
    job_id = create(client, "stop-me", repeat="FINISHED, +1 HOUR")
    get_job(client, "stop-me")
    assert client.request("FinishJob", jobID=job_id, data={"delete": True}).status == "200 OK"
    assert_error(client.request("QueryJob", jobID=job_id), "404 No job with this jobID")


def test_finish_job_data_delete_false_keeps_a_repeating_job(client):
    job_id = create(client, "keep-me", repeat="FINISHED, +1 HOUR")
    get_job(client, "keep-me")
    assert client.request("FinishJob", jobID=job_id, data={"delete": False}).status == "200 OK"
    assert query(client, job_id)["state"] == "QUEUED"


def test_repeating_job_runs_again_with_the_data_it_finished_with(client):
    # Scheduled two days ago, daily: its next run has passed, so it is due at once.
    two_days_ago = stamp(now() - timedelta(days=2))
    job_id = create(client, "again", repeat="SCHEDULED, +1 DAY", firstRun=two_days_ago,
                    data={"step": 1})
    get_job(client, "again")
    client.request("FinishJob", jobID=job_id, data={"step": 2})
    job = get_job(client, "again")
    assert (job["jobID"], job["data"]) == (job_id, {"step": 2})
    assert job["lastRun"] != ""


# DeleteJob.


def test_delete_job_removes_a_queued_job(client):
    job_id = create(client, "gone")
    reply = client.request("DeleteJob", jobID=job_id)
    assert (reply.status, reply.body) == ("200 OK", b"")
    assert_error(client.request("QueryJob", jobID=job_id), "404 No job with this jobID")
    assert_queue_empty(client)
    assert_error(client.request("DeleteJob", jobID=job_id), "404 No job with this jobID")


def test_delete_job_of_a_running_job_is_405(client):
    job_id = create(client, "busy")
    get_job(client, "busy")
    assert_error(client.request("DeleteJob", jobID=job_id), "405 Can't delete a RUNNING job")
    assert query(client, job_id)["state"] == "RUNNING"


def test_delete_job_of_a_future_job(client):
    job_id = create(client, "future", firstRun="2099-01-01")
    assert client.request("DeleteJob", jobID=job_id).status == "200 OK"
    assert_error(client.request("QueryJob", jobID=job_id), "404 No job with this jobID")


# UpdateJob.


def test_update_job_replaces_data(client):
    job_id = create(client, "u", data={"old": 1})
    reply = client.request("UpdateJob", jobID=job_id, data={"new": [1, 2]})
    assert (reply.status, reply.body) == ("200 OK", b"")
    job = query(client, job_id)
    assert job["data"] == {"new": [1, 2]}
    assert job["state"] == "QUEUED"


def test_update_job_works_on_a_running_job(client):
    job_id = create(client, "u")
    get_job(client, "u")
    assert client.request("UpdateJob", jobID=job_id, data={"status": "CHECKING"}).status == "200 OK"
    job = query(client, job_id)
    assert (job["state"], job["data"]) == ("RUNNING", {"status": "CHECKING"})


def test_update_job_without_data_is_402_missing_data(client):
    job_id = create(client, "u", data={"old": 1})
    assert_error(client.request("UpdateJob", jobID=job_id), "402 Missing data")
    assert query(client, job_id)["data"] == {"old": 1}


def test_update_job_with_empty_data_is_402_missing_data(client):
    job_id = create(client, "u", data={"old": 1})
    assert_error(client.request("UpdateJob", jobID=job_id, data=""), "402 Missing data")


@pytest.mark.parametrize("data", ["blabla", "[]", "NaN"])
def test_update_job_with_invalid_data_changes_nothing(client, data):
    job_id = create(client, "u", data={"old": 1})
    reply = client.request("UpdateJob", jobID=job_id, data=data)
    assert_error(reply, "402 Data is not a valid JSON Object")
    assert query(client, job_id)["data"] == {"old": 1}


def test_update_job_sets_job_priority(client):
    low = create(client, "u", jobPriority=0)
    create(client, "u", jobPriority=500)
    assert client.request("UpdateJob", jobID=low, data={}, jobPriority=1000).status == "200 OK"
    assert query(client, low)["priority"] == 1000
    assert get_job(client, "u")["jobID"] == low


def test_update_job_invalid_priority_changes_nothing(client):
    job_id = create(client, "u", data={"old": 1})
    reply = client.request("UpdateJob", jobID=job_id, data={"new": 1}, jobPriority=111)
    assert_error(reply, "402 Invalid priority value")
    job = query(client, job_id)
    assert (job["data"], job["priority"]) == ({"old": 1}, 500)


def test_update_job_repeat_is_stored_and_recomputes_next_run(client):
    scheduled = now().replace(microsecond=0) - timedelta(minutes=10)
    job_id = create(client, "u", firstRun=stamp(scheduled))
    reply = client.request("UpdateJob", jobID=job_id, data={}, repeat="scheduled, +1 hour")
    assert reply.status == "200 OK"
    job = query(client, job_id)
    assert job["repeat"] == "SCHEDULED, +1 HOUR"
    assert job["nextRun"] == stamp(scheduled + timedelta(hours=1))
    assert_error(client.request("GetJob", name="u"), "404 No job found")


def test_update_job_malformed_repeat_changes_nothing(client):
    job_id = create(client, "u", data={"old": 1})
    reply = client.request("UpdateJob", jobID=job_id, data={"new": 1}, repeat="whenever")
    assert_error(reply, "402 Malformed repeat")
    job = query(client, job_id)
    assert (job["data"], job["repeat"]) == ({"old": 1}, "")


def test_update_job_next_run_reschedules(client):
    job_id = create(client, "u")
    reply = client.request("UpdateJob", jobID=job_id, data={}, nextRun="2099-05-06T07:08:09+01:00")
    assert reply.status == "200 OK"
    assert query(client, job_id)["nextRun"] == "2099-05-06 06:08:09"
    assert_error(client.request("GetJob", name="u"), "404 No job found")
    client.request("UpdateJob", jobID=job_id, data={}, nextRun="2000-01-01 00:00:00")
    assert get_job(client, "u")["jobID"] == job_id


def test_update_job_next_run_wins_over_repeat(client):
    job_id = create(client, "u")
    next_run = "2098-01-01 00:00:00"
    client.request("UpdateJob", jobID=job_id, data={}, repeat="HOURLY", nextRun=next_run)
    job = query(client, job_id)
    assert (job["repeat"], job["nextRun"]) == ("HOURLY", "2098-01-01 00:00:00")


def test_update_job_malformed_next_run_is_402(client):
    job_id = create(client, "u", data={"old": 1})
    reply = client.request("UpdateJob", jobID=job_id, data={"new": 1}, nextRun="soonish")
    assert_error(reply, "402 Malformed nextRun")
    assert query(client, job_id)["data"] == {"old": 1}


@pytest.mark.parametrize("flag", ["true", "TRUE", "1"])
def test_update_job_should_clear_repeat(client, flag):
    job_id = create(client, "u", repeat="HOURLY")
    reply = client.request("UpdateJob", jobID=job_id, data={}, shouldClearRepeat=flag)
    assert reply.status == "200 OK"
    assert query(client, job_id)["repeat"] == ""
    # Without a repeat, finishing the job deletes it.
    get_job(client, "u")
    client.request("FinishJob", jobID=job_id)
    assert_error(client.request("QueryJob", jobID=job_id), "404 No job with this jobID")


@pytest.mark.parametrize("flag", ["false", "0", ""])
def test_update_job_should_clear_repeat_false_keeps_repeat(client, flag):
    job_id = create(client, "u", repeat="HOURLY")
    client.request("UpdateJob", jobID=job_id, data={}, shouldClearRepeat=flag)
    assert query(client, job_id)["repeat"] == "HOURLY"


def test_update_job_should_clear_repeat_wins_over_repeat(client):
    job_id = create(client, "u", repeat="HOURLY")
    client.request("UpdateJob", jobID=job_id, data={}, repeat="DAILY", shouldClearRepeat="true")
    assert query(client, job_id)["repeat"] == ""


# UTF-8 and framing.


def test_invalid_utf8_is_400_and_the_connection_stays_usable(client):
    client.send(b"CreateJob\r\nname: caf\xe9\r\n\r\n")
    assert_error(client.read_reply(), "400 Request is not valid UTF-8")
    client.send(b"Create\xffJob\r\nname: x\r\n\r\n")
    assert_error(client.read_reply(), "400 Request is not valid UTF-8")
    assert client.request("Ping").status == "200 OK"
    assert_queue_empty(client)
    assert create(client, "café") == 1


def test_line_over_max_line_is_414_and_closes(client):
    # The line is one byte too long only once its last byte arrives, so the
    # server has read everything sent when it answers.
    prefix = b"CreateJob\r\nname: "
    client.send(prefix + b"a" * (MAX_LINE + 1 - len(b"name: ")))
    reply = client.read_reply()
    assert_error(reply, "414 Line too long")
    assert reply.headers.get("Connection") == "close"
    assert client.at_eof()


def test_too_many_headers_is_431_and_closes(client):
    headers = "".join(f"h{i}: v\r\n" for i in range(MAX_HEADERS + 1))
    client.send(f"Ping\r\n{headers}\r\n".encode())
    reply = client.read_reply()
    assert_error(reply, "431 Too many headers")
    assert reply.headers.get("Connection") == "close"
    assert client.at_eof()


def test_max_headers_is_accepted(client):
    headers = "".join(f"h{i}: v\r\n" for i in range(MAX_HEADERS - 1))
    client.send(f"CreateJob\r\nname: many\r\n{headers}\r\n".encode())
    assert client.read_reply().status == "200 OK"


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "0x10"])
def test_malformed_content_length_is_400_and_closes(client, value):
    client.send(f"CreateJob\r\nname: x\r\nContent-Length: {value}\r\n\r\n".encode())
    reply = client.read_reply()
    assert_error(reply, "400 Malformed Content-Length")
    assert reply.headers.get("Connection") == "close"
    assert client.at_eof()


def test_body_over_max_body_is_413_and_closes(server, client):
    client.send(f"CreateJob\r\nname: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
    reply = client.read_reply()
    assert_error(reply, "413 Body too large")
    assert reply.headers.get("Connection") == "close"
    assert client.at_eof()
    with server.client() as other:
        assert_queue_empty(other)


def test_body_of_max_body_is_read_and_skipped(client):
    client.send(f"Ping\r\nContent-Length: {MAX_BODY}\r\n\r\n".encode() + b"x" * MAX_BODY)
    assert client.read_reply().status == "200 OK"
    assert create(client, "after-body") == 1


def test_body_is_ignored_and_does_not_swallow_the_next_request(client):
    client.send(b"CreateJob\r\nname: a\r\nContent-Length: 5\r\n\r\nhelloPing\r\n\r\n")
    assert client.read_reply().json == {"jobID": 1}
    assert client.read_reply().status == "200 OK"


def test_requests_before_a_framing_error_are_answered_first(client):
    client.send(b"Ping\r\n\r\nCreateJob\r\nname: ok\r\n\r\nPing\r\nContent-Length: x\r\n\r\n")
    assert client.read_reply().status == "200 OK"
    assert client.read_reply().json == {"jobID": 1}
    assert client.read_reply().status == "400 Malformed Content-Length"
    assert client.at_eof()


def test_pipelined_requests_are_answered_in_order(client):
    batch = [
        ("CreateJob", {"name": "pipe", "data": {"i": 1}}),
        ("CreateJob", {"name": "pipe", "data": {"i": 2}}),
        ("GetJob", {"name": "pipe"}),
        ("QueryJob", {"jobID": 1}),
        ("Bogus", {}),
        ("FinishJob", {"jobID": 1}),
        ("QueryJob", {"jobID": 1}),
        ("Ping", {}),
        ("GetJob", {"name": "pipe"}),
        ("GetJob", {"name": "pipe"}),
    ]
    client.send(b"".join(encode(verb, params) for verb, params in batch))
    replies = [client.read_reply() for _ in batch]
    assert [r.status for r in replies] == [
        "200 OK", "200 OK", "200 OK", "200 OK", "430 Unrecognized command",
        "200 OK", "404 No job with this jobID", "200 OK", "200 OK", "404 No job found",
    ]
    assert replies[0].json == {"jobID": 1}
    assert replies[1].json == {"jobID": 2}
    assert replies[2].json["data"] == {"i": 1}
    assert replies[3].json["state"] == "RUNNING"
    assert replies[8].json["data"] == {"i": 2}


def test_request_split_across_sends_is_reassembled(client):
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for piece in (b"Creat", b"eJob\r\nna", b"me: split\r", b"\n\r", b"\nPing\r\n", b"\r\n"):
        client.send(piece)
    assert client.read_reply().json == {"jobID": 1}
    assert client.read_reply().status == "200 OK"
    assert query(client, 1)["name"] == "split"


def test_bare_newlines_and_leading_blank_lines_are_accepted(client):
    client.send(b"\n\r\nCreateJob\nname: nl\ndata: {\"a\":1}\n\n\nQueryJob\njobID: 1\n\n")
    assert client.read_reply().json == {"jobID": 1}
    assert client.read_reply().json["data"] == {"a": 1}


def test_half_closed_connection_still_gets_its_replies(client):
    client.send(encode("CreateJob", {"name": "half"}) + encode("QueryJob", {"jobID": 1}))
    client.sock.shutdown(socket.SHUT_WR)
    assert client.read_reply().json == {"jobID": 1}
    assert client.read_reply().json["name"] == "half"
    assert client.at_eof()


# Connection header.


@pytest.mark.parametrize("value", ["close", "Close"])
def test_connection_close_is_echoed_and_the_socket_closes(client, value):
    client.send(f"CreateJob\r\nname: last\r\nConnection: {value}\r\n\r\nPing\r\n\r\n".encode())
    reply = client.read_reply()
    assert reply.status == "200 OK"
    assert reply.json == {"jobID": 1}
    assert reply.headers.get("Connection") == "close"
    assert list(reply.headers)[-1] == "Content-Length"
    assert client.at_eof()


def test_connection_close_on_an_error_reply(client):
    reply = client.request("QueryJob", jobID=7, Connection="close")
    assert_error(reply, "404 No job with this jobID")
    assert reply.headers.get("Connection") == "close"
    assert client.at_eof()


def test_connection_close_still_stores_the_job(server, client):
    client.request("CreateJob", name="kept", Connection="close")
    with server.client() as other:
        assert query(other, 1)["name"] == "kept"


def test_connection_wait_on_create_job_has_no_effect(client):
    # Were the server to wait, the client's 10 s socket timeout would fail the test.
    reply = client.request("CreateJob", name="w", Connection="wait", timeout=60000)
    assert reply.status == "200 OK"
    assert reply.json == {"jobID": 1}
    assert "Connection" not in reply.headers
    assert query(client, 1)["state"] == "QUEUED"
    assert client.request("QueryJob", jobID=1, Connection="wait").status == "200 OK"


# Inputs found to need care.


@pytest.mark.parametrize("data", ['{"a":1e400}', '{"a":-1e999}', '{"a":[1e309]}'])
def test_numbers_too_large_for_json_are_refused(client, data):
    # They would parse as infinity, which has no JSON form to store.
    client.send(f"CreateJob\nname: big\ndata: {data}\n\n".encode())
    assert_error(client.read_reply(), "402 Data is not a valid JSON Object")
    assert_queue_empty(client)


def test_fail_job_with_an_empty_data_header_keeps_the_data(client):
    job_id = create(client, "f", data={"kept": True})
    get_job(client, "f")
    client.send(f"FailJob\njobID: {job_id}\ndata:\n\n".encode())
    assert client.read_reply().status == "200 OK"
    job = query(client, job_id)
    assert (job["state"], job["data"]) == ("FAILED", {"kept": True})


def test_time_zone_abbreviations_are_refused(client):
    # `PST` means different zones in different places; only UTC names and
    # numeric offsets are read.
    reply = client.request("CreateJob", name="tz", firstRun="2030-01-01 04:00:00 PST")
    assert_error(reply, "402 Malformed firstRun")
    job_id = create(client, "tz", firstRun="2030-01-01 04:00:00 -0800")
    assert query(client, job_id)["nextRun"] == "2030-01-01 12:00:00"


def test_scheduled_repeat_keeps_whole_second_phase(client):
    # A new job's nextRun has milliseconds; its SCHEDULED repeats still fall
    # on whole intervals from its creation second.
    job_id = create(client, "phase", repeat="SCHEDULED, +30 SECONDS")
    created = utc(query(client, job_id)["created"])
    get_job(client, "phase")
    assert client.request("FinishJob", jobID=job_id).status == "200 OK"
    next_run = utc(query(client, job_id)["nextRun"])
    assert (next_run - created).total_seconds() % 30 == 0
    assert next_run > now() - timedelta(seconds=1)
