"""The demo's measured times per class of CPU, kept once: the README's "What to expect on your CPU" table is rendered
from `DEMO_ROWS` (a test checks it is), and `rlstages doctor` says the rows of this machine's class from them.

    python -m rlstages.flows.cli.demo_times     # prints the README's table from the rows (paste it after a new run)

A row's figures come from clean-clone runs (`python -m bench demo`, docs/demo-measured.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoRow:
    """One class of CPU's latest clean-clone demo runs (2 cores); the strings are the README's cells (markdown)."""

    key: str  # the doctor's class of the machine (`doctor_probes.demo_class`)
    name: str
    measured_on: str
    setup: str
    run: str
    first_08: str
    end: str
    peak_pss: str

    def cells(self) -> tuple[str, ...]:
        """The README table's cells, in its columns' order."""
        return (self.name, self.measured_on, self.setup, self.run, self.first_08, self.end, self.peak_pss)

    def sentence(self) -> str:
        """The row as the doctor says it: one plain line."""
        text = (
            f"{self.name}: `make setup` {self.setup}, the run {self.run}; held-out >= 0.8 first at {self.first_08}; "
            f"at step 30 {self.end}; peak PSS {self.peak_pss} (measured on {self.measured_on})"
        )
        return text.replace("**", "").replace("≥", ">=").replace("×", "x")


HEADER = (
    "class of CPU (2 cores)",
    "measured on",
    "`make setup`",
    "the run (30 steps)",
    "held-out ≥ 0.8 first",
    "at step 30",
    "peak memory (PSS, all processes)",
)

DEMO_ROWS: tuple[DemoRow, ...] = (
    DemoRow(
        "native-bf16-amx",
        "native bf16 with AMX",
        "Intel Xeon with AMX-BF16 (Sapphire Rapids or later; bf16 GEMM ~1,130-1,450 GFLOP/s)",
        "1 min 15-31 s",
        "**3.7-5.2 min** (2026-12-07/08, rounds 39-43, seven runs of one curve; the VM's pace varies by the hour)",
        "step 16, **2.13-2.92 min** in",
        "0.86",
        "3.36-3.44 GB",
    ),
    DemoRow(
        "native-bf16",
        "native bf16",
        "AMD EPYC Zen 5, AVX512_BF16, no AMX (bf16 GEMM ~1,000 GFLOP/s)",
        "~3 min",
        "**3 min 37 s** and 3 min 41 s (2026-12-01)",
        "step 14, 2.05 min in",
        "0.78 (before the preset's LR decay)",
        "4.00-4.11 GB",
    ),
    DemoRow(
        "native-bf16",
        "native bf16, half-width",
        "AMD EPYC Zen 4 (AVX512_BF16 on 256-bit units)",
        "2 min 00 s",
        "**6 min 46 s** (2026-12-03)",
        "step 14, 3.6 min in",
        "0.81",
        "4.15 GB",
    ),
    DemoRow(
        "avx2",
        "AVX2 only (most laptops, many cloud VMs)",
        "AMD EPYC Zen 3 (fp32 GEMM ~105-175 GFLOP/s; the bf16 kernel timed 6-7.5× slower, so the fp32 one)",
        "2 min 37 s",
        "**12 min 03 s** and 13 min 16 s (2026-12-07, rounds 37-38)",
        "step 24, **9.7-10.6 min** in (0.78 at step 14)",
        "0.86",
        "3.76-4.00 GB",
    ),
    DemoRow(
        "avx512",
        "AVX-512 without bf16",
        "Intel Xeon (bf16 GEMM ~43 GFLOP/s, fp32 ~157)",
        "2 min 50 s",
        "**23 min 40 s** (before the fast decode step and the evaluation windows; not re-measured)",
        "step 14, 16 min in",
        "not recorded",
        "not recorded",
    ),
)


def readme_table() -> str:
    """The README's table of the rows, as markdown."""
    rows = ["| " + " | ".join(cells) + " |" for cells in (HEADER, *(row.cells() for row in DEMO_ROWS))]
    return "\n".join([rows[0], "|" + "---|" * len(HEADER), *rows[1:]])


def class_times(key: str) -> str:
    """What the doctor says for a class of CPU: its rows' sentences, or that none was measured."""
    rows = [row.sentence() for row in DEMO_ROWS if row.key == key]
    return "; ".join(rows) or f"{key}: no clean-clone demo measured yet"


if __name__ == "__main__":
    import sys

    sys.stdout.write(readme_table() + "\n")
