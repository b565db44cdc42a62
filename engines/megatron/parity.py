"""Parity gate: the Megatron-Core GPTModel built from a converted checkpoint must give the HF model's logits.

`verify_parity` starts TP x PP worker processes (gloo, local layer spec, the CPU shim of `cuda_shim`),
each loads its own rank file into its model chunk(s) with `load_state_dict(strict=True)`, runs the same
tokens through the pipeline stage by stage, and the last stage gathers the vocab-parallel logits.

The tolerance is scale-aware: the reference is the HF model run in float64, and fp32 arithmetic has a noise
floor of its own that grows with the logits' size and the depth (SmolLM2-135M: ~5e-5 on logits up to ~28,
between the HF model's own fp32 and fp64 runs). The Megatron fp32 logits pass when
max |mcore - hf64| <= max(atol, noise_factor * max |hf32 - hf64|) and every argmax agrees with hf64's (a
position whose top two fp64 logits are closer than the tolerance is a tie: either argmax agrees).
Needs megatron-core (imported only in the workers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.convert.hf_to_mcore import load_rank_chunk
from rlstages.engines.convert.manifest import HF_FILES_DIR
from rlstages.engines.convert.spec import ConversionSpec
from rlstages.engines.megatron.gloo_world import run_world


@dataclass(frozen=True)
class ParityReport:
    """Outcome of one parity check."""

    max_abs_diff: float
    argmax_agreement: float
    atol: float
    tp: int
    pp: int
    vpp: int
    hf_fp32_diff: float = 0.0
    tolerance: float = 0.0
    max_abs_logit: float = 0.0
    ep: int = 1

    @property
    def passed(self) -> bool:
        """Within the scale-aware tolerance and every argmax equal (ties within it excepted)."""
        return self.max_abs_diff <= max(self.tolerance, self.atol) and self.argmax_agreement == 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for logs and Prefect artifacts)."""
        return {**asdict(self), "passed": self.passed}


class ParityError(AssertionError):
    """The converted model's logits differ from the HF model's."""


def verify_parity(
    mcore_path: str | Path,
    hf_path: str | Path | None = None,
    *,
    atol: float = 1e-5,
    noise_factor: float = 4.0,
    raise_on_fail: bool = True,
    **kwargs: Any,
) -> ParityReport:
    """Compare HF and Megatron-Core logits on random tokens (HF weights from `hf_path`, else exported)."""
    (report,) = verify_parity_many(
        [(mcore_path, hf_path)], atol=atol, noise_factor=noise_factor, raise_on_fail=raise_on_fail, **kwargs
    )
    return report


ParityCase = tuple[str | Path, str | Path | None] | tuple[str | Path, str | Path | None, str]


