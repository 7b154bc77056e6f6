"""The summary: per-phase status, the figures that matter, and the markdown table printed last."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from .common import _T0, _read_json


def _interval_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def trace_metrics(records: list[list]) -> dict[str, float]:
    """Overlap figures of one step's timeline: how much of the link's time compute hid, and how long
    compute sat idle inside the step."""
    by: dict[str, list[tuple[float, float]]] = {}
    for stream, _kind, _layer, t0, t1 in records:
        by.setdefault(stream, []).append((t0, t1))
    u = {s: _interval_union(v) for s, v in by.items()}
    span = max(r[4] for r in records) - min(r[3] for r in records)
    comp = u.get("compute", [])
    busy = {s: sum(b - a for a, b in v) for s, v in u.items()}
    out = {"span_s": span, **{f"{s}_busy_s": v for s, v in busy.items()}}
    if comp and span > 0:
        out["compute_busy_frac"] = busy["compute"] / span
        for s in ("h2d", "d2h"):
            if u.get(s):
                out[f"{s}_hidden_frac"] = _overlap(u[s], comp) / busy[s]
    return out


def build_summary(out: Path, phases: dict[str, dict[str, Any]], dry: bool) -> dict[str, Any]:
    s: dict[str, Any] = {"dry_run": dry, "out": str(out), "elapsed_s": round(time.time() - _T0, 1),
                         "phases": {n: {k: v for k, v in r.items() if k != "checks"} | {
                             "checks": {c: {"ok": v.get("ok"), **({"error": v["error"]} if v.get("error") else {})}
                                        for c, v in r.get("checks", {}).items()}}
                             for n, r in phases.items()}}
    figs: dict[str, Any] = {}
    checks = {n: r.get("checks", {}) for n, r in phases.items()}
    par = checks.get("parity", {})
    if par:
        figs["parity"] = {k: {m: v.get(m) for m in ("grad_rel", "loss_abs", "param_abs", "param_abs_noise",
                                                     "noise_share", "loss_abs_vs_fp32",
                                                     "loss_abs_vs_autocast", "loss_abs_vs_mixed",
                                                     "streamed_bytes_per_param")
                              if v.get(m) is not None} | {"ok": v.get("ok")} for k, v in par.items()}
    san = checks.get("sanitizer", {}).get("parity_under_sanitizer")
    if san:
        figs["sanitizer"] = {m: san.get(m) for m in ("ok", "sanitizer", "loss_abs", "returncode", "bf16_floor")}
        figs["sanitizer"]["runs"] = {k: {m: v.get(m) for m in ("ok", "loss_abs", "tolerance", "reference")}
                                     | {"threads": sorted(v.get("threads_checked", {}))}
                                     for k, v in (san.get("runs") or {}).items()}
    sy = checks.get("sync", {})
    if sy:
        figs["sync"] = {k: {m: v.get(m) for m in ("syncs_in_loop", "syncs_outside_loop", "syncs_caught")
                            if m in v} | {"ok": v.get("ok")} for k, v in sy.items()}
    bw = checks.get("bandwidth", {})
    peak_h2d = bw.get("pinned", {}).get("h2d_peak_gbps")
    if bw:
        figs["bandwidth"] = {"h2d_peak_gbps": peak_h2d, "d2h_peak_gbps": bw.get("pinned", {}).get("d2h_peak_gbps"),
                             "pageable_h2d_gbps": bw.get("pageable", {}).get("h2d_gbps"),
                             "bidirectional_gbps": bw.get("bidirectional", {}).get("aggregate_gbps"),
                             "engine_stream_gbps": bw.get("engine_stream", {}).get("gbps_busy"),
                             "memcpy_gbps": bw.get("memcpy", {}).get("memcpy_gbps"),
                             "bf16_tflops": bw.get("matmul", {}).get("bf16_tflops"),
                             "fp32_tflops": bw.get("matmul", {}).get("fp32_tflops")}
    from .bench import read_rows

    points = []
    for p in read_rows(out / "results.csv"):
        if p.get("trace_file") and (out / p["trace_file"]).exists():
            tr = _read_json(out / p["trace_file"]) or {}
            if tr.get("records"):
                p["trace"] = trace_metrics(tr["records"])
        points.append(p)
    s["points"] = points
    ok = {p["point"]: p for p in points if p.get("status") == "ok"}
    if "torch" in ok:
        figs["vs_torch"] = {name: ok[name]["step_time_s"] / ok["torch"]["step_time_s"]
                            for name in ("stream", "auto") if name in ok}
    if ok.get("stream", {}).get("trace_file"):
        st = ok["stream"]
        s["timeline"] = {"label": "stream", "trace_file": st["trace_file"], **(st.get("trace") or {})}
    feats = checks.get("features", {})
    if feats:
        figs["features"] = {k: {m: v.get(m) for m in ("speculative_layers", "speculative_rollbacks", "stepped",
                                                       "loss_abs", "status", "error") if v.get(m) is not None}
                            | {"ok": v.get("ok")} for k, v in feats.items()}
    pair = checks.get("dp2", {}).get("node_path_two_gpus")
    if pair:
        figs["dp2"] = {m: pair.get(m) for m in ("ok", "backend", "loss_gap_fp32", "tol", "link_share_per_step",
                                                "max_link_share", "error")}
    s["figures"] = figs
    return s


def _f(v: Any, fmt: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return format(v, fmt)
    return str(v)


def render_markdown(s: dict[str, Any]) -> str:
    lines = [f"# MegaTrain GPU check{' (dry run: CPU, tiny shapes)' if s['dry_run'] else ''}", "",
             f"elapsed {s['elapsed_s']:.0f} s; full results in `{s['out']}`", "",
             "| phase | status | wall s | budget s | failed checks |", "| --- | --- | --- | --- | --- |"]
    for name, r in s["phases"].items():
        failed = [c + (f" ({v['error'][:80]})" if v.get("error") else "")
                  for c, v in r.get("checks", {}).items() if not v.get("ok")]
        why = "; ".join(failed) or r.get("reason", "") if r.get("status") != "ok" else ""
        lines.append(f"| {name} | {r.get('status')} | {_f(r.get('wall_s'))} | {_f(r.get('budget_s'))} | {why} |")
    f = s.get("figures", {})
    if f.get("parity"):
        lines += ["", "## Parity (engine vs plain PyTorch on the same device)", "",
                  "| case | ok | grad rel | loss abs | param abs | param abs, noise-level entries (share) | "
                  "bf16 vs fp32 loss | bf16 vs autocast | bf16 vs its mixed-precision reference | B/param streamed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for k, v in f["parity"].items():
            lines.append(f"| {k} | {_f(v.get('ok'))} | {_f(v.get('grad_rel'))} | {_f(v.get('loss_abs'))} | "
                         f"{_f(v.get('param_abs'))} | {_f(v.get('param_abs_noise'))} ({_f(v.get('noise_share'))}) | "
                         f"{_f(v.get('loss_abs_vs_fp32'))} | "
                         f"{_f(v.get('loss_abs_vs_autocast'))} | {_f(v.get('loss_abs_vs_mixed'))} | "
                         f"{_f(v.get('streamed_bytes_per_param'))} |")
    if f.get("sanitizer"):
        z = f["sanitizer"]
        lines += ["", "## Stream sanitizer", "",
                  f"parity run under TORCH_CUDA_SANITIZER: {'on' if z.get('sanitizer') else 'off (no CUDA)'}, "
                  f"ok {_f(z.get('ok'))}, loss abs vs PyTorch {_f(z.get('loss_abs'))}"]
        if z.get("runs"):
            lines += ["", "| run | ok | reference | loss abs | tolerance | other threads checked |",
                      "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {k} | {_f(v.get('ok'))} | {v.get('reference')} | {_f(v.get('loss_abs'))} | "
                      f"{_f(v.get('tolerance'))} | {', '.join(v.get('threads', [])) or '-'} |"
                      for k, v in z["runs"].items()]
    if f.get("sync"):
        lines += ["", "## Synchronizations", "", "| case | ok | in the per-layer loop | elsewhere in the step | planted, caught |",
                  "| --- | --- | --- | --- | --- |"]
        for k, v in f["sync"].items():
            lines.append(f"| {k} | {_f(v.get('ok'))} | {_f(v.get('syncs_in_loop'))} | "
                         f"{_f(v.get('syncs_outside_loop'))} | {_f(v.get('syncs_caught'))} |")
    if f.get("bandwidth"):
        b = f["bandwidth"]
        lines += ["", "## Link and compute ceilings", "",
                  f"pinned H2D {_f(b['h2d_peak_gbps'])} GB/s, D2H {_f(b['d2h_peak_gbps'])} GB/s, both at once "
                  f"{_f(b['bidirectional_gbps'])} GB/s; pageable H2D {_f(b['pageable_h2d_gbps'])} GB/s; engine copy "
                  f"stream {_f(b['engine_stream_gbps'])} GB/s; memcpy {_f(b['memcpy_gbps'])} GB/s; matmul bf16 "
                  f"{_f(b['bf16_tflops'])} / fp32 {_f(b['fp32_tflops'])} TFLOPS"]
    if f.get("features"):
        lines += ["", "## Speculation, NaN skip, device batches, stream vs auto (bit for bit)", "",
                  "| check | ok | details |", "| --- | --- | --- |"]
        for k, v in f["features"].items():
            detail = ", ".join(f"{m}={_f(x)}" for m, x in v.items() if m != "ok")
            lines.append(f"| {k} | {_f(v.get('ok'))} | {detail[:200]} |")
    if f.get("dp2"):
        d = f["dp2"]
        shares = ", ".join(f"{r} h2d {_f(v.get('h2d_bytes'), '.3f')}x d2h {_f(v.get('d2h_bytes'), '.3f')}x"
                           for r, v in (d.get("link_share_per_step") or {}).items())
        lines += ["", "## Node path on two GPUs (torchrun, every layer streamed)", "",
                  f"ok {_f(d.get('ok'))} ({d.get('backend')}); FP32 losses vs one process on the concatenated batch "
                  f"{_f(d.get('loss_gap_fp32'))} (tolerance {_f(d.get('tol'))}); link bytes per step against a lone "
                  f"rank's (at most {_f(d.get('max_link_share'))}x): {shares or '-'}"
                  + (f"; error: {d['error'][:200]}" if d.get("error") else "")]
    if s.get("points"):
        lines += ["", "## Bench: 7B-width layers at 1 x 4096, streamed and auto against plain PyTorch "
                      "(measured / planner, error %)", "",
                  "| point | status | steps | step s (pred, err %) | tok/s | TFLOPS | H2D GB/s (pred, err %) | "
                  "D2H GB/s (pred, err %) | GPU idle (pred) | H2D GB/s busy | rollbacks | peak dev GiB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in s["points"]:
            dev_gib = p["peak_device_bytes"] / 2**30 if p.get("peak_device_bytes") else None
            status = p["status"] if p["status"] == "ok" else f"{p['status']}: {(p.get('reason') or '')[:70]}"
            lines.append(
                f"| {p['point']} | {status} | {_f(p.get('steps'), '.0f')} | {_f(p.get('step_time_s'))} "
                f"({_f(p.get('pred_step_time_s'))}, {_f(p.get('err_step_pct'))}) | {_f(p.get('tokens_per_s'), '.0f')} | "
                f"{_f(p.get('model_tflops'))} | {_f(p.get('h2d_gbps'))} ({_f(p.get('pred_h2d_gbps'))}, "
                f"{_f(p.get('err_h2d_pct'))}) | {_f(p.get('d2h_gbps'))} ({_f(p.get('pred_d2h_gbps'))}, "
                f"{_f(p.get('err_d2h_pct'))}) | {_f(p.get('gpu_idle_fraction'), '.2f')} "
                f"({_f(p.get('pred_gpu_idle_fraction'), '.2f')}) | {_f(p.get('h2d_gbps_busy'))} | "
                f"{_f(p.get('speculative_rollbacks'), '.0f')} | {_f(dev_gib)} |")
    if f.get("vs_torch"):
        lines += ["", "step time against plain PyTorch on the same layers: " + ", ".join(
            f"{k} {_f(v, '.2f')}x" for k, v in f["vs_torch"].items())]
    if s.get("timeline"):
        t = s["timeline"]
        lines += ["", f"timeline ({t['label']}, `{t['trace_file']}`): step span {_f(t.get('span_s'))} s, compute busy "
                      f"{_f(t.get('compute_busy_frac'), '.2f')}, h2d hidden behind compute {_f(t.get('h2d_hidden_frac'), '.2f')}, "
                      f"d2h hidden {_f(t.get('d2h_hidden_frac'), '.2f')}"]
    return "\n".join(lines) + "\n"
