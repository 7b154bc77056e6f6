"""Validate a batch before any device work: clear errors instead of index faults or silent NaNs.

A batch in host memory is checked at once. A batch already on the device (what HF's Trainer hands the DeepSpeed
face) is checked a little later: its reductions are queued with a copy back (runtime/host_copy.py) and read at the
end of the forward (`PendingCheck.verify`), so the host never waits for the device's queue once per micro-batch.
The attention mask of a device batch is copied back beside them, queued, for the attention's layout (which rows
are padded, where: attention.py host_mask), read once the embedding is queued. Until then the device must not fault
on a bad value: `sanitize` maps ids and labels outside the vocabulary to values it can index, `sanitize_positions`
positions past the model's table into it (a batch that had them is refused by verify before its loss is returned).
What needs no value is refused before any device work whatever the batch's device: shapes and dtypes, and a
sequence longer than the model's positions (the positions a row without position_ids gets); so are the values of
the parts in host memory beside device ones (position_ids a collator built on the host), read at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...models.positions import max_trainable_positions
from ..runtime.host_copy import HostCopy, host_value, to_host
from .attention import keep_host_mask
from .loss import IGNORE_INDEX, keep_host_labels

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_int_tensor(name: str, t: Any, shape: torch.Size | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (token ids), got dtype {t.dtype}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has shape {tuple(shape)}")


def _check_positions(config: Any, seq: int, pos_max: int | None) -> None:
    # Packed documents restart their positions, so what must fit is the largest position, not the row.
    needed = seq if pos_max is None else pos_max + 1
    limit = max_trainable_positions(config)
    if limit is None or needed <= limit:
        return
    max_pos = getattr(config, "max_position_embeddings", None)
    what = f"sequence length {seq}" if pos_max is None else f"position {needed - 1}"
    scaled = f" (RoPE scaling extends it to {limit})" if limit != max_pos else ""
    raise ValueError(f"{what} exceeds the model's max_position_embeddings={max_pos}{scaled}; shorten the "
                     "sequence or extend RoPE (rope_scaling / rope_parameters, or a larger max_position_embeddings)")


def _read_values(parts: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every reduced value the checks need, read back at once per device: inputs already on a GPU cost one
    synchronisation per batch, not one per check; host inputs cost none."""
    by_device: dict[torch.device, list[str]] = {}
    for k, t in parts.items():
        by_device.setdefault(t.device, []).append(k)
    out: dict[str, int] = {}
    for keys in by_device.values():
        out.update(zip(keys, torch.stack([parts[k].long() for k in keys]).tolist()))
    return out


