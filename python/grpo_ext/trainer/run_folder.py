"""The output folder of a run: one run at a time (a lock file), no silent overwrite, no leftovers of killed saves.

A run's outputs are ``checkpoint-N/``, ``final_model/`` (and ``final_model.previous/``, see
:func:`recover_final_model`), ``metrics.jsonl``, ``metrics.png`` and TensorBoard's ``runs/``; other files in the folder
(a run file, notes) are the user's and are never touched. ``.tmp-checkpoint-*`` and ``.tmp-final_model-*`` folders
are saves that a kill interrupted: never read, removed when a run starts and after each save.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".grpo-ext.lock"
FINAL_MODEL_NAME = "final_model"  # the model at the end of a run (grpo_ext.trainer.final_model)
PREVIOUS_FINAL_MODEL_NAME = FINAL_MODEL_NAME + ".previous"  # the one it replaces, until the new one is in place
_OUTPUT_FILES = ("metrics.jsonl", "metrics.png", "runs", FINAL_MODEL_NAME, PREVIOUS_FINAL_MODEL_NAME)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TEMP_CHECKPOINT_PREFIX = ".tmp-checkpoint-"
TEMP_FINAL_MODEL_PREFIX = f".tmp-{FINAL_MODEL_NAME}-"


class OutputFolderError(RuntimeError):
    """The output folder cannot be used: another run holds it, or it holds a previous run's outputs."""


def previous_outputs(folder: Path) -> list[Path]:
    """The outputs of an earlier run in ``folder`` (checkpoints, metrics, plot, TensorBoard events), sorted."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name in _OUTPUT_FILES or CHECKPOINT_RE.match(p.name))


def remove_temp_checkpoints(folder: Path) -> list[Path]:
    """Delete the ``.tmp-checkpoint-*`` and ``.tmp-final_model-*`` folders that killed saves left; returns them."""
    if not folder.is_dir():
        return []
    found = sorted(p for prefix in (TEMP_CHECKPOINT_PREFIX, TEMP_FINAL_MODEL_PREFIX) for p in folder.glob(prefix + "*"))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def recover_final_model(folder: Path) -> None:
    """Finish a replacement of ``final_model`` that a kill interrupted.

    A new final model replaces the old one in two renames (:func:`.final_model.save_final_model`): the old folder to
    ``final_model.previous``, then the new one to ``final_model``; ``final_model.previous`` is deleted last. Killed
    between the renames, only ``final_model.previous`` (a complete model) is left: it is renamed back. Killed after
    them, both are there: the previous one is deleted.
    """
    previous, final = folder / PREVIOUS_FINAL_MODEL_NAME, folder / FINAL_MODEL_NAME
    if not previous.is_dir():
        return
    if final.is_dir():
        shutil.rmtree(previous)
    else:
        os.replace(previous, final)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunFolderLock:
    """An exclusive lock on ``folder/.grpo-ext.lock`` for the life of a run (``fcntl.flock``, POSIX only).

    The kernel drops a flock when its process dies, however it dies, so the lock of a killed run is free and is
    taken over; the file's text (pid, host) only makes the messages precise.
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            OutputFolderError: another live process holds it (named by its pid and host).
        """
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputFolderError(
                    f"another run ({holder}) is writing to {self.path.parent}: two runs would mix their checkpoints "
                    "and metrics. Wait for it to finish, or use another output_dir"
                ) from None
            # The holder may have removed the file between our open and our lock: then lock the new file.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        match = re.match(r"pid (\d+) on (\S+)", previous)
        if match and match.group(2) == socket.gethostname() and not _pid_alive(int(match.group(1))):
            warnings.warn(f"taking over the lock of a run that died ({previous}) in {self.path.parent}", stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (removing first: a waiting run then finds no stale file)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def check_fresh_run(folder: Path, resume: bool, overwrite: bool) -> None:
    """Raises OutputFolderError when a fresh run (neither ``resume`` nor ``overwrite``) finds a previous run's outputs
    in ``folder``."""
    old = previous_outputs(folder)
    if old and not resume and not overwrite:
        names = ", ".join(p.name for p in old[:4]) + (", ..." if len(old) > 4 else "")
        raise OutputFolderError(
            f"{folder} holds the outputs of a previous run ({names}); a new run would overwrite them. Resume it "
            "(--resume), start over deleting them (--overwrite, GRPOConfig.overwrite_output_dir), or use another "
            "output_dir"
        )


def prepare_output_dir(folder: Path, resume: bool, overwrite: bool) -> RunFolderLock:
    """Create and lock ``folder`` for a run, refusing to mix a fresh run with a previous one; clean killed saves.

    Args:
        folder: the run's ``output_dir``.
        resume: the run continues from a checkpoint (the previous outputs are its own).
        overwrite: a fresh run may replace a previous run's outputs (deleted here); ignored when resuming.

    Returns:
        The held lock (release it when the run ends).

    Raises:
        OutputFolderError: another run holds the folder, or a fresh run finds a previous run's outputs without
            ``overwrite``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunFolderLock(folder)
    lock.acquire()
    try:
        check_fresh_run(folder, resume, overwrite)
        if not resume:
            for path in previous_outputs(folder):  # only with overwrite, after check_fresh_run
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        remove_temp_checkpoints(folder)
        recover_final_model(folder)
    except BaseException:
        lock.release()
        raise
    return lock


@contextlib.contextmanager
def claim_output_dir(folder: Path, resume: bool, overwrite: bool, is_main_process: bool) -> Iterator[None]:
    """:func:`prepare_output_dir` on rank 0 for the duration of the block; every rank raises its error alike.

    Raises:
        OutputFolderError: on every rank (see :func:`prepare_output_dir`).
    """
    from . import distributed as dist_utils

    lock, error = None, None
    if is_main_process:
        try:
            lock = prepare_output_dir(folder, resume, overwrite)
        except OutputFolderError as err:
            error = str(err)
    error = dist_utils.broadcast_object(error)
    if error is not None:
        raise OutputFolderError(error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
