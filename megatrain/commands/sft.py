"""`megatrain train --config sft.yaml`: supervised fine-tuning of your model on your data, on TRL's SFTTrainer.

This module reads the YAML, turns alpaca or sharegpt records into TRL's conversational prompt/completion form
(the tokenizer's chat template renders them), and hands TRL a DeepSpeed config whose "megatrain" section
selects the engine and carries its settings. The training loop, packing, loss masking, checkpoints and
logging are TRL's and Trainer's own: nothing here re-implements them. `backend: torch` runs the same file on
plain SFTTrainer, which is how the two are compared. Before anything is written the config, every data record
(`sft_data.py`) and the output folder (`sft_resume.py`: resume, or refuse without --restart) are checked.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.settings import AUTO, face_keys
from ..config.validate import close_match, is_bool, is_int, is_number
from .sft_data import FORMATS, check_file, detect_format, to_conversation

__all__ = ["SFTRun", "Prepared", "load_run", "check_data", "prepare", "train", "lora_config", "to_conversation", "detect_format", "FORMATS"]

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
    save_minutes: float = 30.0  # a checkpoint after this much training since the last one (0: not by time)
    save_steps: int = 0  # also a checkpoint every this many steps (0: not by steps)
    save_total_limit: int | None = 2  # keep the newest this many checkpoints (null: all)
    backend: str = "megatrain"  # megatrain | torch (plain SFTTrainer, for comparison)
    megatrain: dict[str, Any] = field(default_factory=dict)  # the engine's settings (docs/SETTINGS.md)
    lora: dict[str, Any] | None = None  # LoRA adapters instead of full fine-tuning: rank, alpha, targets, dropout
    report: str | None = None  # write the logged losses and which engine trained here (JSON)


# Each key's type, checked before anything runs: (test, what the value must be, an example).
_INT = (is_int, "an integer", "10")
_NUM = (is_number, "a number", "0.001")
_STR = (lambda v: isinstance(v, str), "a string", "'...'")
_BOOL = (is_bool, "true or false", "true")
_TYPES: dict[str, tuple] = {
    "model": _STR, "data": _STR, "output_dir": _STR, "format": _STR, "eval_data": _STR, "tokenizer": _STR,
    "chat_template": _STR, "random_init": _BOOL, "train_on": _STR, "max_length": _INT, "packing": _BOOL,
    "epochs": _NUM, "max_steps": _INT, "micro_batch": _INT, "grad_accum": _INT, "learning_rate": _NUM,
    "lr_scheduler": _STR, "warmup_steps": _NUM, "weight_decay": _NUM, "max_grad_norm": _NUM, "precision": _STR,
    "seed": _INT, "logging_steps": _INT, "save_minutes": _NUM, "save_steps": _INT, "save_total_limit": _INT,
    "backend": _STR, "megatrain": (lambda v: isinstance(v, dict), "a mapping of engine settings",
                                   "{host_master: fp32}"),
    "report": _STR, "lora": (lambda v: isinstance(v, dict), "a mapping of LoRA settings", "{rank: 8, alpha: 16}")}
_OPTIONAL = frozenset({"eval_data", "tokenizer", "chat_template", "report", "save_total_limit", "lora"})
# The `lora:` section's keys and defaults (PEFT's LoraConfig takes them as r, lora_alpha, target_modules,
# lora_dropout). Dropout defaults to 0, PEFT's default: a run is then the same function of its seed on any backend.
LORA_DEFAULTS: dict[str, Any] = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
_AT_LEAST = {"max_length": 1, "micro_batch": 1, "grad_accum": 1, "logging_steps": 1, "save_steps": 0,
             "save_total_limit": 1, "epochs": 0, "learning_rate": 0, "warmup_steps": 0, "weight_decay": 0,
             "max_grad_norm": 0, "save_minutes": 0, "seed": 0}
_CHOICES = {"format": FORMATS, "train_on": ("completion", "all"), "backend": ("megatrain", "torch"),
            "precision": ("auto", "bf16", "fp32")}


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    # Paths are relative to the YAML file, whether written in it or given with --set, so one command line means
    # the same thing from any working directory.
    for key in _PATH_KEYS:
        if isinstance(raw.get(key), str) and not Path(raw[key]).expanduser().is_absolute():
            # chat_template may be the template itself: only a file next to the config is a path
            if key != "chat_template" or (base / raw[key]).is_file():
                raw[key] = str(base / raw[key])
        elif isinstance(raw.get(key), str):
            raw[key] = str(Path(raw[key]).expanduser())


def set_key(raw: dict[str, Any], key: str, value: Any, item: str) -> None:
    """`--set` one key into the run's settings: a dotted key (megatrain.num_buffers, megatrain.residency.weights)
    sets that key inside its section, and a mapping merges into the mapping already there, so the section's other
    keys stay as the file wrote them."""
    *path, last = key.split(".")
    node = raw
    for i, part in enumerate(path):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ValueError(f"--set {item!r}: {where} is {child!r}, not a section; set {where}=... instead")
        node = child
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        value = _merged(node[last], value)
    node[last] = value


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_run(path: str | Path, overrides: list[str] | None = None) -> SFTRun:
    """The run `path` describes, `overrides` ("key=YAML value") applied; every key, value type and value checked
    (`prepare` checks the data), nothing written."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e}); fix the file there") \
            from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"--set {item!r}: the value is not a YAML value; quote it") from None
        set_key(raw, key.strip(), parsed, item)
    _resolve_paths(raw, path.resolve().parent)
    known = {f.name for f in dataclasses.fields(SFTRun)}
    for key in raw:
        if key not in known:
            near = close_match(key, known)
            raise ValueError(f"{path}: unknown key {key!r}" + (f" (did you mean {near!r}?)" if near else "")
                             + f"; the keys are {sorted(known)}")
    missing = [k for k in ("model", "data", "output_dir") if k not in raw]
    if missing:
        raise ValueError(f"{path}: {missing} must be given (the model directory, the data file, where to write)")
    for key, value in raw.items():
        test, what, example = _TYPES[key]
        if test is is_number and isinstance(value, str):
            # YAML 1.1 reads 1e-3 (no dot) as text; the number the user meant is not in doubt
            try:
                raw[key] = value = float(value)
            except ValueError:
                pass
        if value is None and key in _OPTIONAL:
            continue
        if not test(value):
            raise ValueError(f"{path}: {key}: {value!r} is not {what}; write e.g. {key}: {example}")
    run = SFTRun(**raw)
    _check(run, path)
    return run


