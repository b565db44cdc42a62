"""Prompt sets and the prompts of a step: deterministic from (seed, step), so a replay draws the same ones.

Sources: the demo's synthetic addition ("What is a + b?", a and b seeded; held-out prompts from another
seed), the synthetic colour images, JSONL prompt/answer rows, or anything the Hugging Face `datasets` library
reads (`files`: parquet, JSON, arrow, a saved dataset directory, a cached hub dataset, verl's RL schema).

Bad data is a one-line ValueError naming the file, row and column; `check_data` runs every check before
anything starts. Prompts longer than `data.max_prompt_length` tokens (after the chat template) are dropped
and counted, or refused. The training order is a seeded permutation per epoch, read at the step's cursor,
so a run resumes mid-epoch and starts a new epoch when the data is exhausted.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rlstages.configs import RunConfig
from rlstages.configs.data import (
    AdditionTaskConfig,
    ColorsTaskConfig,
    DataConfig,
    JsonlDataConfig,
)
from rlstages.engines.types import Prompt
from rlstages.tasks.driver.data.files import (
    Row,
    dataset_rows,
)
from rlstages.tasks.driver.data.vision import colour_task


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


def longest_prompt(cfg: RunConfig) -> int | None:
    """The longest prompt of the train and eval splits in tokens (chat template included), for the memory plan when
    data.max_prompt_length is unset. None where the data is not local text (a hub dataset, images) or the model's
    tokenizer is not on this machine (a hub id, a provider's model not built yet)."""
    if not isinstance(cfg.data.source, AdditionTaskConfig | JsonlDataConfig):
        return None
    path = cfg.model.path
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    rows = [row for split in ("train", "eval") for row in load_rows(cfg.data, split)]
    return max(_prompt_lengths(cfg.data, rows, str(path)), default=None)


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
        rows, where = dataset_rows(source, split)
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
