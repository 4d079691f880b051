"""What stops a run without losing it: SIGINT/SIGTERM (a checkpoint, then exit 130/143) and non-finite steps.

Both decisions are taken the same way on every rank (a flag all-reduced, or numbers that are already global), so the
ranks of a torch.distributed run stop at the same step.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from types import FrameType

import torch

from . import distributed as dist_utils


class TrainingInterrupted(KeyboardInterrupt):
    """The run stopped on SIGINT or SIGTERM after saving a checkpoint of the last finished step.

    Attributes:
        signal_number: the signal received.
        exit_code: ``128 + signal_number`` (130 for SIGINT, 143 for SIGTERM), the shell's convention.
        step: the last finished step.
        checkpoint: the checkpoint folder written for it.
    """

    def __init__(self, signal_number: int, step: int, checkpoint: Path) -> None:
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number
        self.step = step
        self.checkpoint = checkpoint
        name = signal.Signals(signal_number).name
        super().__init__(f"{name} at step {step}: checkpoint saved in {checkpoint}; continue with --resume")


class NonFiniteStepsError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm (none of them changed the model)."""


class StopSignals:
    """A context that turns SIGINT and SIGTERM into a request to stop after the current step.

    The first signal sets the request (the step finishes, a checkpoint is saved, then :class:`TrainingInterrupted`
    is raised); a second one stops at once (``KeyboardInterrupt``). Handlers are installed only in the main thread
    and restored on exit.

    Args:
        verbose: print what happens (rank 0).
    """

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second signal: stop now
            raise KeyboardInterrupt
        self.received = signum
        if self.verbose:  # a raw write: a buffered print here could re-enter one the signal interrupted
            name = signal.Signals(signum).name
            note = f"\n{name}: finishing this step and saving a checkpoint (again: stop at once)\n"
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), note.encode())

    def requested(self, device: torch.device) -> int | None:
        """The signal to stop on, agreed by every rank (the largest any rank received), or None."""
        if dist_utils.world_size() == 1:
            return self.received
        flag = torch.tensor([float(self.received or 0)], device=device)
        dist_utils.all_reduce_max(flag)
        return int(flag.item()) or None


class NonFiniteSteps:
    """Counts the steps whose loss or gradient norm was not finite, and stops the run after too many in a row.

    Args:
        limit: ``GRPOConfig.max_consecutive_nonfinite_steps``.
        verbose: warn (rank 0).
    """

    def __init__(self, limit: int, verbose: bool) -> None:
        self.limit = limit
        self.verbose = verbose
        self.total = 0  # over the run, saved in checkpoints
        self.in_a_row = 0

    def record(self, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """Account for ``step`` (``skipped``: the optimizer did not step), with a warning when it was skipped."""
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.verbose:
            warnings.warn(
                f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; the step is skipped (the model "
                f"and the optimizer are unchanged; {self.in_a_row} in a row, {self.total} in this run)",
                RuntimeWarning,
                stacklevel=2,
            )

    def raise_if_exceeded(self, step: int) -> None:
        """Raises NonFiniteStepsError after ``limit`` skipped steps in a row (``step`` the last)."""
        if self.in_a_row >= self.limit:
            raise NonFiniteStepsError(
                f"steps {step - self.in_a_row + 1}-{step}: the loss or the gradient norm was not finite "
                f"{self.in_a_row} times in a row (GRPOConfig.max_consecutive_nonfinite_steps={self.limit}); the model "
                "was not updated by those steps. Check the inputs of the loss (rewards, log-probs) and lower "
                "learning_rate, then resume from the last checkpoint (--resume)"
            )


def is_finite_step(loss: float, grad_norm: float) -> bool:
    """Whether a step's (global) loss and gradient norm allow an update."""
    return math.isfinite(loss) and math.isfinite(grad_norm)
