"""`rlstages compare`: the runs of an MLflow experiment side by side, and their reward curves in one PNG.

    rlstages compare rlstages-tiny --metric reward/mean --png compare.png --html compare.html

One column per run: status, steps, wall time, final and best value of each metric, the tags runs are
compared by, and every config key (MLflow params are the flattened config) whose value differs between
the runs. The MLflow UI shows the same runs (same tags, same metric names); for a tracking server the
command prints the link to its compare view. `--html` writes one self-contained page (the curves of every
metric overlaid as inline SVG, the metric table and the config diff) that opens without any server.
"""

from __future__ import annotations

import html
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from rlstages.tasks.driver.tracking import RunRecord

TAG_ROWS = ("rlstages.algorithm", "rlstages.model", "rlstages.rollout_backend", "rlstages.actor_backend")
HIDDEN_PARAMS = ("trainer.run_name",)  # differs by construction; the column header shows it
out = Console()
err = Console(stderr=True)


def differing_params(runs: list[RunRecord]) -> list[str]:
    """Config keys whose value is not the same in every run (a missing key counts as a value)."""
    keys = sorted({k for r in runs for k in r.params} - set(HIDDEN_PARAMS))
    return [k for k in keys if len({r.params.get(k) for r in runs}) > 1]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def compare_table(
    tracking_uri: str, runs: list[RunRecord], metrics: list[str], maximize: bool = True, max_params: int = 40
) -> Table:
    """The side-by-side table (runs as columns)."""
    from rlstages.tasks.driver.tracking import metric_series

    table = Table(title=f"{len(runs)} runs", show_lines=False)
    table.add_column("", style="bold", no_wrap=True)
    for r in runs:
        table.add_column(r.name, overflow="fold")
    table.add_row("run id", *[r.run_id[:12] for r in runs])
    table.add_row("status", *[_status(r.status) for r in runs])
    table.add_row("steps", *[_fmt(r.latest.get("progress/step")) for r in runs])
    table.add_row("wall time", *[_duration(r.wall_seconds) for r in runs])
    for key in metrics:
        series = [metric_series(tracking_uri, r.run_id, key) for r in runs]
        pick = max if maximize else min
        table.add_row(f"{key} final", *[_fmt(s[-1][1]) if s else "-" for s in series])
        table.add_row(f"{key} best", *[_fmt(pick(v for _, v in s)) if s else "-" for s in series])
    for tag in (*TAG_ROWS, "rlstages.failed_stage"):
        if any(tag in r.tags for r in runs):
            table.add_row(tag.removeprefix("rlstages."), *[r.tags.get(tag, "-") for r in runs])
    diff = differing_params(runs)
    table.add_section()
    for key in diff[:max_params]:
        table.add_row(key, *[r.params.get(key, "-") for r in runs])
    if len(diff) > max_params:
        table.add_row(f"... {len(diff) - max_params} more differing keys", *["" for _ in runs])
    if not diff:
        table.add_row("config", *["same" for _ in runs])
    return table


def _status(status: str) -> str:
    colour = {"FINISHED": "green", "FAILED": "red", "RUNNING": "yellow", "KILLED": "red"}.get(status, "white")
    return f"[{colour}]{status}[/]"


def plot_curves(tracking_uri: str, runs: list[RunRecord], metric: str, png: Path) -> Path:
    """Overlay `metric` against step for every run; write a PNG."""
    png.parent.mkdir(parents=True, exist_ok=True)
    png.write_bytes(_curves(tracking_uri, runs, metric, "png"))
    return png


def _curves(tracking_uri: str, runs: list[RunRecord], metric: str, fmt: str) -> bytes:
    """The overlaid curves of `metric` as an image file's bytes (png or svg)."""
    import matplotlib

    from rlstages.tasks.driver.tracking import metric_series

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, smaller); PNGs are unaffected
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in runs:
        points = metric_series(tracking_uri, r.run_id, metric)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=f"{r.name} ({r.status})")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    ax.set_title(metric)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()


