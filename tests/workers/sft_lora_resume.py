"""examples/sft/lora.yaml through megatrain.commands.sft.train on MegaTrain: 8 steps with a checkpoint at step 4,
then a second run resumed from that checkpoint (tests/integration/test_sft_lora.py). Run as
`sft_lora_resume.py WORK_DIR`; prints `REPORT {json}` with both runs' logged losses."""

import json
import sys
from pathlib import Path

from megatrain.commands.sft import load_run, train

example = Path(__file__).resolve().parents[2] / "examples" / "sft" / "lora.yaml"
work = Path(sys.argv[1])
whole = train(load_run(example, [f"output_dir={work / 'whole'}", "save_steps=4", "save_minutes=0", "report=null"]))
resumed = train(load_run(example, [f"output_dir={work / 'resumed'}", "report=null"]),
                resume_from=work / "whole" / "checkpoint-4")
print("REPORT " + json.dumps({"whole": whole, "resumed": resumed}))
