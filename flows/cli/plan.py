"""`rlstages plan CONFIG [--gpu H20|H100|H200|A100-80G] [--async]`: the memory plan of a config before launch
(with --async also the async simulator's split and eta: flows/cli/plan_async.py).

Per distinct rank of each role (one row per pipeline stage): weights, gradients, optimizer states, activations,
logits, reference, rollout engine, sync bucket (GiB), each phase of the GPU (train, reference, rollout, sync) and
the host memory offload takes; the fullest rank, whether it fits the named GPU, and the config changes that free
memory when it does not. The model's sizes come from its config.json, `model.tiny`, or (for the seed presets whose
weights are not here) configs/published_models.json. Nothing starts: no Ray, Prefect or MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from rlstages.configs import RunConfig
from rlstages.flows.cli.quiet import one_line

out = Console()

GpuOption = Annotated[
    str | None, typer.Option("--gpu", help="Check the fullest rank against this GPU: H20, H100, H200 or A100-80G.")
]


def hf_config(cfg: RunConfig) -> dict[str, Any] | None:
    """The model's HF config as a dict (its config.json, or the tiny spec's), None when not on this machine."""
    from rlstages.engines.models.providers import planned_config

    if not (cfg.model.path / "config.json").is_file() and cfg.model.provider != "tiny-random":
        return None  # a provider's placeholder sizes are not the model's
    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny is not None else None
    found = planned_config(cfg.model.path, cfg.model.provider, tiny)
    return None if found is None else found.to_dict()


def build_plan(cfg: RunConfig, gpu: str | None) -> Any:
    """The `MemoryPlan` of `cfg` against `gpu`; without data.max_prompt_length, for the data's longest prompt where
    the data and the tokenizer are on this machine."""
    from rlstages.tasks.driver.memory_plan import plan

    return plan(cfg, hf_config(cfg), gpu, measure_prompts=True)


def plan_lines(result: Any) -> list[str]:
    """The headline figures and advice as `key: value` lines (what `config show` appends as comments)."""
    lines = [f"{key}: {value}" for key, value in result.summary().items()]
    lines.extend(f"advice: {tip}" for tip in result.advice)
    return lines


SHORT = {"activations": "activ", "optimizer": "optim", "reference": "ref", "rollout_engine": "rollout"}


def merged_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive stages of a role with the same figures as one row (`stage` "1-6")."""
    merged: list[dict[str, Any]] = []
    for row in rows:
        prev = merged[-1] if merged else None
        same = prev is not None and {k: v for k, v in prev.items() if k not in ("stage", "first")} == {
            k: v for k, v in row.items() if k != "stage"
        }
        if same and prev is not None:
            prev["stage"] = f"{prev['first']}-{row['stage']}"
        else:
            merged.append({**row, "first": row["stage"]})
    return [{k: v for k, v in r.items() if k != "first"} for r in merged]


def print_plan(result: Any, console: Console = out) -> None:
    """The per-rank table (GiB; one line per distinct rank), the summary and the advice."""
    rows = merged_rows(result.rows())
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    names = [SHORT.get(c, c.removesuffix("_phase").removesuffix("_gib")) for c in columns]
    cells = [[str(row.get(c, "-")) for c in columns] for row in rows]
    widths = [max(len(n), *(len(r[i]) for r in cells)) for i, n in enumerate(names)]
    console.print("memory plan per rank, GiB (params: weights on the rank; train..sync: the GPU in each phase)")
    for line in [names, *cells]:
        console.print("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)), highlight=False, soft_wrap=True)
    for text in plan_lines(result):
        console.print(text, highlight=False, soft_wrap=True)


def plan_command(
    config: Annotated[Path, typer.Argument(help="YAML config (e.g. configs/qwen2_7b_grpo_megatron.yaml).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: actor.micro_batch_size=2")] = None,
    gpu: GpuOption = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
    async_: Annotated[
        bool, typer.Option("--async", help="Also the rollout:trainer split and eta the async simulator suggests.")
    ] = False,
    generate_s: Annotated[float | None, typer.Option(help="--async: a synchronous step's generation seconds.")] = None,
    step_s: Annotated[float | None, typer.Option(help="--async: that step's seconds.")] = None,
    response_length: Annotated[float | None, typer.Option(help="--async: mean reply tokens.")] = None,
) -> None:
    """Per-rank GPU and host memory of CONFIG's layout, the fullest rank, whether it fits --gpu, what to change;
    with --async, the split and eta the simulator suggests and its predicted speed-up (docs/async.md)."""
    from rlstages.configs import ConfigError, load_config
    from rlstages.flows.cli.plan_async import reference_of

    try:
        cfg = load_config(config, overrides or [])
        result = build_plan(cfg, gpu)
        if async_:  # its bad input refused before anything prints
            reference_of(cfg, result.dims.total_params(), generate_s, step_s, response_length)
    except (ConfigError, ValueError, OSError) as exc:
        if debug:
            raise
        Console(stderr=True).print(f"[bold red]error:[/] {escape(one_line(str(exc)))}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    print_plan(result)
    if async_:
        from rlstages.flows.cli.plan_async import print_async

        print_async(cfg, result, generate_s, step_s, response_length, out)
    if result.fits is False:
        raise typer.Exit(3)
