"""The analysis report: PNG plots, ``report.md``, ``report.html`` and ``summary.json``.

``analyze`` finds the run logs (``pearl.analysis.runs``), analyses each in one streaming pass,
draws the plots (``pearl.analysis.plots``), and writes a report whose images are embedded as
base64 data URIs, so ``report.md`` and ``report.html`` are each self-contained. With an
``sacct`` file the report has a Slurm accounting section (``pearl.analysis.accounting``).

Runnable: ``python analysis/report.py RUN_DIR [RUN_DIR ...] [--out DIR] [--json]``
(the same as ``pearl analyze``). A missing or empty input exits with status 2 and one
line on stderr.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl.analysis.runs import RunAnalysis, analyze_log, find_run_logs
from pearl.io.documents import InputError
from pearl.io.extras import require

SUMMARY_VERSION = 1
MAX_TRANSITION_ROWS = 30


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    path: Path
    alt: str


Block = Heading | Para | Table | Image


def fmt(value: Any) -> str:
    """A number for a table: ``-`` for none, 4 significant digits for floats."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def comparison_row(s: dict[str, Any]) -> dict[str, Any]:
    """One run's headline figures (the comparison table and ``summary.json``)."""
    src = s["gpu_hours"]["by_source"]
    return {
        "run": s["name"],
        "policy": s["run"]["policy"],
        "seed": s["run"]["seed"],
        "duration_s": s["run"]["duration_s"],
        "trajectories": s["throughput"]["trajectories"],
        "throughput_traj_per_h": s["throughput"]["throughput_traj_per_h"],
        "tokens_per_s": s["throughput"]["tokens_per_s"],
        "train_steps": s["training"]["train_steps"],
        "transitions": s["pd"]["transitions"],
        "base_gpu_hours": src["base"],
        "borrowed_gpu_hours": src["borrowed"],
        "elastic_gpu_hours": src["elastic"],
        "utilisation": s["gpu_hours"]["utilisation"],
        "batch_mean_s": s["batches"]["batch_time_s"]["mean"],
        "consumed": s["rollout"]["consumed"],
        "off_policy_share": s["rollout"]["off_policy_share"],
        "wasted_tokens": s["rollout"]["wasted_tokens"],
        "prediction_mape": s["batches"]["prediction"]["mape"],
        "max_trainer_wait_s": s["borrow"]["trainer_wait"]["max_s"],
        "skipped_lines": s["read"]["skipped"],
    }


ROLLOUT_COLUMNS = (
    "run",
    "turns",
    "finished",
    "lost",
    "output_tokens_per_s",
    "model_turn_p50_s",
    "model_turn_p99_s",
    "tool_p50_s",
    "tool_p99_s",
    "mean_reward",
)


def rollout_row(s: dict[str, Any]) -> dict[str, Any]:
    """One run's rollout headline (``pearl analyze``'s console table); ``s`` has a
    ``rollout_turns`` section."""
    r = s["rollout_turns"]
    values = (
        s["name"],
        r["turns"],
        r["trajectories_finished"],
        r["trajectories_lost"],
        r["output_tokens_per_s"],
        r["model_turn_s"]["p50"],
        r["model_turn_s"]["p99"],
        r["tool_s"]["p50"],
        r["tool_s"]["p99"],
        r["mean_reward"],
    )
    return dict(zip(ROLLOUT_COLUMNS, values, strict=True))