def _check(run: SFTRun, path: Path) -> None:
    from transformers.trainer_utils import SchedulerType

    choices = {**_CHOICES, "lr_scheduler": tuple(s.value for s in SchedulerType)}
    for key, allowed in choices.items():
        if getattr(run, key) not in allowed:
            raise ValueError(f"{path}: {key}: {getattr(run, key)!r} is not one of {', '.join(allowed)}")
    for key, least in _AT_LEAST.items():
        value = getattr(run, key)
        if value is not None and value < least:
            raise ValueError(f"{path}: {key}: {value!r} must be at least {least}")
    if run.max_steps == 0 or run.max_steps < -1:
        raise ValueError(f"{path}: max_steps: {run.max_steps} must be a number of steps (>= 1), or -1 to train "
                         "for epochs")
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
    if Path(run.output_dir).exists() and not Path(run.output_dir).is_dir():
        raise ValueError(f"output_dir={run.output_dir!r} is a file; give a folder to write the run to")
    if run.lora is not None:
        run.lora = _lora_settings(run.lora, path)
    if run.backend == "megatrain":
        from ..config.deepspeed import parse_config

        try:
            parse_config(_ds_config(run, resolved=True), warn=False)
        except ValueError as e:
            # the user wrote a `megatrain:` section, not a DeepSpeed config: name the section as they wrote it
            raise ValueError(f"{path}: {str(e).removeprefix('DeepSpeed config: ')}") from None


