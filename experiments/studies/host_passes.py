"""The host side of a step against the memory-bandwidth bound, per host mode (a benchmark, not a test; its
results are committed under results/host_passes/).

    python -m experiments.studies.host_passes [--preset llama-100m] [--reps 5] [--modes ...]

For each host mode (FP32 master, FP32 master + bf16 shadow, each stepped whole and with optimizer_overlap's
per-layer update; hilo; hilo + bf16 gradient slabs) one engine is built, and after an untimed forward +
backward on a 16-token batch it times `clip_grad_norm_(1.0) + step() + zero_grad()` (each followed by
`synchronize()`, so queued layer jobs count, and timed apart). The per-layer modes are timed with the fused
pass (engine/update/fused.py: "fused"), with the whole-layer passes it replaced ("unfused"), and for hilo with the
split/join held to their pure-torch path and torch's AdamW kernel ("fused, torch ops": no C compiler), and with
the compiled one-loop AdamW (engine/update/adam_kernel.py) swapped for torch's kernel between the tile's unpack and pack
("fused, torch AdamW": the fused pass before that kernel). Variants alternate on the same
engine, so drift on a shared machine hits them alike. The optimizer in backward (hilo) is timed as the
optimizer thread's busy time over one backward: its per-layer updates, against the layers' bytes bound; and as
"layer updates alone": the same per-layer job run for every layer after the step, with no backward computing
on the same cores (on a GPU host the backward computes on the device, so this is the host's own share).

"step-time norm + zeroing": clip_grad_norm_ reading every layer slab for its norm and zero_grad() zeroing
them, as before engine/host/slab_state.py (now the norm is measured by the job that lands each layer's gradients,
reported apart as "layer norms as gradients land": work moved into backward, off the step, and zero_grad()
only flags the slabs, whose next reduction writes 0 + g).

The bound is the bytes a fused AdamW must move, at this process's measured copy bandwidth (`copy_` of a
256 MiB FP32 tensor, counted as bytes read + bytes written, the best of several measurements through the
run): per decoder-layer parameter read the gradient (4 B, or 2 from a bf16 slab or staging), the master (4:
FP32, or hi + lo), m and v (8), write master, m and v (12), plus 2 B of bf16 shadow refresh in the FP32 +
shadow mode; the resident parameters (embedding, norm, head) are FP32 with FP32 gradients: 28 B each. The
same is reported for hilo's split and join alone on one layer-sized tensor (split: read 4 + write 4, plus 4
of NaN poison; join: read 4, write 4).

Writes results/host_passes/host_passes.csv and README.md (with provenance).

`--reducer 1,2` instead times backward's reduction of one layer (SlabState.reduce with the one-pass kernel,
engine/host/reduce_kernel.py: bf16 staging written or added into an FP32 slab, its chunked norm and finite flag)
on each of those thread counts, each repetition paired with `copy_` of an FP32 tensor as large on the same
threads right before and after it; x bound = time / (10 B/param / the paired copy bandwidth, read + written). It
prints its table and writes nothing.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

WHOLE_STEP = "_whole_step"  # not an EngineConfig key: the engine is built with choose.layer_pass_pays off
MODES = [
    ("fp32", {"compute_dtype": "float32"}),
    ("bf16 shadow", {"compute_dtype": "bfloat16"}),
    # The same mode held to the whole step (one optimizer.step(), the clip and shadow refresh passes around it):
    # what it ran before choose.layer_pass_pays sent it a layer at a time.
    ("bf16 shadow, whole step", {"compute_dtype": "bfloat16", WHOLE_STEP: True}),
    ("fp32, overlap", {"compute_dtype": "float32", "optimizer_overlap": True}),
    ("bf16 shadow, overlap", {"compute_dtype": "bfloat16", "optimizer_overlap": True}),
    ("hilo", {"compute_dtype": "bfloat16", "host_master": "hilo"}),
    ("hilo + bf16 slabs", {"compute_dtype": "bfloat16", "host_master": "hilo", "host_grad_dtype": "bfloat16"}),
]
# Optimizer in backward: each layer's update runs during backward (no clip, no step-time pass); timed as the
# optimizer thread's busy time over one backward.
OIB_MODES = [
    ("hilo, optimizer in backward", {"compute_dtype": "bfloat16", "host_master": "hilo",
                                     "optimizer_in_backward": True}),
]
OUT = Path("results/host_passes")


def copy_bandwidth(numel: int = 1 << 26, reps: int = 5) -> float:
    """Bytes read + written per second by `copy_` of one large FP32 tensor into another (best of `reps`)."""
    a, b = torch.ones(numel), torch.empty(numel)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    return 2 * 4 * numel / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class TorchOps:
    """Within it, hilo's split/join run their torch-ops path: what runs where there is no C compiler. (Set once
    for the whole context: a swap around each call raced between the fused pass's worker threads and could
    leave the compiled kernel off for the rest of the run.)"""

    def __enter__(self):
        from megatrain.engine.parts import hilo

        self.hilo = hilo
        hilo.kernel()
        self.saved, hilo._KERNEL.state = hilo._KERNEL.state, None

    def __exit__(self, *exc) -> None:
        self.hilo._KERNEL.state = self.saved


def bytes_bound(eng, mode: str) -> int:
    layer = sum(g.numel for g in eng.store.layers)
    per = 26 if "bf16 slabs" in mode or "in backward" in mode else 30 if mode.startswith("bf16 shadow") else 28
    if "in backward" in mode:
        return layer * per  # the layers only: the resident parameters are stepped in step()
    return layer * per + eng.store.globals.numel * 28


class Unfused:
    """The per-layer update as whole-layer passes one after another (load/scale the gradients, join, AdamW,
    split or shadow refresh): what ran before the fused pass (engine/update/fused.py)."""

    def __enter__(self):
        from megatrain.engine.parts import fused

        self.fused, self.saved = fused, fused.eligible
        fused.eligible = lambda *a: False

    def __exit__(self, *exc) -> None:
        self.fused.eligible = self.saved


class TorchAdamW:
    """The fused pass with torch's AdamW kernel between the tile's unpack and pack (what runs where the compiled
    one-loop step, engine/update/adam_kernel.py, is unavailable): the fused pass before that kernel."""

    def __enter__(self):
        from megatrain.engine.parts import adam_kernel

        self.mod = adam_kernel
        self.mod.kernel()  # built and self-checked before the swap
        self.saved, self.mod._state = self.mod._state, None

    def __exit__(self, *exc) -> None:
        self.mod._state = self.saved


class NoCompiler:
    """Where no C compiler is found: hilo's split/join in torch ops and torch's AdamW kernel."""

    def __enter__(self):
        self.parts = [TorchOps(), TorchAdamW()]
        for p in self.parts:
            p.__enter__()

    def __exit__(self, *exc) -> None:
        for p in reversed(self.parts):
            p.__exit__(*exc)


class StepTimeNorm:
    """The layers' gradient norm read from the slabs by clip_grad_norm_ and zero_grad() zeroing them (what ran
    before engine/host/slab_state.py measured the norm as gradients land and let the next reduction overwrite)."""

    def __enter__(self):
        from megatrain.engine.parts import SlabState

        self.cls, self.saved = SlabState, (SlabState.reduce, SlabState.zero)
        reduce = self.saved[0]

        def zero(state, i, slab) -> None:
            state._norms[i] = None
            state.fresh[i] = False
            slab.zero_()

        SlabState.reduce = lambda state, i, slab, add, measure: reduce(state, i, slab, add, False)
        SlabState.zero = zero

    def __exit__(self, *exc) -> None:
        self.cls.reduce, self.cls.zero = self.saved


def variants(mode: str) -> dict:
    """label -> context manager factory (None: as now)."""
    per_layer = mode.startswith("hilo") or "overlap" in mode or mode == "bf16 shadow"
    out = {"unfused": Unfused} if per_layer else {}
    if "in backward" not in mode:
        out["step-time norm + zeroing"] = StepTimeNorm
    out["fused" if per_layer else "whole step"] = None
    if per_layer:
        out["fused, torch AdamW"] = TorchAdamW
    if mode.startswith("hilo"):
        out["fused, torch ops"] = NoCompiler
    return out


def bench_mode(preset, mode: str, cfg: dict, reps: int) -> list[dict]:

    from experiments.point import build_preset_model
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine.parts import choose

    cfg = dict(cfg)
    saved = choose.layer_pass_pays
    if cfg.pop(WHOLE_STEP, False):
        choose.layer_pass_pays = lambda *a: False
    try:
        eng = Engine(build_preset_model(preset, 0), EngineConfig(device="cpu", parity_probe=False, **cfg))
    finally:
        choose.layer_pass_pays = saved
    ids = torch.randint(0, preset.vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    bound = bytes_bound(eng, mode)
    oib = cfg.get("optimizer_in_backward", False)
    vs = variants(mode)
    staging = None
    if oib:  # what the layer updates read: gradients as the device stages them (compute dtype), small values
        dtype = torch.bfloat16 if cfg.get("compute_dtype") == "bfloat16" else torch.float32
        numel = max(g.numel for g in eng.store.layers)
        staging = (torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dtype)
    times: dict[str, list[tuple[float, ...]]] = {k: [] for k in vs}
    paired: dict[str, list[float]] = {k: [] for k in vs}  # time / bound at the copy bandwidth of that moment
    paired_alone: dict[str, list[float]] = {k: [] for k in vs}
    for r in range(reps + 1):  # the first round warms up (first-touch pages, the kernel's build, the state)
        for label, ctx in vs.items():
            with (ctx() if ctx is not None else nullcontext()):
                loss = eng(input_ids=ids, labels=ids.clone()).loss
                if oib:
                    # the layer updates run on the optimizer thread during backward: its busy time is theirs
                    eng.synchronize()
                    eng._layered.reset_counters()
                    bw_before = copy_bandwidth(1 << 24, 2)
                    eng.backward(loss)
                    eng.synchronize()
                    parts = [eng._layered.busy_s]
                    eng.step()
                    eng.zero_grad()
                    parts.append(_updates_alone(eng, staging))
                else:
                    eng.backward(loss)
                    eng.synchronize()
                    bw_before = copy_bandwidth(1 << 24, 2)
                    parts = []
                    for call in (lambda: eng.clip_grad_norm_(1.0), eng.step, eng.zero_grad):
                        t0 = time.perf_counter()
                        call()
                        eng.synchronize()  # queued layer jobs count where they are queued
                        parts.append(time.perf_counter() - t0)
            # The rate of the moment: measured just before and just after the timed part (the machine's load
            # drifts from one second to the next), their mean.
            bw_now = (bw_before + copy_bandwidth(1 << 24, 2)) / 2
            if r:
                times[label].append(tuple(parts))
                if oib:
                    paired[label].append(parts[0] / (bound / bw_now))
                    paired_alone[label].append(parts[1] / (bound / bw_now))
                else:
                    paired[label].append(sum(parts) / (bound / bw_now))
    params = sum(g.numel for g in (eng.store.layers if oib else eng.store.groups()))
    rows = []
    if not oib:
        # The work the landed norms moved into backward: each layer slab's norm, on the reducer's thread there.
        eng.backward(eng(input_ids=ids, labels=ids.clone()).loss)
        eng.synchronize()
        slabs = [g.grad for g in eng.store.layers]
        norm = [min(_timed(lambda: [torch.linalg.vector_norm(x if x.dtype == torch.float32 else x.float())
                                    for x in slabs]) for _ in range(reps))]
        eng.zero_grad()
        rows.append({"what": "layer norms as gradients land (in backward)", "mode": mode, "version": "as built",
                     "params": params, "seconds": round(norm[0], 4), "median_total_s": "",
                     "ns_per_param": round(norm[0] / params * 1e9, 3), "bound_bytes": "", "gb_per_s": "",
                     "x_bound": "", "x_bound_paired": ""})
    for label, ts in times.items():
        # The fastest round: on a shared machine the others carry other processes' time.
        best = min(ts, key=lambda t: t[0] if oib else sum(t))
        names = (("layer updates in backward", best[0]), ("layer updates alone", best[1])) if oib else (
            ("clip+step+zero_grad", sum(best)), ("  clip", best[0]), ("  step", best[1]), ("  zero_grad", best[2]))
        for what, t in names:
            row = {"what": what.strip(), "mode": mode, "version": label, "params": params,
                   "seconds": round(t, 4), "median_total_s": round(statistics.median(map(sum, ts)), 4),
                   "ns_per_param": round(t / params * 1e9, 3), "bound_bytes": "", "gb_per_s": "", "x_bound": "",
                   "x_bound_paired": ""}
            if what == "layer updates alone":
                ps = paired_alone[label]
                row["x_bound_paired"] = f"{min(ps):.2f} / {statistics.median(ps):.2f}"
                row["bound_bytes"] = bound
            elif not what.startswith(" "):
                row["x_bound_paired"] = f"{min(paired[label]):.2f} / {statistics.median(paired[label]):.2f}"
                row["bound_bytes"] = bound  # rate and ratio: in main(), against the run's best copy bandwidth
            rows.append(row)
    return rows


def _updates_alone(eng, staging: torch.Tensor) -> float:
    """The optimizer in backward's per-layer updates (the job its optimizer thread runs) one after another with
    no backward computing beside them: every layer updated from `staging`, timed."""
    t0 = time.perf_counter()
    for i in range(len(eng.store.layers)):
        eng.update.update_now(i, staging)
    return time.perf_counter() - t0


def bench_passes(numel: int, impls: dict, reps: int) -> list[dict]:
    """hilo's split and join alone on one layer-sized tensor."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    hi, lo, out = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.int16), torch.empty(numel)
    scratch = torch.empty(numel)
    rows = []
    from megatrain.engine.parts import hilo as mod

    for label, impl in impls.items():
        ctx = impl() if impl is not None else nullcontext()
        with ctx:
            ties = mod.split(x, hi, lo)

        def split_poisoned() -> None:
            mod.split(scratch, hi, lo, poison=True)

        for what, fn, nbytes in (
            ("split + NaN poison", split_poisoned, 12 * numel),
            ("join", lambda ties=ties: mod.join(hi, lo, ties, out), 8 * numel),
        ):
            ts = []
            for _ in range(reps + 1):
                scratch.copy_(x)
                with impl() if impl is not None else nullcontext():
                    ts.append(_timed(fn))
            t = min(ts[1:])
            rows.append({"what": what, "mode": "hilo", "version": label, "params": numel, "seconds": round(t, 5),
                         "median_total_s": round(statistics.median(ts[1:]), 5),
                         "ns_per_param": round(t / numel * 1e9, 3), "bound_bytes": nbytes, "gb_per_s": "",
                         "x_bound": "", "x_bound_paired": ""})
    return rows


