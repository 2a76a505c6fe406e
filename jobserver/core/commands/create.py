"""CreateJob and CreateJobs: check the request, store the job (or merge
into the unique job of its name), reply with its ID.

Handlers run inside a transaction that the writer owns; they never commit
and never touch a socket. A handler returns a `Response` or raises
`CommandError`, whose status line is the reply and whose raise undoes every
change the handler made. Status lines are Bedrock's, word for word.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from jobserver.core.commands import (
    depends_on,
    flow_params,
    idempotency,
    json_params,
    known_headers,
    params,
)
from jobserver.core.commands.depends_on import NONE, Wanted
from jobserver.core.commands.views import ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import creation, dependencies, flow, lifecycle, schedule
from jobserver.core.rules.dependencies import Known
from jobserver.core.rules.schedule import RepeatStalled
from jobserver.model import cron
from jobserver.model.jobs import Job, NewJob, State
from jobserver.model.names import has_control
from jobserver.model.sqlite_functions import json_patch
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response, escape
from jobserver.wire.limits import DEFAULT_PRIORITY, MAX_NAME, PRIORITIES


def create_job(ctx: Context, request: Request) -> Response:
    key = idempotency.key_of(request)
    if key is not None:
        # Checked before its key is claimed: a request refused for its
        # parameters writes nothing (a write, then a refusal, makes the
        # writer run its whole batch again).
        _check_parameters(ctx, request)
        depends_on.of_request(request)
    done = idempotency.replay(ctx, request, key)
    if done is not None:
        return done
    wanted = depends_on.of_request(request)
    if wanted.count:
        known = dependencies.read(ctx, wanted.jobs)
        job_id = _create(ctx, request, wanted, known)
        _link(ctx, known, [wanted], [job_id])
    else:
        job_id = _create(ctx, request)
    response = Response("200 OK", b'{"jobID":%d}' % job_id)
    idempotency.remember(ctx, request, key, response)
    return response


def create_jobs(ctx: Context, request: Request) -> Response:
    """All or nothing: any bad element fails the whole request."""
    key = idempotency.key_of(request)
    if key is not None:
        # As create_job's, each element in turn.
        for element in _elements(json_params.job_list(request)):
            _check_parameters(ctx, element)
    done = idempotency.replay(ctx, request, key)
    if done is not None:
        return done
    response = _create_all(ctx, request)
    idempotency.remember(ctx, request, key, response)
    return response


def _create_all(ctx: Context, request: Request) -> Response:
    elements = json_params.job_list(request)
    wanted = depends_on.of_elements(elements)
    graph = any(one.count for one in wanted)
    # Read (and locked) before any job is created: a dependency that
    # exists now cannot end unseen (dependencies.py).
    known = dependencies.read(ctx, [i for one in wanted for i in one.jobs]) if graph else None
    made, read = _checked(ctx, elements, graph)
    ids: list[int] = []
    # The new jobs' inserts are sent together (storage's held_writes.py),
    # in the elements' order, which is their jobIDs'.
    with ctx.store.holding_writes():
        ctx.store.reserve_ids(len(elements))
        plain: list[NewJob] = []
        for index, (new, one) in enumerate(zip(made, wanted, strict=True)):
            if new is not None:
                plain.append(new)
                if len(plain) == _PLAIN_RUN:
                    ids += creation.create_plain(ctx, plain)
                    plain = []
                continue
            if plain:
                ids += creation.create_plain(ctx, plain)
                plain = []
            ids.append(_create(ctx, read[index], one, known))
        if plain:
            ids += creation.create_plain(ctx, plain)
    if known is not None:
        _link(ctx, known, wanted, ids)
    return known_headers.with_ignored_elements(ok({"jobIDs": ids}), read)


def _checked(
    ctx: Context, elements: list[dict[str, Any]], graph: bool
) -> tuple[list[NewJob | None], dict[int, Request]]:
    """Every element checked before any job is stored: the plain ones made
    (`_plain`; None for the others), the others read as requests (by their
    place in `jobs`) and their parameters checked. A request refused for
    what one of its elements says then sends nothing to the database:
    without this, its first jobs' rows were on their way to PostgreSQL
    (postgres_statements.STREAM_AFTER), and the refusal made its batch run
    again to undo them."""
    made: list[NewJob | None] = []
    read: dict[int, Request] = {}
    for index, element in enumerate(elements):
        new = None if graph else _plain(ctx, element)
        made.append(new)
        if new is None:
            read[index] = _element(element)
            _check_parameters(ctx, read[index])
    return made, read


# A CreateJobs element of these keys alone, each of its usual JSON type, is
# a standalone job due now: made without a request of its own and the
# fifteen parameters a CreateJob reads (most of a bulk insert's Python).
# Any other element, and one whose value would be refused, goes the long
# way, which says why.
_PLAIN_KEYS = frozenset({"name", "data", "priority"})
# Plain elements stored a run of this many at a time: a backend may send
# their rows while the next runs are stored (postgres_statements.STREAM_AFTER).
_PLAIN_RUN = 100


def _plain(ctx: Context, element: dict[str, Any]) -> NewJob | None:
    """The job a plain element asks for, exactly as _create would make it;
    None for any other element."""
    if not _PLAIN_KEYS.issuperset(element):
        return None
    name = element.get("name")
    if type(name) is not str or not _is_name(name):
        return None
    data = element.get("data")
    if data is None:
        text = "{}"
    elif type(data) is dict:
        text = jsonbody.compact(data)
        # Encoded only when it may be too large: a character is 4 bytes at most.
        if len(text) * 4 > json_params.MAX_DATA and len(text.encode()) > json_params.MAX_DATA:
            return None
    else:
        return None
    priority = element.get("priority")
    if priority is None:
        priority = DEFAULT_PRIORITY
    elif type(priority) is not int or priority not in PRIORITIES:
        return None
    _check_cost_fits(ctx, name, 1)
    return NewJob(name=name, next_run=ctx.now_ms, priority=priority, data=text)


def _is_name(name: str) -> bool:
    """What from_json and params.name accept of a name given as a string."""
    if not name.isascii() and jsonbody.has_lone_surrogate(name):
        return False
    return 0 < len(name.encode()) <= MAX_NAME and not has_control(name)


def _link(ctx: Context, known: Known, wanted: list[Wanted], ids: list[int]) -> None:
    """The request's jobs all have IDs: store their edges (`#N` now a
    jobID), and make the moves that dependencies ended already decide."""
    new = [
        (job_id, (*one.jobs, *(ids[index] for index in one.elements)))
        for job_id, one in zip(ids, wanted, strict=True)
        if one.count
    ]
    lifecycle.make(ctx, dependencies.link(ctx, known, new))


def _elements(elements: list[dict[str, Any]]) -> Iterator[Request]:
    """CreateJobs' elements, each as a CreateJob, read as they are asked for
    (so that a bad element is refused after the elements before it)."""
    for element in elements:
        yield _element(element)


def _element(element: dict[str, Any]) -> Request:
    """One of CreateJobs' elements as a CreateJob."""
    if "name" not in element and not any(key.lower() == "name" for key in element):
        raise CommandError("402 Missing name")
    return json_params.from_json(element, "CreateJob")


