"""The model as ``transformers`` files, shared by the checkpoints (:mod:`.checkpoint`) and the final model.

Both gather the full (unsharded) model state to rank 0 the same way, and write it with the model's own
``save_pretrained`` beside the tokenizer's files: a peft ``PeftModel`` (LoRA) writes its adapter alone.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from . import distributed as dist_utils

try:
    from safetensors import SafetensorError
except ImportError:  # safetensors comes with transformers; without it no save_pretrained raises its error

    class SafetensorError(Exception):  # type: ignore[no-redef]
        """Stands for safetensors' error class where safetensors is not installed."""


#: What a failed write of a checkpoint or of the final model raises: OSError, torch.save's RuntimeError ("file write
#: failed"), and safetensors' SafetensorError (a plain Exception: save_pretrained on a full disk raises it).
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, SafetensorError)

# How safetensors (Rust's io::Error, in the message) and other writers spell a full disk or an exhausted quota.
_DISK_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or the user's quota) is full, by its errno or, for errors without one
    (safetensors' SafetensorError), by its message."""
    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(word in str(err) for word in _DISK_FULL_WORDS)


def size_text(num_bytes: float) -> str:
    """A size in the largest unit it reaches, one decimal (``4.0 KiB``, ``12.3 MiB``): a few KiB never read as
    ``0.0 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} bytes"


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def space_shortage(err: BaseException, folder: Path, needed: int) -> str | None:
    """``"needs about X and Y are free"`` when ``err`` is a full disk, else None.

    A full disk is named by the error (:func:`is_disk_full`) or by less free space than ``needed`` below ``folder``'s
    parent (torch.save says only "file write failed" or "unexpected pos").
    """
    try:
        free = shutil.disk_usage(folder.parent).free
    except OSError:
        free = None
    if not is_disk_full(err) and (free is None or free >= needed):
        return None
    free_text = f"{size_text(free)} are free" if free is not None else "the free space is unknown"
    return f"needs about {size_text(needed)} and {free_text}"


def full_state_options() -> Any:
    """torch.distributed.checkpoint's options for a full state: whole tensors, on rank 0 only, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state_dict(model: torch.nn.Module, fsdp: bool) -> dict[str, Any] | None:
    """``model``'s full state dict on rank 0, None on the other ranks; under FSDP2 a collective every rank calls.

    Args:
        model: the policy, FSDP2-sharded when ``fsdp`` (its shards are gathered), else unwrapped (not DDP).
        fsdp: whether ``model`` is sharded.
    """
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=full_state_options())
        return state if dist_utils.rank() == 0 else None
    return model.state_dict() if dist_utils.rank() == 0 else None


def write_pretrained(
    folder: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    model_state: dict[str, Any],
    fsdp: bool,
    model_class_name: str,
) -> None:
    """``model.save_pretrained`` of ``model_state`` and ``tokenizer.save_pretrained`` into ``folder`` (rank 0 only).

    Args:
        folder: an existing folder.
        model: the policy (its ``save_pretrained`` picks the files: a ``PeftModel`` writes its adapter alone).
        tokenizer: written beside it when it has ``save_pretrained``.
        model_state: the full state (:func:`full_model_state_dict`); not modified.
        fsdp: whether ``model`` is FSDP2-sharded (its class is then a generated subclass).
        model_class_name: the model's class before FSDP2 wrapping, written into ``config.json``'s architectures.
    """
    # A copy: save_pretrained takes entries out of the dict it is given (a PeftModel picks its adapter's).
    model.save_pretrained(folder, state_dict=dict(model_state))
    if fsdp:
        fix_saved_architecture(folder, model_class_name)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)


def fix_saved_architecture(folder: Path, class_name: str) -> None:
    """save_pretrained records the model's class; under FSDP2 that is the generated ``FSDP<Class>`` subclass,
    which ``from_pretrained`` would not know: write the original name back."""
    config_path = folder / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        config["architectures"] = [class_name]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
