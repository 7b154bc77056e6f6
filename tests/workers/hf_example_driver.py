"""Runs examples/ Trainer scripts in one process and prints their reports as JSON (tests/integration/test_hf_integration.py).

    hf_example_driver.py torch OUT SCRIPT...      each script once on plain Trainer
    hf_example_driver.py megatrain OUT SCRIPT...  each script on MegaTrain: 8 steps straight (checkpoint at 4),
                                                  then a fresh trainer resumed from that checkpoint
    hf_example_driver.py torch+megatrain OUT SCRIPT...   both of the above, plain first, in this one process

Each Trainer resets accelerate's shared state when it is built, so runs in one process do not see each other's.
"""

import importlib.util
import json
import sys
from pathlib import Path

backends, out, scripts = sys.argv[1].split("+"), Path(sys.argv[2]), sys.argv[3:]
reports = {}
for script in scripts:
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    where = out / Path(script).stem
    reports[script] = {}
    if "torch" in backends:
        reports[script]["plain"] = module.main(["--backend", "torch", "--output_dir", str(where / "plain")])
    if "megatrain" in backends:
        reports[script]["full"] = module.main(["--output_dir", str(where / "full")])
        reports[script]["resumed"] = module.main(["--output_dir", str(where / "resumed"),
                                                  "--resume_from_checkpoint", str(where / "full" / "checkpoint-4")])
print("REPORT " + json.dumps(reports))