def verify_parity_many(
    cases: Sequence[ParityCase],
    *,
    layout: tuple[int, int, int] | None = None,
    batch: int = 2,
    seq_len: int = 16,
    seed: int = 0,
    atol: float = 1e-5,
    noise_factor: float = 4.0,
    hf_model_loader: Callable[[Path], torch.nn.Module] | None = None,
    raise_on_fail: bool = True,
    timeout: float = 600.0,
) -> list[ParityReport]:
    """Parity of several converted checkpoints in one worker world of one (tp, pp, vpp) layout.

    A case is `(mcore_dir, hf_dir_or_None)` or `(mcore_dir, hf_dir_or_None, "dist_ckpt")`; the last loads the
    checkpoint's `dist_ckpt/` copy, which megatron-core reshards to the world's layout. Rank-file cases must
    have been converted for that layout (default: theirs).
    """
    items = [(Path(c[0]), c[1], c[2] if len(c) > 2 else "ranks") for c in cases]  # type: ignore[misc]
    bad = [src for _, _, src in items if src not in ("ranks", "dist_ckpt")]
    if bad:
        raise ValueError(f"verify_parity_many: case source must be 'ranks' or 'dist_ckpt', got {bad}")
    specs = [ConversionSpec.load(path) for path, _, _ in items]
    own = {(s.tp, s.pp, s.vpp) for s, (_, _, src) in zip(specs, items, strict=True) if src == "ranks"}
    layouts = own | ({layout} if layout else set()) or {(specs[0].tp, specs[0].pp, specs[0].vpp)}
    if len(layouts) != 1:
        raise ValueError(f"verify_parity_many: rank-file cases need one parallel layout, got {sorted(layouts)}")
    tp, pp, vpp = layouts.pop()
    eps = {(s.ep, s.expert_tp) for s, (_, _, src) in zip(specs, items, strict=True) if src == "ranks"}
    if len(eps) > 1:
        raise ValueError(f"verify_parity_many: rank-file cases need one (ep, expert tp), got {sorted(eps)}")
    ep, etp = eps.pop() if eps else (1, tp)
    for spec in specs:
        spec.with_layout(tp, pp, vpp)  # clear error before any process starts
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, s.hf_vocab_size, (batch, seq_len), generator=gen) for s in specs]
    references = [
        _hf_logits(spec, Path(path), hf, t, hf_model_loader)
        for spec, (path, hf, _), t in zip(specs, items, tokens, strict=True)
    ]
    jobs = [
        {"mcore_dir": str(path), "tokens": t.tolist(), "source": src}
        for (path, _, src), t in zip(items, tokens, strict=True)
    ]
    results = run_world(
        "rlstages.engines.megatron.parity:parity_worker",
        tp * pp * ep,  # the EP ranks are data-parallel replicas of the TP x PP grid, each runs the same tokens
        {"cases": jobs, "layout": [tp, pp, vpp, ep, etp]},
        timeout=timeout,
    )
    gathered = next(r for r in results if r is not None)
    reports = []
    for (path, _, _), (ref32, ref64), logits in zip(items, references, gathered, strict=True):
        logits = torch.tensor(logits, dtype=torch.float64)
        floor = float((ref32.double() - ref64).abs().max())
        tolerance = max(atol, noise_factor * floor)
        report = ParityReport(
            max_abs_diff=float((logits - ref64).abs().max()),
            argmax_agreement=_argmax_agreement(logits, ref64, tolerance),
            atol=atol,
            tp=tp,
            pp=pp,
            vpp=vpp,
            hf_fp32_diff=floor,
            tolerance=tolerance,
            max_abs_logit=float(ref64.abs().max()),
            ep=ep,
        )
        if raise_on_fail and not report.passed:
            raise ParityError(f"{path}: Megatron logits differ from HF: {report.to_dict()}")
        reports.append(report)
    return reports


def _argmax_agreement(logits: torch.Tensor, ref: torch.Tensor, tolerance: float) -> float:
    """Share of positions whose argmax is the reference's, or scores within `tolerance` of its best (a tie)."""
    chosen = ref.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    same = (logits.argmax(-1) == ref.argmax(-1)) | (chosen >= ref.max(-1).values - tolerance)
    return float(same.float().mean())


