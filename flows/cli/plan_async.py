"""`rlstages plan CONFIG --async`: beside the memory plan, the rollout:trainer split and eta the simulator of
asynchronous training suggests (engines/async_sim), with its predicted samples/s and speed-up over the synchronous
colocated run -- a prediction, from a synchronous step's figures: verl's table for the seed presets' models, or
`--generate-s` / `--step-s` / `--response-length` given (docs/async.md, "Simulator")."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlstages.configs import RunConfig
from rlstages.engines.async_sim.advise import VERL_TABLE, Reference, Suggestion, candidates, suggest, sync_seconds
from rlstages.engines.async_sim.profile import LengthModel

CLI_STEPS = 8  # simulated steps per layout (two warm-up steps left out of the rate)


def reference_of(
    cfg: RunConfig,
    params: int,
    generate_s: float | None,
    step_s: float | None,
    response_length: float | None,
) -> tuple[Reference, str]:
    """The synchronous reference step of `cfg` (figures given, else verl's row for its model) and where it came
    from. Raises ValueError (one line) when neither is there or the figures do not make a step."""
    row = VERL_TABLE.get(cfg.model.path.name)
    gpus = cfg.cluster.num_gpus or (row[0] if row else 0)
    if generate_s is None or step_s is None:
        if row is None:
            raise ValueError(
                f"plan --async: no GPU profile for model {cfg.model.path.name!r} (verl's table has "
                f"{', '.join(VERL_TABLE)}): give --generate-s and --step-s, a synchronous step's seconds"
            )
        gpus, generate, step = row[0], row[2], row[3]
        length = float(row[1] if response_length is None else response_length)
        source = f"verl's table: generation {generate:g} s of a {step:g} s step on {gpus} GPUs"
    else:
        generate, step = generate_s, step_s
        length = response_length if response_length is not None else cfg.rollout.response_budget / 2
        source = f"given: generation {generate:g} s of a {step:g} s step on {gpus} GPUs"
    if gpus < 2 or cfg.rollout.num_workers < 2:
        raise ValueError(
            f"plan --async: cluster.num_gpus={gpus} and rollout.num_workers={cfg.rollout.num_workers}: a split "
            "needs at least 2 GPUs and 2 rollout workers (one stays with the trainer's side)"
        )
    if not 0 < generate < step:
        raise ValueError(f"plan --async: --generate-s {generate:g} must be > 0 and below --step-s {step:g}")
    lengths = LengthModel(float(length), cfg.rollout.response_budget)
    ref = Reference(gpus, cfg.rollout.num_workers, cfg.data.prompts_per_step, cfg.rollout.n, lengths, generate,
                    step, sync_seconds(params))  # fmt: skip
    return ref, source


def async_lines(ref: Reference, source: str, found: list[Suggestion], best: Suggestion) -> list[str]:
    """The suggestion and the layouts beside it as `key: value` lines (a prediction, labelled)."""
    lines = [
        f"async plan (simulated prediction, docs/async.md 'Simulator'): from {source}; weight sync {ref.sync_s:.1f} s",
        f"async suggestion: rollout {best.rollout_gpus} GPUs : trainer {best.trainer_gpus} GPUs, "
        f"trainer.async.max_staleness={best.eta}, partial_rollout={str(best.partial_rollout).lower()}",
        f"async predicted: {best.samples_per_s:.3g} samples/s vs sync {best.sync_samples_per_s:.3g} "
        f"({best.speedup:.2f}x); lag mean {best.lag_mean:.2f} max {best.lag_max:.0f}; "
        f"idle rollout {best.rollout_idle:.2f} trainer {best.trainer_idle:.2f}",
    ]
    for eta in sorted({s.eta for s in found}):
        row = [s for s in found if s.eta == eta]
        top = max(row, key=lambda s: s.samples_per_s)
        lines.append(
            f"async eta {eta}: best {top.speedup:.2f}x at rollout {top.rollout_gpus} : trainer {top.trainer_gpus}"
            f"{' with partial rollouts' if top.partial_rollout else ''}"
        )
    return lines


def print_async(
    cfg: RunConfig, result: Any, generate_s: float | None, step_s: float | None, response_length: float | None,
    console: Console,
) -> None:  # fmt: skip
    """Simulate every split and eta for `cfg` and print the suggestion (`result`: its memory plan, for the size)."""
    ref, source = reference_of(cfg, result.dims.total_params(), generate_s, step_s, response_length)
    found = candidates(ref, steps=CLI_STEPS)
    for line in async_lines(ref, source, found, suggest(found)):
        console.print(line, highlight=False, soft_wrap=True)
