"""The output folder of a run: one run at a time (a lock file), no silent overwrite, no leftovers of killed saves.

A run's outputs are ``checkpoint-N/`` and ``final_model/`` (its ``trainer_state.json`` holds its step), and
``<name>.previous/`` of either while a new one replaces it (see :func:`replace_folder`), ``metrics.jsonl``,
``metrics.png``, TensorBoard's ``runs/``, and the ``abandoned-after-step-K/`` folders of resumes that went back to an
earlier step (:func:`set_aside_later_outputs`); other files in the folder (a run file, notes) are the user's and are
never touched. ``.tmp-checkpoint-*`` and ``.tmp-final_model-*`` folders (and a ``.tmp-metrics.jsonl-*`` file) are
writes that a kill interrupted: never read, removed when a run starts and after each save. Every folder and file is
flushed to the disk before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".grpo-ext.lock"
FINAL_MODEL_NAME = "final_model"  # the model at the end of a run (grpo_ext.trainer.final_model)
PREVIOUS_SUFFIX = ".previous"  # a folder being replaced (final_model, a checkpoint-N saved again), deleted last
PREVIOUS_FINAL_MODEL_NAME = FINAL_MODEL_NAME + PREVIOUS_SUFFIX  # the one it replaces, until the new one is in place
# In final_model/: the step it was saved at (HF Trainer's key), so that a resume from an earlier step sets it aside.
FINAL_MODEL_STATE_NAME = "trainer_state.json"
_REWRITTEN_FILES = ("metrics.jsonl",)  # rewritten with write_text_atomic (a resume drops lines after its step)
_OUTPUT_FILES = ("metrics.jsonl", "metrics.png", "runs", FINAL_MODEL_NAME, PREVIOUS_FINAL_MODEL_NAME)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
ABANDONED_RE = re.compile(r"^abandoned-after-step-(\d+)(-\d+)?$")  # set_aside_later_outputs' folders
TEMP_CHECKPOINT_PREFIX = ".tmp-checkpoint-"
TEMP_FINAL_MODEL_PREFIX = f".tmp-{FINAL_MODEL_NAME}-"
TEMP_FILE_PREFIX = ".tmp-"  # of a file rewritten in one rename (metrics.jsonl): .tmp-metrics.jsonl-<pid>


class OutputFolderError(RuntimeError):
    """The output folder cannot be used: another run holds it, or it holds a previous run's outputs."""


def previous_outputs(folder: Path) -> list[Path]:
    """The outputs of an earlier run in ``folder`` (checkpoints, metrics, plot, TensorBoard events), sorted."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.name in _OUTPUT_FILES or CHECKPOINT_RE.match(p.name) or ABANDONED_RE.match(p.name))  # fmt: skip


def numbered_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``(N, folder/checkpoint-N)`` of every checkpoint in ``folder``, by step."""
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name)))


def remove_temp_checkpoints(folder: Path) -> list[Path]:
    """Delete the ``.tmp-checkpoint-*`` and ``.tmp-final_model-*`` folders that killed saves left, and a
    ``.tmp-metrics.jsonl-*`` file of a killed rewrite; returns them."""
    if not folder.is_dir():
        return []
    found = sorted(p for prefix in (TEMP_CHECKPOINT_PREFIX, TEMP_FINAL_MODEL_PREFIX) for p in folder.glob(prefix + "*"))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    patterns = [f"{TEMP_FILE_PREFIX}{name}-*" for name in _REWRITTEN_FILES]
    found_files = sorted(p for pattern in patterns for p in folder.glob(pattern) if p.is_file())
    for path in found_files:
        path.unlink(missing_ok=True)
    return found + found_files


