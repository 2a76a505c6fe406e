"""The HTTP side of the server (`--http-port`), an optional extra:
`pip install 'jobserver[web]'` (Starlette and Hypercorn)."""

from __future__ import annotations

MISSING = (
    "--http-port needs the web extra, which is not installed: pip install 'jobserver[web]'"
)


def available() -> bool:
    try:
        import hypercorn.trio  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        return False
    return True
