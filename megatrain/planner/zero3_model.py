"""DeepSpeed ZeRO-3 (and ZeRO-2) CPU offload, as its mechanisms run it: per-submodule fetches with a
bounded lookahead, host-side hooks, gradient buckets, and DeepSpeedCPUAdam's own throughput.

Arithmetic only, over a decoder layer's submodules; `step_time.py` turns it into a step. What each
term is, from DeepSpeed 0.19.8's source (deepspeed.runtime.zero.partitioned_param_coordinator, .stage3):

- **Fetch.** A pre-forward (and pre-backward) hook on *every* submodule gathers its partitioned
  parameters (with offloaded parameters: a host->device copy) and, once the model's module order is
  traced, queues prefetches of the next parameters up to `stage3_prefetch_bucket_size` elements (at
  least one parameter, however large). The host synchronizes on the oldest fetch event once more
  than 2 are outstanding, so it runs at most ~3 fetches ahead of the device.
- **Hooks.** Each submodule costs host Python per pass (fetch + release bookkeeping), each parameter
  a gradient hook, each gradient bucket (`reduce_bucket_size` elements) a flush that waits on the
  previous one; these run on the thread that also launches the device work.
- **Gradients** leave the device bucket by bucket and are cast to FP32 on the host for the optimizer.
- **Optimizer**: DeepSpeedCPUAdam at a measured parameters/s (`Hardware.cpu_adam_params_per_s`),
  after backward, not overlapped.
Parameters at or under `stage3_param_persistence_threshold` elements stay resident (no fetch).
"""

from __future__ import annotations

from dataclasses import dataclass

# DeepSpeed's limit on fetch events in flight before the host synchronizes (__max_ongoing_fetch_events)
MAX_ONGOING_FETCH_EVENTS = 2


def offload_tuning(hidden: int) -> dict[str, int]:
    """The ZeRO-3 sizes the zero3 baseline runs with (Hugging Face's documented "auto" values)."""
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


@dataclass(frozen=True)
class Submodule:
    """One module DeepSpeed hooks, in execution order: its parameter sizes and its share of the
    layer's forward compute (0 for containers)."""

    name: str
    params: tuple[int, ...]
    compute_share: float


def decoder_layer_submodules(hidden: int, kv_dim: int, intermediate: int, qkv_bias: bool,
                             attention_share: float) -> list[Submodule]:
    """An HF Llama/Qwen2/Mistral decoder layer's modules in forward order. `attention_share` is the
    fraction of the layer's forward compute in the attention core (scores, softmax, AV), which runs
    inside the attention container; the rest splits over the projections by their weight size."""
    h, kv, i = hidden, kv_dim, intermediate
    b = (lambda n: (n,)) if qkv_bias else (lambda n: ())
    proj = {"q_proj": h * h, "k_proj": h * kv, "v_proj": h * kv, "o_proj": h * h,
            "gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}
    total = sum(proj.values())
    gemm = 1.0 - attention_share

    def p(name: str, extra: tuple[int, ...] = ()) -> Submodule:
        return Submodule(name, (proj[name], *extra), gemm * proj[name] / total)

    return [
        Submodule("decoder_layer", (), 0.0),
        Submodule("input_layernorm", (h,), 0.0),
        Submodule("self_attn", (), attention_share),
        p("q_proj", b(h)), p("k_proj", b(kv)), p("v_proj", b(kv)), p("o_proj"),
        Submodule("post_attention_layernorm", (h,), 0.0),
        Submodule("mlp", (), 0.0),
        p("gate_proj"), p("up_proj"), Submodule("act_fn", (), 0.0), p("down_proj"),
    ]


@dataclass(frozen=True)
class Step:
    """One submodule visit in a pass: parameter elements it must fetch, device compute it launches,
    and host work beyond the per-module hook (gradient hooks, bucket flushes and casts)."""

    fetch_elements: int
    compute_s: float
    host_extra_s: float = 0.0


@dataclass(frozen=True)
class PassCost:
    seconds: float  # wall time of the pass (host, copy and compute timelines)
    compute_s: float
    fetch_s: float  # copy-lane busy time
    host_s: float  # host thread busy time (hooks, flushes, casts)
    fetched_elements: int


def run_pass(steps: list[Step], element_bytes: int, link_bps: float, hook_s: float, prefetch_bucket: int,
             overlap: bool = True) -> PassCost:
    """One pass over the submodules in order, on three timelines: the host runs each module's hook
    and launches its compute; the copy lane fetches parameters in issue order; the device computes
    module j once its parameters have landed and the host has launched it.

    The prefetch issued at module j reaches `prefetch_bucket` elements past the modules already
    issued (at least one more parameter); the host waits for the oldest fetch once more than
    MAX_ONGOING_FETCH_EVENTS are in flight. `overlap=False` serializes everything (the worst case)."""
    fetch = [s.fetch_elements * element_bytes / link_bps for s in steps]
    comp_total = sum(s.compute_s for s in steps)
    host_total = len(steps) * hook_s + sum(s.host_extra_s for s in steps)
    elements = sum(s.fetch_elements for s in steps)
    if not overlap:
        return PassCost(comp_total + sum(fetch) + host_total, comp_total, sum(fetch), host_total, elements)
    host = copy = dev = 0.0
    done = [0.0] * len(steps)  # when each module's parameters have landed
    events: list[float] = []  # fetch events recorded at the host's waits, oldest first
    issued = -1
    for j, st in enumerate(steps):
        k, budget = issued + 1, 0
        # j's own fetch if no prefetch covered it, then the following ones up to the bucket
        while k < len(steps) and (k <= j or (prefetch_bucket > 0 and budget < prefetch_bucket)):
            copy = done[k] = max(copy, host) + fetch[k]
            if k > j:
                budget += steps[k].fetch_elements
            issued = k
            k += 1
            if k > j and budget == 0 and k - j > 64:
                break  # nothing to fetch for a long way: stop looking ahead
        if fetch[j] > 0:
            # waiting for j's parameters records an event; past the limit the host blocks on the oldest
            events = [t for t in events if t > host]
            while len(events) > MAX_ONGOING_FETCH_EVENTS:
                host = max(host, events.pop(0))
            events.append(done[j])
        host += hook_s + st.host_extra_s
        dev = max(dev, done[j], host) + st.compute_s
    return PassCost(max(dev, host), comp_total, sum(fetch), host_total, elements)
