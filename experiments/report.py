"""`megatrain report DIR`: markdown tables and PNG plots from DIR/results.csv.

Every figure is always written, with a note inside when the sweep has no data for it, so a reader
(or a README link) never finds a missing file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from experiments import results as R

FIGURES = {
    "throughput_vs_model_size": "Throughput vs model size, per backend",
    "throughput_vs_context": "Throughput vs context length",
    "throughput_vs_batch": "Throughput vs batch size",
    "memory_vs_model_size": "Peak device and host memory vs model size",
    "link_utilization": "Host-to-device link utilization",
    "timeline": "Per-step timeline of one run (compute vs copy streams)",
}
FLOPS_NOTE = ("Model TFLOPS = (6·N·T + 12·L·h·s·T·½) / step time, N = non-embedding parameters "
              "(a MoE: the active ones, router and top-k experts), T = tokens per "
              "step; activation recompute and embedding/LM-head FLOPs are not counted, so the figure is the "
              "same for every backend whatever it recomputes.")
GiB = float(2**30)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(row: pd.Series) -> str:
    eng = {}
    if isinstance(row.get("engine"), str) and row["engine"] not in ("", "{}"):
        try:
            eng = {k: v for k, v in json.loads(row["engine"]).items() if k != "trace"}
        except ValueError:
            eng = {}
    s = str(row["backend"])
    if eng:
        s += " (" + ", ".join(f"{k}={v}" for k, v in sorted(eng.items())) + ")"
    if row.get("precision") == "bf16":
        s += " bf16"
    return s


def load(dir_or_csv: str | Path) -> pd.DataFrame:
    p = Path(dir_or_csv)
    csv = p / "results.csv" if p.is_dir() else p
    if not csv.exists():
        raise FileNotFoundError(f"no results at {csv}: run `megatrain sweep SPEC --out {csv.parent}` first")
    df = R.read_rows(csv)
    for c in ("params", "seq_len", "micro_batch", "grad_accum", "tokens_per_s", "model_tflops", "mfu",
              "peak_device_bytes", "peak_host_rss_bytes", "link_util", "h2d_gbps", "h2d_gbps_busy",
              "step_time_s", "host_bytes_per_param", "h2d_bytes_per_step"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if len(df):
        df["series"] = df.apply(_series, axis=1)
        df["batch"] = df["micro_batch"] * df["grad_accum"]
    else:
        df["series"] = pd.Series(dtype=str)
        df["batch"] = pd.Series(dtype=float)
    return df


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _reference(ok: pd.DataFrame, vary: str, fixed: list[str]) -> tuple[pd.DataFrame, str]:
    """The slice of `ok` along which `vary` changes most: the fixed-key combination with the most
    distinct values of `vary` (ties: most rows). Mixing contexts in one line would be meaningless."""
    if ok.empty:
        return ok, ""
    keyed = ok.assign(_k=ok[fixed].astype(str).agg("|".join, axis=1))
    score = keyed.groupby("_k").agg(n=(vary, "nunique"), rows=(vary, "size"))
    best = score.sort_values(["n", "rows"], ascending=False).index[0]
    sl = keyed[keyed["_k"] == best].drop(columns="_k")
    first = sl.iloc[0]
    desc = ", ".join(f"{k}={first[k]}" for k in fixed if k not in ("series", "backend"))
    return sl, desc


def _size_axis(ax: Any, params: pd.Series) -> None:
    """Log x-axis labelled at the measured model sizes (matplotlib's minor log labels collide)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ticks = sorted(set(params.dropna() / 1e6))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size_label(t) for t in ticks], fontsize=8)
    ax.set_xlabel("parameters")


def _size_label(millions: float) -> str:
    return f"{millions / 1e3:.3g}B" if millions >= 1e3 else f"{millions:.2g}M"


def _fig_vs_model(ok: pd.DataFrame, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sl, desc = _reference(ok, "model", ["seq_len", "micro_batch", "grad_accum"])
    if sl.empty:
        for ax in axes:
            _empty(ax, "no successful points")
    elif sl["params"].nunique() == 1:  # one model size: a bar per series
        size = f"parameters: {_size_label(sl['params'].iloc[0] / 1e6)} only"
        _bars(axes[0], list(sl.groupby("series")), size)
        _bars(axes[1], list(sl.groupby("series")), size, "model_tflops", "model TFLOPS")
        fig.suptitle(f"Throughput at one model size ({desc})", fontsize=10)
    else:
        for series, g in sl.groupby("series"):
            g = g.sort_values("params")
            axes[0].plot(g["params"] / 1e6, g["tokens_per_s"], "o-", label=series)
            axes[1].plot(g["params"] / 1e6, g["model_tflops"], "o-", label=series)
        for ax, yl in zip(axes, ("tokens / s", "model TFLOPS")):
            _size_axis(ax, sl["params"])
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Throughput vs model size ({desc})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tick(t: float) -> str:
    return f"{int(t) // 1024}k" if t >= 1024 and int(t) % 1024 == 0 else str(int(t))


def _group_label(key: Any) -> str:
    return " / ".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))


