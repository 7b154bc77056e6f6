"""The CUDA path, checked: one script that validates and measures MegaTrain on a machine with an NVIDIA GPU.

    bash experiments/gpu_check.sh                 # on the GPU machine (installs ./wheels/*.whl first, if any)
    bash scripts/fetch_wheels.sh                  # on a machine with network, for a GPU machine without it
    python -m experiments.gpu_check --dry-run     # the same script on the CPU with tiny shapes (CI runs it)
    python -m experiments.gpu_check --only parity,sanitizer   # rerun some phases

Results land in results/gpu/<UTC time>/ (or --out). Set MEGATRAIN_GIT_COMMIT=<sha> to record the commit
when the tree has no .git. The whole check takes at most 280 s from the wrapper's start (TOTAL_BUDGET_S; README.md).

Phases, in order (correctness first, the bench last with at least BENCH_MIN_S = 120 s of the 280), each with its
own time budget, in a child process that the parent kills when a phase overruns and replaces when it dies (and
after a phase that raised on a GPU, whose CUDA context may be poisoned): a hang or a crash costs that phase only.
The parent publishes the summary after every phase. README.md gives the time plan and the `carry` list.

- env        what ran where: GPU, driver, PCIe link, torch/CUDA, packages, host memory and cores, pinning
- parity     engine vs plain PyTorch on the device: FP32 (Llama, tied Qwen2), bf16, 1 and 3 device
             buffers; offloaded activations and the overlapped optimizer bit-identical to their plain
             runs under deterministic kernels; pinned host bytes exactly the preflight's figure
- features   speculation on vs off bit-identical with a clip that scales every step and one that never does
             (rollbacks counted); a NaN loss skipped by skip_nonfinite as if its batch never came; device-tensor
             batches through forward, loss and backward under set_sync_debug_mode("error") (CUDA only);
             residency "stream" vs "auto" bit-identical (features.py)
- sync       no synchronizing CUDA call inside the per-layer loop (torch.cuda.set_sync_debug_mode), every
             layer streamed and at a partial placement (some layers kept), with a planted `.item()` that
             must be caught; pinned buffers and side streams in use
- stress     slowed copy and compute streams must not change results (stream waits, record_stream, the
             allocator's reuse of activation memory); a removed wait must be caught; the host must run
             ahead of delayed copies (non-blocking copies from pinned memory)
- bandwidth  pinned and pageable host<->device copies timed with CUDA events, both directions at once,
             the engine's own copy stream, and the bf16/fp32 matmul rate (the link and compute ceilings)
- dp2        (two GPUs; skipped, saying "needs 2 GPUs (found N)", with fewer) the node path under torchrun: 2 NCCL
             ranks, every layer streamed, FP32 losses within 1e-5 of one process on the concatenated batch and each
             rank's h2d/d2h bytes per step <= 0.6x a lone process's (dp2.py)
- bench      8 layers of llama2-7b's width at 1 x 4096 tokens: residency "stream", "auto" and plain PyTorch on
             the same layers; measured H2D/D2H GB/s and GPU idle beside the planner's prediction, error in %
             (bench.py)
- sanitizer  (only with --only sanitizer: ~75 s) parity runs under PyTorch's CUDA stream sanitizer
             (TORCH_CUDA_SANITIZER=1) on every thread the engine starts, in the GPU's configuration (bf16 compute,
             overlap on, hilo), with the overlap off, and FP32, each with every layer streamed and at a partial
             placement

No module of the check imports pandas or DeepSpeed (the GPU image has neither need: a unit test checks). Its
engines run without the parity probe (`parity_probe=False`): the probe trains tiny models on the CPU whatever the
device (the suite and docs/COMPATIBILITY.md cover it), and every phase here compares with PyTorch itself; on a
fresh machine (an empty probe cache) it cost the dry run's parity phase 39 of its 104 s.

Tolerances (sanitizer): bf16 compute against plain PyTorch in the same mixed-precision scheme (FP32 masters
and gradients, bf16 forward and backward), at the suite's tolerance (tests/gpu_defaults.py): 2 x that
reference's own bf16 floor measured in the same run (how far it moves when only its attention kernel
changes, sdpa's own choice -> sdpa's math kernel); FP32 against FP32 at 1e-5.

Tolerances (parity): first-step gradients 1e-5 relative on a GPU (1e-6 on the CPU: the engine and the
reference run different kernels there), per-step losses 1e-5, parameters after 5 AdamW steps at lr 1e-3
1e-5, except entries whose first gradient is at the noise level of those kernel differences: Adam moves
them by about lr whatever the gradient's size, so they are held to 2 lr per step and reported apart.

Outputs, in --out: phases/<phase>.json (written as each check finishes), results.csv (the bench's rows),
traces/ (the engine points' median step), summary.json and summary.md; with --bundle DIR (default: $OUT when
set) the 6 files worth reading are copied there after every phase: summary.md, summary.json, results.csv,
timeline.json (the streamed point's median step), gpu_check.tar.gz (everything), and the wrapper's log.txt. The summary table
is printed last.
"""

from .bandwidth import phase_bandwidth
from .bench import bench_points, phase_bench
from .common import PHASES, SHAPES, Ctx, Shapes, make_batches, tiny_model
from .env import phase_env
from .features import phase_features
from .orchestrate import PHASE_FNS, Orchestrator, run_phases
from .parity import phase_parity
from .sanitizer import phase_sanitizer
from .stress import phase_stress, slow_compute, slow_copies
from .summary import build_summary, render_markdown, trace_metrics
from .sync import phase_sync, sync_watch

__all__ = ["PHASES", "PHASE_FNS", "SHAPES", "Ctx", "Orchestrator", "Shapes", "bench_points", "build_summary",
           "make_batches", "phase_bandwidth", "phase_bench", "phase_env", "phase_features",
           "phase_parity", "phase_sanitizer", "phase_stress", "phase_sync", "render_markdown", "run_phases", "slow_compute",
           "slow_copies", "sync_watch", "tiny_model", "trace_metrics"]