def _table(rows: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> Table:
    keys = list(keys if keys is not None else (rows[0] if rows else {}))
    return Table(tuple(keys), tuple(tuple(fmt(r.get(k)) for k in keys) for r in rows))


def _kv(pairs: dict[str, Any]) -> Table:
    return Table(("figure", "value"), tuple((k, fmt(v)) for k, v in pairs.items()))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def _run_blocks(run: RunAnalysis, s: dict[str, Any], plots: dict[str, Path]) -> list[Block]:
    info, read = s["run"], s["read"]
    blocks: list[Block] = [
        Heading(2, f"Run {s['name']}"),
        Para(
            f"`{s['path']}`: {info['source'] or '?'} run `{info['run_id'] or '?'}`, policy "
            f"{info['policy'] or '?'}, scenario {info['scenario'] or '?'}, seed "
            f"{fmt(info['seed'])}, {fmt(info['duration_s'])} s"
            + ("" if info["ended"] else " (no run_ended record)")
            + "."
        ),
        Para(
            f"Read {read['lines']} lines: {read['records']} records used, {read['skipped']} "
            f"skipped ({read['malformed']} malformed or truncated, {read['unknown_type']} "
            f"of unknown type, {read['other_version']} of another schema version, "
            f"{read['invalid']} invalid)."
        ),
    ]
    blocks += [Para(f"Note: {n}.") for n in s["notes"]]
    blocks += [Heading(3, "GPU roles over time"), Image(plots["gpu-timeline"], "GPU timeline")]
    blocks += [Heading(3, "Throughput and training"), Image(plots["throughput"], "throughput")]
    blocks.append(_kv({**_flat(s["throughput"]), **_flat(s["training"])}))
    if "rollout_turns" in s:  # a rollout manager's log (pearl.analysis.turns)
        blocks += [Heading(3, "Rollout: turns, tokens/s, tool latencies")]
        blocks += [_kv(_flat(s["rollout_turns"]))]
    blocks += [Heading(3, "Consumption and the staleness bound"), _kv(_flat(s["rollout"]))]
    blocks += [Heading(3, "GPU-hours and utilisation"), _kv(_flat(s["gpu_hours"]))]
    pd = s["pd"]
    blocks += [Heading(3, "PD mode and P:D ratio"), Image(plots["pd"], "PD configuration")]
    blocks.append(_kv(_flat(pd)))
    if pd["transition_list"]:
        keys = ["t", "from", "to", "reason", "predicted_s", "measured_s", "steps_done"]
        shown = pd["transition_list"][:MAX_TRANSITION_ROWS]
        blocks.append(_table(shown, keys))
        if pd["transitions"] > len(shown):
            blocks.append(Para(f"({pd['transitions'] - len(shown)} more in summary.json.)"))
    blocks += [
        Heading(3, "Predicted against actual batch completion"),
        Image(plots["batches"], "batches"),
        _kv(_flat(s["batches"])),
        Heading(3, "Borrow windows, the trainer's wait, elastic GPUs"),
        Image(plots["borrow-elastic"], "borrow and elastic"),
        _kv(_flat(s["borrow"])),
        _kv(_flat(s["elastic"])),
    ]
    return blocks


def build_blocks(
    runs: Sequence[RunAnalysis],
    summaries: Sequence[dict[str, Any]],
    plots: Sequence[dict[str, Path]],
    compare: dict[str, Path],
    accounting: dict[str, Any] | None,
) -> list[Block]:
    rows = [comparison_row(s) for s in summaries]
    skipped = sum(s["read"]["skipped"] for s in summaries)
    blocks: list[Block] = [
        Heading(1, "pearl run analysis"),
        Para(f"{len(runs)} run log(s); {skipped} line(s) skipped in all (see each run)."),
        Heading(2, "Runs compared"),
        _table(rows),
    ]
    blocks += [Image(p, name) for name, p in compare.items()]
    if accounting is not None:
        blocks += [Heading(2, "Slurm accounting"), _kv(_flat(accounting))]
    for run, s, p in zip(runs, summaries, plots, strict=True):
        blocks += _run_blocks(run, s, p)
    return blocks


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            out[-1] += "\n|" + "---|" * len(b.header)
            out[-1] += "".join(
                "\n| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows
            )
        else:
            out.append(f"![{b.alt}]({_data_uri(b.path)})")
    return "\n\n".join(out) + "\n"


def render_html(blocks: Sequence[Block]) -> str:
    e = html.escape
    out = [
        "<!doctype html>",
        '<html><head><meta charset="utf-8"><title>pearl run analysis</title>',
        "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}"
        "table{border-collapse:collapse;font-size:12px;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
        "img{max-width:100%}</style></head><body>",
    ]
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p>{e(b.text)}</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{e(h)}</th>" for h in b.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in b.rows
            )
            out.append(f"<table><tr>{head}</tr>{body}</table>")
        else:
            out.append(f'<img alt="{e(b.alt)}" src="{_data_uri(b.path)}">')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def draw_plots(
    runs: Sequence[RunAnalysis], rows: Sequence[dict[str, Any]], out: Path
) -> tuple[list[dict[str, Path]], dict[str, Path]]:
    """Every run's plots, and the comparison plots when there are several runs."""
    require("matplotlib")
    from pearl.analysis import plots as P

    per_run: list[dict[str, Path]] = []
    for run in runs:
        stem = _slug(run.log.name)
        per_run.append(
            {
                "gpu-timeline": P.gpu_timeline(run, out / f"{stem}-gpu-timeline.png"),
                "throughput": P.throughput(run, out / f"{stem}-throughput.png"),
                "pd": P.pd_modes(run, out / f"{stem}-pd.png"),
                "batches": P.batches(run, out / f"{stem}-batches.png"),
                "borrow-elastic": P.borrow_elastic(run, out / f"{stem}-borrow-elastic.png"),
            }
        )
    compare: dict[str, Path] = {}
    if len(runs) > 1:
        compare["compare-throughput"] = P.compare_throughput(runs, out / "compare-throughput.png")
        compare["compare-gpu-hours"] = P.compare_gpu_hours(
            runs, rows, out / "compare-gpu-hours.png"
        )
    return per_run, compare