def html_report(tracking_uri: str, experiment: str, runs: list[RunRecord], metrics: list[str]) -> str:
    """One self-contained HTML page: each metric's curves overlaid (inline SVG), final/best values, the tags
    runs are compared by and the config keys that differ. No scripts, no links out: it opens from a file."""
    from rlstages.tasks.driver.tracking import metric_series

    e = html.escape
    head = "".join(f"<th>{e(r.name)}</th>" for r in runs)

    def row(label: str, cells: list[str]) -> str:
        return f"<tr><th>{e(label)}</th>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>"

    rows = [
        row("run id", [r.run_id for r in runs]),
        row("status", [r.status for r in runs]),
        row("steps", [_fmt(r.latest.get("progress/step")) for r in runs]),
        row("wall time", [_duration(r.wall_seconds) for r in runs]),
    ]
    for key in metrics:
        series = [metric_series(tracking_uri, r.run_id, key) for r in runs]
        rows.append(row(f"{key} final", [_fmt(s[-1][1]) if s else "-" for s in series]))
        rows.append(row(f"{key} best", [_fmt(max(v for _, v in s)) if s else "-" for s in series]))
    for tag in (*TAG_ROWS, "rlstages.failed_stage"):
        if any(tag in r.tags for r in runs):
            rows.append(row(tag.removeprefix("rlstages."), [r.tags.get(tag, "-") for r in runs]))
    diff = differing_params(runs)
    diff_rows = [row(k, [r.params.get(k, "-") for r in runs]) for k in diff] or [row("config", ["same"] * len(runs))]
    charts = "".join(
        f"<figure><figcaption>{e(m)}</figcaption>{_svg(_curves(tracking_uri, runs, m, 'svg'))}</figure>"
        for m in metrics
    )
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}th,td{border:1px solid #ccc;"
        "padding:3px 8px;text-align:left}figure{display:inline-block;margin:0 1em 1em 0}"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>rlstages compare: {e(experiment)}'
        f"</title><style>{style}</style></head><body><h1>Experiment {e(experiment)}</h1>"
        f"<p>{len(runs)} runs from {e(tracking_uri)}</p><h2>Curves</h2>{charts}"
        f'<h2>Runs</h2><table id="runs"><tr><th></th>{head}</tr>{"".join(rows)}</table>'
        f'<h2>Config diff</h2><table id="config-diff"><tr><th>key</th>{head}</tr>{"".join(diff_rows)}</table>'
        "</body></html>\n"
    )


def _svg(data: bytes) -> str:
    """Matplotlib's SVG without its XML prolog and doctype, for inlining in HTML."""
    text = data.decode()
    return text[text.index("<svg") :]


def check_store_exists(uri: str) -> None:
    """A local tracking store must exist already: reading it must not create an empty database or directory."""
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme.startswith("sqlite"):
        path = Path(uri.split(":///", 1)[1]) if ":///" in uri else None
        if path is not None and str(path) != ":memory:" and not path.is_file():
            raise FileNotFoundError(f"--tracking-uri {uri}: no such database file {path}")
    elif parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_dir():
            raise FileNotFoundError(f"--tracking-uri {uri}: no such MLflow store directory {path}")


def check_output_file(path: Path | None, option: str) -> None:
    """An output file goes into an existing directory and is not one itself (checked before any store is read)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory (expected a file name)")
    parent = path.parent
    if not parent.is_dir():
        state = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"{option} {path}: its directory {parent} {state}")


def _fail(message: str, code: int) -> NoReturn:
    line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def compare_command(
    experiment: Annotated[
        str | None, typer.Argument(help="Experiment name (default: the most recently active).")
    ] = None,
    metric: Annotated[
        list[str] | None, typer.Option("--metric", "-m", help="Metric to compare (repeatable; the first is plotted).")
    ] = None,
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
    ] = None,
    max_runs: Annotated[int, typer.Option(help="The newest N runs.")] = 8,
    filter_string: Annotated[str, typer.Option("--filter", help="MLflow search filter, e.g. \"tags.x = 'y'\".")] = "",
    minimize: Annotated[bool, typer.Option(help="Lower is better for the 'best' rows.")] = False,
    png: Annotated[Path | None, typer.Option(help="Also write the overlaid curves of the first metric here.")] = None,
    html_out: Annotated[
        Path | None, typer.Option("--html", help="Also write one self-contained HTML page (curves, config diff).")
    ] = None,
) -> None:
    """Print the runs of an MLflow experiment side by side (config differences, metrics, steps, time, status)."""
    from rlstages.tasks.driver.tracking import DEFAULT_URI, compare_link, experiment_id, experiment_runs

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    metrics = metric or ["reward/mean", "eval/reward_mean"]
    try:
        check_output_file(png, "--png")
        check_output_file(html_out, "--html")
        check_store_exists(uri)
        exp_id, exp_name = experiment_id(uri, experiment)
        runs = experiment_runs(uri, exp_id, max_runs, filter_string)
    except Exception as exc:  # noqa: BLE001 - one line for a bad URI, experiment or filter
        _fail(str(exc), 2)
    if not runs:
        err.print(f"experiment {exp_name!r} has no runs" + (f" matching {filter_string!r}" if filter_string else ""))
        raise typer.Exit(1)
    if metric:
        known = sorted({k for r in runs for k in r.latest})
        unknown = [m for m in metric if m not in known]
        if unknown:
            _fail(f"--metric {unknown[0]!r}: no run of {exp_name!r} logged it; metrics: {', '.join(known[:30])}", 2)
    table = compare_table(uri, runs, metrics, maximize=not minimize)
    table.title = f"experiment {exp_name} ({uri})"
    out.print(table)
    link = compare_link(uri, exp_id, [r.run_id for r in runs])
    if link:
        out.print(f"MLflow UI: {link}", highlight=False, soft_wrap=True)
    if png is not None:
        out.print(f"curves of {metrics[0]}: {plot_curves(uri, runs, metrics[0], png)}", highlight=False)
    if html_out is not None:
        html_out.parent.mkdir(parents=True, exist_ok=True)
        html_out.write_text(html_report(uri, exp_name, runs, metrics), encoding="utf-8")
        out.print(f"report: {html_out}", highlight=False)
