"""Prefect tasks of checkpoint conversion: HF -> Megatron-Core (cached), its parity check, and the export back.

`convert_checkpoint` is cached on the sha256 of every input file + the template + the parallel layout (and
the output path): a second run on the same inputs, even in a new flow run, is a cache hit that does no
work. The result is persisted (only the output path string), and the key is dropped when the output
directory it points to is gone or no longer holds that conversion, so a cache hit never returns a stale path.
The heavy lifting is `rlstages.engines.convert`; megatron-core is only reached through it (parity, dist checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from rlstages.engines.convert import (
    ConversionSpec,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    get_template,
    hf_weight_files,
    read_hf_config,
    read_manifest,
)
from rlstages.engines.convert.manifest import FORMAT, verify_manifest
from rlstages.engines.convert.safetensors_io import DEFAULT_CHECKSUM, new_checksum
from rlstages.engines.megatron.dist_ckpt import dist_checkpoint_writer
from rlstages.tasks.policies import retry_condition

KEY_VERSION = "rlstages-convert/1"
DEFAULTS: dict[str, Any] = {"transformer_impl": "local", "dist_checkpoint": False, "checksum": DEFAULT_CHECKSUM}
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file, memoised on (path, size, mtime) so a key and its task body hash each file once."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def input_digests(hf_dir: str | Path) -> dict[str, str]:
    """sha256 of every top-level file of an HF directory (weights, config, tokenizer...)."""
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise FileNotFoundError(f"{hf}: HF model directory not found")
    return {p.name: file_digest(p) for p in sorted(hf.iterdir()) if p.is_file()}


def template_fingerprint(model_type: str) -> str:
    """A digest of a template's declaration: editing a template invalidates cached conversions."""
    t = get_template(model_type)
    text = json.dumps(
        [t.config_hf_to_mcore, t.constant_mcore_config, [repr(op) + str(op.when) for op in t.weight_ops],
         t.hf_layer_prefix, t.hf_invalid_keys, t.mcore_model_cls, t.tp_rules, t.hf_name_prefixes],
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def conversion_key(hf_dir: str, out_dir: str, tp: int, pp: int, vpp: int | None, **options: Any) -> str:
    """The cache key: input digests + template + parallel sizes + options + output path."""
    model_type = read_hf_config(Path(hf_dir)).get("model_type", "")
    payload = {
        "version": KEY_VERSION,
        "inputs": input_digests(hf_dir),
        "template": [model_type, template_fingerprint(model_type)],
        "layout": [tp, pp, vpp or 1],
        "options": options,
        "out": str(Path(out_dir).resolve()),
    }
    return "convert-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def holds_conversion(out_dir: str | Path, key: str) -> bool:
    """True when `out_dir` is a complete conversion made for `key`."""
    try:
        return read_manifest(out_dir).get("cache_key") == key
    except (FileNotFoundError, ValueError):
        return False


def check_conversion_inputs(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int,
    pp: int,
    vpp: int | None,
    transformer_impl: str = "local",
    checksum: str = DEFAULT_CHECKSUM,
    overwrite: bool = False,
    dist_checkpoint: bool = False,
    ep: int = 1,
    etp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> None:
    """Fail fast, before any flow run, on a bad HF directory, config or parallel layout (one-line errors)."""
    new_checksum(checksum)
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise FileNotFoundError(f"{hf}: HF model directory not found")
    stages = (first_stage_layers, last_stage_layers)
    if any(n is not None for n in stages) and pp < 2:
        raise ValueError(f"--first-stage-layers / --last-stage-layers need --pp > 1 (uneven stages), got pp={pp}")
    ConversionSpec.from_hf_config(
        read_hf_config(hf), tp, pp, vpp, transformer_impl, ep=ep, etp=etp,  # type: ignore[arg-type]
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
    )  # fmt: skip
    hf_weight_files(hf)
    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()) and ours(out):  # the same conversion again is a cache hit, not a clash
        options = {"transformer_impl": transformer_impl, "dist_checkpoint": dist_checkpoint, "checksum": checksum}
        options |= expert_option(ep, *stages, etp, tp)
        check_replaceable(out, overwrite, conversion_key(str(hf), str(out), tp, pp, vpp, **options))
    else:
        check_replaceable(out, overwrite)


def ours(out: Path) -> bool:
    """True when `out` holds a complete conversion written by `rlstages convert` (its manifest says so)."""
    try:
        manifest = read_manifest(out)
    except (FileNotFoundError, ValueError, OSError):
        return False
    return manifest.get("format") == FORMAT and manifest.get("direction", "hf_to_mcore") == "hf_to_mcore"


def check_replaceable(out: Path, overwrite: bool, key: str | None = None) -> None:
    """An existing, non-empty output may be replaced only when it is provably our conversion and the user asked
    (`--overwrite`); the same conversion (same cache key) is left as it is."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; refusing to replace it")
    if not out.exists() or not any(out.iterdir()):
        return
    if not ours(out):
        raise FileExistsError(f"{out}: exists and is not an rlstages conversion output; refusing to replace it")
    if key is not None and holds_conversion(out, key):
        return
    if not overwrite:
        raise FileExistsError(f"{out}: holds another conversion; pass --overwrite to replace it")


def check_export_inputs(mcore_dir: str | Path, out_dir: str | Path, overwrite: bool) -> None:
    """Fail fast on a directory that is not a complete, intact conversion of a registered template, or an
    output that exists. Checksums pass before any name from the directory's metadata is looked up."""
    verify_manifest(mcore_dir)
    ConversionSpec.load(mcore_dir, import_module=False)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists; pass --overwrite to replace it")
    if out.exists() and any(out.iterdir()) and not _exported_by_us(out):
        raise FileExistsError(f"{out_dir}: exists and is not an rlstages export; refusing to replace it")


def _exported_by_us(out: Path) -> bool:
    try:
        return read_manifest(out).get("direction") == "mcore_to_hf"
    except (FileNotFoundError, ValueError, OSError):
        return False


def expert_option(
    ep: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    etp: int | None = None,
    tp: int | None = None,
) -> dict:
    """The expert-parallel sizes and uneven pipeline stages as cache-key options, only when set (the keys of
    dense, evenly split conversions stay as they were); an expert TP equal to `tp` is the default, not an option."""
    experts = ({"ep": ep} if ep != 1 else {}) | ({"etp": etp} if etp not in (None, tp) else {})
    return experts | ConversionSpec.stage_fields((first_stage_layers, last_stage_layers))


def _cache_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    options = {k: params.get(k, DEFAULTS[k]) for k in DEFAULTS}
    stages = (params.get("first_stage_layers"), params.get("last_stage_layers"))
    options |= expert_option(params.get("ep", 1), *stages, params.get("etp"), params["tp"])
    key = conversion_key(params["hf_dir"], params["out_dir"], params["tp"], params["pp"], params.get("vpp"), **options)
    store = getattr(context, "result_store", None)
    if not holds_conversion(params["out_dir"], key) and store is not None and store.exists(key):
        # the cached path is stale (output deleted or replaced): run again under a one-off key
        return f"{key}-rebuild-{uuid.uuid4().hex}"
    return key


@task(
    name="convert_checkpoint",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_condition,
)
def convert_checkpoint(
    hf_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    vpp: int | None = None,
    *,
    transformer_impl: str = "local",
    dist_checkpoint: bool = False,
    checksum: str = DEFAULT_CHECKSUM,
    progress: bool = False,
    overwrite: bool = False,
    ep: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    etp: int | None = None,
) -> str:
    """HF directory -> Megatron-Core rank files in `out_dir` (replacing an older conversion of ours there only
    with `overwrite`); `ep` > 1 splits an MoE model's experts over expert-parallel ranks, `etp` each expert over
    that many expert-TP ranks (None: tp); `first_stage_layers` / `last_stage_layers` give megatron-core's uneven
    first / last pipeline stage."""
    options = {"transformer_impl": transformer_impl, "dist_checkpoint": dist_checkpoint, "checksum": checksum}
    options |= expert_option(ep, first_stage_layers, last_stage_layers, etp, tp)
    key = conversion_key(hf_dir, out_dir, tp, pp, vpp, **options)
    out = Path(out_dir)
    if holds_conversion(out, key):
        return str(out)  # made by an earlier run whose Prefect record is gone: nothing to do
    check_replaceable(out, overwrite, key)
    with _progress_bar(progress, f"convert {Path(hf_dir).name} -> tp{tp} pp{pp}") as report:
        convert_hf_to_mcore(
            hf_dir, out, tp, pp, vpp, ep=ep, etp=etp, transformer_impl=transformer_impl,  # type: ignore[arg-type]
            first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
            extra_outputs=dist_checkpoint_writer() if dist_checkpoint else None, overwrite=True,
            checksum=checksum, input_digests=input_digests(hf_dir),
            manifest_extra={"cache_key": key}, progress=report,
        )  # fmt: skip
    return str(out)


@task(name="verify_conversion", cache_policy=NO_CACHE)
def verify_conversion(hf_dir: str, out_dir: str) -> dict[str, Any]:
    """Parity gate: Megatron-Core logits of the converted checkpoint vs the HF model's (needs megatron-core)."""
    from rlstages.engines.megatron.parity import verify_parity

    return verify_parity(out_dir, hf_dir).to_dict()


@task(name="export_checkpoint", cache_policy=NO_CACHE, retries=2, retry_condition_fn=retry_condition)
def export_checkpoint(mcore_dir: str, out_dir: str, overwrite: bool = False, progress: bool = False) -> str:
    """Megatron-Core rank files (any TP/PP) -> an HF model directory."""
    with _progress_bar(progress, f"export {Path(mcore_dir).name} -> HF") as report:
        convert_mcore_to_hf(mcore_dir, out_dir, overwrite=overwrite, progress=report)
    return str(out_dir)


@contextmanager
def _progress_bar(enabled: bool, description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich byte-progress bar on stderr when enabled; yields the `(done, total)` callback (or None)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("[bold]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task_id = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task_id, completed=done, total=total)
