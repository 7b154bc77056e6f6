"""`megatrain train --config sft.yaml`: supervised fine-tuning of your model on your data, on TRL's SFTTrainer.

This module reads the YAML, turns alpaca or sharegpt records into TRL's conversational prompt/completion form
(the tokenizer's chat template renders them), and hands TRL a DeepSpeed config whose "megatrain" section
selects the engine and carries its settings. The training loop, packing, loss masking, checkpoints and
logging are TRL's and Trainer's own: nothing here re-implements them. `backend: torch` runs the same file on
plain SFTTrainer, which is how the two are compared.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("auto", "alpaca", "sharegpt", "messages")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
          "system": "system"}
_PATH_KEYS = ("model", "data", "eval_data", "tokenizer", "chat_template", "output_dir", "report")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


@dataclass
class SFTRun:
    """One SFT run, as the YAML gives it (keys are these fields' names)."""

    model: str  # a model directory (config.json, weights, tokenizer)
    data: str  # a local .json / .jsonl file
    output_dir: str
    format: str = "auto"  # alpaca | sharegpt | messages | auto (read off the first record)
    eval_data: str | None = None
    tokenizer: str | None = None  # default: the model directory
    chat_template: str | None = None  # a Jinja template, or a file holding one; default: the tokenizer's
    random_init: bool = False  # a directory with config.json but no weights: start from random weights
    train_on: str = "completion"  # completion: the loss covers the assistant's last reply; all: every token
    max_length: int = 1024
    packing: bool = False
    epochs: float = 1.0
    max_steps: int = -1
    micro_batch: int = 1
    grad_accum: int = 1
    learning_rate: float = 2e-5
    lr_scheduler: str = "cosine"
    warmup_steps: float = 0  # steps, or below 1 a fraction of the run (transformers 5)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    precision: str = "auto"  # auto: bf16 on an accelerator, fp32 on the CPU
    seed: int = 0
    logging_steps: int = 1
    save_steps: int = 0  # 0: save only at the end
    backend: str = "megatrain"  # megatrain | torch (plain SFTTrainer, for comparison)
    megatrain: dict[str, Any] = field(default_factory=dict)  # the engine's settings (docs/SETTINGS.md)
    report: str | None = None  # write the logged losses and which engine trained here (JSON)


def load_run(path: str | Path, overrides: list[str] | None = None) -> SFTRun:
    """The run `path` describes, `overrides` ("key=YAML value") applied; bad keys and values named."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level, got {type(raw).__name__}")
    # Paths in the file are relative to the file, as its reader expects; --set paths to the working directory.
    for key in _PATH_KEYS:
        if isinstance(raw.get(key), str) and not Path(raw[key]).is_absolute():
            # chat_template may be the template itself: only a file next to the config is a path
            if key != "chat_template" or (path.parent / raw[key]).is_file():
                raw[key] = str(path.parent / raw[key])
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        raw[key.strip()] = yaml.safe_load(value)
    known = {f.name for f in dataclasses.fields(SFTRun)}
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            raise ValueError(f"{path}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; the keys are {sorted(known)}")
    missing = [k for k in ("model", "data", "output_dir") if k not in raw]
    if missing:
        raise ValueError(f"{path}: {missing} must be given (the model directory, the data file, where to write)")
    run = SFTRun(**raw)
    _check(run)
    return run


def _check(run: SFTRun) -> None:
    if run.format not in FORMATS:
        raise ValueError(f"format={run.format!r}: one of {FORMATS}")
    if run.train_on not in ("completion", "all"):
        raise ValueError(f"train_on={run.train_on!r}: 'completion' (the assistant's reply) or 'all'")
    if run.backend not in ("megatrain", "torch"):
        raise ValueError(f"backend={run.backend!r}: 'megatrain' or 'torch' (plain SFTTrainer)")
    if run.precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision={run.precision!r}: 'auto', 'bf16' or 'fp32'")
    if not isinstance(run.megatrain, dict):
        raise ValueError(f"megatrain: expected a mapping of engine settings, got {run.megatrain!r}")
    for key in ("max_length", "micro_batch", "grad_accum"):
        if not isinstance(getattr(run, key), int) or getattr(run, key) < 1:
            raise ValueError(f"{key}={getattr(run, key)!r} must be an integer >= 1")
    for key in ("data", "eval_data"):
        value = getattr(run, key)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{key}={value!r}: no such file (a local .json or .jsonl dataset)")
    model = Path(run.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"model={run.model!r}: not a model directory (no config.json there)")
    if not run.random_init and not any((model / f).is_file() for f in _WEIGHT_FILES):
        raise ValueError(f"model={run.model!r} has no weights ({', '.join(_WEIGHT_FILES)}); give a trained model "
                         "directory, or set random_init: true to start from random weights")


def to_conversation(record: dict[str, Any], fmt: str, train_on: str = "completion") -> dict[str, list]:
    """One record in TRL's conversational form: {"prompt": [...], "completion": [assistant reply]}, or with
    train_on 'all' {"messages": [...]}. alpaca: instruction / input / output (/ system); sharegpt:
    conversations of {"from", "value"}; messages: {"role", "content"} already."""
    if fmt == "alpaca":
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    elif fmt == "sharegpt":
        messages = []
        for turn in record["conversations"]:
            role = _ROLES.get(turn.get("from", turn.get("role")))
            if role is None:
                raise ValueError(f"sharegpt turn {turn!r}: 'from' must be one of {sorted(_ROLES)}")
            messages.append({"role": role, "content": turn.get("value", turn.get("content"))})
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError(f"a {fmt} record must end with the assistant's reply: {record!r}")
    if train_on == "all":
        return {"messages": messages}
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def detect_format(record: dict[str, Any]) -> str:
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise ValueError(f"cannot tell the dataset's format from a record with keys {sorted(record)}: alpaca has "
                     "instruction/output, sharegpt conversations, messages messages; set format: in the config")


def load_conversations(path: str, fmt: str, train_on: str) -> Any:
    """The file as a `datasets.Dataset` of TRL conversational records."""
    from datasets import load_dataset

    ds = load_dataset("json", data_files=path, split="train")
    if len(ds) == 0:
        raise ValueError(f"{path}: no records")
    fmt = detect_format(ds[0]) if fmt == "auto" else fmt
    return ds.map(lambda r: to_conversation(r, fmt, train_on), remove_columns=ds.column_names)


def _ds_config(run: SFTRun) -> dict[str, Any]:
    # "auto" values are filled by Trainer from the SFTConfig, so the two never disagree. Accelerate's DeepSpeed
    # plugin wants a ZeRO section; the "megatrain" section is what routes the run to the engine.
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "megatrain": dict(run.megatrain)}


def train(run: SFTRun) -> dict[str, Any]:
    """Run `run` to the end; returns the logged losses and which engine trained (also written to run.report)."""
    import torch
    import transformers

    try:
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        raise ImportError(f"megatrain train --config needs TRL and datasets ({e}): pip install 'megatrain[sft]'") from e

    if run.backend == "megatrain":
        import megatrain.integrations.hf  # noqa: F401  Trainer's DeepSpeed path runs MegaTrain

    tokenizer = transformers.AutoTokenizer.from_pretrained(run.tokenizer or run.model)
    if run.chat_template is not None:
        template = Path(run.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else run.chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {run.tokenizer or run.model!r} has no chat template: set chat_template: "
                         "(a Jinja template or a file holding one) in the config")
    if run.random_init:
        config = transformers.AutoConfig.from_pretrained(run.model)
        torch.manual_seed(run.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    accel = torch.accelerator.current_accelerator() is not None
    bf16 = run.precision == "bf16" or (run.precision == "auto" and accel)
    args = SFTConfig(
        output_dir=run.output_dir, per_device_train_batch_size=run.micro_batch,
        gradient_accumulation_steps=run.grad_accum, num_train_epochs=run.epochs, max_steps=run.max_steps,
        learning_rate=run.learning_rate, lr_scheduler_type=run.lr_scheduler, warmup_steps=run.warmup_steps,
        weight_decay=run.weight_decay, max_grad_norm=run.max_grad_norm, bf16=bf16, seed=run.seed,
        logging_steps=run.logging_steps, save_strategy="steps" if run.save_steps else "no",
        save_steps=run.save_steps or 500, report_to=[], max_length=run.max_length, packing=run.packing,
        use_cpu=not accel, deepspeed=_ds_config(run) if run.backend == "megatrain" else None)
    train_ds = load_conversations(run.data, run.format, run.train_on)
    eval_ds = load_conversations(run.eval_data, run.format, run.train_on) if run.eval_data else None
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_ds,
                         eval_dataset=eval_ds)
    trainer.train()
    trainer.save_model(str(Path(run.output_dir) / "final"))
    out = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
           "eval_loss": trainer.evaluate()["eval_loss"] if eval_ds is not None else None,
           "engine": type(trainer.model_wrapped).__name__, "backend": run.backend}
    if run.report:
        Path(run.report).parent.mkdir(parents=True, exist_ok=True)
        Path(run.report).write_text(json.dumps(out, indent=1))
    return out
