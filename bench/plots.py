"""PNG plots: attention TFLOP/s per provider and coreattn's speedups; mask builder times."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bench.report import NOT_PERF


def _grouped_bars(ax, groups: list[str], series: dict[str, dict[str, float]], ylabel: str, log: bool = False):
    import numpy as np

    names = list(series)
    width = 0.8 / max(1, len(names))
    x = np.arange(len(groups))
    for i, name in enumerate(names):
        ys = [series[name].get(g, 0.0) for g in groups]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, ys, width, label=name)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)


def _title(kind: str, meta: dict) -> str:
    title = f"{kind} - {meta['device']} - torch {meta['torch']}"
    return title if meta["performance_data"] else f"{title}\n{NOT_PERF}"


def _save(fig, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def write_plots(out_dir: Path, rows: list[dict], meta: dict, primary: str = "coreattn") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    ok = [r for r in rows if r.get("status") == "ok"]
    by_mode = defaultdict(list)
    for r in ok:
        if r["kind"] == "attention":
            by_mode[(r["dtype"], r["mode"])].append(r)
    for (dtype, mode), rs in sorted(by_mode.items()):
        configs = list(dict.fromkeys(r["config"] for r in rs))
        tflops, speedup = defaultdict(dict), defaultdict(dict)
        for r in rs:
            tflops[r["provider"]][r["config"]] = r["tflops"]
            if f"speedup_of_{primary}" in r:
                speedup[r["provider"]][r["config"]] = r[f"speedup_of_{primary}"]
        width = max(6.0, 0.5 * len(configs) * max(1, len(tflops)) ** 0.5)
        fig, ax = plt.subplots(figsize=(width, 4.5))
        _grouped_bars(ax, configs, tflops, "TFLOP/s")
        ax.set_title(_title(f"attention {mode} {dtype}", meta), fontsize=8)
        _save(fig, out_dir / f"attention_tflops_{dtype}_{mode}.png", written)
        if speedup:
            fig, ax = plt.subplots(figsize=(width, 4.5))
            _grouped_bars(ax, configs, speedup, f"speedup of {primary} (x)")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(_title(f"{primary} speedup over each provider, {mode} {dtype}", meta), fontsize=8)
            _save(fig, out_dir / f"attention_speedup_{dtype}_{mode}.png", written)
    mask_rows = [r for r in ok if r["kind"] == "masks"]
    if mask_rows:
        groups = list(dict.fromkeys(f"{r['op']} {r['config']}" for r in mask_rows))
        series = defaultdict(dict)
        for r in mask_rows:
            series[r["provider"]][f"{r['op']} {r['config']}"] = r["ms"]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(groups)), 4.5))
        _grouped_bars(ax, groups, series, "ms (log)", log=True)
        ax.set_title(_title("mask builders", meta), fontsize=8)
        _save(fig, out_dir / "masks_ms.png", written)
    return written