def load_accounting(path: Path) -> dict[str, Any]:
    """The accounting section from an ``sacct`` output file (``pearl.analysis.accounting``)."""
    from pearl.analysis.accounting import parse_sacct, summarize

    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise InputError(path, "", f"cannot read: {err.__class__.__name__}") from None
    try:
        return dict(summarize(parse_sacct(text, str(path))))
    except ValueError as err:  # no usable header: not sacct output
        raise InputError(path, "", str(err)) from None


def query_accounting(runs: Sequence[RunAnalysis]) -> dict[str, Any]:
    """Ask Slurm (``sacct``) about the jobs of the coordinator runs among ``runs``: those
    named after the run and the coordinator's own (``run.json``'s ``slurm_job_ids``)."""
    from pearl.analysis.accounting import SacctUnavailable, parse_sacct, query_sacct, summarize

    texts = []
    for run in runs:
        started = run.info.started
        if started is None or started.source != "coordinator":
            continue
        meta = run.log.path.parent / "run.json"
        try:
            job_ids = list(json.loads(meta.read_text(encoding="utf-8")).get("slurm_job_ids", []))
        except (OSError, ValueError):
            job_ids = []
        try:
            texts.append(query_sacct(started.run_id, job_ids))
        except SacctUnavailable as err:
            raise InputError("sacct", "", str(err)) from None
    if not texts:
        raise InputError("--sacct-query", "", "no coordinator run among the run logs")
    header, *_ = texts[0].splitlines() or [""]
    rows = [line for t in texts for line in t.splitlines()[1:] if line.strip()]
    return dict(summarize(parse_sacct("\n".join([header, *rows]), "sacct")))


def analyze(
    paths: Sequence[Path],
    out: Path,
    sacct: Path | None = None,
    max_return_delay_s: float | None = None,
    sacct_query: bool = False,
) -> dict[str, Any]:
    """Analyse the run logs under ``paths`` and write the report to ``out``; the Slurm
    accounting from ``sacct`` output in a file, or asked of Slurm (``sacct_query``)."""
    logs = find_run_logs(paths)
    runs = [analyze_log(log, max_return_delay_s) for log in logs]
    accounting = load_accounting(sacct) if sacct is not None else None
    if sacct_query and accounting is None:
        accounting = query_accounting(runs)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [run.summary() for run in runs]
    rows = [comparison_row(s) for s in summaries]
    plots, compare = draw_plots(runs, rows, out)
    summary: dict[str, Any] = {
        "version": SUMMARY_VERSION,
        "runs": summaries,
        "comparison": rows,
        "skipped_lines": sum(s["read"]["skipped"] for s in summaries),
        "plots": sorted(
            p.name for p in [*compare.values(), *(q for d in plots for q in d.values())]
        ),
    }
    if accounting is not None:
        summary["accounting"] = accounting
    blocks = build_blocks(runs, summaries, plots, compare, accounting)
    (out / "report.md").write_text(render_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(render_html(blocks), encoding="utf-8")
    text = json.dumps(summary, indent=2, allow_nan=False)
    (out / "summary.json").write_text(text + "\n", encoding="utf-8")
    return summary


def default_out(paths: Sequence[Path]) -> Path:
    """``FIRST/analysis`` for a directory, the file's folder's ``analysis`` for a file."""
    first = paths[0]
    return (first if first.is_dir() else first.parent) / "analysis"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="a run log, a run's directory, or a pearl simulate --out directory",
    )
    p.add_argument("--out", type=Path, default=None, help="report folder (FIRST/analysis)")
    p.add_argument("--json", action="store_true", help="print only summary.json to stdout")
    p.add_argument("--sacct", type=Path, default=None, help="sacct output for the accounting")
    p.add_argument(
        "--sacct-query",
        action="store_true",
        help="ask sacct about the coordinator runs' jobs (on a Slurm login node)",
    )
    p.add_argument(
        "--max-return-delay-s",
        type=float,
        default=None,
        help="the policy's borrowing.max_return_delay_s (default: run_started's, if logged)",
    )


def run(args: argparse.Namespace) -> int:
    paths: list[Path] = list(args.run_dirs)
    out = args.out if args.out is not None else default_out(paths)
    summary = analyze(paths, out, args.sacct, args.max_return_delay_s, args.sacct_query)
    if args.json:
        print(json.dumps(summary, allow_nan=False))
        return 0
    keys = ["run", "trajectories", "throughput_traj_per_h", "train_steps", "transitions"]
    print("  ".join(keys))
    for row in summary["comparison"]:
        print("  ".join(fmt(row[k]) for k in keys))
    rollouts = [r for r in summary["runs"] if "rollout_turns" in r]
    if rollouts:
        print()
        print("  ".join(ROLLOUT_COLUMNS))
        for r in rollouts:
            print("  ".join(fmt(v) for v in rollout_row(r).values()))
    if summary["skipped_lines"]:
        print(f"{summary['skipped_lines']} line(s) skipped (counted in the report)")
    print(f"report.md, report.html, summary.json and plots in {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python analysis/report.py", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except InputError as err:
        print(f"analysis: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
