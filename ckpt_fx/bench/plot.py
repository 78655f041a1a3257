"""plot: the bench's rows drawn as peak memory against step time, with the Pareto front."""

from __future__ import annotations

from ckpt_fx.bench.table import Row


def require_matplotlib() -> None:
    """Raise a ValueError naming the extra when matplotlib is missing (checked before any setup runs)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'ckpt-fx[plot]'")


def plot(rows: list[Row], path: str, *, title: str = "") -> None:
    """Peak memory (MB) against step time (ms), one labelled point per setup, each budget line
    (ours, torch's knob) drawn through its points and the Pareto front (no other setup both
    smaller and faster) drawn through; the ratios to the first setup on the opposite axes; failed
    setups listed under the plot. Saved as an image at `path`. Needs matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.error is None]
    failed = [r for r in rows if r.error is not None]
    front = pareto_front(done)
    ms = lambda r: 1e3 * r.step_s  # noqa: E731
    fig, ax = plt.subplots(figsize=(9, 6 + 0.22 * len(failed)))
    for r in done:
        ax.scatter(ms(r), r.peak_mb, color="tab:red" if r in front else "tab:gray", zorder=3)
    lines: dict[str, list[Row]] = {}
    for r in done:
        head, sep, _ = r.setup.rpartition("budget:")
        if sep:
            lines.setdefault(head + "budget", []).append(r)
    for name, members in lines.items():
        if len(members) < 2:
            continue
        members = sorted(members, key=lambda r: r.peak_mb)
        ax.plot([ms(r) for r in members], [r.peak_mb for r in members], alpha=0.6,
                linestyle="--" if members[0].ours else ":", label=name)
    ordered = sorted(front, key=lambda r: r.step_s)
    ax.step([ms(r) for r in ordered], [r.peak_mb for r in ordered], where="post", color="tab:red", label="Pareto front")
    ref = rows[0] if rows and rows[0].error is None else None
    if ref is not None:  # ratios to the first setup on the top and right axes
        t0, m0 = ms(ref), ref.peak_mb
        ax.secondary_xaxis("top", functions=(lambda x: x / t0, lambda x: x * t0)).set_xlabel(f"step time / {ref.setup}'s")
        ax.secondary_yaxis("right", functions=(lambda y: y / m0, lambda y: y * m0)).set_ylabel(f"peak / {ref.setup}'s")
    ax.set_xlabel("step time (ms, median)")
    ax.set_ylabel("measured peak (MB)")
    fig.suptitle(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if failed:
        fig.text(0.01, 0.01, "failed: " + "\n        ".join(f"{r.setup}: {r.error}"[:110] for r in failed),
                 fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.03 * len(failed), 1, 1))
    _label_points(fig, ax, [(r.setup, ms(r), r.peak_mb) for r in done])
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label_points(fig, ax, points: list[tuple[str, float, float]]) -> list:
    """Label each point beside it where the label overlaps no label placed before it nor another
    point and stays inside the axes: the first free one of 32 positions beside it, nearest first
    (far ones with a line back to the point), else the least crowded of them. Returns the labels' boxes (display coordinates), in order."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig.canvas.draw()  # the axes' limits are settled at a draw: the points' places are final
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)  # a label inside the axes is not cut off
    offsets = [(dx, dy) for k in range(8) for dy in (3 + 8 * k, -9 - 8 * k) for dx in (5, -5)]
    marks = [Bbox.from_bounds(*(ax.transData.transform((x, y)) - 5), 10, 10) for _, x, y in points]
    taken: list = []
    for label, x, y in points:
        best = None
        for dx, dy in offsets:
            far = abs(dy) > 12  # a thin line back to its point
            text = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                               ha="left" if dx > 0 else "right",
                               arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if far else None)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer).expanded(1.02, 1.1)  # the text, not its line
            outside = not (frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1)
            clash = sum(box.overlaps(t) for t in taken) + sum(box.overlaps(m) for m in marks) + outside
            if best is None or clash < best[0]:
                if best is not None:
                    best[1].remove()
                best = (clash, text, box)
            else:
                text.remove()
            if clash == 0:
                break
        taken.append(best[2])
    return taken


def pareto_front(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both peak and step time."""
    return [r for r in rows if not any(
        o is not r and o.peak_mb <= r.peak_mb and o.step_s <= r.step_s and (o.peak_mb < r.peak_mb or o.step_s < r.step_s)
        for o in rows)]
