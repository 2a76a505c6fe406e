"""`Worker`: the handlers of an application, each registered for a job-name
pattern, and which one takes a job.

    worker = Worker()

    @worker.handler("email/*")
    def send(data):                      # runs in a thread
        ...

    @worker.handler("thumb/make", timeout=60, lease=10)
    async def thumbnail(data, job):      # runs as a task on the event loop
        ...

A handler's first parameter gets the job's data (a dict); a parameter named
`job` gets the `Job` too. Anything else it requires is refused when it is
registered, not when the first job comes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from jobserver.core.commands import params
from jobserver.model.globmatch import (
    MAX_PATTERNS,
    MAX_WILDCARDS,
    glob_match,
    is_glob,
    too_many_wildcards,
)
from jobserver.wire.limits import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_RETRY_DELAY,
    MAX_TIMEOUT,
)
from jobserver.worker.settings import Settings
from jobserver.workers.policy import check_lease, retry_policy

F = TypeVar("F", bound=Callable[..., Any])

# The GetJobs name a worker asks with: as long as the server takes one.
MAX_JOBS_PATTERN = 12750


@dataclass(frozen=True)
class Handler:
    """One registered handler."""

    pattern: str  # a GLOB pattern, matched as GetJob matches names
    function: Callable[..., Any]
    is_async: bool  # `async def`: a task; else a thread
    wants_job: bool  # has a parameter named `job`
    timeout: float | None  # None: the worker's --timeout
    # The retry policy sent with a failure of a job created without one
    # (FailJob's, protocol.md 14.1), as fail_job's keywords; {} for none.
    policy: dict[str, Any] = field(default_factory=dict)
    # Seconds of the lease its jobs are renewed by (leases.py); None: the
    # worker's (--lease).
    lease: int | None = None

    @property
    def label(self) -> str:
        """The function's name, for the log."""
        return getattr(self.function, "__qualname__", repr(self.function))


