"""The array literals storage binds as text in place of a list parameter
(storage/sql.py), read back by PostgreSQL itself."""

from __future__ import annotations

from collections.abc import Iterator

import pg
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.core.rules.leases import LEASE_BYTES
from jobserver.storage import sql

# A lease token (leases.py), or none given.
_LEASES = st.lists(
    st.none() | st.binary(min_size=LEASE_BYTES, max_size=LEASE_BYTES).map(bytes.hex),
    max_size=50,
)


@pytest.fixture(scope="module")
def db() -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg.database_url(), autocommit=True) as connection:
        yield connection


@settings(max_examples=60, deadline=None)
@given(leases=_LEASES)
def test_lease_tokens_and_nulls_read_back_as_they_were(
    db: psycopg.Connection, leases: list[str | None]
) -> None:
    row = db.execute("SELECT %s::text[]", (sql.tokens(leases),)).fetchone()
    assert row is not None and row[0] == leases


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=50))
def test_integers_read_back_as_they_were(db: psycopg.Connection, ids: list[int]) -> None:
    row = db.execute("SELECT %s::bigint[]", (sql.integers(ids),)).fetchone()
    assert row is not None and row[0] == ids


@pytest.mark.parametrize(
    "text", ["", "a,b", 'a"b', "a}b", "a\\b", "a b", "NULL", "null", "\u0661\u0662", "ä1"]
)
def test_anything_but_letters_and_digits_is_refused_as_a_token(text: str) -> None:
    with pytest.raises(ValueError, match="not a lease token"):
        sql.tokens(["ab12", text])
