"""PNG plots for `fairbatch bench serve` (matplotlib, Agg backend: no display needed).

Per run: per-tenant service over time (`service_over_time.png`), latency CDFs per tenant
(`latency_cdf.png`: TTFT and end-to-end) and output throughput over time (`throughput.png`).
For comparisons: grouped bars (`grouped_bars`) and one service panel per compared run
(`service_panels`). Figures are small (DPI 80) so they can be committed next to the docs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fairbatch.benchmarks.serve_metrics import service_curves  # noqa: E402
from fairbatch.benchmarks.serve_types import RequestResult  # noqa: E402

DPI = 80


def _step(results: Sequence[RequestResult], points: int = 200) -> float:
    end = max((r.end_s for r in results), default=1.0)
    return max(0.05, end / points)


def _save(fig: plt.Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path.name


def _rate(grid: np.ndarray, cum: np.ndarray, window_s: float) -> np.ndarray:
    """Service per second over a trailing window of `window_s` (a smoothed derivative)."""
    k = max(1, int(round(window_s / (grid[1] - grid[0])))) if len(grid) > 1 else 1
    shifted = np.concatenate([np.zeros(k), cum[:-k]]) if len(cum) > k else np.zeros_like(cum)
    return (cum - shifted) / (k * (grid[1] - grid[0]) if len(grid) > 1 else 1.0)


def plot_service(
    results: Sequence[RequestResult],
    weights: Mapping[str, float],
    path: Path,
    title: str = "",
    arrivals_end_s: float | None = None,
) -> str:
    """Left: cumulative service / weight per tenant (fair = lines together while both are
    backlogged). Right: each tenant's service rate (weighted tokens/s, 2 s window). A dotted
    line marks the end of the arrivals, when given."""
    grid, curves = service_curves(list(results), step_s=_step(results))
    g = np.asarray(grid)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for tenant, cum in curves.items():
        c = np.asarray(cum)
        left.plot(
            g, c / weights.get(tenant, 1.0), label=f"{tenant} (w={weights.get(tenant, 1.0):g})"
        )
        right.plot(g, _rate(g, c, 2.0), label=tenant)
    left.set(xlabel="time (s)", ylabel="service / weight (weighted tokens)", title="cumulative")
    right.set(xlabel="time (s)", ylabel="weighted tokens / s", title="service rate (2 s window)")
    if arrivals_end_s:
        for ax in (left, right):
            ax.axvline(arrivals_end_s, color="gray", linestyle=":", linewidth=1)
    left.legend(fontsize="small")
    fig.suptitle(f"per-tenant service {title}".strip(), fontsize="medium")
    return _save(fig, path)


def _cdf(ax: plt.Axes, values: Sequence[float], label: str) -> None:
    if values:
        xs = np.sort(np.asarray(values))
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} ({len(xs)})")


def plot_latency_cdfs(results: Sequence[RequestResult], path: Path, title: str = "") -> str:
    """CDFs of TTFT and end-to-end latency (s), one line per tenant, completed requests only."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for tenant in sorted({r.spec.tenant for r in results}):
        ok = [r for r in results if r.ok and r.spec.tenant == tenant]
        _cdf(left, [r.ttft_s for r in ok if r.ttft_s is not None], tenant)
        _cdf(right, [r.e2e_s for r in ok], tenant)
    left.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="time to first token")
    right.set(xlabel="end-to-end (s)", title="end-to-end latency")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize="small")
    fig.suptitle(f"latency CDFs {title}".strip(), fontsize="medium")
    return _save(fig, path)


def output_rate(
    results: Sequence[RequestResult], window_s: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Window starts and output tokens/s per tenant in each window (a chunk carries
    completion_tokens / chunks tokens of its request)."""
    end = max((r.end_s for r in results), default=0.0)
    edges = np.arange(0.0, end + window_s, window_s)
    rates: dict[str, np.ndarray] = {}
    for r in results:
        if not r.chunk_times_s:
            continue
        per_chunk = (r.completion_tokens or len(r.chunk_times_s)) / len(r.chunk_times_s)
        hist, _ = np.histogram(r.chunk_times_s, bins=edges)
        rates[r.spec.tenant] = rates.get(r.spec.tenant, 0) + hist * per_chunk / window_s
    return edges[:-1], dict(sorted(rates.items()))


def plot_throughput(results: Sequence[RequestResult], path: Path, title: str = "") -> str:
    """Output tokens/s in windows: stacked per tenant, the top edge is the total."""
    end = max((r.end_s for r in results), default=1.0)
    window = max(0.5, end / 60)
    starts, rates = output_rate(results, window)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    if rates:
        ax.stackplot(starts, *rates.values(), labels=list(rates), step="post", alpha=0.8)
        ax.legend(fontsize="small", loc="upper right")
    ax.set(
        xlabel="time (s)",
        ylabel="output tokens / s",
        title=f"throughput ({window:.1f} s windows) {title}".strip(),
    )
    return _save(fig, path)


def plot_run(
    results: Sequence[RequestResult],
    weights: Mapping[str, float],
    out_dir: Path,
    title: str = "",
    arrivals_end_s: float | None = None,
) -> list[str]:
    """The three per-run plots into `out_dir`; returns their file names."""
    out_dir = Path(out_dir)
    return [
        plot_service(results, weights, out_dir / "service_over_time.png", title, arrivals_end_s),
        plot_latency_cdfs(results, out_dir / "latency_cdf.png", title),
        plot_throughput(results, out_dir / "throughput.png", title),
    ]


def grouped_bars(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    path: Path,
    *,
    title: str,
    ylabel: str,
    log: bool = False,
) -> str:
    """One cluster of bars per group (e.g. policy), one bar per series (e.g. tenant)."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(groups) + 2), 3.4))
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        ys = [np.nan if v is None else v for v in values]
        ax.bar(x + (k - (len(series) - 1) / 2) * width, ys, width, label=name)
    ax.set_xticks(x, groups)
    ax.set(ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def service_panels(
    runs: Mapping[str, Sequence[RequestResult]],
    weights: Mapping[str, float],
    path: Path,
    title: str = "",
    arrivals_end_s: float | None = None,
) -> str:
    """One panel per run (e.g. per policy): cumulative service / weight per tenant."""
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs) + 1, 3.2), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (label, results) in zip(axes, runs.items()):
        grid, curves = service_curves(list(results), step_s=_step(results))
        for tenant, cum in curves.items():
            ax.plot(grid, np.asarray(cum) / weights.get(tenant, 1.0), label=tenant)
        if arrivals_end_s:
            ax.axvline(arrivals_end_s, color="gray", linestyle=":", linewidth=1)
        ax.set(title=label, xlabel="time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("service / weight")
    axes[0].legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    return _save(fig, path)


def cdf_panels(
    series: Mapping[str, Sequence[float]], path: Path, *, xlabel: str, title: str
) -> str:
    """CDFs of several samples (e.g. one TTFT sample per phase) on one log-x axis."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for label, values in series.items():
        _cdf(ax, [v for v in values if v is not None], label)
    ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="fraction of requests", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)
