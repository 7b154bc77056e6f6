"""The GPU check's 2-GPU worker (experiments/gpu_check/dp2_worker.py) with the node path's all-gather broken: a
rank's layer holds only its own shard. The negative control of tests/unit/test_gpu_check_dp2.py; the harness itself
reaches only megatrain's exported names, so the break lives here."""

import runpy
from pathlib import Path

from megatrain.engine.parallel import node_path

node_path.gather_layer = lambda buf, smap, group, stats=None: None
runpy.run_path(str(Path(__file__).resolve().parents[2] / "experiments" / "gpu_check" / "dp2_worker.py"),
               run_name="__main__")
