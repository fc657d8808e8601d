"""Where a study lives: a journal file in the study directory by default, or any Optuna storage URL.

The journal (``optuna.storages.journal``) is Optuna's storage for several processes on one host
without a server; a database URL (``postgresql://...``) lets ``phalanx tune`` on several hosts
share one study. The runner, every trial and ``--report`` open the same storage through here.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage

from phalanx.errors import ConfigurationError

JOURNAL_PREFIX = "journal:"
SCHEMA_ATTEMPTS = 5
DUPLICATES = ("42P07", "42710")  # PostgreSQL: duplicate_table, duplicate_object


def journal_url(study_dir: str | Path) -> str:
    """The default storage of a study directory, as a URL :func:`open_storage` reads."""
    return f"{JOURNAL_PREFIX}{Path(study_dir).resolve() / 'study.journal'}"


def open_storage(url: str) -> BaseStorage:
    """Open ``journal:PATH`` or a database URL; a clear error says what is wrong with it."""
    if url.startswith(JOURNAL_PREFIX):
        path = Path(url[len(JOURNAL_PREFIX):])
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    for attempt in range(SCHEMA_ATTEMPTS):
        try:
            return RDBStorage(url, heartbeat_interval=None, engine_kwargs={"pool_pre_ping": True})
        except (ImportError, ModuleNotFoundError) as error:
            raise ConfigurationError(f"--storage {url}: its database driver is not installed ({error}); for "
                                     "PostgreSQL `pip install psycopg2-binary`.") from None
        except Exception as error:  # noqa: BLE001 - SQLAlchemy raises many kinds
            if not _created_meanwhile(error):
                raise ConfigurationError(f"--storage {url}: cannot open it ({type(error).__name__}: {error}).") from None
            time.sleep(0.2 + random.random() * (attempt + 1))
    raise ConfigurationError(f"--storage {url}: its tables could not be created after {SCHEMA_ATTEMPTS} attempts.")


def _created_meanwhile(error: Exception) -> bool:
    """Whether ``error`` says that another process created the same tables at the same moment: a
    unique key of the catalogue taken (an IntegrityError), or PostgreSQL's "relation already exists"
    (a ProgrammingError, SQLSTATE 42P07, or 42710 for another object), depending on which step of
    the creation the two met in."""
    return isinstance(error, sqlalchemy.exc.IntegrityError) or (
        isinstance(error, sqlalchemy.exc.ProgrammingError) and getattr(error.orig, "pgcode", None) in DUPLICATES)


def load_study(url: str, name: str, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """The existing study ``name`` in the storage at ``url`` (a study's pruner is not stored: pass it)."""
    try:
        return optuna.load_study(study_name=name, storage=open_storage(url), pruner=pruner)
    except KeyError:
        raise ConfigurationError(f"no study {name!r} in {url}; start it with `phalanx tune`.") from None
