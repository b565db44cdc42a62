"""Checkpoint conversion as Prefect flows and their Python API (behind `rlstages convert` / `export`).

    rlstages convert HF_DIR OUT_DIR --tp 2 --pp 2 [--vpp 2] [--ep 2] [--etp 1] [--first-stage-layers N]
                     [--last-stage-layers N] [--verify] [--dist-checkpoint]
    rlstages export MCORE_DIR OUT_DIR [--overwrite]

The conversion task is cached (see `rlstages.tasks.convert`): converting the same inputs to the same layout again,
even from a new flow run, does no work. `--verify` adds the parity gate (needs megatron-core).
The commands' options live in `rlstages.flows.cli.convert`, which imports this module only when one runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect.artifacts import create_markdown_artifact

from rlstages.flows.flow_guard import guarded_flow
from rlstages.tasks.convert import (
    convert_checkpoint,
    expert_option,
    export_checkpoint,
    verify_conversion,
)


@guarded_flow(name="convert-hf-to-mcore")
def convert_flow(
    hf_dir: str,
    out_dir: str,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    verify: bool = False,
    transformer_impl: Literal["local", "transformer_engine"] = "local",
    dist_checkpoint: bool = False,
    checksum: Literal["xxh3_128", "crc32", "sha256", "none"] = "xxh3_128",
    progress: bool = False,
    overwrite: bool = False,
    ep: int = 1,
    etp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> dict[str, Any]:
    """Convert (cached) and optionally check logits parity; returns the output path and the parity report.
    `etp`: expert tensor parallel size (None: tp); `first_stage_layers` / `last_stage_layers`: uneven pipeline."""
    out = convert_checkpoint(
        hf_dir, out_dir, tp, pp, vpp, transformer_impl=transformer_impl, dist_checkpoint=dist_checkpoint,
        checksum=checksum, progress=progress, overwrite=overwrite, ep=ep, etp=etp,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
    )  # fmt: skip
    parity = verify_conversion(hf_dir, out) if verify else None
    options = expert_option(ep, first_stage_layers, last_stage_layers, etp, tp)
    experts = "".join(f" {k.upper() if k in ('ep', 'etp') else k}={n}" for k, n in options.items())
    lines = [f"**{Path(hf_dir).name}** -> `{out}` with TP={tp} PP={pp} VPP={vpp or 1}{experts} ({transformer_impl})"]
    if parity is not None:
        lines.append(
            f"parity: max |diff| {parity['max_abs_diff']:.2e} vs fp64 HF (tolerance {parity['tolerance']:.2e}; "
            f"HF's own fp32 error {parity['hf_fp32_diff']:.2e}), argmax agreement {parity['argmax_agreement']:.0%}"
        )
    _artifact("conversion", "\n\n".join(lines))
    return {"out_dir": out, "parity": parity}


@guarded_flow(name="export-mcore-to-hf")
def export_flow(mcore_dir: str, out_dir: str, overwrite: bool = False, progress: bool = False) -> str:
    """Export a converted (or Megatron-trained) checkpoint back to an HF model directory."""
    out = export_checkpoint(mcore_dir, out_dir, overwrite=overwrite, progress=progress)
    _artifact("export", f"`{mcore_dir}` -> HF `{out}`")
    return out


def _artifact(key: str, markdown: str) -> None:
    try:
        create_markdown_artifact(markdown=markdown, key=key, description=f"checkpoint {key}")
    except Exception:  # noqa: BLE001 - a report must never fail a conversion
        pass


def convert_hf_to_mcore(
    hf_path: str | Path, out_path: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None, **kwargs: Any
) -> str:
    """Python API: run the conversion flow (cached; `verify=True` for the parity gate); returns the output dir."""
    return str(convert_flow(str(hf_path), str(out_path), tp, pp, vpp, **kwargs)["out_dir"])


def convert_mcore_to_hf(mcore_path: str | Path, out_path: str | Path, overwrite: bool = False) -> str:
    """Python API: run the export flow; returns the HF directory."""
    return str(export_flow(str(mcore_path), str(out_path), overwrite))
