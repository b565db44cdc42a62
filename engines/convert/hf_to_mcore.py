"""HF safetensors directory -> Megatron-Core checkpoint: one safetensors file per (tp, pp) rank.

The conversion runs twice over the same generator: first on meta tensors (headers only) to plan every
rank file and to find leftovers, missing tensors and shape errors before a byte is written; then on real
tensors, read shard by shard in file order and written as soon as an op has its inputs. Peak memory is
about one layer plus the tensors in flight, never the whole model. Output layout:

    OUT/mp_rank_<tp>[_<pp>][_<ep>]/model.safetensors   Megatron names, chunk-local layer (and expert) indices
    OUT/mcore_config.json                       template, parallel sizes, flat Megatron config, HF config
    OUT/hf/                                     config.json, tokenizer and other side files of the input
    OUT/dist_ckpt/                              megatron-core dist_checkpointing copy (optional)
    OUT/manifest.json                           size and checksum of every file; written last
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.convert.manifest import (
    HF_FILES_DIR,
    WEIGHT_INDEX,
    atomic_directory,
    copy_hf_side_files,
    write_manifest,
)
from rlstages.engines.convert.ops import Converted, RowConcat
from rlstages.engines.convert.safetensors_io import DEFAULT_CHECKSUM, Planned, PlannedWriter, Reader, new_checksum
from rlstages.engines.convert.sharding import chunk_prefix, expert_index, pad_vocab, split_ep, split_tp, tp_kind
from rlstages.engines.convert.spec import SPEC_FILE, ConversionSpec, TransformerImpl
from rlstages.engines.convert.stream import ConversionError, HfToMcore

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
RankTensor = tuple[int, int, str, torch.Tensor | RowConcat]  # (tp_rank, pp_rank, name in the rank file, shard)
EpRankTensor = tuple[int, int, int, str, torch.Tensor | RowConcat]  # (tp_rank, pp_rank, ep_rank, name, shard)


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's rank directory name: mp_rank_TT when pp == 1, else mp_rank_TT_PPP; `_EEE` appended under
    expert parallelism (ep > 1), as Megatron-LM names its expert-parallel checkpoints."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


def rank_file(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Relative path of one rank's safetensors file."""
    return f"{rank_dir(tp_rank, pp_rank, pp, ep_rank, ep)}/model.safetensors"


