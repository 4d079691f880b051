"""``grpo-ext train`` in a child process for tests/test_faults.py, which kills or interrupts it from outside.

Usage: ``python fault_child.py [--pause-in-save STEP MARKER] <grpo-ext arguments>``. With ``--pause-in-save``, the
save of checkpoint-STEP stops half-way (its model file written, its trainer state not) and writes the file MARKER,
so that the parent can ``kill -9`` the process in the middle of a save.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from grpo_ext.trainer.cli import main


def pause_in_save(step: int, marker: Path) -> None:
    """Make the write of ``checkpoint-<step>``'s trainer state block after its model state is on disk."""
    save = torch.save

    def paused_save(obj, path, *args, **kwargs):
        if Path(path).name == "trainer_state.pt" and obj.get("step") == step:
            marker.write_text("in the middle of a save\n")
            time.sleep(600)  # the parent kills us here
        return save(obj, path, *args, **kwargs)

    torch.save = paused_save


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    if argv[0] == "--pause-in-save":
        pause_in_save(int(argv[1]), Path(argv[2]))
        argv = argv[3:]
    sys.exit(main(argv))
