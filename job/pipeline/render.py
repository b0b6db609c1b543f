"""The rank x time picture of a schedule, as text and as a PNG (matplotlib, Agg backend).

Both are drawn from :func:`~shardline.job.pipeline.simulate.simulate`'s timeline, so what is shown is the
timing the simulator predicts, with idle time (the bubble) left blank.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import ScheduleError
from .actions import ActionKind, Schedule
from .simulate import SimulationResult, simulate


def render_text(schedule: Schedule, result: SimulationResult, *, columns_per_unit: int = 1) -> str:
    """One row per rank, one column per time unit: the compute action running then, ``.`` when idle.

    A cell is labelled by the action's token (``F3``, or ``F3@5`` with chunks); an action longer than one unit
    repeats its label. Times are rounded to the column grid.
    """
    with_stage = schedule.n_chunks > 1
    width = max([len(t.action.token(with_stage=with_stage)) for t in result.timeline] + [1])
    n_cols = math.ceil(result.makespan * columns_per_unit - 1e-9)
    grid = [["." * width] * n_cols for _ in range(schedule.n_ranks)]
    for item in result.timeline:
        label = item.action.token(with_stage=with_stage).ljust(width)
        for col in range(round(item.start * columns_per_unit), round(item.end * columns_per_unit)):
            grid[item.rank][col] = label
    header = (f"{schedule.name}: p={schedule.n_ranks} m={schedule.n_microbatches} v={schedule.n_chunks} "
              f"makespan={result.makespan:g} bubble={result.bubble_fraction:.3f}")
    rows = [f"r{rank:<3}|" + "|".join(cells) + "|" for rank, cells in enumerate(grid)]
    return "\n".join([header, *rows]) + "\n"


def render_png(schedule: Schedule, result: SimulationResult, path: str | Path) -> Path:
    """Draw the timeline as a Gantt chart: forwards in blue, backwards in orange, chunks darker per chunk."""
    import matplotlib

    matplotlib.use("Agg")  # never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    colors = {ActionKind.FORWARD: (0.2, 0.45, 0.8), ActionKind.BACKWARD: (0.95, 0.55, 0.15),
              ActionKind.WEIGHT: (0.3, 0.7, 0.3)}
    fig_w = min(40.0, 2.0 + 0.35 * result.makespan)
    fig, ax = plt.subplots(figsize=(fig_w, 0.5 + 0.45 * schedule.n_ranks))
    for item in result.timeline:
        chunk = item.action.stage // schedule.n_ranks
        shade = 1.0 - 0.5 * chunk / max(1, schedule.n_chunks - 1) if schedule.n_chunks > 1 else 1.0
        color = tuple(c * shade for c in colors[item.action.kind])
        ax.barh(item.rank, item.end - item.start, left=item.start, color=color, edgecolor="black", linewidth=0.4)
        if result.makespan <= 120:
            ax.text((item.start + item.end) / 2, item.rank, str(item.action.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(schedule.n_ranks), [f"rank {r}" for r in range(schedule.n_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_xlim(0, result.makespan)
    ax.set_title(f"{schedule.name}  p={schedule.n_ranks} m={schedule.n_microbatches} v={schedule.n_chunks}  "
                 f"bubble {result.bubble_fraction:.3f}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(schedule: Schedule, *, path: str | Path | None = None, t_forward: float = 1.0,
           t_backward: float = 2.0, t_comm: float = 0.0) -> str:
    """Simulate ``schedule`` and return its text grid; also write the PNG to ``path`` when given."""
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"render expects a Schedule, got {type(schedule).__name__}")
    result = simulate(schedule, t_forward=t_forward, t_backward=t_backward, t_comm=t_comm)
    if path is not None:
        render_png(schedule, result, path)
    return render_text(schedule, result)
