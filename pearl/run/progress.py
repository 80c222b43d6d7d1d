"""``pearl run``'s progress display (rich): one line per update, and a bar for the run.

A line: the step, the policy version it made, the batch's mean reward, the loss, the
rollout's output tokens per second since the previous update, how long the trainer waited
for its batch, the update's and the weight sync's times, the PD configuration serving, the
times the trainer's slot was lent since the previous update and the elastic engines
serving. On a terminal the bar stays at the bottom; elsewhere (CI, a pipe) the lines print
plainly and the bar does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


@dataclass(frozen=True)
class StepReport:
    step: int
    version: int
    reward_mean: float
    loss: float
    tokens_per_s: float  # rollout output tokens per second since the previous update
    batch_wait_s: float  # the trainer's wait for this batch
    train_s: float
    sync_s: float
    pd: str  # the PD configuration serving, e.g. "2C" (colocated) or "1P:1D"
    lent: int = 0  # times the trainer's devices were lent since the previous update
    elastic: int = 0  # engines serving on elastic slots at the update's end


COLUMNS = (
    *("step", "version", "reward", "loss", "tok/s", "wait s", "train s", "sync s"),
    *("PD", "lent", "elastic"),
)
WIDTHS = (5, 8, 7, 9, 7, 7, 8, 7, 14, 5, 8)  # every line's columns align


class RunDisplay:
    def __init__(self, steps: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]pearl run"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("starting", total=steps)

    def __enter__(self) -> RunDisplay:
        self.progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.stop()

    def note(self, text: str) -> None:
        self.progress.update(self.task, description=text)
        if not self.console.is_terminal:
            self.console.print(text)

    def step(self, r: StepReport) -> None:
        row = Table.grid(padding=(0, 2))
        for width in WIDTHS:
            row.add_column(justify="right", width=width)
        if r.step == 0:
            row.add_row(*COLUMNS, style="bold")
        row.add_row(
            str(r.step),
            str(r.version),
            f"{r.reward_mean:.3f}",
            f"{r.loss:+.4f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.batch_wait_s:.1f}",
            f"{r.train_s:.1f}",
            f"{r.sync_s:.2f}",
            r.pd,
            str(r.lent),
            str(r.elastic),
        )
        self.progress.console.print(row)
        self.progress.update(self.task, advance=1, description=f"reward {r.reward_mean:.3f}")
