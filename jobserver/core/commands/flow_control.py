"""Flow control (protocol.md 14.7 to 14.9): SetLimit, PauseJobs and
ResumeJobs."""

from __future__ import annotations

from jobserver.core.commands import flow_params, params
from jobserver.core.commands.views import ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import flow
from jobserver.model.globmatch import match_cost
from jobserver.wire.framing import Request, Response


def set_limit(ctx: Context, request: Request) -> Response:
    """Set, change or (max 0, nothing else) remove a limit: a capacity, a
    rate, per key, fair. A new one past --max-limits is refused; changing
    or removing one always works."""
    pattern = params.pattern(request)
    limit = flow_params.set_limit(request)
    limits = ctx.store.limits
    most = ctx.settings.max_limits
    if limit.is_set and pattern not in limits:
        if len(limits) >= most:
            raise CommandError(f"413 Too many limits (max {most})")
        _check_cost(ctx, pattern)
    ctx.store.set_limit(pattern, limit)
    # A higher or removed limit may let waiting jobs run.
    ctx.wake_all()
    return ok()


def pause_jobs(ctx: Context, request: Request) -> Response:
    """Pause a pattern. A new one past --max-limits paused patterns is
    refused: every candidate of a GetJob is matched against them."""
    pattern = params.pattern(request)
    paused = ctx.store.paused
    most = ctx.settings.max_limits
    if pattern not in paused and len(paused) >= most:
        raise CommandError(f"413 Too many paused patterns (max {most})")
    if pattern not in paused:
        _check_cost(ctx, pattern)
    ctx.store.pause(pattern)
    return ok()


def _check_cost(ctx: Context, pattern: str) -> None:
    """A new limit or pause is refused when judging a name against all of
    them would cost more than flow.MAX_PATTERNS_COST: each candidate of a
    GetJob is judged in the writer."""
    store = ctx.store
    cost = flow.patterns_cost([*store.limits, *store.paused, pattern])
    if cost > flow.MAX_PATTERNS_COST:
        raise CommandError(
            f"413 Patterns too costly ({flow.MAX_PATTERNS_COST} units a name at most, "
            f"this one {match_cost(pattern)})"
        )


def resume_jobs(ctx: Context, request: Request) -> Response:
    if ctx.store.resume(params.pattern(request)):
        ctx.wake_all()
    return ok()
