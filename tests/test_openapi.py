"""GET /openapi.json, and schemathesis against it: requests generated from
the document, sent to a real server over real HTTP, must get answers the
document allows, and never a server error."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from harness import ThreadServer
from helpers import until
from jobserver.web import openapi

TIMEOUT = 10.0
# Per operation: enough to reach each parameter's edges, few enough that
# the whole module takes seconds.
EXAMPLES = 25

TOKEN = "openapi-test-token"
# The wire refuses bad parameters with its own 4xx codes (402 Malformed
# ..., 404 for a job that is not there), which the document allows as 4XX;
# and it refuses some input that JSON Schema cannot describe (a repeat
# rule's grammar, a job in the wrong state): 4XX for valid data too.
# Server errors are never allowed.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {
        "checks": {
            "negative_data_rejection": {"expected-statuses": ["4XX"]},
            "positive_data_acceptance": {"expected-statuses": ["2XX", "4XX"]},
        }
    }
)
# Backup is fuzzed too: it writes only plain names into the server's
# backup directory (tests/test_security_backup.py).
schema = schemathesis.openapi.from_dict(openapi.document(), config=CONFIG)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    db: Path = tmp_path_factory.mktemp("openapi") / "jobs.db"
    running = ThreadServer(db, http_port=0, auth_token=TOKEN)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


def base_url(server: ThreadServer) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


def test_the_server_serves_the_document(http_server: ThreadServer) -> None:
    with urllib.request.urlopen(base_url(http_server) + "/openapi.json", timeout=TIMEOUT) as r:
        served = json.load(r)
    assert served == json.loads(json.dumps(openapi.document()))
    commands = {path.removeprefix("/api/") for path in served["paths"] if path.startswith("/api/")}
    # Every wire command but the aliases has an operation.
    from jobserver.core.commands.dispatch import ROUTES

    wire = {verb for verb in ROUTES if verb.isalpha()}
    assert {c.lower() for c in commands} == wire


def test_every_parameter_a_command_reads_is_described() -> None:
    """A parameter added to a wire command (SetLimit's rate, CreateJob's key)
    is refused over HTTP until the document lists it: it must be listed."""
    from jobserver.core.commands.known_headers import KNOWN_HEADERS

    # Backup reads `path` only to refuse it with advice (protocol.md 14.18).
    unlisted = {("backup", "path")}
    for command, (_, _, params) in openapi.COMMANDS.items():
        described = {param.name.lower() for param in params}
        reads = KNOWN_HEADERS[command.lower()]
        missing = {name for name in reads - described if (command.lower(), name) not in unlisted}
        assert not missing, (command, missing)
        assert described <= reads, (command, described - reads)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(case, http_server: ThreadServer) -> None:
    bound_await(case)
    case.call_and_validate(
        base_url=base_url(http_server), headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=TIMEOUT,
    )


# An AwaitJob's wait, in ms, well within TIMEOUT.
AWAIT_MS = 2000


def bound_await(case) -> None:
    """An AwaitJob of a job an earlier case made and left unended waits out its
    timeout, 110 s when none is given: past TIMEOUT, which the module's
    order (xdist's) decided. Its wait is cut to AWAIT_MS; any other value is
    sent as generated."""
    if case.path != "/api/AwaitJob" or not isinstance(case.body, dict):
        return
    timeout = case.body.get("timeout", AWAIT_MS + 1)
    if isinstance(timeout, str) and timeout.isascii() and timeout.isdigit():
        timeout = int(timeout)
    if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > AWAIT_MS:
        case.body["timeout"] = AWAIT_MS