class Worker:
    """The handlers one worker runs. `jobs`: the GetJobs name to ask with;
    by default it is made from the handlers' patterns (`get_jobs_name`)."""

    def __init__(self, jobs: str | None = None) -> None:
        if jobs is not None:
            check_pattern(jobs, MAX_JOBS_PATTERN, commas=True)
        self.jobs = jobs
        self.handlers: list[Handler] = []

    def handler(
        self,
        pattern: str,
        *,
        timeout: float | None = None,
        max_attempts: int | None = None,
        backoff: str = DEFAULT_BACKOFF,
        retry_delay: float = DEFAULT_RETRY_DELAY,
        retry_max_delay: float = DEFAULT_MAX_RETRY_DELAY,
        lease: int | None = None,
    ) -> Callable[[F], F]:
        """A decorator: the function handles the jobs whose name matches
        `pattern` (a GLOB pattern, no comma), each within `timeout` seconds
        (0 < timeout <= a week; default: the worker's). The first
        registered handler whose pattern matches a job takes it.
        `max_attempts` (1 to 10,000), `backoff` ("fixed" or "exponential"),
        `retry_delay` and `retry_max_delay` (seconds) are the retry policy
        of the jobs it takes that were created without one (a job's own
        wins), sent with their first failure (protocol.md 14.1). `lease`
        (whole seconds, 1 to a day) replaces the worker's --lease for the
        jobs it takes without retryAfter, from their first renewal on
        (leases.py): a job whose worker died is back when it ends."""
        check_pattern(pattern, params.MAX_NAME, commas=False)
        policy = retry_policy(max_attempts, backoff, retry_delay, retry_max_delay)
        check_lease(lease)
        if timeout is not None and not (
            isinstance(timeout, int | float)
            and math.isfinite(timeout)
            and 0 < timeout <= MAX_TIMEOUT
        ):
            raise ValueError(f"timeout must be seconds above 0 and at most {MAX_TIMEOUT:g}")

        def register(function: F) -> F:
            handler = _handler(pattern, function, timeout)
            self.handlers.append(replace(handler, policy=policy, lease=lease))
            return function

        return register

    def run(self, settings: Settings, loop: Literal["asyncio", "trio"] = "asyncio") -> int:
        """Run until stopped (a signal), blocking, on a new event loop; the
        exit status (runner.py)."""
        # Here, not at the top: registering handlers needs no anyio, whose
        # import is slow.
        from jobserver.worker import runner

        return runner.run(self, settings, loop)

    async def serve(self, settings: Settings) -> int:
        """Run until stopped on the running asyncio or trio loop; the exit
        status. Without the main thread, use Settings(signals=False)."""
        from jobserver.worker import runner

        return await runner.serve(self, settings)

    def handler_for(self, name: str) -> Handler | None:
        """The handler that takes jobs named `name`, if any."""
        return next((h for h in self.handlers if glob_match(h.pattern, name)), None)

    def lease_for(self, name: str) -> int | None:
        """The lease of the handler that takes jobs named `name`, if it has one."""
        handler = self.handler_for(name)
        return None if handler is None else handler.lease

    def get_jobs_name(self) -> str:
        """The GetJobs name that asks for exactly the jobs the handlers
        take: `jobs` if given, else the handlers' patterns, comma-separated
        (a list of GLOB patterns, or of exact names when none is one;
        protocol.md 5.3), so the worker never takes a job it has no handler
        for. ValueError if there is none, or the list is past GetJobs'
        bounds."""
        if self.jobs is not None:
            return self.jobs
        patterns = list(dict.fromkeys(h.pattern for h in self.handlers))
        if not patterns:
            raise ValueError("the worker has no handlers")
        name = ",".join(patterns)
        if len(name.encode("utf-8")) > MAX_JOBS_PATTERN:
            raise ValueError(
                f"the handlers' patterns make a GetJobs name over {MAX_JOBS_PATTERN} bytes"
            )
        globs = [p for p in patterns if is_glob(p)]
        if globs and (len(patterns) > MAX_PATTERNS or too_many_wildcards(name)):
            raise ValueError(
                f"the handlers' patterns are more than GetJobs takes at once ({MAX_PATTERNS} "
                f"patterns, {MAX_WILDCARDS} wildcards in all): give the worker a pattern that "
                "covers them, Worker(jobs='...') or --job-name"
            )
        return name


def check_pattern(pattern: str, limit: int, commas: bool) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("a job-name pattern must be a non-empty string")
    if len(pattern.encode("utf-8")) > limit or params.has_control(pattern):
        raise ValueError(
            f"a job-name pattern is 1 to {limit} bytes without control characters: {pattern!r}"
        )
    if not commas and "," in pattern:
        raise ValueError(
            f"a handler's pattern holds no comma (GetJobs would read a list of names): {pattern!r}"
        )


def _handler(pattern: str, function: Callable[..., Any], timeout: float | None) -> Handler:
    """The Handler for `function`; TypeError if it cannot be called as
    function(data) or function(data, job=job)."""
    if not callable(function):
        raise TypeError(f"a handler must be a function, not {function!r}")
    parameters = list(inspect.signature(function).parameters.values())
    job = next((p for p in parameters if p.name == "job"), None)
    if job is not None and job.kind in (job.POSITIONAL_ONLY, job.VAR_POSITIONAL):
        raise TypeError("a handler's `job` parameter must be one that can be passed by name")
    rest = [p for p in parameters if p is not job]
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not rest or rest[0].kind not in plain:
        raise TypeError("a handler takes the job's data as its first parameter")
    required = [
        p.name
        for p in rest[1:]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise TypeError(
            f"a handler is called with the data and, if it asks, `job`: it cannot require "
            f"{', '.join(required)}"
        )
    return Handler(
        pattern,
        function,
        inspect.iscoroutinefunction(function),
        job is not None,
        timeout,
    )
