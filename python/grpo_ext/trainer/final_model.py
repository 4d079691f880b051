"""The model a run ends with: ``output_dir/final_model``, written by ``save_pretrained`` when ``train()`` returns.

TRL's ``trl grpo`` saves the trained model when training ends (``trainer.save_model``); so does every run here, also
one that stops on ``max_time_s``. The folder loads with ``from_pretrained``: a full model's ``config.json`` and
weights, or for a peft ``PeftModel`` (LoRA) its adapter alone (``adapter_config.json``, ``adapter_model.safetensors``:
load it onto the base model with ``peft.PeftModel.from_pretrained``), the tokenizer's files beside them, the run's
``config.grpo.json``, and ``trainer_state.json`` (``{"global_step": N}``, HF Trainer's key: its step). A run
stopped by a signal or by non-finite steps is not finished: its last checkpoint holds the model.

The folder is written as a checkpoint is: the full state gathered to rank 0 (:mod:`.model_files`), which alone writes,
into a temporary folder renamed into place. A final model already there (a resumed run's earlier one) is replaced
without a moment where no complete one exists (:func:`.run_folder.replace_folder`;
:func:`.run_folder.recover_replaced_folders` finishes a replacement a kill interrupted).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from . import distributed as dist_utils
from .config import GRPOConfig
from .model_files import WRITE_ERRORS, full_model_state_dict, space_shortage, tensor_bytes, write_pretrained
from .run_folder import (
    FINAL_MODEL_NAME,
    FINAL_MODEL_STATE_NAME,
    TEMP_FINAL_MODEL_PREFIX,
    recover_replaced_folders,
    replace_folder,
)


class FinalModelWriteError(OSError):
    """The final model could not be written (the folder and the cause are in the message)."""


def final_model_path(output_dir: str | os.PathLike) -> Path:
    """Where a run in ``output_dir`` leaves its final model: ``output_dir/final_model``."""
    return Path(output_dir) / FINAL_MODEL_NAME


def save_final_model(
    output_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    config: GRPOConfig,
    model_class_name: str,
    step: int | None = None,
) -> Path:
    """Write ``model`` and ``tokenizer`` to ``output_dir/final_model`` with ``save_pretrained``; return that path.

    Every rank must call it (under FSDP2 the full state is gathered, a collective); rank 0 alone writes, and no rank
    returns before the folder is in place. A kill at any moment leaves the previous final model (if any) complete,
    as ``final_model`` or ``final_model.previous``, and at most a ``.tmp-final_model-*`` folder, which the next run
    removes.

    Args:
        output_dir: the run's folder.
        model: the policy, unwrapped (not DDP), FSDP2-sharded when ``config.fsdp``.
        tokenizer: saved beside it.
        config: the run's options (``fsdp``; written as ``config.grpo.json``).
        model_class_name: the model's class name before FSDP2 wrapping.
        step: the step the model is at, written as ``trainer_state.json``'s ``global_step`` (a resume from an
            earlier step then sets this final model aside, :func:`.run_folder.set_aside_later_outputs`).

    Raises:
        FinalModelWriteError: on every rank, when rank 0 could not write (a full disk says how much space the model
            needs and how much is free).
    """
    final = final_model_path(output_dir)
    model_state = full_model_state_dict(model, config.fsdp)
    failure = None
    if dist_utils.rank() == 0:
        tmp = output_dir / f"{TEMP_FINAL_MODEL_PREFIX}{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_pretrained(tmp, model, tokenizer, model_state, config.fsdp, model_class_name)
            (tmp / "config.grpo.json").write_text(json.dumps(config.to_dict(), indent=2))
            if step is not None:
                (tmp / FINAL_MODEL_STATE_NAME).write_text(json.dumps({"global_step": step}) + "\n")
            replace_folder(tmp, final)
        except WRITE_ERRORS as err:  # safetensors' SafetensorError too: save_pretrained on a full disk
            shutil.rmtree(tmp, ignore_errors=True)
            recover_replaced_folders(output_dir)  # an earlier final model moved aside goes back
            first_line = str(err).splitlines()[0] if str(err) else ""
            failure = (f"could not write the final model to {final}: {type(err).__name__}: {first_line}. The "
                       "checkpoints and an earlier final model are intact")  # fmt: skip
            shortage = space_shortage(err, final, tensor_bytes(model_state))
            if shortage is not None:
                failure += (f"; the disk is full: the final model {shortage}. Free some space, then --resume from "
                            "the last checkpoint")  # fmt: skip
    del model_state
    # Instead of a barrier: every rank learns whether rank 0's write failed, so none waits for the others.
    failure = dist_utils.broadcast_object(failure)
    if failure is not None:
        raise FinalModelWriteError(failure)
    return final
