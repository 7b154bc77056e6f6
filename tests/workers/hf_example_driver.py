"""Runs examples/ Trainer scripts in one process and prints their reports as JSON (tests/integration/test_hf_integration.py).

    hf_example_driver.py torch OUT SCRIPT...      each script once on plain Trainer
    hf_example_driver.py megatrain OUT SCRIPT...  each script on MegaTrain: 8 steps straight (checkpoint at 4),
                                                  then a fresh trainer resumed from that checkpoint
"""

import importlib.util
import json
import sys
from pathlib import Path

backend, out, scripts = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
reports = {}
for script in scripts:
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    where = out / Path(script).stem
    if backend == "torch":
        reports[script] = {"plain": module.main(["--backend", "torch", "--output_dir", str(where / "plain")])}
    else:
        full = module.main(["--output_dir", str(where / "full")])
        resumed = module.main(["--output_dir", str(where / "resumed"),
                               "--resume_from_checkpoint", str(where / "full" / "checkpoint-4")])
        reports[script] = {"full": full, "resumed": resumed}
print("REPORT " + json.dumps(reports))
