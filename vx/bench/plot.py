"""`vx bench serve --plot FILE.png`: one figure of one or more benchmark runs.

Runs in: the bench CLI process (matplotlib with the Agg backend, imported only here, only when a
plot is asked for). Four panels: the TTFT and ITL distributions (empirical CDFs, one line per
concurrency level, p50 and p99 marked), throughput against concurrency, and the
latency-throughput trade-off (TPOT p50 and p99 against output throughput). A run saved without
raw samples (older JSON) is drawn from its percentiles alone.
"""

from __future__ import annotations

from typing import Any

_INK = "#1f2430"
_MUTED = "#6b7280"
_GRID = "#e5e7eb"


def _levels_colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["plasma"]
    return [cmap(0.12 + 0.7 * i / max(n - 1, 1)) for i in range(n)]


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, loc="left", fontsize=11.5, fontweight="bold", color=_INK, pad=10)
    ax.set_xlabel(xlabel, color=_MUTED, fontsize=9.5)
    ax.set_ylabel(ylabel, color=_MUTED, fontsize=9.5)
    ax.grid(True, color=_GRID, linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#c7cbd3")
    ax.tick_params(colors=_MUTED, labelsize=8.5)


def _cdf(ax: Any, runs: list[dict[str, Any]], key: str, colors: list[Any]) -> None:
    lo, hi = float("inf"), 0.0
    for s, color in zip(runs, colors, strict=True):
        values = sorted(v for v in (s.get("samples") or {}).get(f"{key}_ms", []) if v > 0)
        pct = s[f"{key}_ms"]
        label = f"c={s['concurrency']}"
        if values:
            n = len(values)
            # An ECDF: 0 up to the smallest value, then one step of 1/n per value.
            ys = [0.0] + [(i + 1) / n for i in range(n)]
            ax.step([values[0], *values], ys, where="post", color=color, linewidth=1.8,
                    label=label)  # fmt: skip
            lo, hi = min(lo, values[0]), max(hi, values[-1])
        else:
            xs = [pct["p50"], pct["p90"], pct["p99"]]
            ax.plot(xs, [0.5, 0.9, 0.99], color=color, linewidth=1.4, linestyle="--", label=label)
            lo, hi = min(lo, *xs), max(hi, *xs)
        for q, marker in (("p50", "o"), ("p99", "D")):
            ax.plot([pct[q]], [0.5 if q == "p50" else 0.99], marker=marker, markersize=5,
                    color=color, markeredgecolor="white", markeredgewidth=0.8)  # fmt: skip
    if hi > 0 and lo > 0 and hi / lo > 30:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.5, color="#d1d5db", linewidth=0.8, linestyle=":")
    ax.axhline(0.99, color="#d1d5db", linewidth=0.8, linestyle=":")
    ax.legend(frameon=False, fontsize=8.5, loc="best", title="● p50  ◆ p99",
              title_fontsize=8)  # fmt: skip


def _throughput(ax: Any, runs: list[dict[str, Any]], colors: list[Any]) -> None:
    xs = [s["concurrency"] for s in runs]
    out = [s["output_throughput"] for s in runs]
    total = [s["total_token_throughput"] for s in runs]
    ax.plot(xs, total, color="#9ca3af", linewidth=1.5, linestyle="--", marker="s", markersize=4,
            label="total (prompt + output)")  # fmt: skip
    ax.plot(xs, out, color="#4f46e5", linewidth=2.2, label="output")
    ax.scatter(xs, out, c=colors, s=46, zorder=3, edgecolors="white", linewidths=0.8)
    for x, y in zip(xs, out, strict=True):
        ax.annotate(f"{y:,.0f}", (x, y), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=8.5, color=_INK)  # fmt: skip
    if len(xs) > 1 and max(xs) / max(min(xs), 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_ylim(bottom=0, top=max(total + out) * 1.18 or 1)
    ax.legend(frameon=False, fontsize=8.5, loc="upper left")


def _tradeoff(ax: Any, runs: list[dict[str, Any]], colors: list[Any]) -> None:
    xs = [s["output_throughput"] for s in runs]
    p50 = [s["tpot_ms"]["p50"] for s in runs]
    p99 = [s["tpot_ms"]["p99"] for s in runs]
    ax.plot(xs, p50, color="#4f46e5", linewidth=1.6, alpha=0.6)
    ax.vlines(xs, p50, p99, colors=colors, linewidth=2.2, alpha=0.55)
    ax.scatter(xs, p50, c=colors, s=52, zorder=3, edgecolors="white", linewidths=0.8)
    ax.scatter(xs, p99, c=colors, s=22, marker="D", zorder=3, edgecolors="white", linewidths=0.6)
    for s, x, y in zip(runs, xs, p50, strict=True):
        ax.annotate(f"c={s['concurrency']}", (x, y), textcoords="offset points", xytext=(7, -3),
                    fontsize=8.5, color=_INK)  # fmt: skip
    from matplotlib.lines import Line2D

    keys = [Line2D([], [], color=_MUTED, marker=m, linestyle="", markersize=s, label=q)
            for m, s, q in (("o", 7, "TPOT p50"), ("D", 5, "TPOT p99"))]  # fmt: skip
    ax.legend(handles=keys, frameon=False, fontsize=8.5, loc="upper left")
    ax.set_xlim(left=0, right=max(xs) * 1.15 or 1)
    ax.set_ylim(bottom=0, top=max(p99) * 1.15 or 1)


def plot_runs(runs: list[dict[str, Any]], path: str) -> None:
    """Draw `runs` (summaries from `vx.bench.serve.summarize`) into the image file `path`."""
    if not runs:
        raise ValueError("no runs to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda s: s["concurrency"])
    colors = _levels_colors(len(runs))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.6), dpi=120, facecolor="white")
    (ttft, itl), (tput, trade) = axes
    _style(ttft, "Time to first token", "TTFT (ms)", "fraction of requests")
    _cdf(ttft, runs, "ttft", colors)
    _style(itl, "Inter-token latency", "ITL (ms)", "fraction of gaps")
    _cdf(itl, runs, "itl", colors)
    _style(tput, "Throughput against concurrency", "concurrent clients", "tokens / s")
    _throughput(tput, runs, colors)
    _style(trade, "Latency against throughput", "output tokens / s", "time per output token (ms)")
    _tradeoff(trade, runs, colors)
    first = runs[0]
    fig.suptitle(
        f"vx bench serve · {first.get('model')} · {first.get('input_len')} in / "
        f"{first.get('output_len')} out · {first.get('base_url')}",
        x=0.01, ha="left", fontsize=12.5, fontweight="bold", color=_INK,
    )  # fmt: skip
    failed = sum(s.get("failed", 0) for s in runs)
    note = f"{sum(s['completed'] for s in runs)} requests" + (
        f", {failed} failed" if failed else ""
    )
    fig.text(0.99, 0.985, note, ha="right", va="top", fontsize=9, color=_MUTED)
    fig.tight_layout(rect=(0, 0, 1, 0.96), h_pad=2.2, w_pad=2.5)
    fig.savefig(path)
    plt.close(fig)
