"""Engine settings: the `megatrain` section of a DeepSpeed-style config, as one typed, frozen object.

An `EngineConfig` holds the settings as written, each checked (the compute dtype's "auto" settled for this machine at
once), and keeps what the user wrote (`written`, with `"auto"` as written) for saving and printing. The faces reach it
through megatrain/config/resolve.py, which settles their own arguments (mixed_precision, a DeepSpeed bf16 section)
with `settle_compute_dtype` first and hands on a `ResolvedConfig`; megatrain/config/settle.py settles it into one
engine's `EnginePlan`. Whether a setting is still "auto" is asked here only (`left_auto` and the typed questions
below: `residency_set`, `speculation_set`, `chooses_host_mode`, ...; `rule_or` for another module's own word).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ..costs.modes import GradSlab, HostMaster, parse
from ..costs.nvme import check_nvme_settings
from ..costs.residency import AUTO, Residency
from ..costs.residency import parse as parse_residency
from .validate import check_keys, is_bool, is_int, is_number

_DTYPES = ("float32", "bfloat16")
MIN_LINK_GBPS = 1e-3
MIN_WATCHDOG_S = 0.1


MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more
MIN_MMAP_THRESHOLD = 4096  # a page: below it every small allocation would be a system call
# speculative_step "auto" settled where it can run (a CUDA device, an optimizer it steps a layer at a time): on for as
# many layers as their rollback copies fit the host, which the engine measures once it holds the store
# (engine/update/speculative.py).
IF_FITS = "if it fits"
MIXED_PRECISION = ("no", "bf16")
# The settings whose "auto" a plan keeps as a rule applied per batch (costs/memory.py, engine/layer/attention.py).
PER_BATCH = ("residency", "offload_activations", "mlp_tile_tokens", "loss_chunk_tokens", "segment_attention")  # Accelerate's names: FP32, bf16 compute


def left_auto(value: Any) -> bool:
    """Whether a setting is left to "auto" as written (a string: "auto" is no count, switch or policy object).
    Readers outside this package ask here rather than compare with the word: what "auto" then means is settled
    by this package (megatrain/config/resolve.py) or by the one rule that decides it per model or per batch."""
    return isinstance(value, str) and value == AUTO


def rule_or(value: Any, rule: Callable[[], Any]) -> Any:
    """`value`, or what `rule` chooses where it is left "auto": how a module outside this package takes a word of its
    own (a data path, a data format) without asking whether it is "auto"."""
    return rule() if left_auto(value) else value


def auto_or(word: str, parse: Callable[[str], Any]) -> Any:
    """A command-line word: "auto" (any case) as the setting's "auto", anything else as `parse` reads it."""
    return AUTO if word.strip().lower() == AUTO else parse(word)


