"""Performance and memory model of MegaTrain and its baselines: arithmetic over model shapes and
hardware profiles (megatrain/data/hardware.yaml). Its megatrain device-memory terms are the engine's
own long-context model (megatrain/costs/memory.py, torch-free), so the two agree.

    from megatrain.planner import plan, max_batch, max_context, preflight
    pl = plan("120b", context=4096, batch=8, hardware="h200-pcie")      # -> Plan
    pl.fits, pl.memory.host, pl.memory.device, pl.time.step_s, pl.tokens_per_s, pl.model_tflops
    megatrain plan --model 120b --context 4096 --batch 8 --hardware h200-pcie

What it charges (c = bytes of the compute dtype, T = tokens per micro-batch, k = layer buffers):
  host (megatrain)  the streamed layers by host-memory mode (megatrain/costs/modes.py, what the engine allocates
                    by: master 4 (fp32 / hilo) or 2 (bf16) + grad 4, 2 (bf16) or 0 (optimizer in backward) + Adam
                    m 4 + v 4 + a 2 B bf16 shadow with an fp32 master in bf16 compute), the globals 16 B/param,
                    one layer's FP32 scratch in the non-default modes, + offloaded boundary
                    activations L*T*h*c, pinned grad staging and the head-gradient host copy (CUDA),
                    and the share of it that is pinned (costs/pinning.py's rule, page-exact),
                    runtime (a profile number; measured by `megatrain bench` on this machine).
  device            what costs/memory.py's LongContextPolicy predicts for the batch (and chooses: offload,
                    MLP tile): k layer buffers + embedding/head/norm, boundary activations (all L, or a few
                    in flight when offloaded), the larger of one layer's (tiled) recompute + backward and the
                    chunked-loss workspace; + the runtime's reserve; + the residency (costs/residency.py): kept
                    layers' weights and forward graphs, the ring freed when every layer is kept.
  residency         the point's `residency` (EngineConfig's default when unset): counts as given, or for "auto"
                    the planner's placement (placement.py): the placements that fill the room the batch's working
                    set leaves, replayed, the fastest kept unless the engine's own weights-first fill is within 1%;
                    kept layers are copied once per step (ahead of the ring's prefetches), graph layers' backward
                    skips the recompute, and the replay counts the step's H2D bytes and recomputed layers (the
                    engine reports both). Where the whole model fits the device, plain PyTorch's step beside it
                    (reference.py).
  time              the engine's schedule replayed (costs/pipeline.py's issue order, the one engine/pipeline/schedule.py
                    runs, on a compute lane and the copy lanes): per layer compute = FLOPs / (peak x sustained)
                    + elementwise bytes / device bandwidth, attention included (causal, flash backward = 2.5x
                    forward); h2d = layer bytes / link; d2h = grad bytes / link and the host add (on the d2h
                    worker on a CPU device; on CUDA the reducer thread after the copy, c + 8 B/param with its norm
                    (a bf16 slab: c + 4), one pass into FP32 slabs (engine/host/reduce_kernel.py), on a quarter of
                    the host's cores as engine/runtime/stream.py side_threads gives it, host_work.py, with the
                    staging slots it blocks on; its rate held at the bound on more threads than it was measured
                    on, and shared with the globals' reduce lane beside it); fills, drains, the layers still resident
                    at the turn and across micro-batches, activation offload; + the embedding/head I/O the
                    engine does per device type (none on a CPU device in FP32: it aliases them; on CUDA the
                    gradients' copy on the d2h lane after the head, their add on a reduce lane of its own, as
                    the engine adds them on a worker of their own, engine/pipeline/global_grads.py, at that
                    worker's share of the host's bandwidth) + CPU AdamW
                    (bytes touched / host bandwidth) after backward, or with optimizer_overlap (its "auto", as the
                    engine resolves it: on with a CUDA device) a layer at a time behind the next forward, or with
                    optimizer_in_backward a layer at a time behind the backward; the resident parameters' update
                    on the launch thread once the layer jobs are queued, and their rounding into the bf16 upload
                    staging on a worker of its own, which the next forward waits for (host_work.py).
                    The step's timeline (step_timeline.py): GPU busy, each link's and the host's busy time, the
                    GPU idle fraction and its causes. `megatrain plan` also tabulates every mode at the point.
  zero3             DeepSpeed ZeRO-3 (or ZeRO-2, zero_stage=2) offload from its mechanisms (zero3_model.py):
                    host memory as stage3.py allocates it; per-submodule fetches with DeepSpeed's lookahead
                    and event limit, host hooks per module / parameter / bucket, the buckets' FP32 cast,
                    DeepSpeedCPUAdam at the profile's parameters/s after backward; HF's full logits and
                    activations on the device.
  data parallel     plan_multi / `plan --gpus-per-node N --nodes M` (multi.py): one host store per node (the layers'
                    state once, the resident parameters, staging, activations and a gradient transit buffer per
                    rank), each GPU's share of the host link and DRAM bandwidth, the gradient reduction within a
                    node (host memory) and across nodes (ring all-reduce), and the scaling efficiency; on GPUs
                    joined by NVLink the node path instead (node_path.py, docs/DISTRIBUTED.md: each GPU's 1/G shard
                    over its link, NVLink all-gather / reduce-scatter, one host update split by shard, nodes
                    sharing one store), ZeRO-3 offload on the same GPUs (zero3_node.py); summary.py is the
                    command's first screen.
Where each part lives: point.py (the settings), memory.py, step_time.py and pipeline_sim.py (the models),
placement.py (the residency search), reference.py (plain PyTorch where the model fits),
prediction.py (the Plan), estimate.py (plan), point_plan.py (plan_point, the host modes), search.py (fit questions), multi.py (data parallel),
summary.py and details.py (the plan as text), cli.py (`megatrain plan`'s flags, `python -m megatrain.planner`).
Every assumption is a named constant in those modules or in megatrain/costs/, or a sourced number in the profiles file.
"""

