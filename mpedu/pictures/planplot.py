"""The planner's picture: peak memory against step time, with the Pareto front, the cap and measured points."""
from __future__ import annotations


def plot_plans(plans, ax=None, measured=None):
    """Peak memory against step time for a planner's Plans: every simulated candidate (grey), the front
    (line), the best (star), the cap (dashed), and a Measurement's points beside their predictions when given."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ax.scatter([c.step_s * 1e3 for c in plans.simulated], [c.peak_bytes / 1e6 for c in plans.simulated],
               s=10, color="0.75", label="simulated candidates")
    ax.plot([c.step_s * 1e3 for c in plans.front], [c.peak_bytes / 1e6 for c in plans.front], "o-",
            color="C0", label="Pareto front (predicted)")
    if plans.best is not None:
        ax.plot([plans.best.step_s * 1e3], [plans.best.peak_bytes / 1e6], "*", color="C3", markersize=14,
                label=f"fastest that fits: {plans.best.label}")
    if plans.memory_cap:
        ax.axhline(plans.memory_cap / 1e6, color="C3", linestyle="--", linewidth=1, label="memory cap")
    if measured is not None:
        by_label = {(c.label, str(c.placement)): c for c in plans.simulated + plans.front}
        for r in measured.rows:
            c = by_label.get((r["label"], r["placement"]))
            if c is None:
                continue
            y = c.peak_bytes / 1e6
            ax.plot([r["predicted_s"] * 1e3, r["measured_s"] * 1e3], [y, y], color="C1", linewidth=1)
            ax.plot([r["measured_s"] * 1e3], [y], "s", color="C1", markersize=6)
        ax.plot([], [], "s-", color="C1", label="measured (same memory)")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("peak memory of the largest device (MB)")
    ax.legend(fontsize=8)
    return ax