def _bars(ax: Any, groups: list[tuple[Any, pd.DataFrame]], xlabel: str, col: str = "tokens_per_s",
          ylabel: str = "tokens / s", scale: float = 1.0) -> None:
    """`col` (times `scale`) as one bar per group, its median over the group's rows, each labelled with its value:
    how a figure draws an axis that has one value."""
    labels = [_group_label(k) for k, _ in groups]
    values = [float(g[col].median()) * scale for _, g in groups]
    x = range(len(groups))
    ax.bar(x, values, color="tab:blue")
    for i, v in zip(x, values):
        ax.text(i, v, f"{v:.4g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")


def _fig_vs_axis(ok: pd.DataFrame, path: Path, axis: str, xlabel: str, group: list[str], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    groups = list(ok.groupby(group)) if not ok.empty else []
    if not groups:
        _empty(ax, "no successful points")
    elif ok[axis].nunique() == 1:
        # One value on the axis: a bar per series (a line through one x value says nothing of the axis).
        _bars(ax, groups, f"{xlabel}: {_tick(ok[axis].iloc[0])} only")
        title = title.replace("(lines:", "(bars:")
    else:
        # Lines where the axis varies; lone points only when nothing varies, so they do not crowd it.
        varying = [(k, g) for k, g in groups if g[axis].nunique() >= 2]
        for key, g in varying or groups:
            g = g.sort_values(axis)
            ax.plot(g[axis], g["tokens_per_s"], "o-", label=_group_label(key))
        from matplotlib.ticker import NullLocator

        ax.set_xscale("log", base=2)
        ticks = sorted(set(ok[axis].dropna()))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks)
        ax.set_xticklabels([_tick(t) for t in ticks], fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig_memory(ok: pd.DataFrame, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sl, desc = _reference(ok, "model", ["seq_len", "micro_batch", "grad_accum"])
    for ax, col, title in ((axes[0], "peak_device_bytes", "peak device memory"),
                           (axes[1], "peak_host_rss_bytes", "peak host RSS")):
        d = sl.dropna(subset=[col]) if not sl.empty else sl
        if d.empty:
            _empty(ax, f"no {title} measurements")
            continue
        if d["params"].nunique() == 1:  # one model size: a bar per series
            _bars(ax, list(d.groupby("series")), f"parameters: {_size_label(d['params'].iloc[0] / 1e6)} only", col,
                  "GiB", 1 / GiB)
            ax.set_title(title, fontsize=10)
            continue
        for series, g in d.groupby("series"):
            g = g.sort_values("params")
            ax.plot(g["params"] / 1e6, g[col] / GiB, "o-", label=series)
        _size_axis(ax, d["params"])
        ax.set_ylabel("GiB")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Memory vs model size ({desc})" if desc else "Memory vs model size", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig_link(ok: pd.DataFrame, path: Path) -> None:
    plt = _plt()
    d = ok.dropna(subset=["link_util"]) if not ok.empty else ok
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(d) + 3), 4.5))
    if d.empty:
        _empty(ax, "no link measurements (megatrain points or NVML on CUDA give them)")
    else:
        d = d.sort_values(["params", "seq_len", "batch"])
        x = range(len(d))
        ax.bar(x, d["link_util"] * 100, color="tab:blue")
        for i, (_, r) in enumerate(d.iterrows()):
            ax.text(i, r["link_util"] * 100, f"{r['h2d_gbps']:.2g} GB/s", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(list(x))
        ax.set_xticklabels(d["label"], rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("h2d GB/s over the step / link peak (%)")
        src = ", ".join(sorted(set(d["link_peak_source"].dropna().astype(str))))
        ax.set_title(f"Link utilization (peak source: {src})", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_trace(df: pd.DataFrame, root: Path) -> Path | None:
    """The trace of the largest successful megatrain point (the most layers to see overlap in)."""
    if df.empty:
        return None
    d = df[(df["status"] == "ok") & df["trace_file"].notna()].sort_values(["params", "seq_len"], ascending=False)
    for rel in d["trace_file"]:
        p = root / str(rel)
        if p.exists():
            return p
    return None


def _fig_timeline(trace: Path | None, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.2))
    if trace is None:
        _empty(ax, "no engine trace in this sweep (megatrain points save one)")
    else:
        data = json.loads(trace.read_text())
        recs = data["records"]
        lanes = sorted({r[0] for r in recs}, key=lambda s: {"compute": 0, "h2d": 1, "d2h": 2}.get(s, 3))
        kinds = sorted({r[1] for r in recs})
        cmap = plt.get_cmap("tab10")
        color = {k: cmap(i % 10) for i, k in enumerate(kinds)}
        for li, lane in enumerate(lanes):
            for kind in kinds:
                bars = [(r[3], max(r[4] - r[3], 1e-6)) for r in recs if r[0] == lane and r[1] == kind]
                if bars:
                    ax.broken_barh(bars, (li - 0.4, 0.8), color=color[kind], label=kind)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right", ncol=len(uniq))
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes)
        ax.set_xlabel("seconds since the step's first recorded operation")
        ax.set_title(f"{data.get('label', trace.stem)}: one step ({data.get('step_time_s', float('nan')):.3f} s)",
                     fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "–"
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _speedups(ok: pd.DataFrame) -> list[list[str]]:
    """megatrain tokens/s over each baseline's at the same model, context and batch."""
    keys = ["model", "seq_len", "micro_batch", "grad_accum", "precision"]
    rows = []
    mt = ok[ok["backend"] == "megatrain"]
    for _, m in mt.iterrows():
        for base in ("zero3", "torch"):
            b = ok[(ok["backend"] == base) & (ok[keys] == m[keys]).all(axis=1)]
            if len(b):
                rows.append([m["model"], str(int(m["seq_len"])), f"{int(m['micro_batch'])}x{int(m['grad_accum'])}",
                             m["series"], base, _fmt(m["tokens_per_s"]), _fmt(b.iloc[0]["tokens_per_s"]),
                             _fmt(m["tokens_per_s"] / b.iloc[0]["tokens_per_s"], ".2f") + "x"])
    return rows


def write_report(dir_or_csv: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.md and the FIGURES PNGs next to the results; returns the markdown path."""
    src = Path(dir_or_csv)
    root = src if src.is_dir() else src.parent
    out = Path(out_dir) if out_dir else root
    out.mkdir(parents=True, exist_ok=True)
    df = load(src)
    ok = df[df["status"] == "ok"].copy() if len(df) else df

    _fig_vs_model(ok, out / "throughput_vs_model_size.png")
    _fig_vs_axis(ok, out / "throughput_vs_context.png", "seq_len", "context length (tokens)",
                 ["series", "model", "batch"], "Throughput vs context length (lines: backend / model / batch)")
    _fig_vs_axis(ok, out / "throughput_vs_batch.png", "batch", "sequences per step (micro-batch x accumulation)",
                 ["series", "model", "seq_len", "grad_accum"],
                 "Throughput vs batch size (lines: backend / model / context / accumulation)")
    _fig_memory(ok, out / "memory_vs_model_size.png")
    _fig_link(ok, out / "link_utilization.png")
    _fig_timeline(pick_trace(df, root), out / "timeline.png")

    name = str(df["sweep"].iloc[0]) if len(df) else root.name
    lines = [f"# Sweep `{name}`", ""]
    if len(df):
        counts = df["status"].value_counts().to_dict()
        lines.append("Points: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".")
        lines.append("")
        for col, title in (("device_name", "Device"), ("cpu_model", "CPU"), ("git_commit", "Commit"),
                           ("versions", "Versions")):
            vals = sorted(set(df[col].dropna().astype(str)))
            if vals:
                lines.append(f"- {title}: " + "; ".join(f"`{v}`" for v in vals))
        hm = pd.to_numeric(df["host_mem_bytes"], errors="coerce").dropna()
        if len(hm):
            lines.append(f"- Host memory: {hm.max() / GiB:.1f} GiB")
        ts = df["timestamp"].dropna().astype(str)
        if len(ts):
            lines.append(f"- Recorded: {ts.min()} to {ts.max()}")
        lines.append("")
    lines += ["## Throughput and memory", "", FLOPS_NOTE, ""]
    if len(ok):
        ok = ok.sort_values(["params", "seq_len", "batch", "backend"])
        header = ["backend", "model", "params", "context", "batch", "tokens/s", "TFLOPS", "MFU", "step s",
                  "fwd / bwd / opt / wait s", "peak device GiB", "peak RSS GiB", "host B/param",
                  "h2d GB/step", "link util"]
        rows = []
        for _, r in ok.iterrows():
            rows.append([
                r["series"], str(r["model"]), f"{r['params'] / 1e6:.1f}M", str(int(r["seq_len"])),
                f"{int(r['micro_batch'])}x{int(r['grad_accum'])}", _fmt(r["tokens_per_s"], ".4g"),
                _fmt(r["model_tflops"], ".3g"), _fmt(r["mfu"], ".1%"), _fmt(r["step_time_s"], ".3g"),
                " / ".join(_fmt(r[c], ".2g") for c in ("forward_s", "backward_s", "optimizer_s", "copy_wait_s")),
                _fmt(r["peak_device_bytes"] / GiB, ".3g"), _fmt(r["peak_host_rss_bytes"] / GiB, ".3g"),
                _fmt(r["host_bytes_per_param"], ".3g"), _fmt(r["h2d_bytes_per_step"] / 1e9, ".3g"),
                _fmt(r["link_util"], ".1%"),
            ])
        lines += [_md_table(header, rows), ""]
        peak_src = sorted(set(ok["peak_source"].dropna().astype(str)))
        lines.append(f"MFU against the device peak ({', '.join(peak_src) or 'unknown'} source; `measured` = best "
                     "square matmul on this device and thread count). Batch = micro-batch x accumulation.")
        lines.append("")
        sp = _speedups(ok)
        if sp:
            lines += ["## MegaTrain vs the baselines (same model, context, batch)", "",
                      _md_table(["model", "context", "batch", "megatrain", "baseline", "megatrain tok/s",
                                 "baseline tok/s", "speed-up"], sp), ""]
        if (ok["model"] == "dense-120b").any():
            lines += ["`dense-120b`: hidden 10240 x 96 layers as in the MegaTrain calculator; its MLP width, "
                      "heads and vocabulary are this project's choice.", ""]
    else:
        lines += ["No successful points.", ""]
    bad = df[df["status"] != "ok"] if len(df) else df
    if len(bad):
        lines += ["## Not run or failed", "",
                  _md_table(["point", "status", "reason"],
                            [[str(r["label"]), str(r["status"]), str(r["reason"])] for _, r in bad.iterrows()]), ""]
    lines += ["## Figures", ""]
    for stem, title in FIGURES.items():
        lines += [f"### {title}", "", f"![{title}]({stem}.png)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md
