"""`megatrain train --config ...` that waits after its checkpoint at step N until a stop signal arrives.

    python sft_signal_driver.py N READY_FILE train --config ...

Once checkpoint N is whole it writes READY_FILE and waits; the test sends SIGINT or SIGTERM from outside, so
the signal always lands mid-run at the same step, however fast the steps are on the machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megatrain.commands import cli, sft_resume

pause_at, ready = int(sys.argv[1]), Path(sys.argv[2])
real_on_save = sft_resume.SaveCallback.on_save


def on_save(self, args, state, control, **kw):
    real_on_save(self, args, state, control, **kw)
    if state.global_step == pause_at:
        ready.write_text("ready")
        deadline = time.monotonic() + 120
        while not self.stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)


sft_resume.SaveCallback.on_save = on_save
sys.exit(cli.main(sys.argv[3:]))
