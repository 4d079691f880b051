"""The run lifecycle of :class:`~grpo_ext.trainer.trainer.GRPOTrainer`: ``train()`` and its loop of steps.

:class:`TrainingLoopMixin` holds ``train`` (claim the output folder, resume from a checkpoint, open the metrics files,
run the steps under the SIGINT/SIGTERM handlers, save the final model, print where it went and plot the metrics) and
``_run_steps``, the loop itself: the evaluation before the first step, each step's timing and counters, the progress
bar and its postfix, the logging and completion samples (written by :mod:`.metrics`), the periodic evaluations and
checkpoints, and the stops: ``max_steps``, ``max_time_s`` (``_out_of_time``, by rank 0's clock: a checkpoint, then
the final model), a signal (a checkpoint, then :class:`~.guards.TrainingInterrupted`) and too many non-finite steps in
a row.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from . import distributed as dist_utils
from .guards import StopSignals, TrainingInterrupted
from .run_folder import claim_output_dir, set_aside_later_outputs


class TrainingLoopMixin:
    """The run lifecycle of :class:`~grpo_ext.trainer.trainer.GRPOTrainer` (see the module docstring)."""

    def train(self, resume_from_checkpoint: str | bool | None = None) -> list[dict[str, float]]:
        """Run until ``config.max_steps`` optimizer steps (or ``config.max_time_s``), then save the model.

        The trained model and the tokenizer are written to ``output_dir/final_model`` (:attr:`final_model_path`) with
        ``save_pretrained`` when the run ends, a ``max_time_s`` stop included (a peft model: its adapter alone). A
        ``max_time_s`` stop before ``max_steps`` also saves a checkpoint of its last step, which ``--resume`` (with a
        larger ``max_time_s``) continues from; a run stopped by a signal or by non-finite steps leaves its last
        checkpoint instead of the final model. With ``save_steps``, a checkpoint is saved every ``save_steps`` steps
        and at the last one (as HF Trainer does), so that a resume with a larger ``max_steps`` continues from the end.

        A run resumed from an earlier step than what ``output_dir`` holds (later checkpoints, a final model of a
        later step, metrics lines after it) moves those to ``output_dir/abandoned-after-step-K/`` first.

        Args:
            resume_from_checkpoint: a checkpoint folder, or True for the latest ``checkpoint-N`` in ``output_dir``.
                A checkpoint of another folder resumes into an ``output_dir`` without previous outputs, or with
                ``config.overwrite_output_dir`` (they are deleted first).

        Returns:
            The logged metrics, one dict per logged step (also in ``output_dir/metrics.jsonl``). Under
            torch.distributed every rank returns them; only rank 0 writes files, TensorBoard events and progress.

        Raises:
            OutputFolderError: another run holds ``output_dir``, or a fresh run (or one resumed from another
                folder's checkpoint) finds a previous run's outputs there (without ``config.overwrite_output_dir``).
            CheckpointReadError: a file of the checkpoint cannot be read (naming it and the newest other one).
            TrainingInterrupted: SIGINT or SIGTERM, after a checkpoint of the last finished step was saved.
            NonFiniteStepsError: ``config.max_consecutive_nonfinite_steps`` skipped steps in a row.
            FinalModelWriteError: the final model could not be written (a full disk).
        """
        cfg = self.config
        resume = bool(resume_from_checkpoint)
        # The checkpoint's folder, not only whether there is one: another run's checkpoint must not mix with (and
        # replace) the outputs of the run in output_dir.
        with claim_output_dir(self.output_dir, resume_from_checkpoint, cfg.overwrite_output_dir, self.is_main_process):
            if resume:
                self.load_checkpoint(self.checkpoints.resume_path(resume_from_checkpoint))
            if self.is_main_process:
                if resume:
                    self._set_aside_abandoned_outputs()
                    self.checkpoints.prune_to_limit()  # a kill between a save's rename and its pruning left one more
                self.metrics_logger.open(self.global_step)
            with StopSignals(verbose=self.is_main_process) as stop:
                history = self._run_steps(stop)
                # Still under the signal handlers: a first Ctrl-C waits for the model to be on disk.
                saved_model = self.save_final_model()
            if self.is_main_process:
                tqdm.write(f"final model (step {self.global_step}): {saved_model}")
            if cfg.plot and self.is_main_process:
                self.metrics_logger.plot()
            dist_utils.barrier()  # rank 0's files are complete when train() returns on any rank
        return history

    def _set_aside_abandoned_outputs(self) -> None:
        """A run resumed from an earlier step than the last one saved or logged abandons what came after it: the
        later checkpoints, a final model of a later step and the metrics lines after it go to
        ``abandoned-after-step-K/`` (rank 0), with a note; nothing of the abandoned run is deleted."""
        step = self.global_step
        aside = set_aside_later_outputs(self.output_dir, step, self.metrics_logger.logged_after(step))
        if aside is None:
            return
        moved = sorted(p.name for p in aside.iterdir())
        if "metrics.jsonl" in moved:
            moved[moved.index("metrics.jsonl")] = f"metrics.jsonl as it stood (its lines after step {step} are dropped)"
        tqdm.write(f"resumed at step {step}: what the run after it left was moved to {aside}: {', '.join(moved)}")

    def _run_steps(self, stop: StopSignals) -> list[dict[str, float]]:
        """The loop of :meth:`train`: steps, logging, checkpoints, and the stops (time, signals, non-finite steps)."""
        cfg = self.config
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        bar = tqdm(
            total=cfg.max_steps, initial=self.global_step, disable=cfg.disable_tqdm or not self.is_main_process,
            desc="GRPO", unit="step",
            mininterval=0.1 if sys.stderr.isatty() else 10.0,  # a log file gets a line every 10 s, not 10 a second
        )  # fmt: skip
        try:
            if self.eval_dataset is not None and self.global_step == 0:  # where the model starts
                metrics = {"step": 0, **self.evaluate()}
                if self.is_main_process:
                    self.metrics_logger.log(metrics, 0)
                history.append(metrics)
            while self.global_step < cfg.max_steps:
                step_start = time.perf_counter()
                metrics = self._training_step()
                self.global_step += 1
                metrics.update(self._rollout_metrics)
                metrics["step_time"] = time.perf_counter() - step_start
                # The tokens this step trained on (all processes): its gradient_accumulation_steps micro-batches of
                # the steps_per_generation that one generation batch (num_tokens) is cut into; a step that reuses a
                # batch (num_iterations > 1, or later steps of one generation) counts its own share, not the batch
                share = cfg.gradient_accumulation_steps / cfg.steps_per_generation
                metrics["tokens_per_second"] = self._rollout_metrics["num_tokens"] * share / metrics["step_time"]
                metrics["nonfinite_steps"] = float(self.nonfinite.total)
                metrics["step"] = self.global_step
                bar.update(1)
                out_of_time = cfg.max_time_s is not None and self._out_of_time(start)
                last = self.global_step == cfg.max_steps or out_of_time
                evaluated = self.eval_dataset is not None and (
                    last or (cfg.eval_steps > 0 and self.global_step % cfg.eval_steps == 0)
                )
                if evaluated:
                    metrics.update(self.evaluate())
                if self.global_step % cfg.logging_steps == 0 or last or evaluated:
                    if self.is_main_process:
                        self.metrics_logger.log(metrics, self.global_step)
                    history.append(metrics)
                    postfix = {"reward": f"{metrics['reward']:.3f}", "loss": f"{metrics['loss']:.4f}"}
                    if self.last_eval_reward is not None:
                        postfix["eval"] = f"{self.last_eval_reward:.3f}"
                    bar.set_postfix(postfix)
                if cfg.log_completions and self.global_step % cfg.log_completions_steps == 0 and self.is_main_process:
                    self.metrics_logger.print_completions(self.global_step, self._sample_completions)
                saved = None
                # The last step too (as HF Trainer's save_strategy="steps"): a resume with a larger max_steps then
                # continues from the end, not from the last multiple of save_steps (redoing the steps after it).
                if cfg.save_steps and (self.global_step % cfg.save_steps == 0 or self.global_step == cfg.max_steps):
                    saved = self.save_checkpoint()
                self.nonfinite.raise_if_exceeded(self.global_step)
                signal_number = stop.requested(self.device)  # the same on every rank
                if signal_number and self.global_step < cfg.max_steps:
                    raise TrainingInterrupted(signal_number, self.global_step, saved or self.save_checkpoint())
                if out_of_time:
                    # A time stop is a pause: --resume (with more max_time_s) continues from this checkpoint.
                    if self.global_step < cfg.max_steps:
                        saved = saved or self.save_checkpoint()
                    if self.is_main_process:
                        where = f"; checkpoint: {saved}" if saved else ""
                        tqdm.write(f"stopping at step {self.global_step}: max_time_s={cfg.max_time_s} reached{where}")
                    break
        finally:
            bar.close()
            self.metrics_logger.close()
        return history

    def _out_of_time(self, start: float) -> bool:
        """Whether ``max_time_s`` has passed, by rank 0's clock: every rank must stop at the same step."""
        return dist_utils.broadcast_flag(time.perf_counter() - start > self.config.max_time_s, self.device)
