"""Coverage-guided fuzzing of the request parser with atheris (optional).

Not run by pytest (the name does not start with test_). With atheris
installed (`pip install atheris`):

    python tests/fuzz_parser.py -atheris_runs=200000          # a bounded run
    python tests/fuzz_parser.py corpus_dir/ -max_total_time=600

Each input is split in two at a position taken from its first byte and fed
to one RequestParser in two pieces, and again in one piece. The parser
must not raise, must give the same requests and error either way, and an
error must be one of the framing errors.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from jobserver.wire.framing import RequestParser

FRAMING_ERRORS = {
    "400 Malformed Content-Length",
    "413 Body too large",
    "413 Request too large",
    "414 Line too long",
    "431 Too many headers",
}


def parse(*pieces: bytes) -> tuple[list[tuple[str, dict[str, str], bytes, bool]], str | None]:
    parser = RequestParser()
    requests = []
    for piece in pieces:
        requests += parser.feed(piece)
    summary = [(r.method_line, r.headers, r.body, r.invalid_utf8) for r in requests]
    return summary, parser.error.status if parser.error else None


def one_input(data: bytes) -> None:
    if not data:
        return
    cut = data[0] * len(data) // 256
    stream = data[1:]
    whole = parse(stream)
    split = parse(stream[:cut], stream[cut:])
    if whole != split:
        raise AssertionError(f"split at {cut} parses differently: {whole!r} != {split!r}")
    error = whole[1]
    if error is not None and error not in FRAMING_ERRORS:
        raise AssertionError(f"unexpected error {error!r}")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
