"""What a :class:`~grpo_ext.trainer.trainer.GRPOTrainer` run leaves on disk and restores from it.

:class:`RunStateMixin` holds the trainer's public checkpoint and final-model methods: ``save_checkpoint`` (the
trainer's own state, its queued micro-batches, the rollout sampler's position, ``beta``, the counts of non-finite
steps (in the run, and in a row) and the reward functions' names, handed to :class:`~.checkpoint.CheckpointManager`,
which writes ``checkpoint-<step>``), ``load_checkpoint`` (the same state read back, also from another number of
processes with the same global batch), ``latest_checkpoint``, and ``final_model_path``/``save_final_model``
(``output_dir/final_model``, written by :mod:`.final_model`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .final_model import final_model_path, save_final_model


class RunStateMixin:
    """Checkpoints and the final model of :class:`~grpo_ext.trainer.trainer.GRPOTrainer` (see the module docstring)."""

    def latest_checkpoint(self) -> Path | None:
        """The ``checkpoint-N`` folder of ``output_dir`` with the largest N, or None."""
        return self.checkpoints.latest()

    def save_checkpoint(self) -> Path:
        """Write ``output_dir/checkpoint-<step>`` atomically (a temp folder renamed into place) and return it.

        Under torch.distributed every rank must call it: the full (unsharded) state and every rank's queued
        micro-batches are gathered, rank 0 alone writes, and no rank returns before the folder is in place.
        """
        # reward_funcs: their names, which a resume must match (what the run scores may not change)
        state = {"rollout_metrics": self._rollout_metrics, **self.rollouts.state_dict(), "beta": self.beta,
                 "nonfinite_steps": self.nonfinite.total, "nonfinite_in_a_row": self.nonfinite.in_a_row,
                 "reward_funcs": list(self.reward_names)}  # fmt: skip
        return self.checkpoints.save(self.global_step, self._micro_batches, state)

    @property
    def final_model_path(self) -> Path:
        """Where :meth:`train` leaves the trained model: ``output_dir/final_model`` (:mod:`.final_model`)."""
        return final_model_path(self.output_dir)

    def save_final_model(self) -> Path:
        """Write the model and the tokenizer to :attr:`final_model_path` with ``save_pretrained``; return it.

        :meth:`train` calls it when the run ends. Under torch.distributed every rank must call it: the full model is
        gathered and rank 0 alone writes (into a temporary folder renamed into place, see :mod:`.final_model`).
        """
        return save_final_model(self.output_dir, self.model, self.tokenizer, self.config,
                                self.checkpoints.model_class_name, step=self.global_step)  # fmt: skip

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, RNG states, queued rollouts and step from a checkpoint folder.

        Under torch.distributed every rank calls it; rank 0 reads the folder and sends the state to the others
        (they need not see the files). The checkpoint may come from another number of processes if the global batch
        is the same: ``per_device_train_batch_size * world_size`` must equal the saving run's. Queued micro-batches
        are then re-cut into this run's per-rank slices (the same rows per global micro-batch, so the same updates
        up to float rounding; with the saving run's world size they are restored bit for bit).

        Raises:
            ValueError: naming ``per_device_train_batch_size`` when the global batch differs or this world size
                does not divide it; naming ``reward_funcs`` when the reward functions (by name) differ from the
                checkpoint's.
            CheckpointReadError: a file of the checkpoint cannot be read (naming it, and the previous checkpoint).
        """
        state, self._micro_batches = self.checkpoints.load(path, reward_names=self.reward_names)
        self.global_step = state["step"]
        self._rollout_metrics = state["rollout_metrics"]
        self.rollouts.load_state_dict(state)
        self.beta = state["beta"]
        self.nonfinite.total = state.get("nonfinite_steps", 0)
        # the streak goes on: a run stopped between two non-finite steps stops where the uninterrupted one does
        self.nonfinite.in_a_row = state.get("nonfinite_in_a_row", 0)