def write(rows: list[dict], meta: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "host_passes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Host passes against the memory-bandwidth bound",
        "",
        "Written by `python -m experiments.studies.host_passes` (see its docstring for what is timed and how the",
        "bound is counted). `x bound` = measured time / (bytes a fused pass must move / this process's `copy_`",
        "bandwidth, read + written). \"unfused\": the per-layer update as whole-layer passes (as before the fused",
        "pass); \"fused\": engine/update/fused.py with the compiled one-loop AdamW (engine/update/adam_kernel.py); \"torch AdamW\":",
        "the fused pass with torch's AdamW kernel per tile instead; \"torch ops\": where no C compiler is found.",
        "",
        f"- preset: {meta['preset']}, 16-token batch; the fastest of {meta['reps']} timed rounds after one warm-up",
        "  (shared machine: slower rounds carry other processes' time; the medians are in the CSV)",
        f"- copy bandwidth: {meta['copy_gbps']:.2f} GB/s (read + written; the best of {meta['copy_all']} GB/s, "
        f"measured before each mode and at the end), torch threads: {meta['threads']}",
        f"- hilo kernel: {meta['kernel']}",
        f"- machine: {meta['cpu']} ({meta['cores']} cores), torch {meta['torch']}, python {meta['python']}",
        f"- commit: {meta['commit']}",
        "",
        "`x bound, paired`: each round's time against the copy bandwidth measured just before and after it, best / median",
        "of the rounds (the load of a shared machine drifts; this ratio is the steadier one).",
        "",
        "| what | mode | version | ns/param | GB/s | x bound | x bound, paired |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['mode']} | {r['version']} | {r['ns_per_param']} | {r['gb_per_s']} | "
              f"{r['x_bound']} | {r['x_bound_paired']} |" for r in rows]
    readme = OUT / "README.md"
    # The hand-written reading of a run (from "## Notes" on) survives a rerun; check it against the new table.
    old = readme.read_text() if readme.exists() else ""
    notes = old[old.index("## Notes"):] if "## Notes" in old else ""
    readme.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))


