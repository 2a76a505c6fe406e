"""PostgreSQL neighbours: other roles of the queue's database, against
the nodes. (Query's own boundary is tests/test_security_query.py; notices
between nodes are tests/test_security_notices.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import pg
import psycopg
import pytest

WARNING = "create objects in it"


@pytest.fixture
def queue() -> Iterator[str]:
    with pg.fresh_schema() as url:
        yield url


def schema_of(url: str) -> str:
    options = unquote(parse_qs(urlsplit(url).query)["options"][0])
    return options.removeprefix("-csearch_path=")


def test_a_schema_others_may_create_in_is_warned_of(start_server, queue: str) -> None:
    quiet = start_server(queue)
    assert quiet.started, quiet.log
    assert WARNING not in quiet.log
    quiet.kill()
    with psycopg.connect(pg.database_url(), autocommit=True) as db:
        db.execute(f"GRANT CREATE ON SCHEMA {schema_of(queue)} TO PUBLIC".encode())
    warned = start_server(queue)
    assert warned.started, warned.log
    assert f"lets PUBLIC {WARNING}" in warned.log
    with warned.client() as client:
        assert client.request("Ping").status == "200 OK"
