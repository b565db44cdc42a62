"""The tracking store: which URI a run logs to (the config wins, then MLFLOW_TRACKING_URI), why MLflow could
not open it (found without writing: the pre-flight asks), and a client for it."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from mlflow import MlflowClient

from rlstages.configs import RunConfig

DEFAULT_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: RunConfig | None = None) -> str:
    """`tracking.tracking_uri` when the config sets one (it wins), else MLFLOW_TRACKING_URI, else ./mlflow.db."""
    configured = cfg.tracking.tracking_uri if cfg is not None else None
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def tracking_uri_origin(cfg: RunConfig) -> tuple[str, str]:
    """(where the tracking URI comes from, the URI): the setting a user fixes when the store cannot work."""
    if cfg.tracking.tracking_uri:
        return "tracking.tracking_uri", cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"]
    return "the default tracking URI (set tracking.tracking_uri or MLFLOW_TRACKING_URI)", DEFAULT_URI


def store_problem(uri: str) -> str | None:
    """Why MLflow could not open the tracking store `uri` (None when it can), found without writing anything:
    an unknown scheme, a database file that is not one or cannot be created, a database driver that is not
    installed, a file store that this MLflow refuses, a server URI without a host."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry  # no public API

        registry.get_store_builder(uri)
    except (ImportError, AttributeError):  # another MLflow: its own error, later
        pass
    except Exception:  # noqa: BLE001 - MLflow's "unsupported URI" exception
        known = ", ".join(sorted(k for k in getattr(registry, "_registry", {}) if k))
        return f"has an unknown scheme {scheme!r} (MLflow knows {known}; e.g. sqlite:///mlflow.db)"
    if scheme in ("http", "https"):
        return None if urlparse(uri).hostname else "has no host (expected http://HOST:PORT)"
    if scheme in ("", "file"):
        return _file_store_problem(Path(urlparse(uri).path if scheme == "file" else uri))
    if scheme.partition("+")[0] in ("sqlite", "postgresql", "mysql", "mssql"):
        return _database_problem(uri)
    return None


def _file_store_problem(path: Path) -> str | None:
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

    if not MLFLOW_ALLOW_FILE_STORE.get():
        return (
            f"is a file store, which MLflow {mlflow.__version__} opens only with MLFLOW_ALLOW_FILE_STORE=true; "
            "use a database such as sqlite:///mlflow.db"
        )
    if path.exists() and not path.is_dir():
        return f"names {path}, which is not a directory (expected an MLflow file store directory)"
    return _creatable(path)


def _database_problem(uri: str) -> str | None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        url.get_dialect().import_dbapi()
    except ArgumentError as exc:
        return f"is not a database URL ({exc})"
    except (ImportError, NoSuchModuleError) as exc:
        return f"needs a database driver that is not installed here ({type(exc).__name__}: {exc})"
    if not url.drivername.startswith("sqlite") or url.database in (None, "", ":memory:"):
        return None
    path = Path(url.database)
    if path.is_dir():
        return f"names {path}, which is a directory (expected an SQLite database file)"
    if path.exists():
        with open(path, "rb") as fh:
            head = fh.read(16)
        if head and head != b"SQLite format 3\x00":
            return f"names {path}, which is not an SQLite database"
        return None
    return _creatable(path)


def _creatable(path: Path) -> str | None:
    """Why `path` cannot be created (its nearest existing parent is a file, or not writable), else None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


_OPENED: set[str] = set()  # SQLite stores this process has opened (created, migrated) once


def client(cfg: RunConfig) -> MlflowClient:
    """A client for the run's tracking URI (see `tracking_uri`). A SQLite store is first opened under a lock
    beside its file: MLflow creates and migrates the database on first open, and two processes doing that at
    once race on its alembic table (`Online migration expected to match one row`)."""
    uri = tracking_uri(cfg)
    if uri in _OPENED or not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    from rlstages.tasks.driver.run_lock import file_lock

    with file_lock(Path(uri.removeprefix("sqlite:///") + ".lock")):
        made = MlflowClient(tracking_uri=uri)
        made.search_experiments(max_results=1)  # the store is created and migrated here, one process at a time
    _OPENED.add(uri)
    return made
