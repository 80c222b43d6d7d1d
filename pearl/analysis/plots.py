"""The report's figures: PNG files drawn with matplotlib's Agg canvas (headless).

Matplotlib is imported here and in ``sweep_plots`` (``pearl sweep``'s figure), nowhere
else in ``analysis`` (it is the ``analysis`` extra); figures are plain ``Figure``
objects on an Agg canvas, never ``pyplot``'s global state, so drawing needs no display
and leaks no figures. Every function draws one figure of one run (or of several runs,
``compare_*``) into ``path`` and returns it; a run without the records a figure needs
gets a figure that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pearl.analysis.runs import RunAnalysis
from pearl.analysis.timeline import ROLES, Segment

ROLE_COLOURS = {
    "train": "#4c72b0",
    "colocated": "#55a868",
    "prefill": "#dd8452",
    "decode": "#c44e52",
    "idle": "#d0d0d0",
}
DPI = 100
MAX_LABELS = 80  # GPU rows labelled on the timeline; more rows get every n-th label
MAX_BARS = 150  # throughput bins drawn; finer bins are merged


def _rebinned(run: RunAnalysis) -> tuple[list[float], float, list[int], list[int]]:
    """The run's throughput bins merged to at most ``MAX_BARS``: starts, width, counts."""
    starts, traj, tokens = run.throughput.series(run.end_t)
    base_s = run.throughput.bin_s
    k = max(1, -(-len(starts) // MAX_BARS))
    merged = range(0, len(starts), k)
    return (
        [starts[i] for i in merged],
        base_s * k,
        [sum(traj[i : i + k]) for i in merged],
        [sum(tokens[i : i + k]) for i in merged],
    )


def save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)  # the Agg canvas: no display, no pyplot state
    fig.savefig(path, dpi=DPI)
    return path


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _bars(ax: Axes, rows: Sequence[tuple[float, float, float]], **kw: object) -> None:
    """Horizontal bars (row, start, end) as one collection: fast for many segments."""
    verts = [[(s, y - 0.4), (e, y - 0.4), (e, y + 0.4), (s, y + 0.4)] for y, s, e in rows]
    if verts:
        ax.add_collection(PolyCollection(verts, **kw))  # type: ignore[arg-type]


def gpu_timeline(run: RunAnalysis, path: Path) -> Path:
    """A Gantt chart of every GPU's role; hatched while borrowed, x where preempted."""
    end_t = run.end_t
    if run.timeline.exact:
        return _gpu_gantt(run.timeline.all_segments(end_t), run, path)
    return _control_gantt(run, path)


def gantt_rows(segments: list[Segment]) -> tuple[dict[str, int], list[str]]:
    """A row per base GPU (by id); elastic GPUs, which come and go, share rows: each
    takes the lowest row free since the previous holder left (a GPU per row at a time)."""
    life: dict[str, list[float]] = {}
    elastic: set[str] = set()
    for s in segments:
        span = life.setdefault(s.gpu_id, [s.start_t, s.end_t])
        span[0], span[1] = min(span[0], s.start_t), max(span[1], s.end_t)
        if s.source == "elastic":
            elastic.add(s.gpu_id)
    fixed = sorted(g for g in life if g not in elastic)
    row = {g: i for i, g in enumerate(fixed)}
    labels = list(fixed)
    free_at: list[float] = []  # per elastic row: when its last GPU left
    for g in sorted(elastic, key=lambda g: (life[g][0], g)):
        k = next((k for k, t in enumerate(free_at) if t <= life[g][0]), len(free_at))
        if k == len(free_at):
            free_at.append(0.0)
            labels.append(f"elastic {k + 1}")
        free_at[k] = life[g][1]
        row[g] = len(fixed) + k
    return row, labels


def _gpu_gantt(segments: list[Segment], run: RunAnalysis, path: Path) -> Path:
    row, gpus = gantt_rows(segments)
    fig = Figure(figsize=(11, min(30.0, max(3.0, 0.16 * len(gpus) + 1.5))))
    ax = fig.add_subplot()
    groups: dict[tuple[str, bool, bool], list[tuple[float, float, float]]] = {}
    for s in segments:
        key = (s.role, s.phase == "ready", s.borrowed)
        groups.setdefault(key, []).append((row[s.gpu_id], s.start_t, s.end_t))
    for (role, ready, borrowed), bars in groups.items():
        _bars(
            ax,
            bars,
            facecolors=ROLE_COLOURS.get(role, "#999999"),
            alpha=1.0 if ready else 0.45,
            hatch="///" if borrowed else None,
            edgecolors="black" if borrowed else "none",
            linewidths=0.3,
        )
    marks = {"preempted": ("x", "black"), "returned": ("<", "navy"), "lent": (">", "navy")}
    for kind, (marker, colour) in marks.items():
        pts = [
            (m.t, row[m.gpu_id]) for m in run.timeline.markers if m.kind == kind and m.gpu_id in row
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, marker=marker, color=colour, s=18, zorder=3)
    every = max(1, -(-len(gpus) // MAX_LABELS))
    ax.set_yticks(range(0, len(gpus), every))
    ax.set_yticklabels(gpus[::every], fontsize=6)
    ax.set_ylim(-0.6, len(gpus) - 0.4)
    ax.set_xlim(0, max(run.end_t, 1e-9))
    ax.invert_yaxis()
    ax.set_xlabel("run time (s)")
    handles = [Patch(color=ROLE_COLOURS[r], label=r) for r in ROLES]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="borrowed"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=3)
    ax.set_title(f"{run.log.name}: GPU roles (pale: starting/switching/draining)")
    fig.tight_layout()
    return save(fig, path)


def _control_gantt(run: RunAnalysis, path: Path) -> Path:
    """Without GPU records: borrow windows and elastic allocations as rows."""
    labels: list[str] = []
    held: list[tuple[float, float, float]] = []
    waiting: list[tuple[float, float, float]] = []
    closing: list[tuple[float, float, float]] = []
    ends: list[tuple[float, float]] = []
    end_t = run.end_t
    for k, w in enumerate(run.borrow.windows):
        y = float(len(labels))
        labels.append(f"lent #{k + 1} ({w.gpus} trainer GPUs)")
        back_t = w.returned_t if w.returned_t is not None else end_t
        held.append((y, w.lent_t, w.return_t if w.return_t is not None else back_t))
        if w.return_t is not None:
            closing.append((y, w.return_t, back_t))
    for a in run.elastic.allocations.values():
        y = float(len(labels))
        labels.append(f"{a.allocation_id} ({a.num_gpus} elastic GPUs)")
        if a.requested_t is not None:
            waiting.append((y, a.requested_t, a.granted_t or a.held_until(end_t)))
        if a.granted_t is not None:
            stop_t = a.held_until(end_t)
            notice_t = a.preempting_t if a.preempting_t is not None else stop_t
            held.append((y, a.granted_t, notice_t))
            closing.append((y, notice_t, stop_t))
            if a.end_status == "ended":
                ends.append((stop_t, y))
    fig = Figure(figsize=(11, min(30.0, max(3.0, 0.22 * len(labels) + 1.5))))
    ax = fig.add_subplot()
    if not labels:
        _empty(ax, "no GPU, borrow or allocation records in this log")
    else:
        _bars(ax, waiting, facecolors="#d0d0d0")
        _bars(ax, held, facecolors=ROLE_COLOURS["colocated"])
        _bars(ax, closing, facecolors="#f0a030")
        if ends:
            xs, ys = zip(*ends, strict=True)
            ax.scatter(xs, ys, marker="x", color="black", s=25, zorder=3)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_ylim(-0.6, len(labels) - 0.4)
        ax.set_xlim(0, max(end_t, 1e-9))
        ax.invert_yaxis()
        ax.set_xlabel("run time (s)")
        handles = [
            Patch(color="#d0d0d0", label="requested, waiting"),
            Patch(color=ROLE_COLOURS["colocated"], label="lent / granted"),
            Patch(color="#f0a030", label="returning / preempting"),
        ]
        ax.legend(handles=handles, loc="upper right", fontsize=7)
    ax.set_title(f"{run.log.name}: borrowed and elastic GPUs (the log has no GPU records)")
    fig.tight_layout()
    return save(fig, path)


def throughput(run: RunAnalysis, path: Path) -> Path:
    """Trajectories per minute, generated tokens per second and training steps."""
    starts, bin_s, traj, tokens = _rebinned(run)
    fig = Figure(figsize=(11, 7))
    a1, a2, a3 = fig.subplots(3, 1, sharex=True)
    a1.bar(starts, [n * 60.0 / bin_s for n in traj], width=bin_s, align="edge", color="#55a868")
    a1.set_ylabel("trajectories / min")
    rate = [n / bin_s for n in tokens]
    a2.step([*starts, starts[-1] + bin_s], [*rate, rate[-1]], where="post", color="#4c72b0")
    a2.set_ylabel("tokens / s")
    steps = run.training.steps
    if steps:
        a3.step([0.0] + [t for t, *_ in steps], range(len(steps) + 1), where="post")
        for t, _, started_t, _ in steps:
            a3.axvspan(started_t, t, color="#4c72b0", alpha=0.15)
    a3.set_ylabel("train steps")
    a3.set_xlabel("run time (s)")
    a3.set_xlim(0, max(run.end_t, 1e-9))
    a1.set_title(f"{run.log.name}: rollout throughput and training (shaded: updates)")
    fig.tight_layout()
    return save(fig, path)


def pd_modes(run: RunAnalysis, path: Path) -> Path:
    """Instances by role over time (P, D, C) and every transition, shaded."""
    run.pd.finish()
    pts = run.pd.points
    fig = Figure(figsize=(11, 4))
    ax = fig.add_subplot()
    if not pts:
        _empty(ax, "no decision records")
    else:
        ts = [p.t for p in pts] + [run.end_t]
        for attr, label, colour in (
            ("prefill", "P (prefill)", ROLE_COLOURS["prefill"]),
            ("decode", "D (decode)", ROLE_COLOURS["decode"]),
            ("colocated", "C (colocated)", ROLE_COLOURS["colocated"]),
        ):
            ys = [getattr(p, attr) for p in pts]
            if any(ys):
                ax.step(ts, [*ys, ys[-1]], where="post", label=label, color=colour)
        for tr in run.pd.transitions:
            end = tr.end_t if tr.end_t is not None else tr.t
            ax.axvspan(tr.t, max(end, tr.t + 1e-6), color="grey", alpha=0.25)
        ax.set_xlim(0, max(run.end_t, 1e-9))
        ax.set_ylabel("instances")
        ax.set_xlabel("run time (s)")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{run.log.name}: PD configuration (grey: transitions, decision to last step)")
    fig.tight_layout()
    return save(fig, path)


def batches(run: RunAnalysis, path: Path) -> Path:
    """Predicted against actual batch completion time."""
    fig = Figure(figsize=(11, 4))
    a1, a2 = fig.subplots(1, 2)
    done = run.batches.done
    if not done:
        _empty(a1, "no batch completed")
        _empty(a2, "no batch completed")
    else:
        ids = [b for b, *_ in done]
        a1.plot(ids, [t - s for _, s, t, _ in done], "o-", label="actual")
        pred = [(b, p) for b, _, _, p in done if p is not None]
        if pred:
            a1.plot(*zip(*pred, strict=True), "s--", label="predicted")
        a1.set_xlabel("batch")
        a1.set_ylabel("completion time (s)")
        a1.legend(fontsize=8)
        pairs = run.batches.pairs()
        if pairs:
            p, a = zip(*pairs, strict=True)
            a2.scatter(a, p, s=14)
            hi = max(*p, *a)
            a2.plot([0, hi], [0, hi], color="grey", lw=0.8)
            a2.set_xlabel("actual (s)")
            a2.set_ylabel("predicted (s)")
        else:
            _empty(a2, "no batch had a prediction")
    fig.suptitle(f"{run.log.name}: batch completion, predicted against actual")
    fig.tight_layout()
    return save(fig, path)


def _held_series(intervals: list[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    deltas: dict[float, int] = {}
    for start, end, n in intervals:
        deltas[start] = deltas.get(start, 0) + n
        deltas[end] = deltas.get(end, 0) - n
    ts, ys, level = [0.0], [0], 0
    for t in sorted(deltas):
        level += deltas[t]
        ts.append(t)
        ys.append(level)
    return ts, ys


def borrow_elastic(run: RunAnalysis, path: Path) -> Path:
    """GPUs lent and elastic GPUs held over time; the trainer's waits against the limit."""
    end_t = run.end_t
    fig = Figure(figsize=(11, 6))
    a1, a2 = fig.subplots(2, 1, sharex=True)
    lent = [
        (w.lent_t, w.returned_t if w.returned_t is not None else end_t, w.gpus)
        for w in run.borrow.windows
    ]
    held = [
        (a.granted_t, a.held_until(end_t), a.num_gpus)
        for a in run.elastic.allocations.values()
        if a.granted_t is not None
    ]
    for series, label, colour in (
        (lent, "lent trainer GPUs", "#4c72b0"),
        (held, "elastic GPUs held", "#55a868"),
    ):
        ts, ys = _held_series(series)
        a1.step([*ts, end_t], [*ys, ys[-1]], where="post", label=label, color=colour)
    for a in run.elastic.allocations.values():
        if a.end_status == "ended" and a.end_t is not None:
            a1.axvline(a.end_t, color="black", lw=0.6, ls=":")
    a1.set_ylabel("GPUs")
    a1.legend(fontsize=8, loc="upper right")
    a1.set_title(f"{run.log.name}: borrowed and elastic GPUs (dotted: preemptions)")
    steps = run.training.steps
    if steps:
        a2.bar([started for _, _, started, _ in steps], [w for *_, w in steps], width=end_t / 200)
    limit = run.max_return_delay_s
    if limit is not None:
        a2.axhline(limit, color="red", lw=0.8, label=f"max_return_delay_s = {limit:g}")
        a2.legend(fontsize=8)
    a2.set_ylabel("trainer wait (s)")
    a2.set_xlabel("run time (s)")
    a2.set_xlim(0, max(end_t, 1e-9))
    fig.tight_layout()
    return save(fig, path)


def compare_throughput(runs: Sequence[RunAnalysis], path: Path) -> Path:
    """Several runs overlaid: cumulative trajectories and trajectories per minute."""
    fig = Figure(figsize=(11, 7))
    a1, a2 = fig.subplots(2, 1, sharex=True)
    for run in runs:
        starts, bin_s, traj, _ = _rebinned(run)
        total, cumulative = 0, []
        for n in traj:
            total += n
            cumulative.append(total)
        ends = [s + bin_s for s in starts]
        a1.plot([0.0, *ends], [0, *cumulative], label=run.log.name)
        rate = [n * 60.0 / bin_s for n in traj]
        a2.step(ends, rate, where="pre", label=run.log.name)
    a1.set_ylabel("trajectories finished")
    a1.legend(fontsize=8)
    a2.set_ylabel("trajectories / min")
    a2.set_xlabel("run time (s)")
    a1.set_title("runs compared")
    fig.tight_layout()
    return save(fig, path)


def compare_gpu_hours(
    runs: Sequence[RunAnalysis], rows: Sequence[dict[str, Any]], path: Path
) -> Path:
    """Throughput and GPU-hours by source, one group of bars per run."""
    fig = Figure(figsize=(11, 4))
    a1, a2 = fig.subplots(1, 2)
    names = [run.log.name for run in runs]
    xs = list(range(len(names)))
    a1.bar(xs, [float(r.get("throughput_traj_per_h") or 0.0) for r in rows])
    a1.set_ylabel("trajectories / h")
    for k, key in enumerate(("base_gpu_hours", "borrowed_gpu_hours", "elastic_gpu_hours")):
        vals = [float(r.get(key) or 0.0) for r in rows]
        a2.bar([x + 0.27 * (k - 1) for x in xs], vals, width=0.27, label=key.split("_")[0])
    a2.set_ylabel("GPU-hours")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    return save(fig, path)