def _lora_settings(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The `lora:` section with its defaults filled in, every key and value checked (ValueError naming the key)."""
    for key in raw:
        if key not in LORA_DEFAULTS:
            near = close_match(key, LORA_DEFAULTS)
            raise ValueError(f"{path}: lora: unknown key {key!r}" + (f" (did you mean {near!r}?)" if near else "")
                             + f"; the keys are {sorted(LORA_DEFAULTS)}")
    out = {**LORA_DEFAULTS, **raw}
    if not is_int(out["rank"]) or out["rank"] < 1:
        raise ValueError(f"{path}: lora.rank: {out['rank']!r} must be an integer >= 1; write e.g. rank: 8")
    for key in ("alpha", "dropout"):
        if isinstance(out[key], str):
            try:  # YAML 1.1 reads 1e-1 (no dot) as text
                out[key] = float(out[key])
            except ValueError:
                pass
    if not is_number(out["alpha"]) or out["alpha"] <= 0:
        raise ValueError(f"{path}: lora.alpha: {out['alpha']!r} must be a number > 0; write e.g. alpha: 16")
    if not is_number(out["dropout"]) or not 0 <= out["dropout"] < 1:
        raise ValueError(f"{path}: lora.dropout: {out['dropout']!r} must be a number in [0, 1); write e.g. "
                         "dropout: 0.0")
    targets = out["targets"]
    if isinstance(targets, str):
        targets = out["targets"] = [targets] if targets != "all-linear" else targets
    if targets != "all-linear" and (not isinstance(targets, list) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
        raise ValueError(f"{path}: lora.targets: {targets!r} must be a list of module names or 'all-linear'; "
                         "write e.g. targets: [q_proj, v_proj]")
    return out


def lora_config(run: SFTRun) -> Any:
    """PEFT's LoraConfig for the run's `lora:` section (None without one); TRL's SFTTrainer wraps the model."""
    if run.lora is None:
        return None
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"the config's lora: section needs PEFT ({e}): pip install peft") from e
    lora = run.lora
    return peft.LoraConfig(r=int(lora["rank"]), lora_alpha=lora["alpha"], target_modules=lora["targets"],
                           lora_dropout=float(lora["dropout"]), task_type="CAUSAL_LM")


def check_run_model(run: SFTRun) -> None:
    """Raise refusal.ModelRefused (one paragraph: what, why, the fix) when the engine would refuse the run's model,
    with the engine settings the run will have, before anything is written."""
    import transformers

    from ..config.resolve import resolve
    from .refusal import check_trainable

    engine = resolve(_ds_config(run, resolved=True), face="deepspeed").engine
    check_trainable(run.model, transformers.AutoConfig.from_pretrained(run.model), engine)


def check_data(run: SFTRun) -> dict[str, Any]:
    """Every record of the data files checked and converted: {"train": [(Record, conversation), ...],
    "eval": the same or None}."""
    out: dict[str, Any] = {"eval": None}
    for key, file in (("train", run.data), ("eval", run.eval_data)):
        if file is not None:
            out[key] = check_file(file, run.format, run.train_on)
    return out


def _ds_config(run: SFTRun, resolved: bool = False) -> dict[str, Any]:
    # "auto" values are filled by Trainer from the SFTConfig, so the two never disagree; `resolved` writes them
    # out as Trainer will, for checking the config before anything runs. Accelerate's DeepSpeed plugin wants a ZeRO
    # section; the "megatrain" section is what routes the run to the engine. No offload sections: they mean
    # nothing to MegaTrain, and with them accelerate would build DeepSpeed's CPU Adam instead of Trainer's AdamW.
    if resolved:
        face = face_keys(micro_batch=run.micro_batch, accumulation=run.grad_accum, clip=float(run.max_grad_norm),
                         bf16=_bf16(run))
    else:
        face = face_keys(micro_batch=AUTO, accumulation=AUTO, clip=AUTO, bf16=AUTO)
    return {**face, "zero_optimization": {"stage": 3}, "megatrain": dict(run.megatrain)}


