"""Prompt sets and the prompts of a step: deterministic from (seed, step), so a replay draws the same ones.

Sources: the demo's synthetic addition ("What is a + b?", a and b seeded; held-out prompts from another
seed), JSONL prompt/answer rows, or anything the Hugging Face `datasets` library reads (parquet, JSON,
arrow, a saved dataset directory, a cached hub dataset) with verl's RL schema as the default columns:
`prompt` (a string or chat messages), `data_source`, `reward_model.ground_truth`, `extra_info`.

Bad data is a one-line ValueError naming the file, row and column; `check_data` runs every check before
anything starts. Prompts longer than `data.max_prompt_length` tokens (after the chat template) are dropped
and counted, or refused. The training order is a seeded permutation per epoch, read at the step's cursor,
so a run resumes mid-epoch and starts a new epoch when the data is exhausted.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlstages.configs import RunConfig
from rlstages.configs.data import (
    AdditionTaskConfig,
    ColorsTaskConfig,
    DataConfig,
    DatasetsDataConfig,
    JsonlDataConfig,
)
from rlstages.engines.types import Prompt
from rlstages.tasks.driver.vision_data import colour_task, row_images

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


@dataclass(frozen=True)
class Split:
    """The rows of a split after the length filter, with what was dropped and where they came from."""

    rows: tuple[Row, ...]
    dropped: int
    source: str
    digest: str


# --- synthetic and JSONL sources -------------------------------------------------------------------------


def _addition(cfg: AdditionTaskConfig, split: str) -> list[Row]:
    count = cfg.num_train if split == "train" else cfg.num_eval
    rng = random.Random(f"{cfg.seed}:{split}")
    rows = []
    for _ in range(count):
        terms = [rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(cfg.terms)]
        a, b = terms[0], terms[1]
        text = cfg.template.format(a=a, b=b, expr=" + ".join(map(str, terms)))
        rows.append(Row(text, str(sum(terms)), data_source="addition"))
    return rows


def _jsonl(cfg: JsonlDataConfig, split: str) -> list[Row]:
    path = cfg.train_path if split == "train" else (cfg.eval_path or cfg.train_path)
    if not path.is_file():
        raise FileNotFoundError(f"data.source.{split}_path: {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(Row(str(obj[cfg.prompt_key]), str(obj[cfg.answer_key]), where=f"{path}: row {n}"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{n}: expected a JSON object with keys {cfg.prompt_key!r} and {cfg.answer_key!r} ({exc})"
            ) from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


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


def _datasets(cfg: DatasetsDataConfig, split: str) -> tuple[list[Row], str]:
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


# --- splits, the length filter, steps ------------------------------------------------------------------------


def _digest(rows: list[Row]) -> str:
    """A content digest of the rows (what a run trained on), stable across file formats."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.text, r.messages, r.ground_truth, r.data_source, r.extra_info]).encode())
        for image in r.images:
            h.update(hashlib.sha256(image).digest())
    return h.hexdigest()[:16]


def _prompt_lengths(cfg: DataConfig, rows: list[Row], model_path: str) -> list[int]:
    """Token counts of each row's prompt as the rollout engine will see it (chat template included)."""
    from rlstages.engines.models import load_tokenizer
    from rlstages.engines.rollout.batching import format_prompts

    tok = load_tokenizer(model_path)
    if cfg.chat_template:
        tok.chat_template = cfg.chat_template
    ids = format_prompts(tok, [r.prompt("len") for r in rows], cfg.apply_chat_template, cfg.system_prompt)
    return [len(x) for x in ids]


