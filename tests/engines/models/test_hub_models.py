"""`model.path` as a hub id: resolved offline through a temporary Hugging Face cache in the hub's layout
(`models--org--name/snapshots/<rev>/...`, `refs/main`), honouring HF_HOME, HF_HUB_OFFLINE and a revision."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlstages.engines.models import ensure_model, is_hub_id, load_causal_lm, resolve_model_path

REV_A = "a" * 40
REV_B = "b" * 40


def place_in_hub_cache(model_dir: Path, hub_cache: Path, repo_id: str, revision: str, branch: str | None) -> Path:
    """Copy a model directory into the hub cache layout as `repo_id` at `revision` (named by `branch`)."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    if branch:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(revision)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    place_in_hub_cache(tiny_model_dir, home / "hub", "tiny-org/tiny-qwen2", REV_A, "main")
    place_in_hub_cache(tiny_model_dir, home / "hub", "tiny-org/tiny-qwen2", REV_B, None)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_id_resolves_to_the_cached_snapshot_offline(hf_home: Path) -> None:
    path = resolve_model_path("tiny-org/tiny-qwen2")
    assert path == hf_home / "hub" / "models--tiny-org--tiny-qwen2" / "snapshots" / REV_A
    assert resolve_model_path("tiny-org/tiny-qwen2", REV_B).name == REV_B  # a pinned commit
    assert ensure_model("tiny-org/tiny-qwen2", "local") == path
    model = load_causal_lm(path)
    assert model.config.model_type == "qwen2"


def test_missing_hub_id_is_a_one_line_error_naming_the_cache(hf_home: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("tiny-org/absent")
    message = str(err.value)
    assert "\n" not in message and "tiny-org/absent" in message and str(hf_home / "hub") in message
    assert "HF_HUB_OFFLINE=1" in message
    with pytest.raises(FileNotFoundError, match="tiny-qwen2@main2"):
        resolve_model_path("tiny-org/tiny-qwen2", "main2")


def test_local_paths_are_never_taken_for_hub_ids(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert not is_hub_id(tiny_model_dir) and not is_hub_id("./org/name") and not is_hub_id("a/b/c")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir.resolve()
