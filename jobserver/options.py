"""Command-line options shared by the client commands and the worker manager."""

from __future__ import annotations

import argparse

from .client import TLS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level(text: str) -> str:
    """--log-level: any case."""
    return text.upper()


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls and --tls-ca."""
    parser.add_argument(
        "--tls",
        action="store_true",
        help="speak TLS, trusting the system's certificate authorities; the server's "
        "certificate must name the host of --server (default: plain TCP)",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="speak TLS, trusting the CA certificates in FILE (PEM) instead of the "
        "system's; implies --tls (default: none)",
    )


def tls_option(args: argparse.Namespace) -> TLS:
    """A client's `tls` argument from --tls and --tls-ca."""
    return args.tls_ca or args.tls


# What $JOBSERVER_AUTH_TOKEN is, wherever --auth-token-file is offered.
AUTH_TOKEN_HELP = (
    "send the token in FILE with each request (default: $JOBSERVER_AUTH_TOKEN, which "
    "holds the token itself, not a file name; else no token)"
)
