"""CreateJob's and CreateJobs' `dependsOn` and `onDependencyFailure`
(protocol.md 14.25): read and checked as a graph before any job is
created, then handed to the rules (core/rules/dependencies.py) once every
job of the request has its ID.

`dependsOn` is a JSON list of jobIDs; in an element of CreateJobs an item
may also be `"#N"`, element N of the same request (0-based, before or
after it), so that a whole graph is one atomic request. What is refused,
each with a status line that names it: a list that is not one, more than
MAX_DEPENDENCIES items, a `#N` naming no element (or given to CreateJob),
an element depending on itself, a cycle among the elements, more than
MAX_REQUEST_DEPENDENCIES edges in one request, and (once read) a jobID
that names no job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobserver.core.commands import json_params, params
from jobserver.core.errors import CommandError
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request
from jobserver.wire.limits import (
    MAX_DEPENDENCIES,
    MAX_JOB_ID,
    MAX_REQUEST_DEPENDENCIES,
    ON_DEPENDENCY_FAILURE,
)

_ELEMENT = re.compile(r"#(0|[1-9][0-9]{0,8})")
MALFORMED = "402 Malformed dependsOn"


@dataclass(frozen=True)
class Wanted:
    """One new job's dependencies: existing jobIDs, and elements of its
    request by index; what it does when one does not finish ("" is fail)."""

    jobs: tuple[int, ...] = ()
    elements: tuple[int, ...] = ()
    policy: str = ""

    @property
    def count(self) -> int:
        return len(self.jobs) + len(self.elements)


NONE = Wanted()


def of_request(request: Request) -> Wanted:
    """CreateJob's: jobIDs only."""
    return _wanted(_items(request), _policy(request), None)


def of_elements(elements: Sequence[Mapping[str, Any]]) -> list[Wanted]:
    """CreateJobs': each element's, its `#N` checked against the request,
    the request's edges counted and its graph checked for cycles."""
    wanted = []
    edges = 0
    for index, element in enumerate(elements):
        items, policy = _dependency_keys(element)
        one = _wanted(
            _list(items), _policy_text(policy), (index, len(elements))
        ) if items is not None or policy is not None else NONE
        edges += one.count
        if edges > MAX_REQUEST_DEPENDENCIES:
            raise CommandError(
                f"413 Too many dependencies in one request (max {MAX_REQUEST_DEPENDENCIES})"
            )
        wanted.append(one)
    _check_acyclic(wanted)
    return wanted


def _dependency_keys(element: Mapping[str, Any]) -> tuple[Any, Any]:
    """An element's dependsOn and onDependencyFailure, their names in any
    case; None where absent. One look at each key: a CreateJobs of 1,000
    plain elements spent 3% of its node's time here at two."""
    found: dict[str, Any] = {}
    for name, value in element.items():
        if len(name) >= _SHORTEST_KEY:
            # The first of names that differ only in case, as a header's.
            found.setdefault(name.lower(), value)
    return found.get("dependson"), found.get("ondependencyfailure")


# The shorter of the two keys: a name, data or priority is passed over unread.
_SHORTEST_KEY = len("dependson")


def _items(request: Request) -> list[Any] | None:
    if params.present(request, "dependsOn") is None:
        return None
    try:
        value = json_params.json_value(request, "dependson")
    except ValueError:
        raise CommandError(MALFORMED) from None
    return _list(value)


def _list(value: Any) -> list[Any] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        # An element may give the list as JSON text, as a header does.
        try:
            value = jsonbody.parse(value)
        except ValueError:
            raise CommandError(MALFORMED) from None
    if not isinstance(value, list):
        raise CommandError(f"{MALFORMED}: a JSON list of jobIDs")
    if len(value) > MAX_DEPENDENCIES:
        raise CommandError(f"413 Too many dependencies (max {MAX_DEPENDENCIES})")
    return value


def _policy(request: Request) -> str:
    return _policy_text(params.present(request, "onDependencyFailure"))


def _policy_text(text: Any) -> str:
    if text is None or text == "":
        return ""
    if text not in ON_DEPENDENCY_FAILURE:
        raise CommandError("402 Malformed onDependencyFailure: fail, cancel or run")
    return "" if text == "fail" else str(text)


def _wanted(items: list[Any] | None, policy: str, place: tuple[int, int] | None) -> Wanted:
    """The items read: jobIDs, and in CreateJobs (`place`: this element's
    index, the request's length) `#N`; repeats count once."""
    jobs: dict[int, None] = {}
    elements: dict[int, None] = {}
    for item in items or ():
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 < item <= MAX_JOB_ID:
                raise CommandError(f"{MALFORMED}: {item} is not a jobID")
            jobs[item] = None
            continue
        match = _ELEMENT.fullmatch(item) if isinstance(item, str) else None
        if match is None:
            raise CommandError(f"{MALFORMED}: jobIDs, and #N for an element of CreateJobs")
        if place is None:
            raise CommandError(f"{MALFORMED}: #N names an element of CreateJobs only")
        index = int(match.group(1))
        if index >= place[1]:
            raise CommandError(f"{MALFORMED}: {item} names no element of jobs")
        if index == place[0]:
            raise CommandError(f"402 Element {index} depends on itself")
        elements[index] = None
    if not jobs and not elements:
        return NONE if not policy else Wanted(policy=policy)
    return Wanted(tuple(jobs), tuple(elements), policy)


def _check_acyclic(wanted: Sequence[Wanted]) -> None:
    """Refuse a cycle among the request's elements, naming its elements
    (Kahn's order: what is left when no element is free is on a cycle, or
    waits for one)."""
    if not any(one.elements for one in wanted):
        return
    waiting = [len(one.elements) for one in wanted]
    dependents: list[list[int]] = [[] for _ in wanted]
    for index, one in enumerate(wanted):
        for on in one.elements:
            dependents[on].append(index)
    free = [index for index, count in enumerate(waiting) if count == 0]
    done = 0
    while free:
        index = free.pop()
        done += 1
        for dependent in dependents[index]:
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                free.append(dependent)
    if done == len(wanted):
        return
    cycle = _a_cycle(wanted, [count > 0 for count in waiting])
    shown = ", ".join(str(index) for index in cycle[:10])
    more = ", ..." if len(cycle) > 10 else ""
    raise CommandError(f"402 Dependency cycle: elements {shown}{more}")


def _a_cycle(wanted: Sequence[Wanted], stuck: list[bool]) -> list[int]:
    """One cycle among the stuck elements: following any stuck
    dependency from a stuck element comes back around."""
    start = stuck.index(True)
    seen: dict[int, int] = {}
    path: list[int] = []
    index = start
    while index not in seen:
        seen[index] = len(path)
        path.append(index)
        index = next(on for on in wanted[index].elements if stuck[on])
    return sorted(path[seen[index]:])
