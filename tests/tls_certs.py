"""Certificates made on the spot with trustme, and a real server that serves TLS with them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme

from harness import ThreadServer


@dataclass(frozen=True)
class Certificates:
    cert: Path  # the server's certificate (PEM)
    key: Path  # its private key
    ca: Path  # the certificate of the CA that signed it: what a client trusts


def make_certificates(directory: Path, *names: str) -> Certificates:
    """A new CA, and a server certificate from it for `names` (default: the loopback ones)."""
    authority = trustme.CA()
    issued = authority.issue_cert(*(names or ("127.0.0.1", "localhost")))
    files = Certificates(directory / "cert.pem", directory / "key.pem", directory / "ca.pem")
    issued.cert_chain_pems[0].write_to_path(files.cert)
    issued.private_key_pem.write_to_path(files.key)
    authority.cert_pem.write_to_path(files.ca)
    return files


@contextmanager
def tls_server(
    directory: Path, *names: str, **options: object
) -> Iterator[tuple[ThreadServer, Certificates]]:
    """A real server speaking TLS with a certificate for `names`, and its
    files; `options` are more of the server's Config."""
    directory.mkdir(exist_ok=True)
    files = make_certificates(directory, *names)
    running = ThreadServer(
        directory / "tls.db", tls_cert=str(files.cert), tls_key=str(files.key), **options
    )
    try:
        yield running, files
    finally:
        running.stop()

