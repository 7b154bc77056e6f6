"""results.csv: one row per point, appended crash-safely, read back tolerating a torn last line.

A row is written as one complete line with a single write() on an O_APPEND descriptor, then
fsync'd, so a crash or kill leaves either the whole row or a partial last line. A partial line
has no trailing newline; readers drop it and the next append cuts it off first, so the point it
belonged to simply runs again.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

# (column, meaning). The README's column table is checked against this list by the tests.
COLUMNS: list[tuple[str, str]] = [
    # what was run
    ("sweep", "sweep name (spec `name`)"),
    ("point_id", "stable hash of the point's measured settings; the key for skipping recorded points"),
    ("label", "readable point name, `backend/model/s{seq}/b{micro}[x{accum}]/{precision}[/knobs]`"),
    ("status", "`ok`; `skipped` (does not fit: preflight or the engine's host check); `failed` (error, out of memory, killed by a signal); `timeout`"),
    ("reason", "why a point is not ok: the preflight's needed-vs-available line, or the last error line"),
    ("backend", "`megatrain`, `zero3` or `torch`"),
    ("model", "model preset name (megatrain/models/presets.py)"),
    ("family", "HF architecture family of the preset (llama, qwen2, ...)"),
    ("num_layers", "decoder layers"),
    ("hidden", "hidden size"),
    ("intermediate", "SwiGLU MLP width"),
    ("heads", "attention heads"),
    ("kv_heads", "key/value heads"),
    ("vocab", "vocabulary size"),
    ("params", "total parameters (embeddings included)"),
    ("nonembed_params", "parameters outside the embedding and LM head, every expert counted (what is stored and streamed)"),
    ("active_params", "parameters one token computes with, embeddings included (a MoE's top-k experts; = params in a dense model); the FLOPs formula's N is this less the embeddings"),
    ("seq_len", "tokens per sequence (context length)"),
    ("micro_batch", "sequences per micro-batch"),
    ("grad_accum", "micro-batches per optimizer step"),
    ("tokens_per_step", "seq_len x micro_batch x grad_accum"),
    ("precision", "`fp32` or `bf16` (compute precision; megatrain masters stay FP32)"),
    ("recompute", "activation recompute (HF gradient checkpointing for torch/zero3; always on for megatrain)"),
    ("engine", "megatrain engine knobs as JSON (num_buffers, link_gbps, ...)"),
    ("optimizer", "the optimizer that actually stepped, with its kernel: e.g. `torch.optim.AdamW(fused)`, "
                  "`deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode)`"),
    ("backend_settings", "JSON of the settings the backend ran with that decide its speed: for zero3 the "
                         "resolved `zero_optimization` section (buckets, prefetch, persistence, live parameters)"),
    ("max_positions", "context limit the model was built with"),
    ("grad_clip", "global gradient-norm clipping applied every step (0: none)"),
    ("warmup_steps", "untimed warm-up optimizer steps"),
    ("timed_steps", "timed optimizer steps"),
    ("threads", "torch intra-op threads in the point's process"),
    # speed
    ("step_time_s", "mean wall time of the timed optimizer steps, run back to back; the last one's clock "
                    "stops once the host work they queued (overlapped layer updates) drained"),
    ("step_time_min_s", "fastest timed step"),
    ("step_time_max_s", "slowest timed step"),
    ("step_times_s", "all timed step times, JSON list"),
    ("tokens_per_s", "tokens_per_step / step_time_s"),
    ("flops_per_step", "6*N*T + 12*L*h*s*T*c with c=1/2 (causal); recompute and embeddings not counted"),
    ("model_tflops", "flops_per_step / step_time_s / 1e12"),
    ("device_peak_tflops", "peak of the device in this precision (see peak_source)"),
    ("peak_source", "`table` (vendor dense peak) or `measured` (best square matmul on this device and thread count)"),
    ("mfu", "model_tflops / device_peak_tflops"),
    ("forward_s", "time in forward per step (engine accounting for megatrain; wall time otherwise)"),
    ("backward_s", "time in backward per step (engine: includes per-layer recompute)"),
    ("optimizer_s", "time in the optimizer step (and zero_grad) per step"),
    ("copy_wait_s", "time the compute stream waited on copies per step (megatrain only)"),
    ("breakdown_source", "`engine` or `wall`"),
    ("loss_first", "loss of the first timed step (sanity: finite)"),
    ("loss_last", "loss of the last timed step"),
    # memory
    ("peak_device_bytes", "peak device memory: torch.cuda.max_memory_allocated on CUDA, the engine's "
                          "accounting for megatrain on CPU, empty for torch/zero3 on CPU (no separate device)"),
    ("device_mem_source", "`cuda`, `engine` or `none`"),
    ("device_weight_bytes", "weight bytes resident on the device at once (engine accounting; megatrain)"),
    ("residency", "layers kept on the device as weights/activations, e.g. `32/17` (megatrain; `0/0`: all streamed)"),
    ("recomputed_layers", "layers recomputed in backward per step (megatrain; micro-batches x streamed layers)"),
    ("peak_host_rss_bytes", "peak resident set size of the point's process"),
    ("base_host_rss_bytes", "RSS just before the model was built (imports, runtime)"),
    ("host_bytes_per_param", "(peak_host_rss_bytes - base_host_rss_bytes) / params"),
    # link
    ("streamed_weight_bytes", "decoder-layer weight bytes in the compute dtype: one full pass of the stream"),
    ("h2d_bytes_per_step", "host->device bytes per step (engine accounting, or NVML PCIe rx on CUDA)"),
    ("d2h_bytes_per_step", "device->host bytes per step (engine accounting, or NVML PCIe tx on CUDA)"),
    ("h2d_gbps", "h2d_bytes_per_step / step_time_s / 1e9 (achieved over the step)"),
    ("d2h_gbps", "d2h_bytes_per_step / step_time_s / 1e9"),
    ("h2d_busy_s", "time the host->device copy stream was busy per step (engine trace)"),
    ("h2d_gbps_busy", "h2d bytes / h2d_busy_s / 1e9 (achieved while copying)"),
    ("link_peak_h2d_gbps", "peak of the link host->device (see link_peak_source)"),
    ("link_peak_source", "`probe` (pinned CUDA copies), `emulated` (engine `link_gbps` on CPU) or `memcpy` (CPU, no emulation)"),
    ("link_util", "h2d_gbps / link_peak_h2d_gbps: the fraction of the step the link would be saturated"),
    ("link_source", "`engine`, `nvml` or `none`: where the byte counts came from"),
    ("trace_file", "per-step timeline of the last timed step (JSON, relative to the results dir), megatrain"),
    ("log_file", "the point's stdout+stderr (relative to the results dir)"),
    ("wall_s", "total wall time of the point, model build and warm-up included"),
    # preflight
    ("preflight_host_bytes", "host memory the planner estimated for the point"),
    ("preflight_device_bytes", "device memory the planner estimated for the point"),
    ("available_host_bytes", "host memory the planner found available"),
    ("available_device_bytes", "device memory the planner found available"),
    # provenance
    ("git_commit", "commit of the code that ran"),
    ("git_dirty", "true when tracked files differed from the commit"),
    ("versions", "python and package versions (megatrain, torch, transformers, accelerate, deepspeed)"),
    ("device_name", "accelerator name, or `cpu: <model>`"),
    ("host_mem_bytes", "total host memory"),
    ("cpu_model", "CPU model name"),
    ("cpu_count", "logical CPUs"),
    ("hostname", "machine name"),
    ("timestamp", "UTC time the row was written (ISO 8601)"),
]
COLUMN_NAMES: list[str] = [c for c, _ in COLUMNS]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(v)
    # One row must stay one line: error text can carry newlines.
    return " ".join(str(v).split()) if isinstance(v, str) else str(v)


def _line(values: list[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


def _truncate_torn_tail(path: Path) -> None:
    """Cut a partial last line (a crash mid-write) so the next row starts on its own line."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Walk back to the last newline; rows are short, so read a bounded tail.
        back = min(size, 1 << 20)
        f.seek(size - back)
        tail = f.read(back)
        cut = tail.rfind(b"\n")
        f.truncate(size - back + cut + 1 if cut >= 0 else 0)
        f.flush()
        os.fsync(f.fileno())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _header_ok(path: Path) -> bool:
    with open(path, newline="") as f:
        first = f.readline()
    return first.rstrip("\r\n") == _line(COLUMN_NAMES).rstrip("\n")


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one row; creates the file with its header. Unknown keys are an error (a typo would
    silently drop a metric otherwise)."""
    path = Path(path)
    extra = set(row) - set(COLUMN_NAMES)
    if extra:
        raise KeyError(f"unknown results columns: {sorted(extra)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        _truncate_torn_tail(path)
    if path.exists() and path.stat().st_size > 0 and not _header_ok(path):
        # Written by an older harness with other columns: rewrite it once under today's header.
        rewrite(path, read_rows(path, dedupe=False))
    new = not path.exists() or path.stat().st_size == 0
    data = (_line(COLUMN_NAMES) if new else "") + _line([_fmt(row.get(c)) for c in COLUMN_NAMES])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        _write_all(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rows(path: str | Path, dedupe: bool = True) -> pd.DataFrame:
    """All complete rows (a torn last line is ignored). With `dedupe`, the last row of each point
    wins, so a `--force` re-run replaces the earlier measurement."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame(columns=COLUMN_NAMES)
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    if not text.strip():
        return pd.DataFrame(columns=COLUMN_NAMES)
    df = pd.read_csv(io.StringIO(text), dtype={"point_id": str, "engine": str})
    for c in COLUMN_NAMES:
        if c not in df.columns:
            df[c] = pd.NA
    if dedupe and len(df):
        df = df.drop_duplicates(subset="point_id", keep="last").reset_index(drop=True)
    return df


def rewrite(path: str | Path, df: pd.DataFrame) -> None:
    """Atomically replace the file with `df` (under today's columns), e.g. to drop superseded rows."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    lines = [_line(COLUMN_NAMES)]
    for rec in df.to_dict("records"):
        lines.append(_line([_fmt(None if _isna(rec.get(c)) else rec.get(c)) for c in COLUMN_NAMES]))
    with open(tmp, "w") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def compact(path: str | Path) -> None:
    """Keep one row per point (the last) on disk, atomically, copying each kept row's text as it
    was written: a pandas round trip would re-type columns (e.g. 2 -> 2.0 next to empty cells)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    if header != COLUMN_NAMES:
        rewrite(path, read_rows(path, dedupe=True))
        return
    key = header.index("point_id")
    last = {r[key]: i for i, r in enumerate(body) if len(r) == len(header)}
    kept = [body[i] for i in sorted(last.values())]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(_line(r) for r in [header, *kept]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _isna(v: Any) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False
