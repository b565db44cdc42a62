"""Prompt sets and the prompts of a step: deterministic from (seed, step), so a replay draws the same ones.

The demo's task is synthetic: "What is a + b? Reply with only the number.", a and b seeded in
[1, max_operand]; held-out prompts come from a different seed. JSONL files hold prompt/answer rows.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

from rlstages.configs.data import AdditionTaskConfig, DataConfig, JsonlDataConfig
from rlstages.engines.types import Prompt

Row = tuple[str, str]


def _addition(cfg: AdditionTaskConfig, split: str) -> list[Row]:
    count = cfg.num_train if split == "train" else cfg.num_eval
    rng = random.Random(f"{cfg.seed}:{split}")
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, cfg.max_operand), rng.randint(1, cfg.max_operand)
        rows.append((cfg.template.format(a=a, b=b), str(a + b)))
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
            rows.append((str(obj[cfg.prompt_key]), str(obj[cfg.answer_key])))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(
                f"{path}:{n}: expected a JSON object with keys {cfg.prompt_key!r} and {cfg.answer_key!r} ({exc})"
            ) from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


@lru_cache(maxsize=8)
def load_rows(cfg: DataConfig, split: str) -> tuple[Row, ...]:
    """All (prompt, answer) rows of a split ("train" or "eval")."""
    source = cfg.source
    rows = _addition(source, split) if isinstance(source, AdditionTaskConfig) else _jsonl(source, split)
    return tuple(rows)


def cursor(cfg: DataConfig, step: int) -> int:
    """Prompts consumed before `step` (1-based steps)."""
    return (step - 1) * cfg.prompts_per_step


def prompts_for_step(cfg: DataConfig, step: int, seed: int) -> list[Prompt]:
    """The prompts of a training step: a seeded permutation per epoch, read at the step's cursor."""
    rows = load_rows(cfg, "train")
    out = []
    start = cursor(cfg, step)
    for i in range(cfg.prompts_per_step):
        position = start + i
        epoch, offset = divmod(position, len(rows))
        order = _epoch_order(len(rows), seed, epoch, cfg.shuffle)
        text, answer = rows[order[offset]]
        out.append(Prompt(uid=f"s{step}-p{i}", text=text, ground_truth=answer))
    return out


@lru_cache(maxsize=4)
def _epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(size))
    if shuffle:
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
    return tuple(order)


def eval_prompts(cfg: DataConfig) -> list[Prompt]:
    """The held-out prompts (the first `eval_prompts` rows of the eval split)."""
    rows = load_rows(cfg, "eval")[: cfg.eval_prompts]
    return [Prompt(uid=f"eval-{i}", text=t, ground_truth=a) for i, (t, a) in enumerate(rows)]