def recover_replaced_folders(folder: Path) -> None:
    """Finish the replacements of ``final_model`` and of ``checkpoint-N`` folders that a kill interrupted.

    A new folder replaces an old one in two renames (:func:`replace_folder`): the old one to ``<name>.previous``, then
    the new one to ``<name>``; ``<name>.previous`` is deleted last. Killed between the renames, only
    ``<name>.previous`` (complete) is left: it is renamed back. Killed after them, both are there: the previous one
    is deleted.
    """
    if not folder.is_dir():
        return
    for previous in folder.glob("*" + PREVIOUS_SUFFIX):
        name = previous.name[: -len(PREVIOUS_SUFFIX)]
        if previous.is_dir() and (name == FINAL_MODEL_NAME or CHECKPOINT_RE.match(name)):
            final = folder / name
            if final.is_dir():
                shutil.rmtree(previous)
            else:
                os.replace(previous, final)


def replace_folder(new: Path, final: Path) -> None:
    """Move the complete folder ``new`` to ``final``, flushed to the disk first; an older ``final`` is moved aside
    and deleted last, so that a kill or a power loss at any moment leaves a complete ``final`` or
    ``final.previous`` (which :func:`recover_replaced_folders` puts back)."""
    fsync_tree(new)
    recover_replaced_folders(final.parent)  # an interrupted replacement's leftover: deleted, or restored as final
    previous = final.with_name(final.name + PREVIOUS_SUFFIX)
    if final.exists():
        os.replace(final, previous)
    os.replace(new, final)
    _fsync_folder(final.parent)
    shutil.rmtree(previous, ignore_errors=True)