def _check_parameters(ctx: Context, request: Request) -> None:
    """What _create checks of a request's own parameters, and its cost
    against the limits on its name (the node holds them), without reading
    the database."""
    name = params.name(request)
    params.priority(request, "jobPriority", "priority")
    json_params.data(request)
    params.retry_after(request)
    params.time(request, "firstRun")
    params.repeat_rule(request)
    params.retry_policy(request)
    _check_cost_fits(ctx, name, flow_params.flow_options(request).cost)
    _parent_id(request)


def _create(
    ctx: Context, request: Request, wanted: Wanted = NONE, known: Known | None = None
) -> int:
    name = params.name(request)
    priority = params.priority(request, "jobPriority", "priority")
    data = json_params.data(request)
    retry_after = params.retry_after(request)
    first_run = params.time(request, "firstRun")
    rule = params.repeat_rule(request)
    policy = params.retry_policy(request)
    flow = flow_params.flow_options(request)
    _check_cost_fits(ctx, name, flow.cost)
    parent_id = _parent_id(request)
    parent = _parent(ctx, parent_id) if parent_id else None
    unique = params.is_true(request.get("unique"))
    if wanted.count and (parent_id or unique):
        # A child's first state follows its parent's, and a unique job may
        # be one that exists already: neither can wait BLOCKED as well.
        other = "parentJobID" if parent_id else "unique"
        raise CommandError(f"402 dependsOn cannot be used with {other}")
    if unique:
        existing = ctx.store.find_by_name(name)
        if existing is not None:
            _update_unique(ctx, request, existing, parent_id, data, rule, priority, flow.zone)
            return existing.jobID
    next_run = first_run or _first_run(ctx, rule, flow.zone)
    if flow.windows:
        next_run = schedule.in_window(flow.windows, flow.zone, next_run)
    new = NewJob(
        name=name,
        next_run=next_run,
        repeat=rule or "",
        data=data if data is not None else "{}",
        priority=DEFAULT_PRIORITY if priority is None else priority,
        parent_id=parent_id,
        retry_after=retry_after,
        policy=policy,
        flow=flow,
    )
    if wanted.count and known is not None:
        ended = sum(1 for job_id in wanted.jobs if known.outcome(job_id) is not None)
        new = replace(
            new,
            dependencies=wanted.count,
            blockers=wanted.count - ended,
            on_dependency_failure=wanted.policy,
        )
    return creation.create(ctx, new, parent)


