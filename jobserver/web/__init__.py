"""The HTTP side of the server (`--http-port`), an optional extra:
`pip install 'jobserverd[web]'` (Starlette, Hypercorn, Jinja2 for the
dashboard's pages, prometheus_client for the metrics, jsonschema to check
API bodies against the OpenAPI document)."""

from __future__ import annotations

MISSING = (
    "--http-port needs the web extra, which is not installed: pip install 'jobserverd[web]'"
)


def available() -> bool:
    try:
        import hypercorn.trio  # noqa: F401
        import jinja2  # noqa: F401
        import jsonschema  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        return False
    return True
