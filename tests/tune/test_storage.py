"""Opening a study's storage: several hosts that create a database's tables at the same moment
retry instead of failing; any other database error is a clear error at once."""

from __future__ import annotations

import pytest
import sqlalchemy

import phalanx as px
from phalanx.tune import storage


class DatabaseError(Exception):
    """What a driver raises, with PostgreSQL's SQLSTATE."""

    def __init__(self, pgcode: str):
        super().__init__(f"SQLSTATE {pgcode}")
        self.pgcode = pgcode


def _failing(errors: list[Exception]) -> type:
    """An RDBStorage that raises ``errors`` one by one, then opens."""

    class Storage:
        def __init__(self, url: str, **kwargs: object):
            if errors:
                raise errors.pop(0)
            self.url = url

    return Storage


CREATED_MEANWHILE = [
    sqlalchemy.exc.IntegrityError("CREATE TYPE", {}, DatabaseError("23505")),  # pg_type's unique key
    sqlalchemy.exc.ProgrammingError("CREATE TABLE studies", {}, DatabaseError("42P07")),  # relation already exists
    sqlalchemy.exc.ProgrammingError("CREATE INDEX", {}, DatabaseError("42710")),
]


@pytest.mark.parametrize("error", CREATED_MEANWHILE, ids=["unique-key", "duplicate-table", "duplicate-object"])
def test_tables_another_host_created_at_the_same_moment_are_retried(monkeypatch: pytest.MonkeyPatch,
                                                                     error: Exception) -> None:
    monkeypatch.setattr(storage, "RDBStorage", _failing([error, error]))
    monkeypatch.setattr(storage.time, "sleep", lambda seconds: None)
    assert storage.open_storage("postgresql://db/study").url == "postgresql://db/study"


def test_any_other_database_error_is_a_clear_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = sqlalchemy.exc.ProgrammingError("CREATE TABLE studies", {}, DatabaseError("42501"))  # no privilege
    monkeypatch.setattr(storage, "RDBStorage", _failing([denied]))
    with pytest.raises(px.ConfigurationError, match=r"--storage postgresql://db/study: cannot open it "
                                                    r"\(ProgrammingError: .*42501"):
        storage.open_storage("postgresql://db/study")


def test_tables_that_never_open_give_up_after_the_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    duplicate = sqlalchemy.exc.ProgrammingError("CREATE TABLE studies", {}, DatabaseError("42P07"))
    monkeypatch.setattr(storage, "RDBStorage", _failing([duplicate] * storage.SCHEMA_ATTEMPTS))
    monkeypatch.setattr(storage.time, "sleep", lambda seconds: None)
    with pytest.raises(px.ConfigurationError, match="could not be created after 5 attempts"):
        storage.open_storage("postgresql://db/study")
