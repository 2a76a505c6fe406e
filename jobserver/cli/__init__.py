"""The `jobserver` command: `serve`, `worker-manager`, `worker` and the client commands."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

from jobserver import __version__
from jobserver.cli import commands

# The subcommands that run for long: each one's line in `jobserver --help`,
# and the module that gives its DESCRIPTION, adds its options
# (add_arguments) and runs it (run). A module is imported only when its
# subcommand is the one asked for: they bring trio, the server or the worker
# manager, which `jobserver --help` and the client commands start without
# (docs/benchmarks.md: bench/startup.py).
PROGRAMS = {
    "serve": ("run the job server", "jobserver.cli.serve"),
    "worker-manager": ("take jobs and run a program for each", "jobserver.workers"),
    "worker": (
        "run the handlers of a Python Worker (MODULE:ATTR) in this process",
        "jobserver.worker.arguments",
    ),
}


def version() -> str:
    """`jobserver VERSION`, and whether the optional compiled build (setup.py,
    docs/install.md) is the one installed: it puts a C extension beside
    framing.py, which Python then imports instead (found, not imported)."""
    spec = importlib.util.find_spec("jobserver.wire.framing")
    compiled = spec is not None and not str(spec.origin).endswith(".py")
    return f"jobserver {__version__}" + (" (compiled with mypyc)" if compiled else "")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the options of that one of
    PROGRAMS alone (the others are listed, their modules not imported)."""
    parser = _Parser(
        prog="jobserver",
        description="A durable job queue that speaks Bedrock::Jobs' text protocol.",
        epilog=commands.EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (summary, _) in PROGRAMS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=summary)
            continue
        program = _program(name)
        program.add_arguments(sub.add_parser(name, help=summary, description=program.DESCRIPTION))
    commands.add_parsers(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """`jobserver`'s parser: words a subcommand does not know are refused
    with that subcommand's usage (`jobserver serve --prot 9000`), where
    argparse would print the top level's."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        words = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(words, namespace)
        if extras:
            self._refusing(words, parsed.command, extras[0]).error(
                f"unrecognized arguments: {' '.join(extras)}"
            )
        return parsed

    def _refusing(
        self, words: list[str], command: str, first_extra: str
    ) -> argparse.ArgumentParser:
        """The subcommand's parser, unless the first unknown word comes
        before the subcommand's name (an option of `jobserver` itself)."""
        if first_extra not in words or words.index(first_extra) < words.index(command):
            return self
        subcommands = next(
            action for action in self._actions if isinstance(action, argparse._SubParsersAction)
        )
        parser: argparse.ArgumentParser = subcommands.choices[command]
        return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=_program_named(words)).parse_args(words)
    args.words = words  # for a program that starts copies of itself (worker --processes)
    if args.command in PROGRAMS:
        exit_status: int = _program(args.command).run(args)
        return exit_status
    return commands.run(args)


def _program(name: str) -> ModuleType:
    return importlib.import_module(PROGRAMS[name][1])


def _program_named(words: list[str]) -> str:
    """The subcommand the words ask for, the first that is not an option
    (`jobserver`'s own options take no value); "" if none of PROGRAMS."""
    command = next((word for word in words if not word.startswith("-")), "")
    return command if command in PROGRAMS else ""