REDUCER_BYTES = 10  # per element: the bf16 gradient read (2), the slab read (4) and written (4; a first write too)


def bench_reducer(numel: int, threads: int, reps: int) -> dict[str, list[float]]:
    """x bound per repetition of the one-pass reduction on `threads` threads, "first" (0 + g) and "add"."""
    from megatrain.engine.parts import PartsAdd, SlabState, set_team

    set_team(threads)  # this thread's team: the kernel splits its chunks over as many
    slab, staging = torch.zeros(numel), (torch.randn(numel) * 1e-3).to(torch.bfloat16)
    a, b = torch.ones(numel), torch.empty(numel)
    state = SlabState(1)
    state.overwrite = True
    adds = PartsAdd(lambda first: None, [(0, staging)])  # the kernel's path only (usable: it always is here)
    out: dict[str, list[float]] = {"first": [], "add": []}
    for _ in range(reps + 1):
        for what in ("first", "add"):
            if what == "first":
                state.zero(0, slab)
            before = 8 * numel / _timed(lambda: b.copy_(a))
            t = _timed(lambda: state.reduce(0, slab, adds, True))
            after = 8 * numel / _timed(lambda: b.copy_(a))
            out[what].append(t / (REDUCER_BYTES * numel / ((before + after) / 2)))
    return {k: v[1:] for k, v in out.items()}  # the first round warms the pages