def _checkpointing(config_cls: type) -> dict[str, Any]:
    """TRL's default (activation checkpointing on) under the name transformers 5.25 keeps: its old name,
    gradient_checkpointing, which TRL's SFTConfig sets, warns that it is deprecated on every run."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"activation_checkpointing": True} if "activation_checkpointing" in names else {}


def _on_accelerator() -> bool:
    from ..engine import resolve_device

    return resolve_device(None).type != "cpu"


def _bf16(run: SFTRun) -> bool:
    from ..config.resolve import precision_is_bf16

    return precision_is_bf16(run.precision, _on_accelerator)


@dataclass
class Prepared:
    """A run whose config, tokenizer and every data record have been checked: what `train` needs."""

    run: SFTRun
    tokenizer: Any
    train: list[dict[str, list]]
    eval: list[dict[str, list]] | None


def prepare(run: SFTRun) -> Prepared:
    """Check what only the data and the tokenizer can tell (every record, rendered by the chat template);
    ValueError naming the file, line and fix. Writes nothing."""
    import transformers

    data = check_data(run)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(run.tokenizer or run.model)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer={run.tokenizer or run.model!r}: no tokenizer could be loaded from it "
                         f"({str(e).splitlines()[0]}); set tokenizer: to a folder holding one") from None
    if run.chat_template is not None:
        template = Path(run.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else run.chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {run.tokenizer or run.model!r} has no chat template: set chat_template: "
                         "(a Jinja template or a file holding one) in the config")
    for file, records in ((run.data, data["train"]), (run.eval_data, data["eval"] or [])):
        for rec, conv in records:
            try:
                tokenizer.apply_chat_template(conv.get("messages") or conv["prompt"] + conv["completion"],
                                              tokenize=False)
            except Exception as e:  # jinja's errors (and a template's raise_exception) have no common base
                raise ValueError(f"{file}:{rec.line}: record {rec.number}: the chat template refuses it "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); fix the "
                                 "record or set chat_template:") from None
    return Prepared(run, tokenizer, [c for _, c in data["train"]],
                    [c for _, c in data["eval"]] if data["eval"] is not None else None)


def train(prep: Prepared | SFTRun, resume_from: str | Path | None = None) -> dict[str, Any]:
    """Train to the end, or until SIGINT / SIGTERM (then a checkpoint is written and "stopped" names the signal);
    returns the logged losses and which engine trained (also written to run.report). Resumes from the checkpoint
    folder `resume_from`. Call `sft_resume.prepare_output` first: it says which checkpoint to resume from."""
    import torch
    import transformers
    from datasets import Dataset

    from ..run.graceful import GracefulStop
    from .sft_resume import FINAL_DIR, SaveCallback, mark_finished, record_run

    try:
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        raise ImportError(f"megatrain train --config needs TRL and datasets ({e}): pip install 'megatrain[sft]'") from e

    prep = prep if isinstance(prep, Prepared) else prepare(prep)
    run = prep.run
    if run.backend == "megatrain":
        from ..integrations import hf, resume_residency

        hf.install()  # Trainer's DeepSpeed path runs MegaTrain (again, where something in this process undid it)
        resume_residency.install()  # a resume places the residency its checkpoint's run chose

    if run.random_init:
        config = transformers.AutoConfig.from_pretrained(run.model)
        torch.manual_seed(run.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    accel = _on_accelerator()
    args = SFTConfig(
        output_dir=run.output_dir, per_device_train_batch_size=run.micro_batch,
        gradient_accumulation_steps=run.grad_accum, num_train_epochs=run.epochs, max_steps=run.max_steps,
        learning_rate=run.learning_rate, lr_scheduler_type=run.lr_scheduler, warmup_steps=run.warmup_steps,
        weight_decay=run.weight_decay, max_grad_norm=run.max_grad_norm, bf16=_bf16(run), seed=run.seed,
        logging_steps=run.logging_steps, save_strategy="steps",
        # without save_steps Trainer saves only when the callback asks (by time or on a signal)
        save_steps=run.save_steps or 2**31 - 1, save_total_limit=run.save_total_limit, report_to=[],
        max_length=run.max_length, packing=run.packing, use_cpu=not accel,
        deepspeed=_ds_config(run) if run.backend == "megatrain" else None, **_checkpointing(SFTConfig))
    settings = dataclasses.asdict(run)
    record_run(run.output_dir, settings)
    trainer = SFTTrainer(model=model, args=args, processing_class=prep.tokenizer,
                         train_dataset=Dataset.from_list(prep.train),
                         eval_dataset=Dataset.from_list(prep.eval) if prep.eval is not None else None,
                         peft_config=lora_config(run))
    with GracefulStop() as stop:
        saver = SaveCallback(stop, run.save_minutes, run.save_steps)
        trainer.add_callback(saver)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    out: dict[str, Any] = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
                           "eval_loss": None, "engine": type(trainer.model_wrapped).__name__, "backend": run.backend,
                           "resumed_from": str(resume_from) if resume_from is not None else None, "stopped": None,
                           "global_step": trainer.state.global_step}
    if saver.stopped_at is not None:
        out["stopped"] = stop.signal_name
        out["checkpoint"] = str(Path(run.output_dir) / f"checkpoint-{saver.stopped_at}")
    else:
        trainer.save_model(str(Path(run.output_dir) / FINAL_DIR))
        out["eval_loss"] = trainer.evaluate()["eval_loss"] if prep.eval is not None else None
        mark_finished(run.output_dir, settings)
    if run.report:
        Path(run.report).parent.mkdir(parents=True, exist_ok=True)
        Path(run.report).write_text(json.dumps(out, indent=1))
    return out
