"""The NVMe tier's disk, measured: what the spill path achieves against raw direct I/O, and its overlap.

    python experiments/studies/nvme_bench.py --dir /path/on/the/disk [--mib 1024] [--out results/nvme]

1. raw: `dd` with O_DIRECT (oflag/iflag=direct, 64 MiB blocks) writing then reading one file: the disk's own
   sequential rate, by a tool that is not ours;
2. spill path: engine/host/spill.py's SpillFile (preallocated, O_DIRECT where allowed, positional writes and reads
   from two page-aligned ring buffers on two I/O threads, as the engine issues them), the same bytes as
   layer-sized records;
3. DeepSpeed's async I/O op (deepspeed.ops.aio, libaio) on the same file and buffers, when it builds here;
4. overlap: a small model trained in memory and spilled (every layer), on the real disk and on a disk emulated
   (nvme_gbps) at the rate where one layer's read + write take as long as its AdamW, with read-ahead (two ring
   buffers) and without (host_budget_bytes at the minimum: one ring buffer, each read after the last write).
   The optimizer step's time and the time it waited on reads say how much of the I/O hid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatrain.metrics.provenance import provenance  # noqa: E402

MIB = 1 << 20


def raw_dd(d: Path, mib: int) -> dict:
    f = d / "dd.bin"
    out = {}
    for what, args in (("write", [f"of={f}", "if=/dev/zero", "oflag=direct", "conv=fsync"]),
                       ("read", [f"if={f}", "of=/dev/null", "iflag=direct"])):
        r = subprocess.run(["dd", "bs=64M", f"count={mib // 64}", *args], capture_output=True, text=True, check=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
        out[f"{what}_gbs"] = int(m.group(1)) / float(m.group(2)) / 1e9
    f.unlink()
    return out


def spill_path(d: Path, mib: int, record_mib: int) -> dict:
    from megatrain.engine.parts import SpillFile, host_buffer

    n, rec = mib // record_mib, record_mib * MIB
    sf = SpillFile(d, n * rec)
    ring = [host_buffer(rec, torch.uint8) for _ in range(2)]
    for b in ring:
        b.fill_(7)
    out = {"direct_io": sf.direct, "record_mib": record_mib}
    with ThreadPoolExecutor(2) as pool:
        for what in ("write", "read"):
            os.sync()
            t0 = time.perf_counter()
            futs = [pool.submit(sf.write if what == "write" else sf.read, ring[i % 2], i * rec) for i in range(n)]
            for fu in futs:
                fu.result()
            if what == "write":
                os.fsync(sf.fd)
            out[f"{what}_gbs"] = n * rec / (time.perf_counter() - t0) / 1e9
    sf.close()
    return out


def deepspeed_aio(d: Path, mib: int) -> dict:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return {"error": "deepspeed async_io is not compatible here (libaio headers missing)"}
        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - reported as the row's result
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    from megatrain.engine.parts import host_buffer

    f = str(d / "aio.bin")
    buf = host_buffer(mib * MIB, torch.uint8)
    buf.fill_(7)
    h = aio.aio_handle(8 * MIB, 32, False, True, 2)
    out = {}
    t0 = time.perf_counter()
    h.sync_pwrite(buf, f)
    out["write_gbs"] = mib * MIB / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    h.sync_pread(buf, f)
    out["read_gbs"] = mib * MIB / (time.perf_counter() - t0) / 1e9
    os.unlink(f)
    return out


def deepspeed_aio_bounded(d: Path, mib: int, timeout_s: float) -> dict:
    """deepspeed_aio in a child process: its first use compiles the op (minutes), which must not hang the rest."""
    try:
        r = subprocess.run([sys.executable, __file__, "--dir", str(d), "--mib", str(mib), "--aio-only"],
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the async_io op did not build and load within {timeout_s:.0f} s"}
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": r.stderr[-300:]}


def _model(layers: int, hidden: int):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def train(d: Path | None, layers: int, hidden: int, steps: int, **cfg) -> dict:
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    eng = Engine(_model(layers, hidden), EngineConfig(parity_probe=False, nvme_path=str(d) if d else None, **cfg))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    step_s = []
    for k in range(steps + 1):
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        t0 = time.perf_counter()
        eng.step()
        if k:  # the first step creates the optimizer state
            step_s.append(time.perf_counter() - t0)
        eng.zero_grad()
        if k == 0 and eng.spill is not None:
            eng.spill.wait_s = 0.0
            eng.spill.file.io_s = 0.0
    eng.synchronize()
    out = {"optimizer_step_s": sorted(step_s)[len(step_s) // 2]}
    if eng.spill is not None:
        st = eng.spill.stats()
        out.update(slots=eng.spill.plan.slots, record_bytes=eng.spill.plan.record,
                   wait_per_step_s=st["nvme_wait_s"] / steps, io_per_step_s=st["nvme_io_s"] / steps,
                   direct_io=st["nvme_direct_io"])
        eng.spill.close()
    return out


def overlap(d: Path, layers: int, hidden: int, steps: int) -> dict:
    from megatrain.costs.nvme import plan_spill  # noqa: F401 - the rule the runs below follow

    mem = train(None, layers, hidden, steps)
    disk = train(d / "a", layers, hidden, steps)
    # The emulated disk: one layer's read + write take as long as its AdamW did in memory.
    u = mem["optimizer_step_s"] / layers
    gbps = 2 * disk["record_bytes"] / u / 1e9
    ahead = train(d / "b", layers, hidden, steps, nvme_gbps=gbps)
    probe = _minimum(d / "c", layers, hidden)
    serial = train(d / "d", layers, hidden, steps, nvme_gbps=gbps, host_budget_bytes=probe)
    return {"layers": layers, "hidden": hidden, "emulated_gbps": gbps, "in_memory": mem, "spilled_disk": disk,
            "emulated_read_ahead": ahead, "emulated_no_read_ahead": serial}


def _minimum(d: Path, layers: int, hidden: int) -> int:
    from megatrain.config.schema import EngineConfig
    from megatrain.costs.nvme import BudgetTooSmall
    from megatrain.engine import Engine

    try:
        Engine(_model(layers, hidden), EngineConfig(parity_probe=False, nvme_path=str(d), host_budget_bytes=1))
    except BudgetTooSmall as e:
        return int(str(e).split("the minimum is ")[1].split()[0])
    raise RuntimeError("a 1-byte budget was accepted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--record-mib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "nvme"))
    ap.add_argument("--aio-timeout", type=float, default=120.0)
    ap.add_argument("--aio-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    if args.aio_only:
        print(json.dumps(deepspeed_aio(d, args.mib)))
        return
    res = {"raw_dd_direct": raw_dd(d, args.mib), "spill_path": spill_path(d, args.mib, args.record_mib),
           "deepspeed_aio": deepspeed_aio_bounded(d, args.mib, args.aio_timeout), "overlap": overlap(d, args.layers, args.hidden, args.steps),
           "bytes": args.mib * MIB, "filesystem": subprocess.run(["df", "-T", str(d)], capture_output=True,
                                                                  text=True).stdout.splitlines()[-1].split()[1],
           "provenance": provenance()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