def reducer_main(threads: list[int], numel: int, reps: int) -> None:
    from megatrain.engine.parts import reduce_kernel

    if reduce_kernel.kernel() is None:
        raise SystemExit("no compiled reduce kernel here (no C compiler?): nothing to time")
    print(f"| threads | reduction | x bound ({REDUCER_BYTES} B/param), best | median |\n|---:|---|---:|---:|")
    for n in threads:
        got = bench_reducer(numel, n, reps)
        for what, xs in got.items():
            print(f"| {n} | {what} | {min(xs):.2f} | {statistics.median(xs):.2f} |", flush=True)
    print(f"({numel} elements, {reps} repetitions, {len(os.sched_getaffinity(0))} cores, "
          f"load {os.getloadavg()[0]:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-100m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default=";".join(m for m, _ in MODES + OIB_MODES), help="';'-separated")
    ap.add_argument("--reducer", default="", help="thread counts, e.g. 1,2: time the reducer's pass only")
    ap.add_argument("--numel", type=int, default=1 << 24, help="--reducer: elements of the layer")
    a = ap.parse_args()
    if a.reducer:
        reducer_main([int(x) for x in a.reducer.split(",")], a.numel, a.reps)
        return

    from megatrain.engine.parts import hilo
    from megatrain.metrics.provenance import cpu_model, git_commit
    from megatrain.models.presets import get_preset

    preset = get_preset(a.preset)
    impls = {"compiled": None, "torch ops": TorchOps}
    # The copy bandwidth is measured again before every mode and the passes, and the best of all is the bound's
    # rate: on a shared machine one early measurement can catch a busy moment and flatter every ratio after it.
    bws, rows, wanted = [copy_bandwidth()], [], a.modes.split(";")
    for mode, cfg in MODES + OIB_MODES:
        if mode in wanted:
            rows += bench_mode(preset, mode, cfg, a.reps)
            bws.append(copy_bandwidth())
            print(mode, "done", flush=True)
    rows += bench_passes(preset.layer_params(), impls, a.reps)
    bws.append(copy_bandwidth())
    bw = max(bws)
    for r in rows:
        if r["bound_bytes"] != "":
            r["gb_per_s"] = round(r["bound_bytes"] / r["seconds"] / 1e9, 2)
            r["x_bound"] = round(r["seconds"] / (r["bound_bytes"] / bw), 2)
    commit, dirty = git_commit()
    lib = hilo.kernel()
    meta = {"preset": a.preset, "reps": a.reps, "copy_gbps": bw / 1e9, "copy_all": [round(b / 1e9, 2) for b in bws],
            "threads": torch.get_num_threads(),
            "kernel": "compiled C (ctypes)" if lib is not None else "torch ops (no compiler)",
            "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": sys.version.split()[0], "commit": commit + (" (dirty)" if dirty else "")}
    write(rows, meta)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