@dataclass(frozen=True, eq=False)
class EngineConfig:
    """The engine's settings as a user writes them ("auto" where a rule is to choose), each checked. Its settled
    forms are types, not a stage: `ResolvedConfig` (a face's arguments folded in, megatrain/config/resolve.py) and
    `EnginePlan` (every choice made for one engine, megatrain/config/settle.py). Equal when the settings are, whatever
    the type: a plan equals the config that already said all it chose."""

    device: str | None = None  # None: the accelerator when it is usable, else cpu (engine/runtime/device_resolution.py)
    # What streams to and computes on the device; masters stay FP32. "auto": bfloat16 on a CUDA device that
    # supports it (2 B/param streamed, bf16 matmuls), float32 elsewhere (a CPU device: as before).
    compute_dtype: str = "auto"
    num_buffers: int = 2  # device layer buffers (>= 2 double-buffers the host->device stream)
    loss_chunk_tokens: int | str = "auto"  # tokens per head/loss chunk (logits never exceed chunk x vocab); "auto":
    # up to 2048, fewer for big vocabularies, fewer still when the device budget needs it
    pin_memory: bool | None = None  # None: pin when the device is CUDA; a failed pin raises PinnedMemoryError
    link_gbps: float | None = None  # CPU only: rate-limit the copy engine to emulate a PCIe/C2C link
    # Long context. "auto" decides per batch from the device budget (see engine/layer/tiling.py).
    offload_activations: bool | str = "auto"  # layer-boundary activations in host memory: True, False, "auto"
    mlp_tile_tokens: int | str | None = "auto"  # sequence tile inside a layer (MLP and attention): int, "auto", None
    # device bytes "auto" may plan for; None: the GPU's free memory at start (tiling.free_device_bytes), no limit on CPU
    device_budget_bytes: int | None = None
    # Which layers stay on the device (costs/residency.py): "auto" keeps what the device budget holds (weights
    # first, then activations: no recompute); "stream" streams and recomputes every layer (the 100B+ path);
    # {"weights": n, "activations": m}: the first n layers' weights, the first m of them with their activations.
    residency: str | dict | Residency = "auto"
    segment_attention: bool | str = "auto"  # padding/packing as per-segment SDPA, no O(tokens²) mask ("auto": when big)
    measure_device_memory: bool = False  # CPU: track live tensor bytes op by op for peak_device_bytes
    trace: bool = False  # record a per-layer timeline of compute and copy streams
    watchdog_s: float = 600.0  # a stream with no progress for this long raises instead of hanging
    skip_nonfinite: bool = True  # a step whose gradients hold NaN/inf is skipped (params untouched)
    # The host AdamW a layer at a time on its own thread after step() returns, overlapped with the next
    # forward (each layer's load waits for its update): same math (engine/update/optim.py). Parameters and optimizer
    # state read by hand between step() and the next forward need engine.synchronize() first.
    # None ("auto"): on where it pays, a CUDA device (the host update hides behind the device's forward) with
    # torch's Adam/AdamW; off on a CPU device, where the "device" compute and the host update share the cores.
    optimizer_overlap: bool | None = None
    # Each layer's host update started as soon as its gradient has landed in backward, before the global norm and
    # the non-finite check are known; step() then validates it: a clip that scales, a non-finite gradient (or a
    # slab or LR changed by hand) rolls the updated layers back from a copy taken before each update and redoes them
    # with the right coefficient (or skips the step). Bit-identical to the serial step (engine/update/speculative.py).
    # The copy (rollback memory) is each layer's master and Adam state, 10-14 B/param more host memory. "auto": on a
    # CUDA device with torch's Adam/AdamW, one rank and no NVMe tier, for as many layers (the first host-updated
    # ones) as their rollback memory fits the host; True: every host-updated layer, or HostMemoryError.
    speculative_step: bool | str = "auto"
    max_bad_steps: int = 5  # ... and this many consecutive skipped steps stop training with an error
    # glibc: fix the mmap threshold at this many bytes, so freed host blocks at least this big leave the
    # resident set at once (engine/runtime/malloc.py). None (default): glibc's dynamic threshold, which keeps freed
    # transients resident for reuse. Measured on a CPU device (2 cores): 128 KiB lowered peak RSS growth 1.5%
    # (llama-0.6b) to 8% (small-7m) and slowed steps 15-30% (page faults): a host-memory-bound CPU run's choice.
    # Process-wide. On CUDA the host transients are pinned or above glibc's limit, so it changes little.
    host_mmap_threshold_bytes: int | None = None
    # Before taking a model whose architecture it has not verified (per model class, structural options and
    # transformers version, cached), train a tiny model of the same class with PyTorch and with the engine and
    # refuse on any difference (engine/model/probe.py). Off: for users who know the architecture is handled exactly.
    parity_probe: bool = True
    # Host-memory modes (megatrain/costs/modes.py; `megatrain plan` prints what each costs). host_master: "fp32"
    # (default), "hilo" (an exact split: the bf16 half streams, FP32 bit for bit; needs bf16 compute) or "bf16"
    # (bf16 weights updated in place, as the paper's code: not exact). host_grad_dtype "bfloat16": bf16
    # gradient slabs, exact with bf16 compute and one micro-batch per step (accumulation is refused).
    # optimizer_in_backward: each layer's AdamW update runs as soon as its gradients land in backward, so no
    # layer gradient slab exists (hilo: 12 B/param); exact without clipping and accumulation, which it refuses.
    # "auto" (the default, both): the fastest exact mode that fits this host (megatrain/costs/host_mode.py: FP32
    # master, hilo, hilo + bf16 slabs, then the NVMe tier when nvme_path is set), chosen by the engine once it
    # knows the model; in FP32 compute that is the FP32 master. An explicit host_master with host_grad_dtype
    # "auto" keeps FP32 slabs.
    host_master: str = "auto"
    host_grad_dtype: str = "auto"
    optimizer_in_backward: bool = False
    # host_master "bf16" only: "nearest" (round-to-nearest-even, as the paper's code) or "stochastic" (unbiased:
    # keeps updates smaller than half a bf16 ulp in expectation; seeded, so a run repeats exactly)
    bf16_rounding: str = "nearest"
    # Data parallel (several ranks): "shared" keeps one host store per node, the layers' weights in shared
    # memory and each layer's gradients and optimizer state on one owning rank (engine/host/node_store.py; host bytes
    # per node stay one GPU's), in every host mode; "replicated" gives every rank a whole private store (N copies
    # per node; not with optimizer_in_backward); "auto" (default): "shared".
    data_parallel_host: str = "auto"
    # Which data path several ranks of a node take (docs/DISTRIBUTED.md): "node" copies 1/G of each streamed layer
    # per rank and all-gathers the rest, reduce-scatters the gradients (needs the shared store, G >= 2); "per_rank"
    # streams every layer on every rank; "auto" (default): "per_rank" until the node path's update lands.
    data_parallel_path: str = "auto"
    # NVMe tier (engine/host/spill.py, docs/NVME.md): spill the layers' update-only state (Adam m/v, the hi/lo master's
    # lo half) to files in the directory nvme_path, keeping the host store within host_budget_bytes (None: spill
    # every layer); nvme_gbps emulates a slower disk (GB/s), as link_gbps does the link.
    nvme_path: str | None = None
    host_budget_bytes: int | None = None
    nvme_gbps: float | None = None
    # What the user wrote, before "auto" was resolved: set by the constructor, carried by dataclasses.replace
    # (the one way a resolved copy is made). Not a setting: outside ENGINE_KEYS, equality and repr.
    _written: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self._written:
            object.__setattr__(self, "_written", tuple((k, getattr(self, k)) for k in _SETTINGS))
        # A switch given as "no" or {} would be truthy: the opposite of what was meant, silently.
        for name in ("pin_memory", "measure_device_memory", "trace", "skip_nonfinite", "optimizer_overlap",
                     "parity_probe", "optimizer_in_backward"):
            value = getattr(self, name)
            if not is_bool(value) and not (value is None and name in ("pin_memory", "optimizer_overlap")):
                raise ValueError(f"{name}={value!r} must be true or false")
        for name, value in (("watchdog_s", self.watchdog_s), ("link_gbps", 1.0 if self.link_gbps is None else self.link_gbps)):
            if not is_number(value):
                raise ValueError(f"{name}={value!r} must be a number")
        dtype = self.settle_compute_dtype(written=self.compute_dtype)
        if dtype == AUTO:
            dtype = default_compute_dtype(self.device)
        object.__setattr__(self, "compute_dtype", dtype)
        if self.compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not supported; use one of {_DTYPES} or 'auto'")
        check_host_modes(self)
        check_speculative(self)
        check_nvme_settings(self.nvme_path, self.host_budget_bytes, self.nvme_gbps, self.optimizer_in_backward,
                            self.data_parallel_host)
        if not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ValueError(f"num_buffers={self.num_buffers!r} must be an int >= 1 (2 overlaps copies with compute)")
        chunk = self.loss_chunk_tokens
        if chunk != "auto" and (not is_int(chunk) or chunk < 1):
            raise ValueError(f"loss_chunk_tokens={chunk!r} must be an int >= 1 or 'auto'")
        if self.link_gbps is not None and not MIN_LINK_GBPS <= self.link_gbps < math.inf:
            raise ValueError(f"link_gbps={self.link_gbps!r} must be a finite rate >= {MIN_LINK_GBPS} GB/s "
                             "(1 MB/s, below any real link), or None for no limit")
        if not isinstance(self.max_bad_steps, int) or self.max_bad_steps < 1:
            raise ValueError(f"max_bad_steps={self.max_bad_steps!r} must be an int >= 1")
        if self.offload_activations not in (True, False, "auto"):
            raise ValueError(f"offload_activations={self.offload_activations!r} must be True, False or 'auto'")
        if self.segment_attention not in (True, False, "auto"):
            raise ValueError(f"segment_attention={self.segment_attention!r} must be True, False or 'auto'")
        tile = self.mlp_tile_tokens
        if not (tile is None or tile == "auto" or (is_int(tile) and tile >= 1)):
            raise ValueError(f"mlp_tile_tokens={tile!r} must be an int >= 1, 'auto' or None (untiled)")
        object.__setattr__(self, "residency", parse_residency(self.residency))  # "auto" or a Residency
        budget = self.device_budget_bytes
        if budget is not None and (not is_int(budget) or budget <= 0):
            raise ValueError(f"device_budget_bytes={budget!r} must be an int > 0 (bytes) or None")
        thr = self.host_mmap_threshold_bytes
        if thr is not None and (not is_int(thr) or not MIN_MMAP_THRESHOLD <= thr <= MAX_MMAP_THRESHOLD):
            raise ValueError(f"host_mmap_threshold_bytes={thr!r} must be an int from {MIN_MMAP_THRESHOLD} (a page) to "
                             f"{MAX_MMAP_THRESHOLD} (glibc's limit), or None for glibc's dynamic default")
        if not MIN_WATCHDOG_S <= self.watchdog_s <= threading.TIMEOUT_MAX:
            raise ValueError(f"watchdog_s={self.watchdog_s!r} must be from {MIN_WATCHDOG_S} s (shorter fires on "
                             f"healthy work) to {threading.TIMEOUT_MAX:.0f} s (the longest wait Python's threads take)")

    @staticmethod
    def settle_compute_dtype(*, written: str | None = None, bf16: bool | None = None, mixed_precision: str | None = None,
                             unsaid: str = AUTO, err: Callable[[str], Exception] = ValueError) -> str:
        """The compute dtype that a user's settings name together, settled for every face by this one rule.

        `written`: compute_dtype as written (a `megatrain` section, an EngineConfig; None: not written); `bf16`: a
        DeepSpeed-style config's bf16.enabled (None: not said); `mixed_precision`: Accelerate's argument, "no" or
        "bf16" (None: not a face argument); `unsaid`: the face's meaning when nothing is said ("float32" for a
        DeepSpeed config, which trains in FP32 unless bf16 is enabled; "auto" for the engine). Returns "float32",
        "bfloat16" or "auto" (resolved for the device by EngineConfig). "auto" as written gives way to the others;
        two explicit settings that disagree are refused with the fix (`err` makes the error).
        """
        if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use one of {MIXED_PRECISION}")
        explicit = written not in (None, AUTO)
        if bf16 is not None and explicit and written != _dtype(bf16):
            raise err(f"'megatrain.compute_dtype' is {written!r} but bf16.enabled is {str(bf16).lower()}; drop one of them")
        if mixed_precision is not None:
            if bf16 is False and mixed_precision == "bf16":
                raise err("mixed_precision='bf16' contradicts the config, which disables bf16")
            # The argument's default ("no") gives way to a config that enables bf16.
            want = _dtype(bf16 is True or mixed_precision == "bf16")
            if explicit and written != want:
                raise err(f"mixed_precision={mixed_precision!r} contradicts the engine's compute_dtype={written!r}; "
                          "drop one of them")
            return want
        if bf16 is not None:
            return _dtype(bf16)
        return unsaid if written is None else written

    @property
    def written(self) -> dict[str, Any]:
        """The settings as the user wrote them ("auto" and None kept): what a run records and prints."""
        return dict(self._written)

    def rewrite(self, **changes: Any) -> EngineConfig:
        """These settings as written with `changes` written too, resolved afresh (a new device re-resolves "auto").
        A copy that changes a resolved value only is `dataclasses.replace`."""
        return EngineConfig.from_dict({**self.written, **changes})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineConfig):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in _SETTINGS)

    def as_type(self, cls: type[EngineConfig], **changes: Any) -> Any:
        """These settings (with `changes`) as `cls`, one of the settled types below, what was written kept."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return cls(**{**values, **changes})

    @property
    def chooses_host_mode(self) -> bool:
        """Whether the host mode is the rule's to choose (host_master written "auto"; in FP32 compute it reads as the
        FP32 master at once, and the rule may still choose the NVMe tier): the engine's plan chooses it
        (config/settle.py), a plan of the planner chooses it by the same order (planner/auto_mode.py)."""
        return left_auto(self.written["host_master"])

    @property
    def host_mode_set(self) -> bool:
        """Whether both host-mode settings hold a mode (written, or settled by a plan): nothing left to choose."""
        return not left_auto(self.host_master) and not left_auto(self.host_grad_dtype)

    @property
    def grad_slab_written(self) -> GradSlab | None:
        """The gradient slab dtype the user wrote; None: "auto" (host mode "auto" chooses it)."""
        grad = self.written["host_grad_dtype"]
        return None if left_auto(grad) else GradSlab(grad)

    @property
    def residency_set(self) -> Residency | None:
        """The residency counts as set ("stream" is none kept); None: "auto", placed per batch from the device budget
        (costs/memory.py, or a placement advisor's search)."""
        return self.residency if isinstance(self.residency, Residency) else None

    @property
    def speculation_set(self) -> bool | None:
        """speculative_step as set (True, False, or settled off); None: "auto", as many layers as fit (a plan's
        IF_FITS: the engine measures it)."""
        value = self.speculative_step
        return None if left_auto(value) or value == IF_FITS else bool(value)

    def per_batch(self) -> tuple[str, ...]:
        """The settings left to a rule that decides them per batch from the device budget (costs/memory.py), by name."""
        return tuple(name for name in PER_BATCH if left_auto(getattr(self, name)))

    def with_stand_ins(self, stand_ins: dict[str, Any]) -> dict[str, Any]:
        """The settings by name, a choice still open (a plan's IF_FITS reads as "auto") replaced by its stand-in in
        `stand_ins` where one is given: what the planner's search takes from an engine being built."""
        out = {}
        for name in _SETTINGS:
            value = getattr(self, name)
            value = AUTO if value == IF_FITS else value
            out[name] = stand_ins[name] if left_auto(value) and name in stand_ins else value
        return out

    @staticmethod
    def spelled(engine: dict[str, Any]) -> dict[str, Any]:
        """`engine` (settings by name) with the planner's spellings of "auto" in the engine's: optimizer_overlap "auto"
        (the engine's None) and speculative_step None (the engine's "auto")."""
        engine = dict(engine)
        if left_auto(engine.get("optimizer_overlap")):
            engine["optimizer_overlap"] = None
        if "speculative_step" in engine and engine["speculative_step"] is None:
            engine["speculative_step"] = AUTO
        return engine

    @property
    def grad_slab_set(self) -> GradSlab | None:
        """The gradient slab dtype settled (written, or fixed by the master); None: host mode "auto" chooses it."""
        return None if self.host_grad_dtype == AUTO else GradSlab(self.host_grad_dtype)

    @property
    def loss_chunk_set(self) -> int | None:
        """loss_chunk_tokens as written; None: "auto" (each batch's plan chooses it, costs/memory.py)."""
        return None if self.loss_chunk_tokens == AUTO else int(self.loss_chunk_tokens)

    @property
    def master_mode(self) -> HostMaster:
        return HostMaster(self.host_master)

    @property
    def share_host_store(self) -> bool:
        """Whether data-parallel ranks share one host store per node (data_parallel_host)."""
        # The NVMe tier keeps a rank's own store: "auto" shares only without it.
        return self.data_parallel_host == "shared" or (self.data_parallel_host == "auto" and self.nvme_path is None)

    @property
    def grad_slab(self) -> GradSlab | None:
        """The layers' gradient slab dtype; None with the optimizer in backward (no slab)."""
        return None if self.optimizer_in_backward else GradSlab(self.host_grad_dtype)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> EngineConfig:
        d = dict(d or {})
        check_keys(d, ENGINE_KEYS, unknown_setting)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The resolved settings (`written`: as the user wrote them)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k in ENGINE_KEYS}


