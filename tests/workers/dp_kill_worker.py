"""One rank of the sharded-save kill test (tests/integration/test_dp_resume.py): two ranks sharing one host store train the
example's tiny Llama through the DeepSpeed face, save checkpoint "a", train a step more, and save "b", during
which rank 1 is SIGKILLed while writing its shard file (before the file's fsync).

Run as `python tests/workers/dp_kill_worker.py OUT_DIR` with torchrun's variables in the environment. Rank 0 writes
OUT_DIR/a.pt (the weights as saved in "a") and, when its save of "b" fails, OUT_DIR/b_error.txt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from examples_module import load_example


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import megatrain

    example = load_example("train_data_parallel")
    model = example.build_model(seed=rank)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": example.CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": example.LR}},
           "megatrain": example.engine_section(30.0)}
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = example.Rows(2 * world)
    root = out / "ckpt"

    def train_step(j: int) -> None:
        batch = data.ids[j * world + rank: j * world + rank + 1]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()

    train_step(0)
    engine.save_checkpoint(root, tag="a")
    if rank == 0:
        torch.save(engine.state_dict(), out / "a.pt")
    train_step(1)
    if rank == 1:
        # The first fsync of the save is that of this rank's shard file, its bytes written: die there.
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    try:
        engine.save_checkpoint(root, tag="b")
    except Exception as e:  # rank 0: its peer died mid-save
        (out / "b_error.txt").write_text(f"{type(e).__name__}: {e}")
        os._exit(3)  # the group is broken: no orderly teardown
    (out / "b_saved.txt").write_text("saved")


if __name__ == "__main__":
    main()
