"""A JSON Schema error of an /api/* or POST /queue body, as a person would
write it: `maxAttempts: expected an integer from 1 to 10000, got the
string "3"`, where jsonschema says "'3' is not valid under any of the
given schemas" (each parameter is `anyOf` its schema and `null`,
openapi.py, so its own words name neither).

What a message quotes of the body is cut short (QUOTED characters) and
JSON-escaped: never more than a line, never a control character.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any

from jsonschema.exceptions import ValidationError, best_match

Schema = dict[str, Any]

# How much of a string the message quotes.
QUOTED = 40


def explain(errors: Iterable[ValidationError]) -> str:
    """The most telling of a body's errors, in words; "" if none."""
    error = best_match(errors)
    return "" if error is None else _explain(error)


def _explain(error: ValidationError) -> str:
    if error.validator in ("anyOf", "oneOf"):
        return _explain_choice(error)
    if error.validator == "additionalProperties":
        return _unknown_parameters(error)
    if error.validator == "required":
        required: list[str] = _attribute(error, "validator_value")
        instance: dict[str, Any] = _attribute(error, "instance")
        missing = [name for name in required if name not in instance]
        return _at(error, missing[0] if missing else "") + "required, and missing"
    schema = error.schema if isinstance(error.schema, dict) else {}
    return f"{_where(error.absolute_path)}: expected {expected(schema)}, got {got(error.instance)}"


def _explain_choice(error: ValidationError) -> str:
    """A parameter that is none of its choices: its schema, or null (left
    out). An error deeper inside the value (an element of a list) is
    explained where it is; else the value against the schema."""
    choices: list[Schema] = _attribute(error, "validator_value")
    branches = [b for b in choices if b != {"type": "null"}]
    inner = [
        e for e in error.context or []
        if len(e.absolute_path) > len(error.absolute_path)
    ]
    if inner:
        return explain(inner)
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return f"{_where(error.absolute_path)}: expected {expected(schema)}, got {got(error.instance)}"


def _unknown_parameters(error: ValidationError) -> str:
    schema: Schema = _attribute(error, "schema")
    known = list(schema.get("properties", {}))
    unknown = sorted(set(_attribute(error, "instance")) - set(known))
    name = unknown[0] if unknown else ""
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        hint = f" (did you mean {close[0]}?)"
    else:
        hint = f" (it takes {', '.join(known)})" if known else " (it takes none)"
    return _at(error, _quoted_name(name)) + "not a parameter here" + hint


def _attribute(error: ValidationError, name: str) -> Any:
    """One of the error's attributes, as the validator set it (typed by
    jsonschema as possibly unset, which a validator's own error never is)."""
    return getattr(error, name)


def _at(error: ValidationError, name: str) -> str:
    """`where.name: ` for a parameter of the object the error is about."""
    where = _where(error.absolute_path)
    if not name:
        return f"{where}: " if where != "the body" else ""
    return f"{name}: " if where == "the body" else f"{where}.{name}: "


def _where(path: Iterable[Any]) -> str:
    """A place in the body: `maxAttempts`, `jobs[0].name`, or the body."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "the body"


def _quoted_name(name: str) -> str:
    if name.isidentifier() and len(name) <= QUOTED:
        return name
    return _quoted(name)


def expected(schema: Schema) -> str:
    """What a schema allows, in words."""
    if "anyOf" in schema:
        return " or ".join(expected(choice) for choice in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return _number(schema, "an integer" if kind == "integer" else "a number")
    if kind == "string":
        return _string(schema)
    if kind == "boolean":
        return "true or false"
    if kind == "object":
        return "a JSON object"
    if kind == "array":
        return _array(schema)
    return "something else"


def _number(schema: Schema, kind: str) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None:
        return f"{kind} from {low} to {high}"
    if low is not None:
        return f"{kind} of at least {low}"
    if high is not None:
        return f"{kind} of at most {high}"
    return kind


def _string(schema: Schema) -> str:
    low, high = schema.get("minLength"), schema.get("maxLength")
    text = "a string"
    if low is not None and high is not None:
        text = f"a string of {low} to {high} characters"
    elif high is not None:
        text = f"a string of at most {high} characters"
    elif low is not None:
        text = f"a string of at least {low} characters"
    if "pattern" in schema:
        examples = schema.get("examples")
        if examples:
            text += f" such as {json.dumps(examples[0])}"
        else:
            text += f" matching {schema['pattern']}"
    return text


def _array(schema: Schema) -> str:
    items = schema.get("items", {})
    of = "objects" if items.get("type") == "object" else "items"
    low, high = schema.get("minItems"), schema.get("maxItems")
    if low is not None and high is not None:
        return f"an array of {low} to {high} {of}"
    if low is not None:
        return f"an array of {low} or more {of}"
    return f"an array of {of}"


def got(value: Any) -> str:
    """A JSON value as a message names it: its type, and a short value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"the integer {value}" if abs(value) < 10**QUOTED else "a very large integer"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        length = f" ({len(value)} characters)" if len(value) > QUOTED else ""
        return f"the string {_quoted(value)}{length}"
    if isinstance(value, list):
        return f"an array of {len(value)} item{'' if len(value) == 1 else 's'}"
    return "an object"


def _quoted(text: str) -> str:
    """JSON text of at most QUOTED characters of `text`: escaped, so a
    control character or a lone surrogate stays out of the message."""
    if len(text) <= QUOTED:
        return json.dumps(text)
    return json.dumps(text[:QUOTED])[:-1] + '..."'
