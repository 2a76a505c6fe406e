"""Keeping PostgreSQL's picture of the jobs table true (issue 38): an
ANALYZE when the planner takes the table for far smaller than it is.

A queue's table swings from empty to tens of thousands of rows in
seconds. The planner estimates a table's rows as the density the last
ANALYZE or VACUUM saw (reltuples / relpages) times its pages now; an
ANALYZE of an emptied table whose dead rows still fill its pages leaves
a density of 0, so a burst of jobs written afterwards is still taken for
no rows at all. Every plan is then a coin toss between indexes: in a
drain (bench/pg_drain.py --dead 22000 --analyze-empty) each FinishJobs'
delete of 100 jobs read the whole of jobsName instead of jobs_pkey
(13,200 to 16,400 buffers over a drain of 10,000), and the search read
jobsReadyNextRun and sorted: 1,616 µs of PostgreSQL's CPU a job over a
drain of 50,000, against 49 with statistics taken after the fill.
Autovacuum mends that within its naptime (a minute) when it runs at all;
the nodes look every second, on a connection of their own
(postgres.PostgresStore.keep_statistics).

A plain VACUUM of a never-analyzed table (an operator's, or autovacuum's
without its analyze) is the other trap: it sets reltuples to the live
rows but takes no column statistics, so the planner sizes the table
rightly and guesses every selectivity. It expected about one ready row
of 100,000 and sorted all of them through jobsReadyName (an external
merge sort, ~150 ms a search; 397 to 470 µs of PostgreSQL's CPU a job
against ~45). The row count being true, only the missing pg_stats rows
tell; one ANALYZE takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psycopg

log = logging.getLogger("jobserver")

# Fewer live rows than this are read quickly by any plan: such a table is
# never analyzed on the nodes' account.
MIN_ROWS = 1000
# How many times more live rows than the planner expects make its
# statistics stale: a table that grows in pages keeps its density, so a
# truer one is rarely this far off (it is when the density is 0).
STALE_FACTOR = 2.0

# The statistics the planner reads, the table's pages now, its live rows
# (the cumulative statistics, a second behind at most), whether this role
# may ANALYZE it (its owner, or a member of the owner's role), and whether
# it has column statistics. pg_stats, not pg_statistic: only a superuser
# may read the latter, while the view shows the owner its table's rows;
# the lookup is by pg_class's and pg_statistic's indexes (~0.1 ms).
_LOOK = (
    b"SELECT c.reltuples, c.relpages, "
    b"pg_relation_size(c.oid) / current_setting('block_size')::integer, "
    b"pg_stat_get_live_tuples(c.oid), pg_has_role(c.relowner, 'USAGE'), "
    b"EXISTS (SELECT 1 FROM pg_stats s "
    b"WHERE s.schemaname = n.nspname AND s.tablename = c.relname) "
    b"FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    b"WHERE c.oid = 'jobs'::regclass"
)


def planner_rows(reltuples: float, relpages: int, pages: int) -> float | None:
    """The rows the planner takes the table to hold, or None when it
    estimates them from the row's width instead (never analyzed, or no
    pages then), which follows the table's size as it grows."""
    if reltuples < 0 or relpages <= 0:
        return None
    return reltuples / relpages * pages


def stale(reltuples: float, relpages: int, pages: int, live: int) -> bool:
    """Whether the planner expects far fewer rows than `live`."""
    expected = planner_rows(reltuples, relpages, pages)
    return expected is not None and live >= MIN_ROWS and live > STALE_FACTOR * expected


def unanalyzed(reltuples: float, relpages: int, live: int, has_columns: bool) -> bool:
    """Whether a VACUUM sized the table but nothing took its column
    statistics: the planner then trusts the row count and guesses how
    many rows each condition keeps. A table with neither (never vacuumed
    nor analyzed) is sized by its pages and left alone, as stale() does."""
    sized = reltuples > 0 or relpages > 0
    return sized and live >= MIN_ROWS and not has_columns


def _why_analyze(
    reltuples: float, relpages: int, pages: int, live: int, *, has_columns: bool
) -> str | None:
    """Why the jobs table needs an ANALYZE, or None when it does not."""
    reltuples, relpages, pages, live = float(reltuples), int(relpages), int(pages), int(live)
    if stale(reltuples, relpages, pages, live):
        expected = planner_rows(reltuples, relpages, pages)
        return f"the planner expected {expected:.0f} rows of {live}"
    if unanalyzed(reltuples, relpages, live, has_columns):
        return f"{live} rows and no column statistics"
    return None


# The analyzer's connection's statement_timeout: ANALYZE samples at most
# 300 x default_statistics_target rows (30,000), a second or so.
ANALYZE_TIMEOUT = b"SET statement_timeout = '60s'"


class StatisticsKeeper:
    """Looks at the jobs table's statistics on a connection of its own,
    made on first use and again after it fails."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self._db: psycopg.Connection[Any] | None = None
        self._refused = False

    def keep(self) -> bool:
        """ANALYZE jobs if its statistics are stale; whether it did."""
        if self._db is None or self._db.closed:
            self._db = self._connect()
            # Its own bound, whatever the role's: a shorter one failed every
            # ANALYZE of a large table, once a second for good.
            self._db.execute(ANALYZE_TIMEOUT)
        try:
            row = self._db.execute(_LOOK).fetchone()
            assert row is not None
            why = _why_analyze(*row[:4], has_columns=bool(row[5]))
            if why is None:
                return False
            if not row[4]:
                self._say_refused()
                return False
            # SKIP_LOCKED: a VACUUM, another node's ANALYZE or a session's
            # LOCK TABLE would have held it (and a node's shutdown, which
            # waits for this thread) until released.
            self._db.execute(b"ANALYZE (SKIP_LOCKED) jobs")
        except psycopg.Error:
            self._db.close()
            raise
        log.debug("analyzed jobs: %s", why)
        return True

    def _say_refused(self) -> None:
        if not self._refused:
            self._refused = True
            log.warning(
                "the jobs table's statistics are stale and this node's role does not own "
                "it, so cannot ANALYZE it: plans may read far more than they need until "
                "autovacuum does"
            )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
