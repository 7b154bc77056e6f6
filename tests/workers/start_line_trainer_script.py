"""A Trainer script as run_clm.py runs: TrainingArguments with a ZeRO-3 offload DeepSpeed config that has a "megatrain"
section, then `from_pretrained` of the tiny model in argv[1]/model, then Trainer (tests/integration/test_start_line.py). Nothing of megatrain imported; transformers
logs at INFO. `old-order` as the second argument drops the start-up hook on accelerate's DeepSpeed module, as
before it existed (routing installed only at the first `import deepspeed`). Prints `REPORT {json}`."""

import json
import sys

if sys.argv[2:] == ["old-order"]:
    for finder in sys.meta_path:
        if type(finder).__name__ == "_RouteDeepSpeed":
            finder.hooks.pop("accelerate.utils.deepspeed")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.set_verbosity_info()
out = sys.argv[1]
ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]
ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "megatrain": {},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
args = transformers.TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=2, max_steps=2,
                                      learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                      use_cpu=True, deepspeed=ds, gradient_checkpointing=True)
model = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/model")  # as run_clm.py: after the arguments
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("REPORT " + json.dumps({"engine": type(trainer.model_wrapped).__name__,
                              "optimizer": type(trainer.optimizer.optimizer).__name__}))