from .advice import Advisor, profile_for_device
from .alst import BUCKET_TERM, zero3_alst_device_terms
from .cli import add_plan_args, flag_knobs, flag_profiles, run_plan
from .estimate import plan, plan_point, predicted_timeline
from .hardware import Hardware, get_hardware, load_profiles, profile_from_dict
from .multi import MultiPlan, plan_multi
from .point import BACKENDS, Point, make_point
from .point_plan import MODES
from .prediction import Plan
from .search import Preflight, max_batch, max_context, preflight
from .shapes import is_model_path, resolve_model
from .step_time import ComputeTerms, compute_terms, crossover_closed_form, sustained_from_layer_time

# The planner's front door: what the commands, the harness and the notebooks use. Its other modules are its own
# (tests reach them where they test them); tests/unit/test_planner_surface.py keeps commands/ and experiments/ to
# these names and the planner off the commands.
__all__ = [
    # a point, its plan, the fit questions
    "BACKENDS", "MODES", "MultiPlan", "Plan", "Point", "Preflight", "make_point", "max_batch", "max_context", "plan",
    "plan_multi", "plan_point", "preflight",
    # hardware profiles and model shapes
    "Hardware", "get_hardware", "is_model_path", "load_profiles", "profile_from_dict", "resolve_model",
    # figures the studies set beside measurements; the compute model `megatrain bench` fits engine times against
    "BUCKET_TERM", "ComputeTerms", "compute_terms", "crossover_closed_form", "predicted_timeline",
    "sustained_from_layer_time", "zero3_alst_device_terms",
    # the engine's placement advice (backend/placement.py asks through costs/advice.py's protocol)
    "Advisor", "profile_for_device",
    # `megatrain plan` / `python -m megatrain.planner` (cli.py)
    "add_plan_args", "flag_knobs", "flag_profiles", "run_plan",
]