def spec_rank_file(spec: ConversionSpec, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    """`rank_file` under the spec's own layout."""
    return rank_file(tp_rank, pp_rank, spec.pp, ep_rank, spec.ep)


def rank_keys(spec: ConversionSpec) -> list[tuple[int, int, int]]:
    """Every (tp_rank, pp_rank, ep_rank) of the spec's layout."""
    return [(t, p, e) for t in range(spec.tp) for p in range(spec.pp) for e in range(spec.ep)]


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json of an HF model directory, with a clear error when absent or not JSON."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected an HF model directory (config.json + *.safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def hf_weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors shards of an HF directory (index order when an index exists)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / WEIGHT_INDEX
    if index.is_file():
        shards = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (hf_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shard(s) that do not exist: {missing}")
        return [hf_dir / s for s in shards]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in hf_dir.glob("*.bin"))
        hint = f" (found {other}: re-save with save_pretrained(safe_serialization=True))" if other else ""
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights{hint}")
    return files


def shard_global(spec: ConversionSpec, name: str, tensor: Converted) -> Iterator[EpRankTensor]:
    """Place one global Megatron tensor: pad vocab, split over TP, locate its pipeline stage and chunk, and its
    expert-parallel rank(s) (a routed expert on one, under its local index; anything else on all). A routed
    expert is split over the expert TP size instead: TP rank t's file holds its shard t % expert_tp (megatron-core
    orders expert ranks ETP fastest, so the rank with dense TP rank t has that expert TP rank)."""
    try:
        kind = tp_kind(name, spec.template.tp_rules)
    except KeyError:
        if spec.tp > 1:
            raise
        kind = "replicated"
    if kind == "vocab":
        tensor = pad_vocab(tensor, spec.mcore["padded_vocab_size"])
    place = spec.layer_map.place(name)
    parts = spec.expert_tp if expert_index(place.local_name) is not None else spec.tp
    shards = split_tp(name, tensor, kind, parts)  # a routed expert: over expert TP, the rest over TP
    for ep_rank, ep_name in split_ep(place.local_name, spec.experts_per_rank, spec.ep):
        local = chunk_prefix(place.vp_stage, spec.vpp) + ep_name
        for tp_rank in range(spec.tp):
            yield tp_rank, place.pp_rank, ep_rank, local, shards[tp_rank % parts]


def stream_rank_tensors(
    spec: ConversionSpec,
    readers: Sequence[Reader],
    meta: bool = False,
    progress: Progress | None = None,
    *,
    ep_rank: int = 0,
) -> Iterator[RankTensor]:
    """Every (tp_rank, pp_rank, name, shard) of expert-parallel rank `ep_rank`, in a deterministic order;
    raises on incompleteness at the end."""
    for t, p, e, name, shard in stream_all_rank_tensors(spec, readers, meta, progress):
        if e == ep_rank:
            yield t, p, name, shard


def stream_all_rank_tensors(
    spec: ConversionSpec, readers: Sequence[Reader], meta: bool = False, progress: Progress | None = None
) -> Iterator[EpRankTensor]:
    """Every rank tensor of the conversion (all TP x PP x EP ranks), in a deterministic order; raises on
    incompleteness at the end."""
    stream = HfToMcore(spec)
    seen: dict[str, Path] = {}
    total = sum(e.end - e.start for r in readers for e in r.entries.values())
    done = 0
    for reader in readers:
        for name, entry in reader.entries.items():
            if name in seen:
                raise ConversionError(f"{name}: present in both {seen[name].name} and {reader.path.name}")
            seen[name] = reader.path
            tensor = reader.meta(name) if meta else reader.get(name)
            for mcore_name, converted in stream.add(name, tensor):
                yield from shard_global(spec, mcore_name, converted)
            done += entry.end - entry.start
            if progress is not None:
                progress(done, total)
        reader.close()  # unmap the shard once its tensors are consumed (pending ones keep it alive)
    stream.finish()


def convert_hf_to_mcore(
    hf_path: str | Path,
    out_path: str | Path,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    *,
    ep: int = 1,
    etp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    transformer_impl: TransformerImpl = "local",
    vocab_divisible_by: int = 1,
    extra_outputs: Mapping[str, Callable[[Path, Path], None]] | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    checksum: str = DEFAULT_CHECKSUM,
    input_digests: dict[str, str] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert an HF model directory to Megatron-Core rank files under `out_path`; returns `out_path`.

    `ep` > 1 (MoE models) writes one file per (tp, pp, ep) rank: each EP rank holds its contiguous share of
    every MoE layer's routed experts, renumbered from 0, plus a copy of all other tensors. `etp` (a divisor of
    `tp`, None = tp) splits each routed expert over that many expert-TP ranks instead of over TP.
    `first_stage_layers` / `last_stage_layers` give the first / last pipeline stage that many layers (megatron-core's
    `num_layers_in_first/last_pipeline_stage`; the middle stages share the rest evenly).
    `extra_outputs` maps a subdirectory name to a writer `(conversion_dir, subdir)` run inside the atomic
    directory before the manifest (e.g. megatron's dist checkpoint: `megatron.dist_ckpt.save_dist_checkpoint`);
    `checksum` ("xxh3_128", "crc32", "sha256" or "none") is taken while writing; `input_digests` and
    `manifest_extra` are recorded in the manifest. Nothing is left at `out_path` when the conversion fails.
    """
    hf_dir, out = Path(hf_path), Path(out_path)
    new_checksum(checksum)  # an unknown algorithm fails before any work
    spec = ConversionSpec.from_hf_config(
        read_hf_config(hf_dir), tp, pp, vpp, transformer_impl, vocab_divisible_by, ep=ep, etp=etp,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
    )  # fmt: skip
    readers = [Reader(f) for f in hf_weight_files(hf_dir)]
    plans: dict[tuple[int, int, int], list[Planned]] = {k: [] for k in rank_keys(spec)}
    for t, p, e, name, shard in stream_all_rank_tensors(spec, readers, meta=True):
        plans[(t, p, e)].append(Planned(name, shard.dtype, tuple(shard.shape)))
    with atomic_directory(out, overwrite) as tmp:
        checksums = _write_ranks(spec, readers, plans, tmp, fsync, checksum, progress)
        (tmp / SPEC_FILE).write_text(json.dumps(spec.to_json(), indent=2, sort_keys=True))
        copy_hf_side_files(hf_dir, tmp / HF_FILES_DIR)
        for name, write in (extra_outputs or {}).items():
            write(tmp, tmp / name)
        info = {
            "direction": "hf_to_mcore",
            "template": spec.template.hf_model_type,
            "tp": spec.tp,
            "pp": spec.pp,
            "vpp": spec.vpp,
            "ep": spec.ep,
            **({"etp": spec.etp} if spec.etp else {}),
            **({"stage_layers": spec.layer_map.stage_layers()} if spec.layer_map.uneven else {}),
            "transformer_impl": spec.transformer_impl,
            "extra_outputs": sorted(extra_outputs or {}),
            "inputs": {r.path.name: (input_digests or {}).get(r.path.name) for r in readers},
            **(manifest_extra or {}),
        }
        write_manifest(tmp, info, checksums, checksum)
    return out


def _write_ranks(
    spec: ConversionSpec,
    readers: Sequence[Reader],
    plans: dict[tuple[int, int, int], list[Planned]],
    tmp: Path,
    fsync: bool,
    checksum: str,
    progress: Progress | None,
) -> dict[str, str]:
    writers: dict[tuple[int, int, int], PlannedWriter] = {}
    try:
        for (t, p, e), plan in plans.items():
            (tmp / rank_dir(t, p, spec.pp, e, spec.ep)).mkdir()
            meta = {"tp_rank": str(t), "pp_rank": str(p), **({"ep_rank": str(e)} if spec.ep > 1 else {})}
            writers[(t, p, e)] = PlannedWriter(tmp / spec_rank_file(spec, t, p, e), plan, meta, checksum)
        for t, p, e, name, shard in stream_all_rank_tensors(spec, readers, progress=progress):
            writers[(t, p, e)].write(name, shard)
        return {spec_rank_file(spec, t, p, e): w.close(fsync) for (t, p, e), w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        for r in readers:
            r.close()


def load_rank_chunk(
    mcore_dir: Path, spec: ConversionSpec, tp_rank: int, pp_rank: int, vp_stage: int, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The state dict of one model chunk of one rank, as GPTModel names it (local expert indices under EP)."""
    reader = Reader(mcore_dir / spec_rank_file(spec, tp_rank, pp_rank, ep_rank), use_mmap=False)
    prefix = chunk_prefix(vp_stage, spec.vpp)
    try:
        return {n[len(prefix) :]: reader.get(n) for n in reader if n.startswith(prefix)}
    finally:
        reader.close()
