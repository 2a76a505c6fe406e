"""What the worker logs of its jobs: at INFO each job that did not finish
(failed, retried, handed back), the first FINISHED_LINES of the finished
jobs each second (the others at DEBUG), and a line every SUMMARY_EVERY
seconds counting how the jobs of that time ended. At thousands of jobs a
second a line for each finished job cost the worker a fifth of its time;
a worker that finishes a few a second still shows each."""

from __future__ import annotations

import logging
from collections import Counter

import anyio

from jobserver.wire.counts import counted
from jobserver.workers.contract import Outcome

log = logging.getLogger("jobserver.worker")

SUMMARY_EVERY = 60.0
# Finished jobs logged at INFO each second, at most.
FINISHED_LINES = 10
# How the summary names each report's verb.
ENDINGS = {
    "finish": "finished", "fail": "failed", "retry": "retried", "cancelled": "cancelled",
}


class Tally:
    """The jobs that ended since the last summary, by how."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.since = anyio.current_time()
        self.second = 0  # the whole second of the event loop's clock counted in
        self.lines_left = FINISHED_LINES  # finished jobs' lines left at INFO this second

    def ended(self, job_id: int, name: str, result: Outcome, seconds: float) -> None:
        """Log one job's end, and count it."""
        verb = result.report.verb if result.reported else "cancelled"
        self.counts[verb] += 1
        level = self._finished_level() if verb == "finish" else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "job %s %s %s in %.3fs", job_id, name, result.text, seconds)

    def _finished_level(self) -> int:
        """INFO for the first FINISHED_LINES finished jobs of a second, then DEBUG."""
        second = int(anyio.current_time())
        if second != self.second:
            self.second, self.lines_left = second, FINISHED_LINES
        if not self.lines_left:
            return logging.DEBUG
        self.lines_left -= 1
        return logging.INFO

    def summarize(self) -> None:
        """Log the jobs that ended since the last summary, if any."""
        now = anyio.current_time()
        if self.counts:
            ends = ", ".join(
                f"{self.counts[verb]} {ENDINGS.get(verb, verb)}"
                for verb in ENDINGS
                if self.counts[verb]
            )
            total = counted(self.counts.total(), "job")
            log.info("%s in the last %.0fs: %s", total, now - self.since, ends)
        self.counts.clear()
        self.since = now

    async def summary_loop(self) -> None:
        """Summarize every SUMMARY_EVERY seconds; runs until cancelled."""
        while True:
            await anyio.sleep(SUMMARY_EVERY)
            self.summarize()
