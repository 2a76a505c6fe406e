"""A handed-out job's reply is the same bytes however it is written: a
plain job's from views.handout_json's template, any other by encoding its
object key by key (jsonbody.encode), as every reply was before."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.core.commands.views import handout_json, job_object
from jobserver.model.jobs import Job
from jobserver.wire import jsonbody

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
DATA = st.dictionaries(TEXT, st.integers() | TEXT, max_size=3).map(jsonbody.compact)

JOBS = st.builds(
    Job,
    created=TEXT, jobID=st.integers(1, 2**63 - 1), state=st.just("QUEUED"), name=TEXT,
    nextRun=TEXT, lastRun=st.none() | TEXT, repeat=TEXT, data=DATA,
    priority=st.integers(-(2**63), 2**63 - 1), parentJobID=st.just(0), retryAfter=TEXT,
    maxAttempts=st.integers(0, 3), retryBackoff=st.just(""), retryDelay=st.just(0.0),
    retryMaxDelay=st.just(3600.0), attempts=st.integers(0, 3), lastError=st.just(""),
    leaseID=st.just(""), cost=st.integers(1, 3), timeWindows=st.just("") | TEXT,
    timeZone=st.just("") | TEXT, key=st.just("") | TEXT,
)


@settings(max_examples=500, deadline=None)
@given(JOBS)
def test_a_plain_jobs_template_writes_what_its_object_encodes_to(job: Job) -> None:
    obj = job_object(job)
    written = handout_json(obj)
    assert written == jsonbody.encode(obj)
    assert json.loads(written)["data"] == json.loads(job.data)


def test_an_object_with_more_keys_is_encoded_key_by_key() -> None:
    job = Job(
        "2030-01-01 00:00:00", 7, "QUEUED", "a", "2030-01-01 00:00:00.000", None, "", "{}",
        500, 0, "", 2, "", 0.0, 3600.0, 0, "", "",
    )
    obj = job_object(job)
    obj["attempt"], obj["maxAttempts"] = 1, 2
    written = handout_json(obj)
    assert written == jsonbody.encode(obj)
    assert list(json.loads(written))[:2] == ["attempt", "created"]


def test_the_keys_kept_for_replies_are_bounded_in_count_and_length() -> None:
    """jsonbody keeps each object key's written form for the next reply; a
    key can be a client's text (a queue's name), so a reply of thousands of
    long keys is written right and leaves at most 1,024 short ones kept."""
    keys = {f"{index:05d}" + "q" * 10_000: index for index in range(3_000)}
    assert json.loads(jsonbody.encode(keys)) == keys
    kept = jsonbody._KEYS
    assert len(kept) <= 1024
    assert max(map(len, kept), default=0) <= 64
