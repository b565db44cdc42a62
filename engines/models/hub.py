"""Hub model ids (`org/name`) resolved to a local snapshot through the Hugging Face cache.

`huggingface_hub.snapshot_download` does the work, so the cache layout (`models--org--name/snapshots/<rev>`,
`refs/<branch>`), `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and a revision behave as in every HF tool:
offline, only what the cache holds is used; online, missing files are fetched. Read at call time, so a
test (or a worker) sees the environment it was given.

Non-goals: loading the model (`registry`), pickle weights (only safetensors and tokenizer/config files).
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
# What a policy needs: config, safetensors weights (and their index), tokenizer and generation files.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def hub_cache_dir() -> Path:
    """The hub cache this environment names: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hub_offline(*also: str) -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, or one of the variables `also` names, such as
    HF_DATASETS_OFFLINE) asks for the cache only."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *also)
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in keys)


def is_hub_id(path: str | Path) -> bool:
    """True for a string shaped like `org/name` that is not an existing local path."""
    text = str(path)
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return False
    org, name = text.split("/")
    return bool(org) and bool(name)


def resolve_model_path(path: str | Path, revision: str | None = None) -> Path:
    """A local directory as given (absolute); a hub id as its snapshot directory in the HF cache (fetched
    first unless offline). A hub id that cannot be resolved is a one-line FileNotFoundError."""
    if not is_hub_id(path):
        return Path(path).expanduser().resolve()
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        local = snapshot_download(
            repo_id=str(path),
            revision=revision,
            cache_dir=str(cache),
            local_files_only=offline,
            allow_patterns=ALLOW_PATTERNS,
        )
    except Exception as err:  # noqa: BLE001 - hub/cache errors of every kind become one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = f"the HF cache {cache} (HF_HUB_OFFLINE=1)" if offline else f"the hub or the HF cache {cache}"
        raise FileNotFoundError(
            f"model.path: {path}{'@' + revision if revision else ''} is neither a local directory nor found in "
            f"{where}: {first}"
        ) from None
    return Path(local)
