"""Megatron-Core (any TP/PP/VPP) -> HF names and layouts, streamed: export and weight sync.

Three entry points share one path (gather TP shards -> global name -> template ops in reverse):

* `mcore_to_hf(source)`: a converted directory, or in-memory rank state dicts `{(tp_rank, pp_rank): {name:
  tensor}}` (`(tp_rank, pp_rank, ep_rank)` keys under expert parallelism), to `(hf_name, tensor)` pairs, one
  tensor at a time. Routed experts are collected from every EP rank under their global indices.
* `rank_mcore_to_hf(named_tensors, spec, ...)`: what one Megatron training rank calls on its own local
  parameters. Every rank of a TP group must call it with the same names in the same order (the TP
  all-gather is a collective); each rank then yields the same full HF tensors. Each pipeline stage yields
  the HF tensors of its own layers (the first stage also the embedding, the last the final norm and lm_head),
  which is what a rollout engine's partial `load_weights` accepts; call once per virtual-pipeline chunk.
  Under expert parallelism every rank of the EP group calls it too: routed experts are all-gathered over
  `ep_group` (after their TP gather), so each rank yields every expert.
* `convert_mcore_to_hf(dir, out)`: a converted directory to an HF model directory (sharded safetensors).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from rlstages.engines.convert.hf_to_mcore import Progress, rank_keys, spec_rank_file
from rlstages.engines.convert.manifest import HF_FILES_DIR, WEIGHT_INDEX, atomic_directory, write_manifest
from rlstages.engines.convert.safetensors_io import DEFAULT_CHECKSUM, Planned, PlannedWriter, Reader, new_checksum
from rlstages.engines.convert.sharding import chunk_prefix, expert_index, global_expert_name, merge_tp, tp_kind
from rlstages.engines.convert.spec import ConversionSpec
from rlstages.engines.convert.stream import McoreToHf

RankStateDicts = Mapping[tuple[int, ...], Mapping[str, torch.Tensor]]  # keys (tp, pp) or (tp, pp, ep)
HfTensors = Iterator[tuple[str, torch.Tensor]]


def _kind(spec: ConversionSpec, name: str) -> str:
    try:
        return tp_kind(name, spec.template.tp_rules)
    except KeyError:
        if spec.tp > 1:
            raise
        return "replicated"


def _to_global(stream: McoreToHf, spec: ConversionSpec, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    kind = _kind(spec, name)
    tensor = merge_tp(name, shards, kind, stream.stacked_parts(name))
    return tensor[: spec.hf_vocab_size] if kind == "vocab" else tensor


def mcore_to_hf(
    source: str | Path | RankStateDicts, spec: ConversionSpec | None = None, *, meta: bool = False
) -> HfTensors:
    """HF-named full tensors from a converted directory or from per-rank state dicts (spec required then)."""
    if isinstance(source, (str, Path)):
        spec = spec or ConversionSpec.load(source)
        readers = {k: Reader(Path(source) / spec_rank_file(spec, *k), use_mmap=False) for k in rank_keys(spec)}

        def release(p: int) -> None:  # unmap a finished chunk
            for (_, pp_rank, _), reader in readers.items():
                if pp_rank == p:
                    reader.close()

        try:
            yield from _from_ranks(
                spec,
                {k: r.entries for k, r in readers.items()},
                lambda k, n: readers[k].meta(n) if meta else readers[k].get(n),
                release,
            )
        finally:
            for r in readers.values():
                r.close()
        return
    if spec is None:
        raise ValueError("mcore_to_hf(state dicts) needs the ConversionSpec of the model")
    dicts = {(k if len(k) == 3 else (*k, 0)): v for k, v in source.items()}
    yield from _from_ranks(spec, dicts, lambda k, n: dicts[k][n])


def _from_ranks(
    spec: ConversionSpec,
    names: Mapping[tuple[int, ...], Iterable[str]],
    load: Callable[[tuple[int, int, int], str], torch.Tensor],
    release: Callable[[int], None] | None = None,
) -> HfTensors:
    missing = [k for k in rank_keys(spec) if k not in names]
    if missing:
        raise ValueError(f"rank state dicts missing for (tp_rank, pp_rank, ep_rank) {missing}")
    stream = McoreToHf(spec)
    for pp_rank, vp_stage in spec.layer_map.chunks():
        prefix = chunk_prefix(vp_stage, spec.vpp)
        local_names = [n for n in names[(0, pp_rank, 0)] if n.startswith(prefix)]
        for local in local_names:
            experts = expert_index(local) is not None
            for ep_rank in range(spec.ep if experts else 1):
                shards = [load((t, pp_rank, ep_rank), local) for t in range(spec.expert_tp if experts else spec.tp)]
                name = global_expert_name(local[len(prefix) :], ep_rank, spec.experts_per_rank)
                name = spec.layer_map.global_name(name, pp_rank, vp_stage)
                yield from stream.add(name, _to_global(stream, spec, name, shards))
        if release is not None:
            release(pp_rank)
    stream.finish()


def rank_mcore_to_hf(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    spec: ConversionSpec,
    *,
    pp_rank: int = 0,
    vp_stage: int = 0,
    tp_group: object | None = None,
    ep_group: object | None = None,
    expert_tp_group: object | None = None,
) -> HfTensors:
    """HF tensors from one Megatron rank's local parameters, TP shards all-gathered over `tp_group`.

    Names are the model chunk's own (`decoder.layers.<local>...`; a leading "module." is stripped).
    With PP/VPP > 1 only this chunk's tensors are produced, so only leftovers are checked, not completeness.
    A routed expert's `spec.expert_tp` shards are gathered over `expert_tp_group` (default `tp_group`;
    megatron-core's expert tensor parallel group) and under expert parallelism the local experts of every EP rank
    over `ep_group` (megatron-core's expert model parallel group), in EP-rank order.
    """
    stream = McoreToHf(spec)
    for raw, tensor in named_tensors:
        local = raw
        while local.startswith("module."):
            local = local[len("module.") :]
        if local.endswith("._extra_state"):
            continue
        name = spec.layer_map.global_name(local, pp_rank, vp_stage)
        expert = expert_index(name) is not None
        shards, parts = [tensor.detach()], spec.expert_tp if expert else spec.tp
        if parts > 1 and _kind(spec, name) != "replicated":
            shards = _all_gather(tensor.detach(), parts, (expert_tp_group or tp_group) if expert else tp_group)
        if not expert or spec.ep == 1:
            yield from stream.add(name, _to_global(stream, spec, name, shards))
            continue
        merged = _to_global(stream, spec, name, shards)
        for ep_rank, full in enumerate(_all_gather(merged, spec.ep, ep_group)):
            global_name = global_expert_name(name, ep_rank, spec.experts_per_rank)
            yield from stream.add(global_name, full)
    stream.finish(check_expected=spec.pp == 1)


def _all_gather(tensor: torch.Tensor, tp: int, group: object | None) -> list[torch.Tensor]:
    import torch.distributed as dist

    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(out, tensor, group=group)
    return out


def convert_mcore_to_hf(
    mcore_path: str | Path,
    out_path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    fsync: bool = True,
    checksum: str = DEFAULT_CHECKSUM,
    progress: Progress | None = None,
) -> Path:
    """Export a converted directory (any TP/PP) to an HF model directory with sharded safetensors."""
    src, out = Path(mcore_path), Path(out_path)
    new_checksum(checksum)  # an unknown algorithm fails before any work
    spec = ConversionSpec.load(src)
    shards: list[list[Planned]] = [[]]
    size = 0
    for name, t in mcore_to_hf(src, spec, meta=True):
        p = Planned(name, t.dtype, tuple(t.shape))
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    total = sum(p.nbytes for s in shards for p in s)
    files = [
        "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    where = {p.name: i for i, s in enumerate(shards) for p in s}
    with atomic_directory(out, overwrite) as tmp:
        writers = [PlannedWriter(tmp / f, s, checksum=checksum) for f, s in zip(files, shards, strict=True)]
        try:
            done = 0
            for name, t in mcore_to_hf(src, spec):
                writers[where[name]].write(name, t)
                done += t.numel() * t.element_size()
                if progress is not None:
                    progress(done, total)
            checksums = {f: w.close(fsync) for f, w in zip(files, writers, strict=True)}
        except BaseException:
            for w in writers:
                w.abort()
            raise
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {n: files[i] for n, i in where.items()}}
            (tmp / WEIGHT_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        side = src / HF_FILES_DIR
        if side.is_dir():
            for f in side.iterdir():
                shutil.copy2(f, tmp / f.name)
        else:
            (tmp / "config.json").write_text(json.dumps(spec.hf_config, indent=2))
        info = {"direction": "mcore_to_hf", "template": spec.template.hf_model_type}
        write_manifest(tmp, info, checksums, checksum)
    return out