def fsync_tree(folder: Path) -> None:
    """Flush every file below ``folder``, and the folders themselves, to the disk: renamed into place afterwards,
    a power loss finds them complete, not empty (a rename alone orders nothing against the data's writes)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_folder(Path(root))


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename in it) to the disk, where the file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; their renames are then as durable as they get
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace the file ``path`` with ``text`` in one rename: a kill or a full disk at any moment leaves the old
    file or the new one, never a truncated one. The temporary ``.tmp-<name>-<pid>`` is removed on an error (and by
    :func:`remove_temp_checkpoints` if a kill left it)."""
    tmp = path.with_name(f"{TEMP_FILE_PREFIX}{path.name}-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def final_model_step(folder: Path) -> int | None:
    """The step of ``folder/final_model`` (its ``trainer_state.json``), or None when unknown (none is there, or it
    was saved before the step was recorded)."""
    try:
        return int(json.loads((folder / FINAL_MODEL_NAME / FINAL_MODEL_STATE_NAME).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def set_aside_later_outputs(folder: Path, step: int, metrics_after_step: bool) -> Path | None:
    """Move what a run resumed at ``step`` abandons to ``folder/abandoned-after-step-<step>/`` (``-2``, ... when
    that exists); returns that folder, or None when it abandons nothing.

    That is: the ``checkpoint-N`` folders with ``N > step``, a ``final_model`` of a later step (or of an unknown one:
    the resumed run would replace it), and, when ``metrics_after_step`` (``metrics.jsonl`` has lines after
    ``step``, which the resumed run drops from its own), a copy of ``metrics.jsonl`` as it stands. The later
    checkpoints must leave the folder: the resumed run's ``--resume`` must not pick them up, nor ``save_total_limit``
    keep them over the new run's. Nothing is deleted. The copy of the metrics is flushed to the disk before anything
    is moved and before the resumed run rewrites ``metrics.jsonl``; a failed copy (a full disk) leaves the folder as
    it was.
    """
    later = [path for n, path in numbered_checkpoints(folder) if n > step]
    final, final_step = folder / FINAL_MODEL_NAME, final_model_step(folder)
    if final.is_dir() and (final_step is None or final_step > step):  # unknown: the resumed run would replace it
        later.append(final)
    if not later and not metrics_after_step:
        return None
    target = folder / f"abandoned-after-step-{step}"
    for k in itertools.count(2):
        if not target.exists():
            break
        target = folder / f"abandoned-after-step-{step}-{k}"
    target.mkdir()
    metrics = folder / "metrics.jsonl"
    try:
        if metrics.is_file():
            shutil.copy2(metrics, target / metrics.name)
        fsync_tree(target)  # the copy is on the disk before the resumed run's rewrite drops those lines
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # nothing was moved into it yet
        raise
    for path in later:
        os.replace(path, target / path.name)
    _fsync_folder(target)
    _fsync_folder(folder)
    return target


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


def foreign_checkpoint(folder: Path, resume: str | os.PathLike | bool | None) -> Path | None:
    """The checkpoint folder ``resume`` names when it is not one of ``folder``'s own ``checkpoint-N`` (another run's,
    or one set aside in ``abandoned-after-step-K/``), else None (also for True: the latest of ``folder``)."""
    if not resume or resume is True:
        return None
    path = Path(resume).expanduser().resolve()
    return None if path.parent == folder.expanduser().resolve() else path


def check_fresh_run(folder: Path, resume: str | os.PathLike | bool | None, overwrite: bool) -> None:
    """Raises OutputFolderError when a run would mix its outputs with a previous run's in ``folder``: a fresh run
    (neither ``resume`` nor ``overwrite``) that finds them, or a run resumed from another folder's checkpoint
    (:func:`foreign_checkpoint`) that finds them without ``overwrite``, or one resumed from a checkpoint inside
    ``folder`` that is not its own ``checkpoint-N`` (``overwrite`` would delete it).

    Args:
        folder: the run's ``output_dir``.
        resume: the checkpoint folder resumed from, True for ``folder``'s latest, or None/False for a fresh run.
        overwrite: a fresh run (or one resumed from another folder's checkpoint) may delete the previous outputs.
    """
    old = previous_outputs(folder)
    if not old:
        return
    names = ", ".join(p.name for p in old[:4]) + (", ..." if len(old) > 4 else "")
    foreign = foreign_checkpoint(folder, resume)
    if foreign is not None and foreign.is_relative_to(folder.expanduser().resolve()):
        raise OutputFolderError(
            f"cannot resume from {foreign} into {folder}: it is not one of the folder's own checkpoint-N (one set "
            f"aside in abandoned-after-step-K/?), and the folder holds another run's outputs ({names}). Resume it "
            "into another output_dir (--overwrite would delete it)"
        )
    if foreign is not None and not overwrite:
        raise OutputFolderError(
            f"cannot resume from {foreign} (another run's checkpoint) into {folder}: {folder} holds the outputs of "
            f"a previous run ({names}), which the resumed run would mix with its own and replace. Use another "
            f"output_dir, or delete those outputs first (--overwrite, GRPOConfig.overwrite_output_dir) to continue "
            f"from that checkpoint in {folder}"
        )
    if not resume and not overwrite:
        raise OutputFolderError(
            f"{folder} holds the outputs of a previous run ({names}); a new run would overwrite them. Resume it "
            "(--resume), start over deleting them (--overwrite, GRPOConfig.overwrite_output_dir), or use another "
            "output_dir"
        )


def prepare_output_dir(folder: Path, resume: str | os.PathLike | bool | None, overwrite: bool) -> RunFolderLock:
    """Create and lock ``folder`` for a run, refusing to mix a run with a previous one; clean killed saves.

    Args:
        folder: the run's ``output_dir``.
        resume: the checkpoint folder resumed from (True: ``folder``'s latest), or None/False for a fresh run.
            Resumed from one of ``folder``'s own checkpoints, the previous outputs are the run's own.
        overwrite: a fresh run, or one resumed from another folder's checkpoint, may replace a previous run's
            outputs (deleted here); ignored when resuming from ``folder``'s own checkpoints.

    Returns:
        The held lock (release it when the run ends).

    Raises:
        OutputFolderError: another run holds the folder, or the run would mix its outputs with a previous run's
            (see :func:`check_fresh_run`).
    """
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunFolderLock(folder)
    lock.acquire()
    try:
        recover_replaced_folders(folder)  # first: a checkpoint a kill left as checkpoint-N.previous is one again
        check_fresh_run(folder, resume, overwrite)
        if not resume or foreign_checkpoint(folder, resume) is not None:
            for path in previous_outputs(folder):  # only with overwrite, after check_fresh_run
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        remove_temp_checkpoints(folder)
    except BaseException:
        lock.release()
        raise
    return lock


@contextlib.contextmanager
def claim_output_dir(
    folder: Path, resume: str | os.PathLike | bool | None, overwrite: bool, is_main_process: bool
) -> Iterator[None]:
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
