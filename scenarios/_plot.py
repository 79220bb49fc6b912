"""The timeline plot: throughput and latency of the faulted run, with the faults marked."""

from __future__ import annotations

from pathlib import Path

from scenarios._report import Report

__all__ = ["plot_timeline"]

_COLORS = {"ok": "tab:blue", "failed": "tab:red", "cancelled": "tab:purple", "burst": "tab:green"}


def plot_timeline(report: Report, path: str | Path) -> None:
    """Write a PNG: tokens/s over time (top), each request's latency at its end (bottom),
    faults as vertical lines (shaded while they last)."""
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit: CI and headless boxes
    import matplotlib.pyplot as plt

    requests = report.requests
    horizon = max(
        [r.ended or r.started for r in requests]
        + [f.ended_at or 0.0 for f in report.faults]
        + [0.1]
    )
    width = max(0.05, horizon / 30)  # about 30 bins over the run
    bins = [0.0] * (int(horizon / width) + 1)
    for r in requests:
        if not r.chunk_times:
            continue
        # Spread the request's tokens over its chunks (a chunk may carry several).
        per_chunk = (r.completion_tokens or len(r.chunk_times)) / len(r.chunk_times)
        for t in r.chunk_times:
            bins[min(len(bins) - 1, int(t / width))] += per_chunk / width

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    title = f"{report.scenario} ({report.backend}): {'PASSED' if report.passed else 'FAILED'}"
    fig.suptitle(title, color="black" if report.passed else "tab:red")
    top.step([i * width for i in range(len(bins))], bins, where="post", color="tab:blue")
    top.set_ylabel("tokens/s (all clients)")
    if report.baseline is not None and report.baseline.duration_s > 0:
        top.axhline(
            report.baseline.tokens / report.baseline.duration_s,
            color="grey",
            linestyle=":",
            label="fault-free mean",
        )
        top.legend(loc="upper right", fontsize=8)

    for label, color in _COLORS.items():
        xs, ys = [], []
        for r in requests:
            kind = (
                "burst"
                if r.group == "burst" and r.ok
                else "cancelled"
                if r.cancelled
                else "ok"
                if r.ok
                else "failed"
            )
            if kind == label and r.ended is not None:
                xs.append(r.ended)
                ys.append(r.ended - r.started)
        if xs:
            marker = "x" if label == "failed" else "o"
            bottom.scatter(xs, ys, s=14, color=color, marker=marker, label=label)
    ttft = [(r.first_token, r.first_token - r.started) for r in requests if r.first_token]
    if ttft:
        bottom.scatter(*zip(*ttft, strict=True), s=5, color="tab:orange", label="time to 1st token")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("seconds since the faulted load started")
    bottom.legend(loc="upper right", fontsize=8)

    for fault in report.faults:
        if fault.injected_at is None:
            continue
        color = "tab:red" if fault.error is None else "grey"
        for ax in (top, bottom):
            ax.axvline(fault.injected_at, color=color, linestyle="--", linewidth=1)
            if fault.ended_at is not None and fault.ended_at - fault.injected_at > 2 * width:
                ax.axvspan(fault.injected_at, fault.ended_at, color=color, alpha=0.08)
        top.annotate(
            f"{fault.kind} {fault.target}",
            (fault.injected_at, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=color,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
