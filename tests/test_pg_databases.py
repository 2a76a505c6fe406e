"""Databases a node meets besides a default one: whatever their encoding
and their sessions' defaults, a node starts on them and stores what it is
sent byte for byte (postgres_connection.connect sets what its SQL
assumes)."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pg
import psycopg
import pytest

from harness import ThreadServer
from helpers import ok
from jobserver.storage import postgres

# A text with a backslash, quotes and characters outside ASCII.
TEXT = "a\\b 'q' \"d\" café €"
# And one that LATIN1 holds.
LATIN1_TEXT = "a\\b 'q' \"d\" café"


@pytest.fixture(
    params=[("SQL_ASCII", None), ("LATIN1", None), ("UTF8", "standard_conforming_strings")],
    ids=["SQL_ASCII", "LATIN1", "UTF8, standard_conforming_strings off"],
)
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A new database's URL, and its encoding."""
    encoding, off = request.param
    with pg.database_in(encoding) as url:
        if off is not None:
            name = url.rsplit("/", 1)[1]
            with psycopg.connect(url, autocommit=True) as db:
                db.execute(f"ALTER DATABASE {name} SET {off} = off".encode())
        yield url, encoding


def test_a_node_starts_and_keeps_texts_whatever_the_database(database: tuple[str, str]) -> None:
    """On a SQL_ASCII database (psycopg read its texts back as bytes), on a
    LATIN1 one and on one whose sessions take backslashes in literals as
    escapes (the schema's functions were refused), a node starts, and a
    job's name and data come back as they were sent; on LATIN1 a character
    it cannot hold is that request's own refusal."""
    url, encoding = database
    text = LATIN1_TEXT if encoding == "LATIN1" else TEXT
    server = ThreadServer(url)
    try:
        with server.client() as client:
            job_id = ok(client.request("CreateJob", name="texts", data={"t": text})).json["jobID"]
            got = ok(client.request("GetJob", name="texts")).json
            assert (got["jobID"], got["data"]) == (job_id, {"t": text})
            ok(client.request("FinishJob", jobID=job_id))
            if encoding == "LATIN1":
                reply = client.request("CreateJob", name="texts", data={"t": "€"})
                assert reply.status.startswith("502 "), reply
            ok(client.request("Ping"))
    finally:
        server.stop()


def test_a_url_asking_another_encoding_still_speaks_utf8() -> None:
    """A URL's client_encoding, or a standard_conforming_strings in its
    options, does not change what the node's sessions speak, and its other
    options (here the schema) still apply beside the node's."""
    with pg.fresh_schema() as url:
        schema = url.rsplit("search_path%3D", 1)[1]
        options = quote(f"-csearch_path={schema} -c standard_conforming_strings=off")
        given = f"{url.split('?')[0]}?options={options}&client_encoding=LATIN1"
        store = postgres.PostgresStore(given, writers=1)
        try:
            row = store._one(
                "SELECT current_setting('client_encoding'), "
                "current_setting('standard_conforming_strings'), current_schema()"
            )
        finally:
            store.close()
    assert row is not None
    assert (row[0], row[1]) == ("UTF8", "on")
    assert row[2] == schema
