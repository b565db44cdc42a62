"""Pre-flight checks of the data: JSONL files row by row, local dataset paths, every row of both splits, and
prompts that do not fit the model's context with the response's budget (`rollout.response_budget`)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from rlstages.configs import RunConfig
from rlstages.configs.data import DatasetsDataConfig, JsonlDataConfig
from rlstages.tasks.driver.checks import PreflightError

TEMPLATE_SLACK = 64  # tokens a chat template and system prompt may add around a prompt, for the cheap bound


def check_data_files(cfg: RunConfig) -> None:
    """JSONL files exist, are UTF-8, non-empty, and every row is an object with the prompt and answer keys; a
    `datasets` path that looks local (absolute, ./, ../, a data file suffix, a glob) names files that exist."""
    source = cfg.data.source
    if isinstance(source, DatasetsDataConfig):
        for field, value in (("data.source.path", source.path), ("data.source.eval_path", source.eval_path)):
            if value is not None:
                _check_dataset_path(value, field)
        return
    if not isinstance(source, JsonlDataConfig):
        return
    paths = [("data.source.train_path", source.train_path)]
    if source.eval_path is not None:
        paths.append(("data.source.eval_path", source.eval_path))
    for field, path in paths:
        _check_jsonl(path, field, source.prompt_key, source.answer_key)


def _check_dataset_path(path: str, field: str) -> None:
    """A local data path must name something; anything else is a hub dataset name (read in `check_data_rows`)."""
    from rlstages.tasks.driver.data.files import DATA_SUFFIXES, is_glob, looks_local

    expected = f"expected a data file ({', '.join(DATA_SUFFIXES)}), a glob of them or a save_to_disk directory"
    if is_glob(path):
        if not glob.glob(path):
            raise PreflightError(f"{field}: {path} matches no file ({expected})")
    elif not Path(path).exists() and looks_local(path):
        raise PreflightError(f"{field}: {path} does not exist ({expected})")


def _check_jsonl(path: Path, field: str, prompt_key: str, answer_key: str) -> None:
    if path.is_dir():
        raise PreflightError(f"{field}: {path} is a directory (expected a JSONL file)")
    if not path.is_file():
        raise PreflightError(f"{field}: {path} does not exist (expected a JSONL file)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreflightError(f"{field}: {path} is not UTF-8 (byte {exc.start}); save it as UTF-8") from None
    rows = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreflightError(f"{field}: {path}:{n} is not JSON ({exc.msg})") from None
        missing = [k for k in (prompt_key, answer_key) if not isinstance(obj, dict) or k not in obj]
        if missing:
            raise PreflightError(
                f"{field}: {path}:{n} lacks {', '.join(repr(k) for k in missing)} (expected a JSON object with "
                f"{prompt_key!r} and {answer_key!r}; see data.source.prompt_key/answer_key)"
            )
        rows += 1
    if rows == 0:
        raise PreflightError(f"{field}: {path} has no rows (expected one JSON object per line)")


def context_length(cfg: RunConfig) -> int | None:
    """The model's context (max_position_embeddings), from the tiny spec or config.json."""
    if cfg.model.tiny is not None:
        return cfg.model.tiny.max_position_embeddings
    config = cfg.model.path / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreflightError(f"model.path: {config} is not valid JSON ({type(exc).__name__}: {exc})") from None
    value = raw.get("max_position_embeddings") or raw.get("n_positions")
    return int(value) if isinstance(value, int) else None


def check_prompt_lengths(cfg: RunConfig) -> list[str]:
    """Prompts + the response's budget (rollout.max_new_tokens, or the multi-turn trajectory's) fit the context:
    refused (data.overlong_prompts=error) or reported."""
    context = context_length(cfg)
    if context is None:
        return []
    budget, key = cfg.rollout.response_budget, cfg.rollout.response_budget_key
    limit = context - budget
    if limit <= 0:
        raise PreflightError(f"{key}: {budget} leaves no room for a prompt in the model's context of {context} tokens")
    from rlstages.tasks.driver.data.loading import load_rows

    rows = [(split, i, row.text) for split in ("train", "eval") for i, row in enumerate(load_rows(cfg.data, split))]
    system = len((cfg.data.system_prompt or "").encode())
    # a token covers at least one byte for the tokenizers we use: short prompts need no tokenizer
    suspects = [r for r in rows if len(r[2].encode()) + system + TEMPLATE_SLACK > limit]
    if not suspects:
        return []
    lengths = _token_lengths(cfg, [r[2] for r in suspects])
    long = [(split, i, n) for (split, i, _), n in zip(suspects, lengths, strict=True) if n > limit]
    if not long:
        return []
    split, i, n = long[0]
    what = f"{len(long)} prompt(s) longer than {limit} tokens (context {context} - {key})"
    if cfg.data.overlong_prompts == "error":
        raise PreflightError(
            f"data.overlong_prompts: {what}, e.g. {split} row {i} with {n} tokens; shorten them or set "
            "data.overlong_prompts=truncate"
        )
    if cfg.rollout.multi_turn.enabled:  # the multi-turn engine keeps a prompt whole; the window ends its trajectory
        return [f"{what} are kept whole: their trajectories stop at the context (stop reason 'context')"]
    return [f"{what} are truncated to their last {limit} tokens (data.overlong_prompts=truncate)"]


def _token_lengths(cfg: RunConfig, texts: list[str]) -> list[int]:
    from rlstages.engines.models import load_tokenizer
    from rlstages.engines.rollout.batching import format_prompts
    from rlstages.engines.types import Prompt

    tokenizer = load_tokenizer(cfg.model.path)
    prompts = [Prompt(uid=str(i), text=t, ground_truth="") for i, t in enumerate(texts)]
    ids = format_prompts(tokenizer, prompts, cfg.data.apply_chat_template, cfg.data.system_prompt)
    return [len(x) for x in ids]


def check_data_rows(cfg: RunConfig) -> None:
    """Both splits read and checked row by row: the file, row and column of a bad cell are named."""
    from rlstages.tasks.driver.data.loading import check_data

    check_data(cfg)


def check_images(cfg: RunConfig) -> None:
    """Image rows: each opens, placeholders match, within the image and length limits, a VLM with its processor."""
    from rlstages.tasks.driver.data.loading import load_rows
    from rlstages.tasks.driver.data.vision import check_image_rows

    check_image_rows(cfg, [r for split in ("train", "eval") for r in load_rows(cfg.data, split)])
