"""Run every benchmark: `python -m bench [NAME ...]` (or `make bench`). Each bench runs in its own process
and records ratios against a baseline measured in the same run; this prints them as one table (figure, ratio,
goal, ✓/✗) and writes bench/results.json: a JSON list of {"name", "ratio", "goal", "ok", ...}, each with the
load average when it was measured, the machine's matmul FLOP/s and its class of CPU (`cpu_class`: "avx2: AMD EPYC,
2026-12-01", the classes of the README's demo table), so figures from different machines compare. A run replaces the
saved rows of the figures it measured on its own class of CPU and keeps the other classes' (`merge_rows`).
None is a test.

    python -m bench                   # all
    python -m bench trl step          # some (short names or bench.bench_<name> modules)
    python -m bench --markdown        # bench/results.json as the table of docs/benchmarks.md
    BENCH_TRL_STEPS=5 python -m bench trl
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import RESULTS_ENV, matmul_flops, memory_bandwidth

BENCHES = [
    "step",
    "sr_adamw",
    "rollout",
    "gen_cpu",
    "sync",
    "flow",
    "convert",
    "backends",
    "off_policy",
    "async",
    "trl",
    "demo",
    "gpu",
    "gpu_sync",
    "profile_off",
    "sandbox",
]
OUT = Path(__file__).resolve().parent / "results.json"


def machine() -> dict[str, object]:
    """The machine's class of CPU and its speed, measured now: matmul FLOP/s (fp32, bf16, this process's
    threads), copy bandwidth."""
    import datetime

    import torch

    from rlstages.engines.training.machine import Machine, bf16_flags, cpu_model, simd_flags

    cpus = os.cpu_count() or 1
    cpu = Machine(cpu_model(), cpus, bf16_flags(), torch.get_num_threads(), "", simd_flags())
    return {
        "cpu_class": f"{cpu.cpu_class}: {cpu.cpu}, {cpus} CPUs, {datetime.date.today().isoformat()}",
        "cpus": cpus,
        "torch_threads": torch.get_num_threads(),
        "matmul_gflops_float32": round(matmul_flops("float32") / 1e9, 1),
        "matmul_gflops_bfloat16": round(matmul_flops("bfloat16") / 1e9, 1),
        "copy_gb_per_s": round(memory_bandwidth() / 1e9, 2),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def bench_env() -> dict[str, str]:
    """The benches' environment: offline hubs, a Prefect home of their own (not ~/.prefect), and a generous
    start-up timeout for Prefect's temporary server (a loaded machine restarts it in a loop otherwise)."""
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_HOME": tempfile.mkdtemp(prefix="rlstages-bench-prefect-"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "900",
    }
    return {**defaults, **os.environ}


def main() -> None:
    """Run the benches named on the command line (default: all) in separate processes; print and save."""
    if sys.argv[1:] == ["--markdown"]:
        print(markdown(json.loads(OUT.read_text())))
        return
    names = [n if n.startswith("bench.") else f"bench.bench_{n}" for n in (sys.argv[1:] or BENCHES)]
    info = machine()
    print(f"machine: {json.dumps(info)}", flush=True)
    fd, tmp = tempfile.mkstemp(prefix="rlstages-bench-", suffix=".jsonl")
    os.close(fd)
    env = {**bench_env(), RESULTS_ENV: tmp}
    for name in names:
        if not (Path(__file__).resolve().parent / f"{name.removeprefix('bench.')}.py").is_file():
            print(f"skip {name}: not present")
            continue
        print(f"== {name}", flush=True)
        done = subprocess.run([sys.executable, "-m", name], env=env, check=False)
        if done.returncode:
            print(f"{name} exited with {done.returncode}", flush=True)
    rows = [json.loads(line) for line in Path(tmp).read_text().splitlines() if line.strip()]
    Path(tmp).unlink()
    for row in rows:
        row["machine_gflops_float32"] = info["matmul_gflops_float32"]
        row.setdefault("cpu_class", info["cpu_class"])
    table = Table("figure", "ratio", "goal", "", "load", "detail", title=f"rlstages bench ({_machine_line(info)})")
    for r in rows:
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: "–"}[r["ok"]]
        table.add_row(r["name"], f"{r['ratio']:.3g}", r["goal"] or "—", mark, f"{r['load_avg'][0]:.1f}", r["detail"])
    Console().print(table)
    previous = json.loads(OUT.read_text()) if OUT.is_file() and sys.argv[1:] else []
    merged = merge_rows(previous, rows)
    OUT.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {OUT} ({len(rows)} figures measured now, {len(merged)} in all)")


def cpu_class_of(row: dict) -> str:  # type: ignore[type-arg]
    """A row's class of CPU ("native-bf16", "avx512", "avx2"; "" for rows recorded before the field)."""
    return str(row.get("cpu_class", "")).partition(":")[0]


def merge_rows(previous: list[dict], rows: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """The saved rows with `rows` in place of those of the same figure measured on the same class of CPU: a run on
    one class replaces its own figures and keeps another class's (issue 53 states its goals per class)."""
    fresh = {(r["name"], cpu_class_of(r)) for r in rows}
    return [p for p in previous if (p["name"], cpu_class_of(p)) not in fresh] + rows


def markdown(rows: list[dict]) -> str:  # type: ignore[type-arg]
    """bench/results.json as the table of docs/benchmarks.md (figure, class of CPU, ratio, goal, met, load when
    measured, detail)."""
    lines = ["| figure | class | ratio | goal | met | load (1 min) | detail |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = {True: "✓", False: "✗", None: "–"}[r["ok"]]
        load = f"{r['load_avg'][0]:.1f}"
        cls = cpu_class_of(r) or "—"
        lines.append(
            f"| `{r['name']}` | {cls} | {r['ratio']:.3g} | {r['goal'] or '—'} | {mark} | {load} | {r['detail']} |"
        )
    speeds = sorted({r.get("machine_gflops_float32") for r in rows if r.get("machine_gflops_float32")})
    lines.append(f"\nMachine speed when measured (plain fp32 matmul): {', '.join(f'{s} GFLOP/s' for s in speeds)}.")
    return "\n".join(lines)


def _machine_line(info: dict[str, object]) -> str:
    return (
        f"{info['cpu_class']}, matmul {info['matmul_gflops_float32']} GFLOP/s fp32 / "
        f"{info['matmul_gflops_bfloat16']} bf16, copy {info['copy_gb_per_s']} GB/s, load {info['load_avg']}"
    )


if __name__ == "__main__":
    main()