@dataclass
class PendingCheck:
    """A device batch's value checks, queued (check_batch): `verify()` reads them back and refuses a bad batch."""

    config: Any
    seq: int
    has_labels: bool
    keys: list[str]
    values: HostCopy | torch.Tensor
    now: dict[str, int]  # the values of the parts that were in host memory

    def verify(self) -> None:
        v = dict(self.now)
        v.update(zip(self.keys, host_value(self.values).tolist()))
        _check_values(self.config, self.seq, self.has_labels, v)

    def sanitize(self, ids: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ids` clamped into the vocabulary and `labels` outside it set to -100 (no read of their values), so
        the forward queued before verify() cannot fault on the device; the same tensors for a valid batch.

        The labels returned are copied to the host now, queued (to_host), and the copy kept for the loss
        (loss.keep_host_labels): it picks its tokens and counts them from it at the end of the forward, by
        when the copy is long done, instead of reading the device's labels (a sync per read)."""
        vocab = self.config.vocab_size
        ids = ids.clamp(0, vocab - 1)
        if labels is not None:
            labels = labels.long()
            labels = torch.where((labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab)), labels,
                                 torch.full_like(labels, IGNORE_INDEX))
            keep_host_labels(labels, to_host(labels))
        return ids, labels

    def sanitize_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """`position_ids` clamped into the model's positions (no read of their values): a learned position table
        (GPT-2's, OPT's) indexed past its end is a device-side assert, which poisons the CUDA context before
        verify() could refuse the batch. The same tensor for a valid batch; None stays None."""
        limit = max_trainable_positions(self.config)
        if position_ids is None or limit is None:
            return position_ids
        return position_ids.clamp(0, limit - 1)


def check_batch(config: Any, input_ids: Any, attention_mask: Any, labels: Any, position_ids: Any,
                unused: dict[str, Any], defer: bool | None = None) -> PendingCheck | None:
    """Refuse a malformed batch (shapes and dtypes at once). Its values (ids in the vocabulary, a 0/1 mask with a
    token in every row, positions, labels) are checked at once when every part is in host memory, else (or with
    `defer`) queued: the PendingCheck returned must be verified before the batch's results are used."""
    if unused:
        raise TypeError(f"unexpected batch keys {sorted(unused)}; the engine takes input_ids, attention_mask, "
                        "labels, position_ids")
    if input_ids is None:
        raise ValueError("input_ids is required (inputs_embeds is not supported)")
    _check_int_tensor("input_ids", input_ids, None)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"empty batch: input_ids has shape {tuple(input_ids.shape)}")
    seq = input_ids.shape[1]
    if attention_mask is not None:
        _check_int_tensor("attention_mask", attention_mask.long() if attention_mask.dtype == torch.bool
                          else attention_mask, input_ids.shape)
    if position_ids is not None:
        _check_int_tensor("position_ids", position_ids, None)
        if position_ids.shape[-1] != seq:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected [.., {seq}]")
    if labels is not None:
        _check_int_tensor("labels", labels, input_ids.shape)
    if position_ids is None:  # a row's positions are 0..seq-1: refused by its shape alone, before any device work
        _check_positions(config, seq, None)
    parts = {"ids_min": input_ids.min(), "ids_max": input_ids.max()}
    if attention_mask is not None:
        m = attention_mask.long()
        parts.update(mask_min=m.min(), mask_max=m.max(), empty_row=(m.sum(dim=1) == 0).any())
    if position_ids is not None:
        parts.update(pos_min=position_ids.min(), pos_max=position_ids.max())
    if labels is not None and seq > 1:
        lv = labels[:, 1:]  # the first label is never predicted (causal shift)
        valid = lv != IGNORE_INDEX
        # min/max over the valid labels without boolean indexing (a data-dependent shape, so a sync)
        parts.update(n_valid=valid.sum(), lab_min=torch.where(valid, lv, 0).min(),
                     lab_max=torch.where(valid, lv, 0).max())
    auto = defer is None
    if auto:
        defer = any(t.device.type != "cpu" for t in parts.values())
    if not defer:
        _check_values(config, seq, labels is not None, _read_values(parts))
        return None
    # Host parts beside device ones are read now (no sync); `defer` asked for by name queues every part.
    on_host = {k: t for k, t in parts.items() if t.device.type == "cpu"} if auto else {}
    now = _read_values(on_host) if on_host else {}
    _check_host_parts(config, seq, now)
    queued = [k for k in parts if k not in on_host]
    if attention_mask is not None:  # for the attention's layout (attention.py host_mask), read after the embedding
        keep_host_mask(attention_mask, to_host(attention_mask))
    values = (to_host(torch.stack([parts[k].long() for k in queued])) if queued
              else torch.empty(0, dtype=torch.long))
    return PendingCheck(config, seq, labels is not None, queued, values, now)


def _check_ids(config: Any, v: dict[str, int]) -> None:
    vocab = config.vocab_size
    lo, hi = v["ids_min"], v["ids_max"]
    if lo < 0 or hi >= vocab:
        bad = hi if hi >= vocab else lo
        raise ValueError(f"input_ids contains token id {bad}, outside the model's vocabulary [0, {vocab}); "
                         "check the tokenizer matches the model")


def _check_mask(v: dict[str, int]) -> None:
    if v["mask_min"] < 0 or v["mask_max"] > 1:
        raise ValueError("attention_mask must contain only 0 and 1")
    if v["empty_row"]:
        raise ValueError("attention_mask masks every token of some sequence in the batch")


def _check_position_values(config: Any, seq: int, v: dict[str, int]) -> None:
    if v["pos_min"] < 0:
        raise ValueError(f"position_ids must be >= 0, got {v['pos_min']}")
    _check_positions(config, seq, v["pos_max"])


def _check_labels(config: Any, v: dict[str, int]) -> None:
    vocab = config.vocab_size
    if not v.get("n_valid", 0):
        raise ValueError("every label in this batch is -100 (ignored) after the causal shift: "
                         "the loss would be 0/0; drop the batch or check the label masking")
    if v["lab_min"] < 0 or v["lab_max"] >= vocab:
        raise ValueError(f"labels contain ids outside [0, {vocab}) other than -100")


def _check_values(config: Any, seq: int, has_labels: bool, v: dict[str, int]) -> None:
    _check_ids(config, v)
    if "mask_min" in v:
        _check_mask(v)
    if "pos_min" in v:
        _check_position_values(config, seq, v)
    else:
        _check_positions(config, seq, None)
    if has_labels:
        _check_labels(config, v)


def _check_host_parts(config: Any, seq: int, v: dict[str, int]) -> None:
    """The checks whose values are all in host memory, at once (a deferred batch's device parts wait)."""
    if {"ids_min", "ids_max"} <= v.keys():
        _check_ids(config, v)
    if {"mask_min", "mask_max", "empty_row"} <= v.keys():
        _check_mask(v)
    if {"pos_min", "pos_max"} <= v.keys():
        _check_position_values(config, seq, v)