def _hf_logits(
    spec: ConversionSpec,
    mcore_dir: Path,
    hf_path: str | Path | None,
    tokens: torch.Tensor,
    loader: Callable[[Path], torch.nn.Module] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's logits in float32 and float64 (the reference; their gap is fp32's noise floor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if hf_path is not None:
        model = (loader or _default_loader)(Path(hf_path))
    else:  # rebuild the HF model from the converted checkpoint itself (export path)
        from rlstages.engines.convert.mcore_to_hf import mcore_to_hf
        from rlstages.engines.models.vision import module_name, vision_model_class

        config = AutoConfig.from_pretrained(mcore_dir / HF_FILES_DIR)
        vision_cls = vision_model_class(config.model_type)  # a VLM: its class; the export's on-disk names mapped
        model = vision_cls(config) if vision_cls else AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        weights = {module_name(k) if vision_cls else k: v for k, v in mcore_to_hf(mcore_dir, spec)}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise ValueError(f"exported weights do not fit the HF model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    model = model.float().eval()
    with torch.no_grad():
        fp32 = model(input_ids=tokens).logits.float()
        if getattr(type(model), "_can_set_experts_implementation", lambda: False)():  # MoE: no float64 grouped_mm
            model.set_experts_implementation("eager")  # type: ignore[operator]
        fp64 = model.double()(input_ids=tokens).logits.double()
    del model
    return fp32, fp64


def _default_loader(path: Path) -> torch.nn.Module:
    """The model registry's loader (custom registered models too), else AutoModelForCausalLM."""
    try:
        from rlstages.engines.models import load_causal_lm
    except ImportError:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return load_causal_lm(path, "float32")


def parity_worker(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], layout: list[int]) -> Any:
    """One rank: per case build and load its chunks, run the pipeline by hand; the logits from the last stage."""
    from megatron.core import parallel_state as ps

    from rlstages.engines.megatron import gpt

    tp, pp, vpp, ep, etp = layout  # verify_parity_many's [tp, pp, vpp, ep, expert tp]
    gpt.init_model_parallel(rank, world_size, port, tp, pp, vpp, ep=ep, etp=etp)
    try:
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
        outputs = []
        for case in cases:
            mcore_dir = Path(case["mcore_dir"])
            spec = ConversionSpec.load(mcore_dir).with_layout(tp, pp, vpp, ep)
            chunks = [gpt.build_gpt_model(spec, vp_stage=v).eval() for v in range(vpp)]
            if case["source"] == "dist_ckpt":
                from rlstages.engines.megatron.dist_ckpt import load_dist_checkpoint

                load_dist_checkpoint(chunks, mcore_dir / "dist_ckpt")
            else:
                for v, chunk in enumerate(chunks):
                    state = load_rank_chunk(mcore_dir, spec, tp_rank, pp_rank, v, ep_rank)
                    chunk.load_state_dict(state, strict=True)
            outputs.append(_pipeline_forward(spec, dict(enumerate(chunks)), torch.tensor(case["tokens"]), pp_rank))
        return outputs if outputs and outputs[0] is not None else None
    finally:
        gpt.destroy_model_parallel()


def _pipeline_forward(
    spec: ConversionSpec,
    chunks: dict[int, Any],
    ids: torch.Tensor,
    pp_rank: int,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    **extra: torch.Tensor,
) -> Any:
    from megatron.core import parallel_state as ps

    from rlstages.engines.megatron.gpt import causal_mask

    batch, seq = ids.shape
    positions = torch.arange(seq).expand(batch, seq) if positions is None else positions
    mask = causal_mask(seq, batch) if mask is None else mask
    order = spec.layer_map.chunks()
    hidden = None
    out = None
    with torch.no_grad():
        for c, (owner, v) in enumerate(order):
            if owner != pp_rank:
                continue
            model = chunks[v]
            if c > 0:
                hidden = torch.empty(seq, batch, spec.mcore["hidden_size"])
                torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(input_ids=ids, position_ids=positions, attention_mask=mask, **extra)
            if c < len(order) - 1:
                torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if not ps.is_pipeline_last_stage() or out is None:
        return None
    shards = [torch.empty_like(out) for _ in range(spec.tp)]
    torch.distributed.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    logits = torch.cat(shards, dim=-1)[..., : spec.hf_vocab_size]
    return logits.tolist() if ps.get_tensor_model_parallel_rank() == 0 else None


IMAGE_INPUTS = ("input_ids", "position_ids", "valid", "pixel_values", "image_grid_thw")
ImageLayout = tuple[int, int, bool]  # (tp, pp, sequence_parallel)


def image_logits_many(
    cases: Sequence[Sequence[tuple[str | Path, str]]],
    inputs: str | Path,
    layouts: Sequence[ImageLayout],
    timeout: float = 600.0,
) -> list[list[dict[str, torch.Tensor]]]:
    """A vision-language model's image batch through Megatron-Core, per layout (all in one world of max(tp x pp)
    ranks, the groups rebuilt between layouts) and per case: its full-vocab logits [B, S, V] and, where pp == 1 and
    the case is a rank-file one, the vision tower's flattened gradient of a fixed random linear function of the
    logits (summed over TP where sequence parallelism split it, as `finalize_model_grads` does).

    `cases[i]` are layout i's cases: `(mcore_dir, "ranks")` (converted for that layout) or `(dist_ckpt_dir,
    "dist_ckpt")` (a megatron-core dist checkpoint whose "model" entry is resharded to the layout; the spec from the
    layout's first case). `inputs` is a safetensors file holding `IMAGE_INPUTS`: token ids [B, S], M-RoPE positions
    [3, B, S], the valid-token mask [B, S] (left padding), and the batch's pixel values and image grids concatenated
    in row order. Returns `{"logits": ..., "vision_grad": ...}` per case (the gradient only where computed).
    """
    world = max(tp * pp for tp, pp, _ in layouts)
    jobs = [[(str(path), source) for path, source in layout_cases] for layout_cases in cases]
    results = run_world(
        "rlstages.engines.megatron.parity:image_logits_worker",
        world,
        {"cases": jobs, "inputs": str(inputs), "layouts": [list(x) for x in layouts]},
        timeout=timeout,
    )
    # each layout's outputs come from its own last stage's TP rank 0: the first rank that has them
    return [
        [
            {k: torch.tensor(v) for k, v in next(r[i][c] for r in results if r[i][c] is not None).items()}
            for c in range(len(layout))
        ]
        for i, layout in enumerate(jobs)
    ]


def image_logits_worker(
    rank: int, world_size: int, port: int, cases: list[list[list[str]]], inputs: str, layouts: list[list[Any]]
) -> Any:
    """One rank of `image_logits_many`: per layout, build, load and run each case; outputs from the last stage."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from rlstages.engines.megatron import gpt
    from rlstages.engines.megatron.dist_ckpt import sharded_state_dict
    from rlstages.engines.megatron.parallel import pad_positions

    batch = load_file(inputs)
    images = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    out: list[list[Any]] = []
    try:
        for (tp, pp, sp), layout_cases in zip(layouts, cases, strict=True):
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()  # the same world, the next layout's groups
            gpt.init_model_parallel(rank, world_size, port, tp, pp)
            tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
            length = batch["input_ids"].shape[1]
            padded = length + (-length % tp if sp else 0)  # sequence parallelism splits the sequence over TP
            ids = torch.nn.functional.pad(batch["input_ids"], (0, padded - length))
            valid = torch.nn.functional.pad(batch["valid"].bool(), (0, padded - length))
            positions = pad_positions(batch["position_ids"], padded)
            mask = gpt.causal_mask(padded, ids.shape[0]) | ~valid[:, None, None, :]
            first = ConversionSpec.load(layout_cases[0][0])
            results: list[Any] = []
            for path, source in layout_cases:
                spec = (first if source == "dist_ckpt" else ConversionSpec.load(path)).with_layout(tp, pp)
                model = gpt.build_gpt_model(spec, config_overrides={"sequence_parallel": bool(sp)}).eval()
                if source == "dist_ckpt":
                    from megatron.core import dist_checkpointing

                    state = dist_checkpointing.load({"model": sharded_state_dict([model])}, path)["model"]
                    model.load_state_dict(state, strict=True)
                else:
                    model.load_state_dict(load_rank_chunk(Path(path), spec, tp_rank, pp_rank, 0), strict=True)
                logits = _pipeline_forward(spec, {0: model}, ids, pp_rank, positions, mask, **images)
                result = None if logits is None else {"logits": [row[:length] for row in logits]}
                if pp == 1 and source == "ranks":
                    grad = _vision_grad(model, ids, positions, mask, images, valid, tp_rank, tp, length)
                    result = None if result is None else {**result, "vision_grad": grad}
                results.append(result)
            out.append(results)
        return out
    finally:
        gpt.destroy_model_parallel()


def logit_weights(batch: int, length: int, vocab: int) -> torch.Tensor:
    """The fixed random weights [B, S, V] of the linear function of the logits whose vision-tower gradient
    `image_logits_many` reports (seed 0; an HF reference takes its first hf-vocab columns)."""
    return torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(0))


def _vision_grad(
    model: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    images: dict[str, torch.Tensor],
    valid: torch.Tensor,
    tp_rank: int,
    tp: int,
    length: int,
) -> list[float]:
    """The vision tower's gradient of sum(logits * W) over the valid tokens of the first `length` positions
    (`logit_weights` over the padded vocabulary; each TP rank takes its vocab shard's term), summed over TP for
    sequence-parallel parameters."""
    from megatron.core import parallel_state as ps

    output = model(input_ids=ids, position_ids=positions, attention_mask=mask, **images)  # [B, S, V / tp]
    weights = logit_weights(ids.shape[0], length, output.shape[2] * tp)
    weights = torch.nn.functional.pad(weights, (0, 0, 0, output.shape[1] - length)).chunk(tp, dim=-1)[tp_rank]
    (output * weights * valid[..., None]).sum().backward()
    params = list(model.vision_model.parameters())
    for param in params:
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
    return torch.cat([param.grad.flatten() for param in params]).tolist()
