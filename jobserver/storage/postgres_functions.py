"""The SQL that makes the PostgreSQL schema's functions and Query's login
table, which postgres_schema.py runs as it creates or migrates a queue's
schema: the transactional enqueue, GetJob's search, and Query's row bound.
"""

from __future__ import annotations

from jobserver.storage.sql import HAND_OUT_ORDER, READY_SQL

# Transactional enqueue (docs/nodes.md, "Creating jobs from your own
# transactions"): a job created in the caller's transaction, and a
# notification that PostgreSQL delivers only if that transaction commits.
ENQUEUE_FUNCTION = """
CREATE OR REPLACE FUNCTION jobserver_create_job(
    job_name TEXT,
    job_data TEXT DEFAULT '{}',
    job_priority INTEGER DEFAULT 500,
    first_run TIMESTAMPTZ DEFAULT NULL
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    moment TIMESTAMPTZ := clock_timestamp();
    run_at TIMESTAMPTZ := GREATEST(COALESCE(first_run, moment), moment);
    new_id BIGINT;
BEGIN
    IF job_name IS NULL OR octet_length(job_name) NOT BETWEEN 1 AND 255
       OR job_name ~ '[\\x01-\\x1f\\x7f-\\x9f]' THEN
        RAISE EXCEPTION 'jobserver_create_job: malformed name %', quote_literal(job_name)
            USING ERRCODE = '22023';
    END IF;
    IF job_priority NOT IN (0, 250, 500, 750, 850, 1000) THEN
        RAISE EXCEPTION 'jobserver_create_job: invalid priority %', job_priority
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(job_data::jsonb) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'jobserver_create_job: data is not a JSON object'
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO jobs (created, state, name, nextRun, data, priority)
    VALUES (
        to_char(moment AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
        'QUEUED', job_name,
        to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS'),
        job_data, job_priority
    )
    RETURNING jobID INTO new_id;
    PERFORM pg_notify(%(channel)s, json_build_object(
        'ready', CASE WHEN run_at <= moment THEN json_build_array(job_name) ELSE '[]' END,
        'due', CASE WHEN run_at > moment
            THEN to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS') END
    )::text);
    RETURN new_id;
END
$fn$
"""


# The search of a GetJob, in one round trip: per priority, highest first,
# an index range of due jobs in hand-out order, locked as they are read and
# passing over those another node holds, until `wanted` are found. One
# query per priority keeps each one an index range, whatever the queue
# holds (a single ordered query over all priorities would sort them all).
# What the search has passed over is left out in the query (version 7):
# the held names and held patterns (regular expressions) tested on each due
# job's entry, and, within the priority of the last job it read, the jobs
# up to that one, before the index range (`after_*`, NULL for none). Since
# version 8 also the held names of one key (`held_pairs`, a name and a key
# joined by a line break, which neither holds) and the held patterns of
# one key (`held_key_patterns` with `held_keys`, pairwise).
def _find_ready_after(names_or_pattern: str, after: str) -> str:
    return f"""
            RETURN QUERY SELECT * FROM jobs
                WHERE state IN ({READY_SQL}) AND {names_or_pattern}
                AND priority = level AND nextRun <= due
                AND name NOT IN (SELECT unnest(held_names)) AND name !~ ALL(held_patterns)
                AND (cardinality(held_pairs) = 0
                    OR (name || E'\\n' || key) NOT IN (SELECT unnest(held_pairs)))
                AND (cardinality(held_keys) = 0
                    OR NOT EXISTS (SELECT 1 FROM unnest(held_key_patterns, held_keys) AS h(p, k)
                        WHERE h.k = key AND name ~ h.p)){after}
                ORDER BY {HAND_OUT_ORDER} LIMIT wanted - found
                FOR UPDATE SKIP LOCKED;"""


# Written from the index's first column. Behind `priority = level` this
# is a filter, not the range's start: each page reads the priority's
# entries from its first again (with 25,000 jobs handed out before the one
# passed over, 213 buffers a page of 100). `(nextRun, name, jobID) > (...)`
# starts the range there (7 buffers), but in a generic plan without
# statistics PostgreSQL then took jobsReadyNextRun's range from after_next
# to due and sorted it (a page of 1,600 behind 100,000 held jobs: 470 ms
# against 20), so the search stays written this way (docs/benchmarks.md).
_AFTER = (
    '\n                AND (priority, nextRun, name, jobID) > '
    '(level, after_next COLLATE "C", after_name COLLATE "C", after_id)'
)
FIND_READY_AFTER_FUNCTION = f"""
CREATE OR REPLACE FUNCTION jobserver_find_ready_after(
    due TEXT, priorities INTEGER[], wanted INTEGER, pattern TEXT, names TEXT[],
    held_names TEXT[], held_patterns TEXT[], held_pairs TEXT[],
    held_key_patterns TEXT[], held_keys TEXT[],
    after_priority INTEGER, after_next TEXT, after_name TEXT, after_id BIGINT
) RETURNS SETOF jobs LANGUAGE plpgsql AS $fn$
DECLARE
    level INTEGER;
    found INTEGER := 0;
    got INTEGER;
BEGIN
    FOREACH level IN ARRAY priorities LOOP
        IF names IS NOT NULL AND level = after_priority THEN
{_find_ready_after("name = ANY(names)", _AFTER)}
        ELSIF names IS NOT NULL THEN
{_find_ready_after("name = ANY(names)", "")}
        ELSIF level = after_priority THEN
{_find_ready_after("name ~ pattern", _AFTER)}
        ELSE
{_find_ready_after("name ~ pattern", "")}
        END IF;
        GET DIAGNOSTICS got = ROW_COUNT;
        found := found + got;
        EXIT WHEN found >= wanted;
    END LOOP;
END
$fn$
"""

# Query's own role logs in with this password (storage/postgres_query.py):
# one row, kept where only the nodes' own database user can read it, so
# that every node of the queue logs Query in the same way.
QUERY_LOGIN_TABLE = """
CREATE TABLE jobserver_query_login (password TEXT NOT NULL);
REVOKE ALL ON jobserver_query_login FROM PUBLIC
"""

# Query's row bound, evaluated by PostgreSQL for each row before it is
# sent: a row whose text is larger than the whole reply may be is an error
# there, so no node ever receives it (storage/postgres_query.py).
QUERY_ROW_FITS_FUNCTION = """
CREATE OR REPLACE FUNCTION jobserver_query_row_fits(row_bytes BIGINT, most BIGINT)
RETURNS BOOLEAN LANGUAGE plpgsql AS $fn$
BEGIN
    IF row_bytes > most THEN
        RAISE EXCEPTION 'a row of % bytes is larger than a reply may be (% bytes)',
            row_bytes, most USING ERRCODE = '%(code)s';
    END IF;
    RETURN TRUE;
END
$fn$
"""
