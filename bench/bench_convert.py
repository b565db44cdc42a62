"""Benchmark: HF -> Megatron-Core conversion time and peak memory, against a plain safetensors read+write.

    python -m bench.bench_convert [--hidden 1024 --layers 12 --vocab 32000 --dtype bfloat16 --shard-mb 100]

Builds a Llama-shaped random checkpoint of a few hundred MB (no model init, no hub), warms the page cache,
then times, each in a fresh process (best of --repeat): the baseline (`safetensors.torch.load_file` +
`save_file` of every shard, the same bytes), our conversion at TP=1/PP=1 and TP=2/PP=2 (with the default
XXH3-128 manifest checksum, with CRC-32, with sha256, and without), and the export back to HF. Every run
reads its input from the page cache and starts with no dirty pages (os.sync), the baseline alike. Wall time
is "best of"; CPU time (all threads) is shown too, as it is steadier on a shared machine.
Peak memory is the process's peak RSS above its RSS before the
timed call. Goal: ratio <= 1.3.
Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def build_checkpoint(out: Path, hidden: int, layers: int, vocab: int, dtype: str, shard_mb: int) -> int:
    """A Llama-shaped HF directory of random weights, in shards of about `shard_mb`; returns its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = max(1, hidden // 64)
    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=vocab, torch_dtype=dtype,
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    out.mkdir(parents=True)
    config.save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, shape in shapes.items():
        if sum(t.nbytes for t in shards[-1].values()) > shard_mb * 2**20:
            shards.append({})
        shards[-1][name] = (torch.randn(shape, generator=gen) * 0.02).to(DTYPES[dtype])
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def worker(mode: str, src: str, out: str, tp: int, pp: int) -> dict[str, float]:
    """One timed run in this (fresh) process: `baseline`, `convert[-<checksum>]` or `export`."""
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file

    from rlstages.engines.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from rlstages.engines.convert.spec import _with_hf_defaults

    _with_hf_defaults({"model_type": "llama"})  # import transformers before the clock starts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    cpu = time.process_time()  # all threads of this process (the checksum thread included)
    start = time.perf_counter()
    if mode == "baseline":
        Path(out).mkdir()
        for shard in sorted(Path(src).glob("*.safetensors")):
            save_file(load_file(shard), Path(out) / shard.name, metadata={"format": "pt"})
    elif mode.startswith("convert"):
        checksum = mode.partition("-")[2]  # "": the conversion's default (the manifest says which)
        convert_hf_to_mcore(src, out, tp=tp, pp=pp, fsync=False, **({"checksum": checksum} if checksum else {}))
    else:
        convert_mcore_to_hf(src, out, fsync=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "cpu": time.process_time() - cpu, "peak_mb": (_status_kb("VmHWM") - before) / 1024}


def timed(modes: list[tuple[str, str, Path, Path, int, int]], repeat: int) -> dict[str, dict[str, float]]:
    """Best wall and CPU time (and worst peak RSS) of `repeat` fresh-process runs of each mode, interleaved.

    Dirty pages are flushed before every run, so no run pays for the previous one's writeback.
    """
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in modes}
    for _ in range(repeat):
        for label, mode, src, out, tp, pp in modes:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            cmd = [sys.executable, "-m", "bench.bench_convert", "--worker", mode, str(src), str(out), str(tp), str(pp)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        label: {"seconds": min(x["seconds"] for x in r), "cpu": min(x["cpu"] for x in r),
                "peak_mb": max(x["peak_mb"] for x in r)}
        for label, r in runs.items()
    }  # fmt: skip


def main() -> None:
    """Build the checkpoint, run the measurements, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="Scratch directory (default: a temp dir).")
    parser.add_argument("--worker", nargs=5, metavar=("MODE", "SRC", "OUT", "TP", "PP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, src, out, tp, pp = args.worker
        print(json.dumps(worker(mode, src, out, int(tp), int(pp))))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        hf = work / "hf"
        size = build_checkpoint(hf, args.hidden, args.layers, args.vocab, args.dtype, args.shard_mb)
        for p in hf.glob("*.safetensors"):  # warm the page cache so every run reads from memory
            p.read_bytes()
        kept = work / "m22-kept"
        timed([("keep", "convert", hf, kept, 2, 2)], 1)
        modes = [
            ("plain safetensors read+write", "baseline", hf, work / "base", 1, 1),
            ("convert TP=1 PP=1", "convert", hf, work / "m11", 1, 1),
            ("convert TP=2 PP=2", "convert", hf, work / "m22", 2, 2),
            ("convert TP=2 PP=2, crc32 manifest", "convert-crc32", hf, work / "m22c", 2, 2),
            ("convert TP=2 PP=2, sha256 manifest", "convert-sha256", hf, work / "m22s", 2, 2),
            ("convert TP=2 PP=2, no checksum", "convert-none", hf, work / "m22n", 2, 2),
            ("export TP=2 PP=2 -> HF", "export", kept, work / "back", 1, 1),
        ]
        rows = list(timed(modes, args.repeat).items())
        _print_table(rows, size, args)
        from bench.common import record

        r = dict(rows)
        base = r["plain safetensors read+write"]["seconds"]
        checked = r["convert TP=2 PP=2"]["seconds"]
        algorithm = json.loads((kept / "manifest.json").read_text())["checksum"]
        record(
            "convert_checksummed",
            checked / base,
            "<= 1.3",
            f"HF -> mcore TP2 PP2 with {algorithm} checksums, {checked:.2f} s vs plain copy {base:.2f} s, "
            f"{size / 2**20:.0f} MB",
        )
        crc = r["convert TP=2 PP=2, crc32 manifest"]["seconds"]
        record("convert_checksummed_crc32", crc / base, None, f"the same with crc32 checksums, {crc:.2f} s")
        record(
            "convert_checksum_cost",
            checked / r["convert TP=2 PP=2, no checksum"]["seconds"],
            None,
            "the same conversion with / without the manifest checksum",
        )
        record(
            "convert_export", r["export TP=2 PP=2 -> HF"]["seconds"] / base, None, "mcore TP2 PP2 -> HF vs plain copy"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _print_table(rows: list[tuple[str, dict[str, float]]], size: int, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    base, base_cpu = rows[0][1]["seconds"], rows[0][1]["cpu"]
    title = (f"{size / 2**20:.0f} MB {args.dtype} checkpoint (hidden {args.hidden}, {args.layers} layers, "
             f"vocab {args.vocab}, {args.shard_mb} MB shards), best of {args.repeat}")  # fmt: skip
    table = Table("run", "wall s", "ratio", "CPU s", "CPU ratio", "MB/s", "peak RSS +MB", title=title)
    for name, r in rows:
        mbps = size / 2**20 / r["seconds"]
        table.add_row(
            name, f"{r['seconds']:.2f}", f"{r['seconds'] / base:.2f}", f"{r['cpu']:.2f}", f"{r['cpu'] / base_cpu:.2f}",
            f"{mbps:.0f}", f"{r['peak_mb']:.0f}",
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
