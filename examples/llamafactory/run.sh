#!/usr/bin/env bash
# The LlamaFactory recipe, followed on a fresh venv: install in an order that keeps torch, train 8 steps with
# LlamaFactory alone and under `megatrain launch`, compare the logged losses.
#   bash examples/llamafactory/run.sh [VENV] [TORCH_SPEC] [RECIPE]
# TORCH_SPEC: the torch you train with, pinned so LlamaFactory's requirements cannot swap it (default: the CPU
# wheel this project's CPU machines use; on a GPU machine give your CUDA build's version, e.g. torch==2.13.0).
# RECIPE: sft.yaml (full fine-tuning, the default) or lora.yaml (finetuning_type: lora).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-llamafactory}"
torch_spec="${2:-torch==2.13.0}"
recipe="${3:-sft.yaml}"
work="$(mktemp -d)"

python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "$torch_spec"
# One resolve with torch pinned: llamafactory 0.9.5 would otherwise pull another torch (and transformers 5.6 with
# it); kernels 0.12.3 is the release transformers 5.6 imports cleanly.
"$py" -m pip install -q -e "$root[deepspeed]" "llamafactory==0.9.5" "$torch_spec" "kernels==0.12.3"
stubs="$work/stubs"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # PyPI's torchvision and torchaudio wheels are CUDA builds that fail to load beside a CPU torch; text-only SFT
    # never calls them: remove torchvision, and stand in an empty torchaudio for LlamaFactory's top-level import.
    "$py" -m pip uninstall -y -q torchvision torchaudio
    mkdir -p "$stubs/torchaudio" && : > "$stubs/torchaudio/__init__.py"
fi

"$py" - "$root/examples/sft/tiny-llama" "$work/model" <<'PY'
import shutil, sys, torch, transformers
shutil.copytree(sys.argv[1], sys.argv[2])
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(sys.argv[2])).save_pretrained(sys.argv[2])
PY
for v in plain megatrain; do
    sed -e "s#MODEL#$work/model#" -e "s#DATASET_DIR#$here#" -e "s#OUTPUT_DIR#$work/out_$v#" "$here/$recipe" \
        > "$work/$v.yaml"
done
echo "deepspeed: $here/ds.json" >> "$work/megatrain.yaml"
export PYTHONPATH="$stubs${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/llamafactory-cli" train "$work/plain.yaml" > "$work/plain.log" 2>&1
"$venv/bin/megatrain" launch llamafactory-cli train "$work/megatrain.yaml" > "$work/megatrain.log" 2>&1
grep -q "MegaTrain is training" "$work/megatrain.log" || { echo "MegaTrain did not train: $work/megatrain.log"; exit 1; }
"$py" - "$work" <<'PY'
import json, sys
loss = {v: [r["loss"] for r in json.load(open(f"{sys.argv[1]}/out_{v}/trainer_state.json"))["log_history"] if "loss" in r]
        for v in ("plain", "megatrain")}
diff = max(abs(a - b) for a, b in zip(loss["plain"], loss["megatrain"]))
print(f"{len(loss['megatrain'])} losses {loss['megatrain'][0]:.3f} -> {loss['megatrain'][-1]:.3f}, "
      f"max |diff| {diff:.1e} from LlamaFactory alone")
sys.exit(0 if len(loss["plain"]) == len(loss["megatrain"]) == 8 and diff < 1e-5 else 1)
PY