_SETTINGS = tuple(f.name for f in fields(EngineConfig) if not f.name.startswith("_"))
ENGINE_KEYS = frozenset(_SETTINGS)


@dataclass(frozen=True, eq=False)
class ResolvedConfig(EngineConfig):
    """The settings as written, with a face's own arguments folded in (mixed_precision, the CPU switch, accumulation:
    megatrain/config/resolve.py): a backend takes it as it is instead of resolving it again."""


@dataclass(frozen=True, eq=False)
class EnginePlan(EngineConfig):
    """One engine's settled plan (megatrain/config/settle.py settle_engine, the one function the engine and the
    planner call): pinning, overlap and speculation decided for the device and the optimizer, and the host mode for
    the model on this host where the facts say what fits. An engine is built from it and keeps it; the choices
    still made per batch (residency, activation offload, the MLP tile, the loss chunk: costs/memory.py) are rules
    with the budget, and speculation "as many layers as fit" (IF_FITS) is the one the engine measures once it holds
    its store (`measured`)."""

    turned_off: tuple[str, ...] = field(default=(), compare=False, repr=False)  # what it turned off that was asked

    @property
    def speculation_measured_later(self) -> bool:
        """Whether speculation is "as many layers as their rollback copies fit", measured by the engine once it
        holds its store (engine/update/speculative.py resolve)."""
        return self.speculative_step == IF_FITS

    @property
    def speculation_backs_off(self) -> bool:
        """Whether speculation pauses where it keeps losing (its "auto"); True as set never does."""
        return self.speculative_step is not True

    def measured(self, speculates: bool) -> EnginePlan:
        """This plan with the engine's measure of speculation taken (on or off: the layers are the engine's)."""
        return dataclasses.replace(self, speculative_step=bool(speculates))


