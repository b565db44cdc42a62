"""Prompt rows and the files they come from: the data-path rules (a glob, a local path, the suffixes `datasets`
reads), the `Row` every source yields, and the reader of anything the Hugging Face `datasets` library opens
(parquet, JSON, arrow, CSV, a saved dataset directory, a cached hub dataset) with verl's RL schema as the default
columns. Bad data is a one-line ValueError naming the file, row and column. `data` builds the splits and the
steps' prompts from these rows.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstages.configs.data import DatasetsDataConfig
from rlstages.engines.types import Prompt
from rlstages.tasks.driver.data.vision import row_images

_SUFFIX_BUILDER = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow", ".csv": "csv"}
DATA_SUFFIXES = tuple(_SUFFIX_BUILDER)


def is_glob(path: str) -> bool:
    """True when a data path is a glob pattern (`*`, `?`, `[`)."""
    return any(c in path for c in "*?[")


def looks_local(path: str) -> bool:
    """True when a data path can only mean a local file or directory (absolute, ./, ../, ~, a data file
    suffix, or more than one `/`), never a hub dataset name `org/name`."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or Path(path).suffix.lower() in _SUFFIX_BUILDER


@dataclass(frozen=True)
class Row:
    """One prompt row before it gets a step's uid; `where` names its file and row for error messages."""

    text: str
    ground_truth: str
    messages: tuple[dict[str, str], ...] = ()
    data_source: str = ""
    extra_info: str = "{}"
    where: str = ""
    images: tuple[bytes, ...] = ()

    def prompt(self, uid: str) -> Prompt:
        """This row as the prompt `uid` of a step."""
        return Prompt(uid, self.text, self.ground_truth, self.messages, self.data_source, self.extra_info, self.images)


# --- Hugging Face datasets --------------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _local_files(path: str) -> list[str]:
    """The local files `path` names (a file or a glob), sorted; empty when it names none."""
    return sorted(glob.glob(path)) if is_glob(path) else ([path] if Path(path).is_file() else [])


def _check_nonempty(file: str, suffix: str) -> None:
    """Refuse an empty file (or a parquet file of zero rows) by name before `datasets` reads it."""
    if Path(file).stat().st_size == 0:
        raise ValueError(f"{file}: empty file (no rows)")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(file).num_rows
        except Exception as err:  # noqa: BLE001 - not a parquet file
            raise ValueError(f"{file}: not a readable parquet file ({_first_line(err)})") from None
        if rows == 0:
            raise ValueError(f"{file}: no rows")


def _hub_snapshot(repo_id: str, revision: str | None) -> str | None:
    """Offline (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`), a hub dataset's files from the HF cache
    (`HF_HOME`/`HF_HUB_CACHE`, the hub's snapshot layout) as a local directory; online, None: `datasets`
    fetches (and caches) it itself."""
    from huggingface_hub import snapshot_download

    from rlstages.engines.models.hub import hub_cache_dir, hub_offline

    if not hub_offline("HF_DATASETS_OFFLINE"):
        return None
    try:
        return snapshot_download(
            repo_id, repo_type="dataset", revision=revision, cache_dir=str(hub_cache_dir()), local_files_only=True
        )
    except Exception:  # noqa: BLE001 - not in the hub cache: `datasets` may have it prepared in its own cache
        return None