def _first_run(ctx: Context, rule: str | None, zone: str) -> str:
    """When a job created without firstRun is first due: now, or a CRON
    rule's first moment after now."""
    if rule is None or not cron.is_cron(rule):
        return ctx.now_ms
    try:
        return schedule.cron_run(ctx, rule, zone)
    except RepeatStalled as stalled:
        raise CommandError(f"402 Malformed repeat: {stalled.reason}") from None


def _check_cost_fits(ctx: Context, name: str, cost: int) -> None:
    """A job that costs more than a limit on its name holds can never run."""
    limits = ctx.store.limits
    if not limits:
        return
    index = flow.index_of(ctx.store)
    # The usual job (cost 1) fits every limit without matching a pattern.
    if cost <= index.min_capacity:
        return
    for pattern in index.verdict(name).limits:
        capacity = index.limits[pattern].max
        if capacity and cost > capacity:
            # Escaped as a header value: a pattern may hold a line break.
            raise CommandError(f"402 Cost {cost} exceeds limit {escape(pattern)} (max {capacity})")


def _parent_id(request: Request) -> int:
    text = params.present(request, "parentJobID")
    if text is None or text == "0":
        return 0
    return params.parse_job_id(text, "parentJobID")


def _parent(ctx: Context, parent_id: int) -> Job:
    parent = ctx.store.get(parent_id)
    if parent is None:
        raise CommandError("404 parentJobID does not exist")
    creation.check_parent(parent)
    # The request's check, not a move's: whether the job it names has a
    # parent is fixed when that job is created, whatever state it is in.
    if parent.parentJobID:
        raise CommandError("405 Cannot create grandchildren")
    return parent


def _update_unique(
    ctx: Context,
    request: Request,
    existing: Job,
    parent_id: int,
    data: str | None,
    rule: str | None,
    priority: int | None,
    zone: str,
) -> None:
    """unique=true found a job of this name: merge the new data into it
    (Bedrock's rules), and its timeZone if the request gives one. A merge
    that changes a QUEUED job's CRON rule or zone moves its nextRun to the
    rule's next moment (protocol.md 6.1): Bedrock has neither, and kept
    its rules' nextRun, as this does."""
    if existing.parentJobID and existing.parentJobID != parent_id:
        raise CommandError(
            "404 Trying to create a child that already exists, but it is tied to a different parent"
        )
    if data is None or data == existing.data:
        return
    overwrite = params.present(request, "overwrite")
    if overwrite is not None and not params.is_true(overwrite):
        return
    changes: dict[str, Any] = {"data": json_patch(existing.data, data)}
    if rule is not None:
        changes["repeat"] = rule
    if priority is not None:
        changes["priority"] = priority
    if params.present(request, "timeZone") is not None:
        changes["timeZone"] = zone
    lifecycle.amend(ctx, existing, _moved_cron_run(ctx, existing, changes), **changes)


def _moved_cron_run(ctx: Context, job: Job, changes: dict[str, Any]) -> str | None:
    """The new nextRun of a QUEUED job whose CRON rule or zone `changes`
    change; None when it keeps its own."""
    rule = changes.get("repeat", job.repeat)
    zone = changes.get("timeZone", job.timeZone)
    if job.state != State.QUEUED or not cron.is_cron(rule):
        return None
    if (rule, zone) == (job.repeat, job.timeZone):
        return None
    return schedule.in_window(job.timeWindows, zone, _first_run(ctx, rule, zone))