def _dtype(bf16: bool) -> str:
    return "bfloat16" if bf16 else "float32"


def default_compute_dtype(device: str | None) -> str:
    """compute_dtype "auto": bfloat16 when `device` (None: the accelerator if there is one) is a CUDA device
    with bf16 support, else float32."""
    import torch

    if not torch.cuda.is_available() or not (device is None or str(device).startswith("cuda")):
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"


def unknown_setting(key: object, close: str | None) -> ValueError:
    """The error for a key of a `megatrain` section (or a sweep point's `engine`) that names no setting."""
    hint = f" (did you mean {close!r}?)" if close else ""
    return ValueError(f"unknown megatrain setting {key!r}{hint}; known: {', '.join(sorted(ENGINE_KEYS))}")


def check_speculative(cfg: EngineConfig) -> None:
    """speculative_step is True, False or "auto", and not set beside what updates a layer another way."""
    value = cfg.speculative_step
    if value == IF_FITS and isinstance(cfg, EnginePlan):
        return  # settle_engine's "auto", checked against the configuration there
    if not (is_bool(value) or value == AUTO):
        raise ValueError(f"speculative_step={value!r} must be true, false or 'auto'")
    if value is True and cfg.optimizer_in_backward:
        raise ValueError("speculative_step=True and optimizer_in_backward=True both update the layers during "
                         "backward: set one of them (speculative_step keeps clipping and skipping exact)")
    if value is True and cfg.nvme_path is not None:
        raise ValueError(f"speculative_step=True with nvme_path={cfg.nvme_path!r}: a spilled layer's state is on disk "
                         "between updates, where no rollback copy is kept; set speculative_step='auto' or False")


