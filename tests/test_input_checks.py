"""Checks on what clients send: flags, job names, times, costs, jobID lists.

Each is proved over the wire against a real server; the name rule is also
checked as a grammar with hypothesis (times in tests/test_times.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ThreadServer
from helpers import create
from jobserver.core.commands import known_headers, params
from jobserver.core.errors import CommandError
from jobserver.model.globmatch import MAX_SET_CHARACTERS, MAX_WILDCARDS
from jobserver.model.limits import Limit
from jobserver.wire.framing import Request
from jobserver.wire.limits import MAX_HEADERS
from wire import Client

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

FAST = settings(max_examples=300, deadline=None)


def running(client: Client, name: str) -> int:
    job_id = create(client, name)
    reply = client.request("GetJob", name=name)
    assert reply.status == "200 OK", reply
    return job_id


def names(client: Client) -> list[str]:
    reply = client.request("Query", query="SELECT name FROM jobs ORDER BY jobID;", format="json")
    return [row[0] for row in reply.json["rows"]]


# unique: a flag like the others.


@pytest.mark.parametrize("flag", ["true", "True", "TRUE", " tRuE ", "1", "-3"])
def test_unique_is_read_like_every_other_flag(client, flag):
    first = create(client, "one", data={"a": 1})
    assert create(client, "one", data={"b": 2}, unique=flag) == first
    reply = client.request(
        "CreateJobs",
        jobs=[{"name": "one", "unique": flag.strip()}, {"name": "one", "unique": True}],
    )
    assert reply.json == {"jobIDs": [first, first]}
    assert names(client) == ["one"]


@pytest.mark.parametrize("flag", ["false", "no", "0", "yes"])
def test_unique_false_creates_another_job(client, flag):
    first = create(client, "one")
    assert create(client, "one", unique=flag) != first


@pytest.mark.parametrize(("overwrite", "kept"), [("TRUE", False), ("1", False), ("false", True)])
def test_overwrite_is_read_like_every_other_flag(client, overwrite, kept):
    job_id = create(client, "one", data={"a": 1})
    assert create(client, "one", data={"b": 2}, unique="True", overwrite=overwrite) == job_id
    data = client.request("QueryJob", jobID=job_id).json["data"]
    assert data == ({"a": 1} if kept else {"a": 1, "b": 2})


# Job names: no control characters.

CONTROL = ["\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x1f", "\x7f", "\x80", "\x85", "\x9f"]


def escaped(text: str) -> str:
    """A header value that unescapes to `text` (protocol.md 1.3)."""
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text.replace("\\", "\\\\"))


@pytest.mark.parametrize("char", CONTROL)
def test_create_job_refuses_a_name_with_a_control_character(untouched, char):
    reply = untouched.request("CreateJob", name=escaped(f"job{char}x"))
    assert reply.status == "402 Malformed name"
    reply = untouched.request("CreateJobs", jobs=[{"name": "fine"}, {"name": f"job{char}x"}])
    assert reply.status == "402 Malformed name"
    assert names(untouched) == []


@pytest.mark.parametrize("char", CONTROL)
def test_renames_refuse_a_name_with_a_control_character(client, char):
    job_id = running(client, "job")
    reply = client.request("RetryJob", jobID=job_id, name=escaped(f"new{char}"))
    assert reply.status == "402 Malformed name"
    reply = client.request("RequeueJobs", jobIDs=job_id, name=escaped(f"new{char}"))
    assert reply.status == "402 Malformed name"
    assert names(client) == ["job"]
    assert client.request("QueryJob", jobID=job_id).json["state"] == "RUNNING"


@pytest.mark.parametrize("char", ["\0", "\x01", "\n", "\x7f", "\x9f"])
@pytest.mark.parametrize(
    ("verb", "params"),
    [
        ("GetJob", {}), ("GetJob", {"Connection": "wait", "timeout": 100}),
        ("GetJobs", {"numResults": 2}), ("FailedJobs", {}),
        ("SetLimit", {"max": 2}), ("PauseJobs", {}), ("ResumeJobs", {}),
    ],
)
def test_patterns_refuse_a_control_character(untouched, verb, params, char):
    # No name holds one, so no pattern with one could match; refused alike
    # on every backend (PostgreSQL's text cannot even hold NUL).
    for pattern in [f"a{char}", f"a*{char}", f"a,b{char}"]:
        reply = untouched.request(verb, name=escaped(pattern), **params)
        assert reply.status == "402 Malformed name", (pattern, reply)
    status = untouched.request("Status").json
    assert (status["limits"], status["paused"]) == ({}, [])


@pytest.mark.parametrize(
    ("verb", "params"),
    [
        ("GetJob", {}), ("GetJob", {"Connection": "wait", "timeout": 100}),
        ("GetJobs", {"numResults": 2}), ("FailedJobs", {}),
        ("RequeueFailedJobs", {"dryRun": "true"}), ("DeleteFailedJobs", {"dryRun": "true"}),
        ("CancelQueuedJobs", {"dryRun": "true"}), ("RunningJobs", {}),
        ("SetLimit", {"max": 2}), ("PauseJobs", {}), ("ResumeJobs", {}),
    ],
)
def test_patterns_of_more_wildcards_than_the_bound_are_refused(client, verb, params):
    """Each wildcard costs every match of a pattern one more search (and its
    compile one more regular expression): a pattern holds at most
    MAX_WILDCARDS, well above what a real one needs."""
    refused = f"402 Name too complex ({MAX_WILDCARDS} wildcards at most)"
    create(client, "job/a")
    for over in ["*" * (MAX_WILDCARDS + 1), "a?" * (MAX_WILDCARDS + 1), "*[x]" * 20]:
        assert client.request(verb, name=over, **params).status == refused, (verb, over)
    # At the bound, and sets holding `*`, `?` and `[`, are patterns as before;
    # where a comma makes a list of exact names (FailedJobs'), they hold no
    # wildcards; GetJob's list of patterns counts them all together.
    fine = ["job/" + "*" * MAX_WILDCARDS, "job/[*?[]" * 5]
    listed = "job/*,job/b" + "*" * 40
    if verb.endswith("FailedJobs"):
        fine.append(listed)
    elif verb in ("GetJob", "GetJobs"):
        assert client.request(verb, name=listed, **params).status == refused, verb
    for pattern in fine:
        assert client.request(verb, name=pattern, **params).status != refused, (verb, pattern)
    # A set is read character by character wherever it is tried: the sets
    # of a pattern hold MAX_SET_CHARACTERS between them.
    too_large = f"402 Name too complex ({MAX_SET_CHARACTERS} characters in sets at most)"
    for over in ["job/*[" + "a" * (MAX_SET_CHARACTERS + 1) + "]", "[abcde]*" * 13, "*[" + "b" * 99]:
        assert client.request(verb, name=over, **params).status == too_large, (verb, over)
    for at in ["job/*[" + "a" * MAX_SET_CHARACTERS + "]", "[^abcd]*" * 16, "job/*[a-z0-9_]"]:
        assert client.request(verb, name=at, **params).status not in (refused, too_large), at


def test_names_with_other_unusual_characters_are_fine(client):
    for name in ["caf\u00e9", "a\u00a0b", "\u200bzero-width", "emoji \U0001f600", "a\\b"]:
        job_id = create(client, escaped(name))
        assert client.request("QueryJob", jobID=job_id).json["name"] == name


@FAST
@given(st.text(min_size=1, max_size=40))
def test_a_name_is_refused_exactly_when_it_holds_a_control_character(text):
    request = Request(method_line="CreateJob", headers={"name": text})
    has_control = any(unicodedata.category(c) == "Cc" for c in text)
    try:
        assert params.name(request) == text
    except CommandError as error:
        assert error.status == "402 Malformed name"
        assert has_control
    else:
        assert not has_control


# Times: unambiguous year-first forms only.

AMBIGUOUS = [
    "1/2/2030", "2/1/2030", "01/02/2030", "Jan 2 2030", "2 Jan 2030", "2030/01/02",
    "02-01-2030", "2030-1-2", "20300102", "2030-01-02 10:00 PST", "2030-01-02 10h",
    "January 2, 2030 10:00",
]


@pytest.mark.parametrize("text", AMBIGUOUS)
def test_times_in_other_forms_are_refused(client, text):
    reply = client.request("CreateJob", name="t", firstRun=text)
    assert reply.status == "402 Malformed firstRun"
    job_id = create(client, "t")
    reply = client.request("UpdateJob", jobID=job_id, data={}, nextRun=text)
    assert reply.status == "402 Malformed nextRun"
    client.request("GetJob", name="t")
    reply = client.request("RetryJob", jobID=job_id, nextRun=text)
    assert reply.status == "402 Malformed nextRun"


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("2030-01-02", "2030-01-02 00:00:00"),
        ("2030-01-02 03:04", "2030-01-02 03:04:00"),
        ("2030-01-02T03:04:05.678Z", "2030-01-02 03:04:05"),
        ("2030-01-02 03:04:05 UTC", "2030-01-02 03:04:05"),
        ("2030-01-02 03:04:05+0200", "2030-01-02 01:04:05"),
        ("2030-01-02T03:04:05-08", "2030-01-02 11:04:05"),
    ],
)
def test_year_first_times_are_read(client, text, stored):
    job_id = create(client, "t", firstRun=text)
    assert client.request("QueryJob", jobID=job_id).json["nextRun"] == stored


def jobserver(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "jobserver", *args], capture_output=True, text=True,
        timeout=30, env=env,
    )


def test_the_cli_passes_first_run_to_the_server_which_refuses_month_first(server, client):
    done = jobserver(
        "create", "x", "--first-run", "1/2/2030", "--server", f"127.0.0.1:{server.port}"
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "402 Malformed firstRun\n")
    assert names(client) == []


def test_the_cli_says_which_first_run_forms_it_takes():
    help_text = " ".join(jobserver("create", "--help").stdout.split())
    assert "YYYY-MM-DD" in help_text
    assert "YYYY-MM-DD HH:MM:SS" in help_text


# Costs: a job that can never fit under a limit on its name.


@pytest.fixture
def limited(tmp_path: Path):
    running_server = ThreadServer(tmp_path / "jobs.db", limits={"email/*": Limit(4)})
    with running_server.client() as c:
        yield c
    running_server.stop()


def test_a_cost_above_a_matching_limit_is_refused(limited):
    reply = limited.request("CreateJob", name="email/bulk", cost=5)
    assert reply.status == "402 Cost 5 exceeds limit email/* (max 4)"
    reply = limited.request(
        "CreateJobs", jobs=[{"name": "email/a"}, {"name": "email/b", "cost": 9}]
    )
    assert reply.status == "402 Cost 9 exceeds limit email/* (max 4)"
    assert names(limited) == []
    # At the capacity, or under no limit, a cost is fine.
    create(limited, "email/bulk", cost=4)
    create(limited, "sms/bulk", cost=5)


def test_a_limit_set_at_run_time_counts_too(limited):
    assert limited.request("SetLimit", name="sms/*", max=2).status == "200 OK"
    reply = limited.request("CreateJob", name="sms/x", cost=3)
    assert reply.status == "402 Cost 3 exceeds limit sms/* (max 2)"
    assert limited.request("SetLimit", name="sms/*", max=0).status == "200 OK"
    create(limited, "sms/x", cost=3)


def test_a_pattern_with_a_line_break_is_refused(limited):
    # A line break in a character class could match no name (names hold no
    # control characters), and would have to be escaped in status lines.
    reply = limited.request("SetLimit", name="a[\\nb]*", max=1)
    assert reply.status == "402 Malformed name"
    assert limited.request("CreateJob", name="abc", cost=2).status == "200 OK"
    assert "a[\nb]*" not in limited.request("Status").json["limits"]


def test_a_limit_lowered_below_a_queued_jobs_cost_holds_it_back(limited):
    # protocol.md 14.7: SetLimit is not refused; the job waits, QUEUED,
    # until the limit is raised or removed.
    job_id = create(limited, "email/bulk", cost=4)
    assert limited.request("SetLimit", name="email/*", max=3).status == "200 OK"
    assert limited.request("GetJob", name="email/*").status == "404 No job found"
    assert limited.request("QueryJob", jobID=job_id).json["state"] == "QUEUED"
    assert limited.request("SetLimit", name="email/*", max=4).status == "200 OK"
    assert limited.request("GetJob", name="email/*").json["jobID"] == job_id


# RequeueJobs: a list that names no job.


@pytest.mark.parametrize("ids", [",,", ",", " , , "])
def test_requeue_jobs_with_no_ids_is_malformed(untouched, ids):
    reply = untouched.request("RequeueJobs", jobIDs=ids)
    assert reply.status == "402 Malformed jobIDs"


def test_requeue_jobs_skips_empty_items_between_ids(client):
    job_id = running(client, "job")
    assert client.request("RequeueJobs", jobIDs=f",{job_id},,").status == "200 OK"
    assert client.request("QueryJob", jobID=job_id).json["state"] == "QUEUED"


# Headers a command does not read: ignored, as Bedrock does, and named.


def test_unknown_headers_are_ignored_and_named_in_the_reply(client):
    reply = client.request("CreateJob", name="typo", priorty=1000)
    assert (reply.status, reply.headers["ignoredHeaders"]) == ("200 OK", "priorty")
    job_id = int(reply.body.decode().split(":")[1].rstrip("}"))
    assert client.request("QueryJob", jobID=job_id).json["priority"] == 500
    # What a command reads, and what Bedrock's PHP client sends with every
    # command, are not named: such a client's replies are as they were.
    reply = client.request(
        "CreateJob", name="php", data="{}", unique="false", jobPriority=500,
        Connection="wait", idempotent="false", overwrite="true", writeConsistency="ASYNC",
        timeout=110000,
    )
    assert reply.status == "200 OK" and "ignoredHeaders" not in reply.headers
    # Known to one command is unknown to another: GetJob takes no repeat.
    reply = client.request("GetJob", name="nothing", repeat="HOURLY", Extra="1")
    assert (reply.status, reply.headers["ignoredHeaders"]) == ("404 No job found", "repeat, extra")
    # A waiting GetJob names them in the answer it gives when it ends.
    reply = client.request("GetJob", name="nothing", Connection="wait", timeout=1, nmae="x")
    assert (reply.status, reply.headers["ignoredHeaders"]) == ("404 No job found", "nmae")
    assert "ignoredHeaders" not in client.request("Bogus", x="1").headers
    # The keys of CreateJobs' and FinishJobs' elements are named as well,
    # after the request's own headers.
    reply = client.request(
        "CreateJobs", jobs=[{"name": "a"}, {"name": "b", "priorty": 1000}], extra="1"
    )
    assert (reply.status, reply.headers["ignoredHeaders"]) == ("200 OK", "extra, jobs[1].priorty")
    a, b = reply.json["jobIDs"]
    for _ in range(2):
        assert client.request("GetJob", name="[ab]").status == "200 OK"
    reply = client.request("FinishJobs", jobs=[{"jobID": a, "dta": {}}, {"jobID": b}])
    assert (reply.status, reply.headers["ignoredHeaders"]) == ("200 OK", "jobs[0].dta")


def test_the_names_of_ignored_headers_make_a_short_reply(client):
    # As many headers as a request may have (section 3), each named with
    # 30,000 characters: the reply names ten, cut, and counts the rest.
    count = MAX_HEADERS - 1
    many = {f"x{i:02d}" + "y" * 30_000: "1" for i in range(count)}
    reply = client.request("Ping", many)
    assert reply.status == "200 OK"
    value = reply.headers["ignoredHeaders"]
    assert len(value) < 1024
    assert value.startswith("x00" + "y" * 58 + "..., x01")
    assert value.endswith(f" and {count - known_headers.MAX_IGNORED_LISTED} more")


def test_every_command_has_its_headers_listed_as_the_http_api_lists_them():
    from jobserver.core.commands.dispatch import ROUTES
    from jobserver.web import openapi

    assert set(known_headers.KNOWN_HEADERS) == set(ROUTES)
    for command in openapi.COMMANDS:
        listed = (openapi.body_schema(command) or {}).get("properties", {})
        known = known_headers.KNOWN_HEADERS[command.lower()]
        assert {name.lower() for name in listed} <= known, command