@lru_cache(maxsize=8)
def load_split(cfg: DataConfig, split: str, model_path: str | None = None) -> Split:
    """All rows of a split ("train" or "eval"), length-filtered when `max_prompt_length` is set (then the
    tokenizer at `model_path` counts the tokens)."""
    source = cfg.source
    if isinstance(source, AdditionTaskConfig):
        rows, where = _addition(source, split), f"addition task (seed {source.seed}, {split})"
    elif isinstance(source, ColorsTaskConfig):
        count = source.num_train if split == "train" else source.num_eval
        made = colour_task(source.task, count, source.image_size, source.seed, split)
        rows = [Row(text, truth, (), f"colors/{source.task}", extra, "", (png,)) for text, truth, png, extra in made]
        where = f"colors task ({source.task}, seed {source.seed}, {split})"
    elif isinstance(source, JsonlDataConfig):
        rows = _jsonl(source, split)
        where = str(source.train_path if split == "train" else (source.eval_path or source.train_path))
    else:
        rows, where = _datasets(source, split)
    dropped = 0
    if cfg.max_prompt_length is not None and model_path is not None:
        lengths = _prompt_lengths(cfg, rows, model_path)
        too_long = [i for i, n in enumerate(lengths) if n > cfg.max_prompt_length]
        if too_long and cfg.overlong_prompts == "error":
            i = too_long[0]
            raise ValueError(
                f"{rows[i].where or where}: prompt of {lengths[i]} tokens > data.max_prompt_length="
                f"{cfg.max_prompt_length} ({len(too_long)} such rows; set data.overlong_prompts=drop to skip them)"
            )
        keep = set(range(len(rows))) - set(too_long)
        rows, dropped = [r for i, r in enumerate(rows) if i in keep], len(too_long)
        if not rows:
            raise ValueError(f"{where}: every prompt is longer than data.max_prompt_length={cfg.max_prompt_length}")
    return Split(tuple(rows), dropped, where, _digest(rows))


def load_rows(cfg: DataConfig, split: str, model_path: str | None = None) -> tuple[Row, ...]:
    """The rows of a split ("train" or "eval") after the length filter."""
    return load_split(cfg, split, model_path).rows


def cursor(cfg: DataConfig, step: int) -> int:
    """Prompts consumed before `step` (1-based steps)."""
    return (step - 1) * cfg.prompts_per_step


def prompts_for_step(cfg: DataConfig, step: int, seed: int, model_path: str | None = None) -> list[Prompt]:
    """The prompts of a training step: a seeded permutation per epoch, read at the step's cursor."""
    rows = load_rows(cfg, "train", model_path)
    out = []
    start = cursor(cfg, step)
    for i in range(cfg.prompts_per_step):
        position = start + i
        epoch, offset = divmod(position, len(rows))
        order = _epoch_order(len(rows), seed, epoch, cfg.shuffle)
        out.append(rows[order[offset]].prompt(f"s{step}-p{i}"))
    return out


@lru_cache(maxsize=4)
def _epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(size))
    if shuffle:
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
    return tuple(order)


def eval_prompts(cfg: DataConfig, model_path: str | None = None) -> list[Prompt]:
    """The held-out prompts (the first `eval_prompts` rows of the eval split)."""
    rows = load_rows(cfg, "eval", model_path)[: cfg.eval_prompts]
    return [r.prompt(f"eval-{i}") for i, r in enumerate(rows)]


def tokenizer_path(cfg: RunConfig) -> str | None:
    """The model directory whose tokenizer measures prompt lengths (None when no length limit is set)."""
    if cfg.data.max_prompt_length is None:
        return None
    from rlstages.engines.models import resolve_model_path

    path = resolve_model_path(str(cfg.model.path), cfg.model.revision)
    if cfg.model.provider != "local" and not (path / "config.json").is_file():
        return None  # a provider builds the model on first use; the flow filters once it exists
    return str(path)


def check_data(cfg: RunConfig) -> None:
    """Read and check both splits before anything starts: a one-line ValueError names the file, row and column
    (missing column, empty file, wrong types, an over-long prompt when refused, a row without a ground truth
    when a built-in reward compares against one)."""
    from rlstages.engines.rewards.registry import NEEDS_GROUND_TRUTH

    needs_truth = [f.name for f in cfg.reward.functions if f.name in NEEDS_GROUND_TRUTH]
    for split in ("train", "eval"):
        data = load_split(cfg.data, split, tokenizer_path(cfg))
        if needs_truth:
            for row in data.rows:
                if not row.ground_truth.strip():
                    column = getattr(cfg.data.source, "answer_key", "ground_truth")
                    raise ValueError(
                        f"{row.where or data.source}: column {column!r}: no ground truth, "
                        f"which reward {needs_truth[0]!r} needs"
                    )


def data_record(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """What each split holds, for the tracking store: {split: {source, digest, rows, dropped}}."""
    out = {}
    for split in ("train", "eval"):
        data = load_split(cfg.data, split, tokenizer_path(cfg))
        out[split] = {"source": data.source, "digest": data.digest, "rows": len(data.rows), "dropped": data.dropped}
    return out
