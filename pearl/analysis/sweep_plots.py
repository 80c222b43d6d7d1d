"""The figure of ``pearl sweep``: each policy's throughput across the grid (top) and
pearl's ratio to each baseline (bottom, with the line of parity). One x position per
grid point, labelled with its values; drawn on an Agg canvas as ``plots`` draws."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pearl.analysis.plots import save

MAX_TICK_LABELS = 40  # grid points labelled; more get every n-th label


def sweep_figure(result: dict[str, Any], path: Path) -> Path:
    rows = result["points"]
    fields = list(result["axes"])
    x = list(range(len(rows)))
    ticks = [", ".join(str(r["point"][f]) for f in fields) for r in rows]
    fig = Figure(figsize=(max(6.0, 0.5 * len(rows) + 3.0), 7.0))
    top, bottom = fig.subplots(2, 1, sharex=True)
    policies = [n for n in rows[0]["policies"] if n != "oracle"]
    for name in policies:
        tph = [r["policies"][name]["throughput_traj_per_h"] for r in rows]
        top.plot(x, tph, marker="o", label=name, linewidth=2.0 if name == "pearl" else 1.0)
    top.set_ylabel("trajectories / h")
    top.set_title(f"{Path(result['scenario']).stem}: {', '.join(fields)}")
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    for name in rows[0]["ratios"]:
        bottom.plot(x, [r["ratios"][name] for r in rows], marker="o", label=f"pearl / {name}")
    bottom.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    bottom.set_ylabel("pearl's ratio")
    bottom.legend(fontsize="small")
    bottom.grid(alpha=0.3)
    every = max(1, -(-len(rows) // MAX_TICK_LABELS))
    bottom.set_xticks(x[::every], ticks[::every], rotation=45, ha="right", fontsize="small")
    bottom.set_xlabel(", ".join(fields))
    fig.tight_layout()
    return save(fig, path)
