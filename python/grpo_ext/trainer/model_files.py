"""The model as ``transformers`` files, shared by the checkpoints (:mod:`.checkpoint`) and the final model.

Both gather the full (unsharded) model state to rank 0 the same way, and write it with the model's own
``save_pretrained`` beside the tokenizer's files: a peft ``PeftModel`` (LoRA) writes its adapter alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import distributed as dist_utils


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
