"""The parameters that hold JSON: `data` (a JSON object), CreateJobs' and
FinishJobs' `jobs` and each element of it read as a request of its own,
and the error FailJob finds in its data.

Apart from params.py because JSON is a concern of its own: a JSON
parameter is parsed once, whoever asks first (dispatch.py before the
writer when it is large, or the command), and kept with the request
(`Request.parsed`), so these read through json_value and never parse again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobserver.core.commands.params import present, too_large
from jobserver.core.errors import CommandError
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request

# Bedrock's limit for a data value.
MAX_DATA = 1024 * 1024
# An error text is for people reading the dead set: a traceback fits.
MAX_ERROR = 64 * 1024


# The parameters that hold JSON text: parsed once, whoever reads them first
# (json_value), and before the writer when they are large (dispatch.py).
JSON_PARAMETERS = ("data", "jobs")


def json_value(request: Request, header: str) -> Any:
    """The JSON value of the parameter `header`, which the request has:
    strict and depth-checked (jsonbody.parse), parsed the first time it is
    asked for and kept with the request, as is a ValueError it raises."""
    text = request.headers[header]
    known = request.parsed.get(header)
    if known is None or known[0] is not text:
        try:
            known = (text, jsonbody.parse(text))
        except ValueError as error:
            known = (text, error)
        request.parsed[header] = known
    if isinstance(known[1], ValueError):
        raise known[1]
    return known[1]


def with_json_value(request: Request, header: str, text: str, value: Any) -> None:
    """Set the parameter `header` to `text`, the compact JSON of `value`
    (a value parsed with jsonbody.parse, or a part of one), known parsed."""
    request.headers[header] = text
    request.parsed[header] = (text, value)


def data(request: Request, header: str = "data") -> str | None:
    """A JSON object parameter as compact JSON text, or None when absent."""
    text = request.get(header)
    if text is None:
        return None
    if len(text.encode("utf-8")) > MAX_DATA:
        raise too_large(header, MAX_DATA)
    try:
        value = json_value(request, header)
    except jsonbody.TooDeep as error:
        raise CommandError(f"402 Malformed data: {error}") from None
    except ValueError:
        raise CommandError("402 Data is not a valid JSON Object") from None
    if not isinstance(value, dict):
        raise CommandError("402 Data is not a valid JSON Object")
    # Valid JSON with no white space at all is already compact: keep the
    # client's text rather than spend time writing it out again.
    if _BLANKS.isdisjoint(text):
        return text
    return jsonbody.compact(value)


_BLANKS = frozenset(" \t\r\n")


def error_text(request: Request, data: str | None) -> str:
    """What FailJob records as the job's last error: the `error` parameter,
    else the `error` key of the data it sends (a string as it is, anything
    else as compact JSON), else nothing. NUL becomes U+FFFD: PostgreSQL's
    text cannot hold it, and the error must read the same on every backend."""
    text = present(request, "error")
    if text is not None:
        if len(text.encode("utf-8")) > MAX_ERROR:
            raise too_large("error", MAX_ERROR)
        return text.replace("\0", "\ufffd")
    # Read only when it may hold an error key: `data` is the request's
    # data, which data() has parsed (an object).
    if data is None or '"error"' not in data:
        return ""
    value = json_value(request, "data").get("error")
    if value is None:
        return ""
    text = value if isinstance(value, str) else jsonbody.compact(value)
    # A lone surrogate (from a `\\ud800` escape) has no UTF-8 form: replaced.
    text = text.encode("utf-8", "replace")[:MAX_ERROR].decode("utf-8", "ignore")
    return text.replace("\0", "\ufffd")


def from_json(element: Mapping[str, Any], verb: str) -> Request:
    """One element of a batch (CreateJobs, FinishJobs) as the parameters
    of a request `verb` (CreateJob, FinishJob).

    Keys are case-insensitive, as header names are; objects stay JSON text;
    `data: []` is how PHP writes an empty object, so it means `{}`. A key
    or a string value with a lone surrogate is `402 Malformed KEY`: it
    could be neither stored nor compared (inside objects, such as data,
    compact() keeps it escaped).
    """
    request = Request(method_line=verb)
    headers = request.headers
    for key, value in element.items():
        # ASCII holds no surrogate: the search is only for the rest.
        if not key.isascii() and jsonbody.has_lone_surrogate(key):
            raise CommandError("402 Malformed parameter name: a lone surrogate")
        name = key.lower()
        if isinstance(value, str):
            if not value.isascii() and jsonbody.has_lone_surrogate(value):
                raise CommandError(f"402 Malformed {key}")
            text = value
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif value is None:
            continue
        elif isinstance(value, (dict, list)):
            if name == "data" and value == []:
                value = {}
            # Parsed with the list: not parsed again as the element's own.
            with_json_value(request, name, jsonbody.compact(value), value)
            continue
        else:
            text = str(value)
        headers[name] = text
    return request


def job_list(request: Request) -> list[dict[str, Any]]:
    """The `jobs` of CreateJobs and FinishJobs: a non-empty JSON array of
    non-empty objects."""
    text = present(request, "jobs")
    try:
        elements = json_value(request, "jobs") if text is not None else None
    except jsonbody.TooDeep as error:
        raise CommandError(f"401 Invalid JSON: {error}") from None
    except ValueError:
        elements = None
    if not isinstance(elements, list) or not elements:
        raise CommandError("401 Invalid JSON")
    if not all(isinstance(e, dict) and e for e in elements):
        raise CommandError("401 Invalid JSON")
    return elements
