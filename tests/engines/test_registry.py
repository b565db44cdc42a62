"""One place for each fact about a backend: what it can do is declared on its entry in `engines/registry.py`, and
no module outside the registry and the backend's own modules compares a backend's name or tests its options class
with `isinstance` (pre-flight, doctor, the memory plan and the stage tasks ask the entry). Every entry's named
pieces import. CPU only, no workers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from rlstages.configs.rollout import RolloutConfig
from rlstages.engines.imports import import_object
from rlstages.engines.memory_models.backends import GeneratedKV, TorchMemory
from rlstages.engines.registry import ALL_TRANSPORTS, ROLLOUT_BACKENDS, TRAINING_BACKENDS
from rlstages.engines.sync.registry import TRANSPORTS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("configs", "engines", "tasks", "flows")
NAMES = sorted({*ROLLOUT_BACKENDS, *TRAINING_BACKENDS})
OPTION_CLASSES = sorted(
    {entry.options.__name__ for entry in TRAINING_BACKENDS.values()}
    | {cls.__name__ for cls in get_args(get_args(RolloutConfig)[0])}
)
AMBIGUOUS = {"hf", "torch"}  # also a conversion side and a package: flagged where the line speaks of a backend


def _compared(names: list[str]) -> re.Pattern[str]:
    alt = "|".join(names)
    return re.compile(rf"""(==|!=)\s*["']({alt})["']|["']({alt})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({alt})["']""")


COMPARED = _compared([n for n in NAMES if n not in AMBIGUOUS])
COMPARED_BACKEND = _compared(NAMES)
LITERAL = re.compile(r"""=\s*[(\[{]((?:\s*["'][\w-]+["']\s*,?)+)[)\]}]""")  # a tuple / list / set of strings
ISINSTANCE = re.compile(rf"isinstance\([^)]*\b({'|'.join(OPTION_CLASSES)})\b")


def forbidden(line: str) -> list[str]:
    """What a line does that only the registry may: compare a backend's name, list backend names (every item one),
    test a backend's options class."""
    out = []
    if COMPARED.search(line) or ("backend" in line and COMPARED_BACKEND.search(line)):
        out.append("a backend name compared")
    for items in LITERAL.findall(line):
        names = re.findall(r"""["']([\w-]+)["']""", items)
        if len(names) > 1 and set(names) <= set(NAMES):
            out.append("a list of backend names")
    if ISINSTANCE.search(line):
        out.append("isinstance on a backend's options")
    return out


def own(path: Path) -> bool:
    """The registry, or a backend's own module: a folder or file named after a registered backend
    (`engines/megatron/`, `vllm_rollout.py`, `deepspeed_backend.py`)."""
    rel = path.relative_to(ROOT)
    if rel.as_posix() == "engines/registry.py":
        return True
    return any(part == name or part.startswith(f"{name}_") for part in rel.with_suffix("").parts for name in NAMES)


def offences(paths: list[Path]) -> list[str]:
    """`file:line: what` for each forbidden pattern outside the registry and the backends' own modules."""
    found = []
    for path in paths:
        if own(path):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {what}" for what in forbidden(line)]
    return found


def test_no_backend_is_asked_for_by_name_outside_the_registry() -> None:
    files = [f for d in PACKAGE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 100
    assert offences(files) == []


def test_the_grep_sees_what_it_forbids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "tasks").mkdir()
    bad = tmp_path / "tasks" / "x.py"
    bad.write_text(
        'if cfg.rollout.backend == "vllm": pass\nif "megatron" != b: pass\nif r.backend in ("hf", "x"): pass\n'
        'IMAGE = ("torch", "deepspeed")\nif isinstance(a, MegatronTrainingConfig): pass\nif cfg.mode == "ray": pass\n'
        'PACKAGES = ("torch", "transformers")\nif side == "hf": pass\n'
    )
    (tmp_path / "engines" / "megatron").mkdir(parents=True)
    (tmp_path / "engines" / "megatron" / "y.py").write_text(bad.read_text())
    found = offences([bad, tmp_path / "engines" / "megatron" / "y.py"])
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize("name", sorted(ROLLOUT_BACKENDS))
def test_each_rollout_entry_names_pieces_that_import(name: str) -> None:
    entry = ROLLOUT_BACKENDS[name]
    assert isinstance(import_object(entry.memory)(), GeneratedKV)
    for target in (entry.interpreter, entry.image_check, entry.actor_options):
        assert target is None or callable(import_object(target))
    assert entry.transports <= ALL_TRANSPORTS
    streams = ("start_stream", "submit", "pump", "set_policy_version", "stop_stream")  # what async_stream calls
    assert entry.partial_rollout == all(hasattr(import_object(entry.engine), m) for m in streams)
    assert entry.multi_turn == ("multi_turn" in entry.options)  # the engine takes the section it can run


@pytest.mark.parametrize("name", sorted(TRAINING_BACKENDS))
def test_each_training_entry_names_pieces_that_import(name: str) -> None:
    entry = TRAINING_BACKENDS[name]
    assert isinstance(import_object(entry.memory)(), TorchMemory)
    assert entry.hf_convert is None or callable(import_object(entry.hf_convert))
    assert entry.reference_layout <= set(entry.options.model_fields)


def test_the_registry_knows_every_transport() -> None:
    assert set(TRANSPORTS) == ALL_TRANSPORTS  # the registry keeps the names (the sync layer is below it)