def _open_dataset(cfg: DatasetsDataConfig, path: str, split: str) -> tuple[Any, str]:
    """Open one split as a `datasets.Dataset`: local files, a save_to_disk directory, or a hub name (cache)."""
    import datasets

    datasets.disable_progress_bars()  # one-line errors and quiet checks, not progress bars on stderr
    files = _local_files(path)
    try:
        if files:
            suffix = Path(files[0]).suffix.lower()
            if suffix not in _SUFFIX_BUILDER:
                raise ValueError(
                    f"{files[0]}: unknown data file type {suffix!r}; expected one of {sorted(_SUFFIX_BUILDER)}"
                )
            for file in files:
                _check_nonempty(file, suffix)
            ds = datasets.load_dataset(_SUFFIX_BUILDER[suffix], data_files=files, split="train")
            return ds, files[0] if len(files) == 1 else path
        if Path(path).is_dir() and any((Path(path) / f).is_file() for f in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(path)
            where = path
        else:
            if Path(path).exists() or looks_local(path):
                raise FileNotFoundError(
                    f"data.source.path: {path} is not a data file, a glob of them or a save_to_disk directory"
                )
            ds = datasets.load_dataset(_hub_snapshot(path, cfg.revision) or path, cfg.name, revision=cfg.revision)
            where = f"hub dataset {path}"
    except (FileNotFoundError, ValueError):
        raise
    except Exception as err:  # noqa: BLE001 - arrow, datasets and hub errors all become one line
        cause = err.__cause__ or err.__context__ or err
        raise ValueError(f"data.source.path: cannot read {path} ({_first_line(cause)})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split if split in ds else cfg.train_split
        if name not in ds:
            raise ValueError(f"{where}: no split {split!r} (splits: {', '.join(ds)})")
        return ds[name], f"{where} [{name}]"
    return ds, where


def _lookup(record: dict[str, Any], key: str) -> tuple[bool, Any]:
    """The value at a dotted key inside nested dicts: (found, value)."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _messages(value: Any, where: str, key: str) -> tuple[dict[str, str], ...]:
    """Chat messages [{role, content}] from a `prompt` cell, or a one-line error naming the cell."""
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: column {key!r}: message {i} is not {{role: str, content: str}}: {m!r}"[:300])
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise ValueError(f"{where}: column {key!r}: no chat messages")
    return tuple(out)


def _dataset_row(cfg: DatasetsDataConfig, record: dict[str, Any], where: str) -> Row:
    """Validate one record and turn it into a Row (types checked cell by cell)."""
    _, prompt = _lookup(record, cfg.prompt_key)
    messages: tuple[dict[str, str], ...]
    if isinstance(prompt, str) and prompt.strip():
        text, messages = prompt, ()
    elif isinstance(prompt, list):
        messages = _messages(prompt, where, cfg.prompt_key)
        text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    else:
        got = "an empty string" if isinstance(prompt, str) else type(prompt).__name__
        raise ValueError(f"{where}: column {cfg.prompt_key!r}: expected a string or chat messages, got {got}")
    _, answer = _lookup(record, cfg.answer_key)
    if answer is None:
        answer = ""
    elif isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(
            f"{where}: column {cfg.answer_key!r}: expected a string or number, got {type(answer).__name__}"
        )
    source = cfg.default_data_source
    if cfg.data_source_key:
        found, value = _lookup(record, cfg.data_source_key)
        if found and value is not None:
            if not isinstance(value, str):
                raise ValueError(
                    f"{where}: column {cfg.data_source_key!r}: expected a string, got {type(value).__name__}"
                )
            source = value
    extra: Any = {}
    if cfg.extra_info_key:
        found, value = _lookup(record, cfg.extra_info_key)
        if found and value is not None:
            if not isinstance(value, dict):
                raise ValueError(f"{where}: column {cfg.extra_info_key!r}: expected a dict, got {type(value).__name__}")
            extra = value
    images = row_images(_lookup(record, cfg.image_key)[1], where, cfg.image_key) if cfg.image_key else ()
    return Row(text, str(answer), messages, source, json.dumps(extra, default=str, sort_keys=True), where, images)


def dataset_rows(cfg: DatasetsDataConfig, split: str) -> tuple[list[Row], str]:
    """The rows of `split` from a `datasets`-readable source, and where they came from (for messages)."""
    path = cfg.path if split == "train" or cfg.eval_path is None else cfg.eval_path
    ds, where = _open_dataset(cfg, path, cfg.train_split if split == "train" else cfg.eval_split)
    if len(ds) == 0:
        raise ValueError(f"{where}: no rows")
    for key in (cfg.prompt_key, cfg.answer_key):
        if key.split(".")[0] not in ds.column_names:
            raise ValueError(f"{where}: missing column {key!r} (columns: {', '.join(ds.column_names)})")
    rows = [_dataset_row(cfg, record, f"{where}: row {i}") for i, record in enumerate(_records(ds))]
    return rows, where


def _records(ds: Any) -> Iterator[dict[str, Any]]:
    """The dataset's rows as plain dicts (nested structs as dicts, lists as lists)."""
    for batch in ds.iter(batch_size=1024):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys), strict=True):
            yield dict(zip(keys, values, strict=True))
