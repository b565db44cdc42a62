"""The `rlstages convert` / `export` commands: their options here, their work in `rlstages.flows.convert`
(Prefect flows over torch), imported only when one of them runs, so every other command starts without it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import typer
from rich.console import Console
from rich.markup import escape

from rlstages.flows.cli.quiet import one_line

err = Console(stderr=True)
# convert_flow's literal parameter types, for the CLI's strings (check_conversion_inputs validates them first)
_Impl = Literal["local", "transformer_engine"]
_Checksum = Literal["xxh3_128", "crc32", "sha256", "none"]

HfDir = Annotated[Path, typer.Argument(help="HF model directory (config.json + *.safetensors).")]
OutDir = Annotated[Path, typer.Argument(help="Output directory (written atomically).")]
Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]


def convert_command(
    hf_dir: HfDir,
    out_dir: OutDir,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size.")] = 1,
    vpp: Annotated[int | None, typer.Option("--vpp", min=1, help="Virtual pipeline chunks per stage.")] = None,
    ep: Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel size (MoE models).")] = 1,
    etp: Annotated[
        int | None, typer.Option("--etp", min=1, help="Expert tensor-parallel size, a divisor of --tp (default: --tp).")
    ] = None,
    first_stage_layers: Annotated[
        int | None, typer.Option("--first-stage-layers", min=1, help="Layers of the first pipeline stage (uneven).")
    ] = None,
    last_stage_layers: Annotated[
        int | None, typer.Option("--last-stage-layers", min=1, help="Layers of the last pipeline stage (uneven).")
    ] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check logits against HF (needs megatron-core).")] = False,
    transformer_impl: Annotated[str, typer.Option(help="Layer-spec names: local or transformer_engine.")] = "local",
    dist_checkpoint: Annotated[
        bool, typer.Option("--dist-checkpoint", help="Also write megatron-core dist_checkpointing.")
    ] = False,
    checksum: Annotated[
        str, typer.Option(help="Manifest checksum: xxh3_128 (fast, 128-bit), crc32, sha256 (slow) or none.")
    ] = "xxh3_128",
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output that is another conversion of ours.")
    ] = False,
    debug: Debug = False,
) -> None:
    """Convert an HF checkpoint to Megatron-Core rank files (cached: a re-run on the same inputs is free)."""
    layout: dict[str, Any] = {
        "ep": ep,
        "etp": etp,
        "first_stage_layers": first_stage_layers,
        "last_stage_layers": last_stage_layers,
    }
    from rlstages.flows.convert import convert_flow
    from rlstages.tasks.convert import check_conversion_inputs

    _run(debug, lambda: check_conversion_inputs(
        hf_dir, out_dir, tp, pp, vpp, transformer_impl, checksum, overwrite, dist_checkpoint, **layout))  # fmt: skip
    result = _run(debug, lambda: convert_flow(
        str(hf_dir), str(out_dir), tp, pp, vpp, verify, cast(_Impl, transformer_impl), dist_checkpoint,
        cast(_Checksum, checksum), progress=True, overwrite=overwrite, **layout))  # fmt: skip
    err.print(f"[green]converted[/]: {escape(str(result['out_dir']))}")
    if result["parity"]:
        p = result["parity"]
        err.print(
            f"[green]parity ok[/]: max |diff| {p['max_abs_diff']:.2e} vs fp64 HF (tolerance {p['tolerance']:.2e}, "
            f"HF fp32 error {p['hf_fp32_diff']:.2e}), argmax {p['argmax_agreement']:.0%}"
        )


def export_command(
    mcore_dir: Annotated[Path, typer.Argument(help="A directory written by `rlstages convert`.")],
    out_dir: OutDir,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    debug: Debug = False,
) -> None:
    """Export a Megatron-Core checkpoint (any TP/PP) to an HF model directory."""
    from rlstages.flows.convert import export_flow
    from rlstages.tasks.convert import check_export_inputs

    _run(debug, lambda: check_export_inputs(mcore_dir, out_dir, overwrite))
    out = _run(debug, lambda: export_flow(str(mcore_dir), str(out_dir), overwrite, progress=True))
    err.print(f"[green]exported[/]: {escape(str(out))}")


def _run(debug: bool, action: Any) -> Any:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if debug else "WARNING")
    if not debug:
        from rlstages.flows.cli.quiet import quiet_prefect

        quiet_prefect(debug)
    try:
        return action()
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        if debug:
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        err.print(f"[bold red]error:[/] {escape(one_line(message))}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
