"""Running a client subcommand: the options every one takes (--server, the
token, TLS), the client they make, and the exit statuses.

Most subcommands are one call of jobserver.client: its result is printed as
JSON (or as it is, if it is `Text`), a refusal as the status line (and the
server's explanation) on stderr with an exit status a script can test.
`top` brings its own session (top.py) and shares the rest.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
    SERVER_HELP,
    SERVER_METAVAR,
    add_tls_arguments,
    chosen_server,
    server_address,
    tls_option,
)
from jobserver.client import (
    Client,
    Conflict,
    ConnectionFailed,
    IllegalState,
    JobNotFound,
    JobServerError,
    ServerError,
    auth_token,
)
from jobserver.client.await_calls import NOT_ENDED

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_ILLEGAL_STATE = 3
EXIT_SERVER_ERROR = 4
EXIT_CONNECTION = 5
# `await`: the job had not ended within --timeout.
EXIT_NOT_ENDED = 6
# Ctrl-C, as shells report it.
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = f"""\
exit status of the client commands (create, get, query, ...):
  0  done; the result is on stdout as JSON
  {EXIT_NOT_FOUND}  not found (404): no job to hand out, or no such job
  {EXIT_USAGE}  usage error, or the server refused the request as invalid (401, 402, other 4xx)
  {EXIT_ILLEGAL_STATE}  the job's state does not allow it (405, 409)
  {EXIT_SERVER_ERROR}  server error (5xx) or an unexpected reply
  {EXIT_CONNECTION}  cannot connect, or the connection broke during the request
  {EXIT_NOT_ENDED}  await: the job had not ended within --timeout (202 Job not ended yet)
A refusal prints the server's status line on stderr, e.g. "404 No job found",
and its explanation when it gave one: "402 Bad query: no such table: jobz"."""

class Text(str):
    """An action's result for people to read: printed as it is, not as JSON."""


# One call of the client: what it returns is printed as JSON, or as Text.
Action = Callable[[Client, argparse.Namespace], Any]
# All a subcommand does with its client; the exit status.
Session = Callable[[Client, argparse.Namespace], int]
# Adds a one-call subcommand: command(name, action, help, description).
CommandAdder = Callable[[str, Action, str, str], argparse.ArgumentParser]


class PartlyRefused(Exception):
    """An action the server carried out in part (FinishJobs, create
    --from): `result` is printed all the same, each of `complaints` on
    stderr, and the exit status is the one `error` gives."""

    def __init__(
        self, result: Any, complaints: list[str], error: JobServerError | ConnectionFailed
    ) -> None:
        super().__init__(str(error))
        self.result = result
        self.complaints = complaints
        self.error = error


class UsageError(Exception):
    """Input an action found unusable before sending anything (a bad line
    of `create --from`): its message on stderr, exit status 2 as for
    argparse's own errors."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps a text of one line (a description) as argparse does, and keeps
    a text already in lines (the epilog's table of exit statuses) as
    written. Wrapping as help is shown, not as the parser is built, spares
    every command's start-up the wrapping of every subcommand's
    description."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


# Built once: each subcommand takes its options from the same parent, and
# building it twenty times over was a share of every command's start-up.
@functools.cache
def connection_options() -> argparse.ArgumentParser:
    """A parent parser: --server, --auth-token-file, --tls, --tls-ca."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server",
        type=server_address,
        metavar=SERVER_METAVAR,
        help=SERVER_HELP,
    )
    common.add_argument("--auth-token-file", metavar="FILE", help=AUTH_TOKEN_HELP)
    add_tls_arguments(common)
    return common


def add_client_parser(
    sub: Any,
    name: str,
    session: Session,
    help: str,
    description: str,
    epilog: str = EXIT_STATUS_HELP,
) -> argparse.ArgumentParser:
    """A subcommand that talks to a server: the connection options, and the
    session it runs with its client."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        parents=[connection_options()],
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(session=session, check=_no_check)
    return parser


def add_check(
    parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], str | None]
) -> None:
    """A check of a subcommand's options together, made before anything is
    sent: the message it returns is a usage error, exit status 2, as
    argparse's own are."""

    def checked(args: argparse.Namespace) -> None:
        problem = check(args)
        if problem is not None:
            parser.error(problem)

    parser.set_defaults(check=checked)


def _no_check(args: argparse.Namespace) -> None:
    return None


def command_factory(sub: Any) -> CommandAdder:
    """Adds one-call subcommands: each prints its action's result."""

    def command(name: str, action: Action, help: str, description: str) -> argparse.ArgumentParser:
        parser = add_client_parser(sub, name, _call_once, help, description)
        parser.set_defaults(action=action)
        return parser

    return command


def run(args: argparse.Namespace) -> int:
    """Run the subcommand's session with a client for the server; the exit status."""
    args.check(args)
    try:
        client = _client(args)
    except ValueError as error:
        print(f"jobserver: {error}", file=sys.stderr)
        return EXIT_USAGE
    with client:
        session: Session = args.session
        return session(client, args)


def _client(args: argparse.Namespace) -> Client:
    """The client --server (else $JOBSERVER_SERVER), the token and TLS ask
    for; ValueError saying what is wrong with them."""
    servers = chosen_server(args.server)
    try:
        token = auth_token(args.auth_token_file)
        return Client(list(servers), auth_token=token, tls=tls_option(args))
    except OSError as error:
        raise ValueError(str(error)) from error


def _call_once(client: Client, args: argparse.Namespace) -> int:
    try:
        result = args.action(client, args)
    except PartlyRefused as partly:
        print(json.dumps(partly.result))
        for complaint in partly.complaints:
            print(complaint, file=sys.stderr)
        return exit_status(partly.error)
    except UsageError as error:
        print(f"jobserver: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (JobServerError, ConnectionFailed) as error:
        return failed(error)
    except KeyboardInterrupt:
        # Closing the connection ends a waiting get; the server keeps its job.
        return EXIT_INTERRUPTED
    print(result if isinstance(result, Text) else json.dumps(result))
    return 0


def failed(error: JobServerError | ConnectionFailed) -> int:
    """Say on stderr why a call failed; its exit status."""
    print(f"jobserver: {error}" if isinstance(error, ConnectionFailed) else error, file=sys.stderr)
    return exit_status(error)


def exit_status(error: JobServerError | ConnectionFailed) -> int:
    """The exit status of a refusal, or of a failed connection."""
    if isinstance(error, ConnectionFailed):
        return EXIT_CONNECTION
    if isinstance(error, JobNotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, (IllegalState, Conflict)):
        return EXIT_ILLEGAL_STATE
    if error.code == NOT_ENDED:
        return EXIT_NOT_ENDED
    if isinstance(error, ServerError) or not 400 <= error.code <= 499:
        return EXIT_SERVER_ERROR
    return EXIT_USAGE