def check_host_modes(cfg: EngineConfig) -> None:
    """The host-memory knobs are known values and fit together (clear errors naming the fix)."""
    bf16 = cfg.compute_dtype == "bfloat16"
    if cfg.host_master == AUTO and not bf16:
        object.__setattr__(cfg, "host_master", HostMaster.FP32.value)  # the one exact master in FP32 compute
    if cfg.host_grad_dtype == AUTO and (cfg.host_master != AUTO or not bf16 or cfg.optimizer_in_backward):
        object.__setattr__(cfg, "host_grad_dtype", GradSlab.FLOAT32.value)  # an explicit master keeps FP32 slabs
    auto = cfg.host_master == AUTO  # resolved by the engine once it knows the model (engine/host/preflight.py)
    try:
        master = None if auto else parse(HostMaster, cfg.host_master, "host_master")
        grad = None if cfg.host_grad_dtype == AUTO else parse(GradSlab, cfg.host_grad_dtype, "host_grad_dtype")
    except ValueError as e:
        raise ValueError(f"{e}, or 'auto' (the default: the fastest exact mode that fits)") from None
    if master is not None:
        object.__setattr__(cfg, "host_master", master.value)  # plain strings, as written in JSON
    if grad is not None:
        object.__setattr__(cfg, "host_grad_dtype", grad.value)
    if master not in (None, HostMaster.FP32) and not bf16:
        raise ValueError(f"host_master={master.value!r} keeps a bf16 half that streams to the device: set "
                         "compute_dtype='bfloat16' (or host_master='fp32' to compute in FP32)")
    if grad is GradSlab.BFLOAT16 and not bf16:
        raise ValueError("host_grad_dtype='bfloat16' is exact only for bf16 gradients: set compute_dtype='bfloat16' "
                         "(or host_grad_dtype='float32')")
    if cfg.bf16_rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bf16_rounding={cfg.bf16_rounding!r}: use 'nearest' or 'stochastic'")
    if cfg.bf16_rounding == "stochastic" and master is not HostMaster.BF16:
        raise ValueError("bf16_rounding='stochastic' rounds a bf16 master: set host_master='bf16' (the exact "
                         "masters round nothing, and \"auto\" chooses an exact one)")
    if cfg.data_parallel_host not in ("auto", "shared", "replicated"):
        raise ValueError(f"data_parallel_host={cfg.data_parallel_host!r}: use 'auto', 'shared' or 'replicated'")
    if cfg.data_parallel_path not in ("auto", "node", "per_rank"):
        raise ValueError(f"data_parallel_path={cfg.data_parallel_path!r}: use 'auto', 'node' or 'per_rank'")
    if cfg.optimizer_in_backward and cfg.optimizer_overlap:
        raise ValueError("optimizer_in_backward and optimizer_overlap are two ways to run the layer updates: "
                         "set one of them")
