"""What a costly session fixture builds, built once for several pytest runs: scripts/run_tests.py sets
RLSTAGES_TEST_SHARED for both tiers to a directory it creates (and removes at the end), so the serial tier reads
the tiny models and the reference run the parallel tier built; xdist workers sharing it build each thing once.
Without the variable (a plain `pytest`), everything stays in the session's own temporary directory."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

SHARED_ENV = "RLSTAGES_TEST_SHARED"


def shared_or(name: str, fallback: Path | None) -> Path | None:
    """`name` in the directory shared by the tiers (RLSTAGES_TEST_SHARED) if set, else `fallback`."""
    root = os.environ.get(SHARED_ENV)
    return Path(root) / name if root else fallback


def built_once(path: Path, build: Callable[[Path], object]) -> dict:
    """Run `build(path)` unless `path` holds a finished build (its stamp `PATH.done` beside it); returns the
    stamp's content (what `build` returned if a dict, else {}). A lock on `PATH.lock` makes pytest runs and xdist
    workers that share `path` build it once; a build that died half-way (no stamp) is removed and redone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = path.with_name(path.name + ".done")
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its process dies)
        if not stamp.is_file():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            info = build(path)
            stamp.write_text(json.dumps(info if isinstance(info, dict) else {}))
    return json.loads(stamp.read_text())


def mlflow_store(folder: Path) -> str:
    """`sqlite:///FOLDER/mlflow.db`, the file first copied from an empty MLflow store built once (per `make test`,
    else per session): a new SQLite store runs MLflow's whole chain of schema migrations when it is first opened
    (6-35 s of one core, per flow run), a copy of a migrated one opens in under a second. A store already there (a
    resumed run's) is kept."""
    db = folder / "mlflow.db"
    if not db.exists():
        template = shared_or("mlflow-store", None) or Path(os.environ["RLSTAGES_TESTS_TMP"]) / "mlflow-store"
        built_once(template, _empty_mlflow_store)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template / "mlflow.db", db)
    return f"sqlite:///{db}"


def _empty_mlflow_store(path: Path) -> None:
    """An MLflow SQLite store at the schema's head revision, with nothing in it but MLflow's Default experiment."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{path / 'mlflow.db'}", str(path / "artifacts"))
    store.engine.dispose()
