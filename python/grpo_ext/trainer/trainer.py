"""GRPOTrainer: rollouts with ``model.generate``, rewards, grpo_ext advantages and loss, AdamW, checkpoints.

The training loop and the GRPO-specific steps live here; sampling is in :mod:`.rollout`, checkpoints in
:mod:`.checkpoint`, and the logged metrics and their files in :mod:`.metrics`.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

import grpo_ext

from ..ops.grpo_loss_from_logits import masked_mean_entropy
from ..ops.options import TOKEN_LEVEL_LOSS_TYPES
from . import distributed as dist_utils
from .checkpoint import CheckpointManager, build_optimizer, scheduler_step, seed_everything
from .config import GRPOConfig
from .evaluation import EVAL_REWARD, evaluate_greedy
from .guards import NonFiniteSteps, StopSignals, TrainingInterrupted, is_finite_step
from .metrics import MetricsLogger, StepMetrics
from .policy_logps import fused_policy_loss, fused_token_logps, plain_token_logps, use_fused
from .rewards import score_completions
from .rollout import RolloutGenerator, bf16_autocast
from .run_folder import claim_output_dir

RewardFunc = Callable[..., list]


def _reward_name(func: RewardFunc) -> str:
    """The name a reward function's metrics are logged under."""
    return getattr(func, "__name__", type(func).__name__)


class GRPOTrainer:
    """GRPO on a causal LM from ``transformers`` (or any module with the same ``generate``/``forward``).

    Args:
        model: the policy, a ``PreTrainedModel`` (``forward(input_ids, attention_mask, position_ids).logits`` and
            ``generate``); trained in place. With ``logps_backend="fused"`` its loss and log-probs come from its
            body's last hidden states and its LM head (:mod:`.policy_logps`), never from ``[B, T, V]`` logits.
        reward_funcs: one callable or a list, each ``f(prompts, completions, **columns) -> list[float | None]``.
            As in TRL, a completion is its text (special tokens removed) when its prompt is a string, and
            ``[{"role": "assistant", "content": text}]`` when its prompt is a list of messages; ``prompts`` are the
            dataset's prompts as they are.
        train_dataset: a sequence of dicts with a ``prompt`` and any other columns (given to the rewards). A prompt
            is a string (tokenized as it is, with the tokenizer's special tokens, no chat template) or a list of
            messages ``[{"role": "user", "content": ...}, ...]`` (rendered with the tokenizer's chat template and
            the generation prompt), as TRL takes them (:func:`.rollout.prompt_token_ids`).
        config: the options (default ``GRPOConfig()``).
        ref_model: the frozen reference for the KL term; default a deep copy of ``model`` made here, only when
            ``config.beta != 0``.
        tokenizer: a ``transformers`` tokenizer with ``pad_token_id`` and ``eos_token_id`` (left padding is used).
            A completion ends at the tokenizer's EOS or at one of the model's ``generation_config.eos_token_id``.
        eval_dataset: held-out rows like ``train_dataset``'s, or None. Their greedy completions are scored by the
            reward functions before the first step, every ``config.eval_steps`` steps and after the last
            (:func:`.evaluation.evaluate_greedy`); ``eval/reward`` (and ``eval/rewards/<name>/mean``) is logged with
            that step (step 0: before training), shown in the progress bar and plotted beside the training reward.

    Under ``torchrun`` (a default process group initialized before the trainer is built, every rank building it
    with the same arguments) the trainer runs data-parallel: DDP, or FSDP2 with ``config.fsdp``. Each rank
    generates, scores and trains on its share of every global batch (``per_device_train_batch_size`` rows per
    micro-batch); rewards are all-gathered so advantages are those of the global batch, and the loss is scaled so the
    averaged gradient equals one process's over the global batch. A run's result depends on the global batch
    (``per_device_train_batch_size * world_size``) and the seed, not on the number of processes (see
    :mod:`grpo_ext.trainer.distributed`). ``model`` must be on this rank's device; rank 0's weights are copied to
    every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        train_dataset: Sequence[dict[str, Any]],
        config: GRPOConfig | None = None,
        ref_model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        eval_dataset: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config if config is not None else GRPOConfig()
        cfg = self.config
        if tokenizer is None:
            raise ValueError("GRPOTrainer needs a tokenizer (to encode prompts and decode completions)")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to the EOS token)")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token: completions could never stop")
        self.model = model
        self.tokenizer = tokenizer
        self.reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function")
        self.reward_names = [_reward_name(f) for f in self.reward_funcs]
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"GRPOConfig.reward_weights has {len(cfg.reward_weights)} entries but there are "
                f"{len(self.reward_funcs)} reward functions"
            )
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty")
        self.train_dataset = train_dataset
        if eval_dataset is not None and len(eval_dataset) == 0:
            raise ValueError("eval_dataset is empty: give held-out rows, or None for no evaluation")
        self.eval_dataset = eval_dataset
        self.last_eval_reward: float | None = None
        self.device = next(model.parameters()).device
        self.use_bf16 = cfg.bf16 if cfg.bf16 is not None else self.device.type == "cuda"

        self.world_size = dist_utils.world_size()
        self.rank = dist_utils.rank()
        self.is_main_process = self.rank == 0
        self.use_fsdp = cfg.fsdp
        if cfg.fsdp and not dist_utils.is_distributed():
            raise ValueError(
                "GRPOConfig.fsdp=True needs torch.distributed initialized (launch with torchrun, or call "
                "torch.distributed.init_process_group before building the trainer)"
            )
        if cfg.fsdp and cfg.dynamic_sampling and cfg.num_generations < self.world_size:
            # A dynamic-sampling round can be a single group; split over more ranks than rows, a rank would have
            # nothing to generate and would miss FSDP's collectives.
            raise ValueError(
                f"GRPOConfig.num_generations ({cfg.num_generations}) must be >= the world size ({self.world_size}) "
                "with fsdp=True and dynamic_sampling=True"
            )
        if self.world_size > 1:
            dist_utils.broadcast_module(model)  # every rank starts from rank 0's weights (DDP does it too; FSDP not)

        self.beta = cfg.beta  # moved by the adaptive KL controller when cfg.kl_target is set
        self.ref_model = None
        if cfg.beta != 0:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
            if self.world_size > 1 and ref_model is not None:
                dist_utils.broadcast_module(self.ref_model)
        # The sampling policy's log-probs are needed only when the policy can move between generation and use.
        self.needs_old_logps = cfg.num_iterations > 1 or cfg.steps_per_generation > 1
        # Which models the fused path scores from hidden states (decided before FSDP2 renames the class; a model it
        # cannot score exactly falls back to the plain path with a warning).
        self.policy_fused = use_fused(model, cfg.logps_backend, "policy", self.is_main_process)
        self.ref_fused = self.ref_model is not None and use_fused(
            self.ref_model, cfg.logps_backend, "reference", self.is_main_process
        )

        model_class_name = type(model).__name__  # FSDP2 swaps in a generated subclass
        self._train_model = dist_utils.wrap_for_training(model, self.ref_model, cfg.fsdp, self.device)

        param_names = [name for name, p in model.named_parameters() if p.requires_grad]  # optimizer order
        self.optimizer, self.lr_scheduler = build_optimizer(model, cfg)

        self.global_step = 0
        self._micro_batches: list[dict[str, Any]] = []  # scored rollouts waiting to be trained on
        self._rollout_metrics: dict[str, float] = {}
        self._sample_completions: list[tuple[str, str, float]] = []
        self.output_dir = Path(cfg.output_dir)
        self.rollouts = RolloutGenerator(
            model, tokenizer, train_dataset, cfg, score=self._score_completions, logps=self.token_logps,
            ref_model=self.ref_model, needs_old_logps=self.needs_old_logps, device=self.device, use_bf16=self.use_bf16,
        )  # fmt: skip
        self.checkpoints = CheckpointManager(
            self.output_dir, cfg, model, self.optimizer, self.lr_scheduler, tokenizer, self.rollouts.data_generator,
            param_names, model_class_name, self.device,
        )  # fmt: skip
        self.metrics_logger = MetricsLogger(self.output_dir, cfg)
        self.metrics_path, self.plot_path = self.metrics_logger.metrics_path, self.metrics_logger.plot_path
        self.nonfinite = NonFiniteSteps(cfg.max_consecutive_nonfinite_steps, verbose=self.is_main_process)
        seed_everything(cfg.seed)

    @property
    def _prompt_pos(self) -> int:
        """How many prompts of this epoch's order have been drawn."""
        return self.rollouts.prompt_pos

    # ------------------------------------------------------------------------------------------------------------
    # Rollouts
    # ------------------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[Any],
        num_return_sequences: int,
        greedy: bool = False,
        row_seeds: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Sample completions and their masks: :meth:`RolloutGenerator.generate`."""
        return self.rollouts.generate(prompts, num_return_sequences, greedy=greedy, row_seeds=row_seeds)

    def decode_completions(
        self, completion_ids: Tensor, completion_mask: Tensor, prompts: Sequence[Any] | None = None
    ) -> list[Any]:
        """Completion texts, or messages for conversational ``prompts``: :meth:`RolloutGenerator.decode_completions`."""
        return self.rollouts.decode_completions(completion_ids, completion_mask, prompts)

    def _score_completions(self, prompts: list[Any], completions: list[Any], columns: dict[str, list]) -> Tensor:
        """Every reward function on ``N`` completions: ``rewards [N, K]`` float32 on the CPU (NaN: not scored).

        Raises:
            ValueError: naming the reward function that returned something else than N numbers or None (an
                infinite reward included), see :func:`rewards.score_completions`.
        """
        return score_completions(self.reward_funcs, self.reward_names, prompts, completions, columns)

    def token_logps(self, model: torch.nn.Module, batch: dict[str, Any], with_entropy: bool = False,
                    entropy_grad: bool = False):  # fmt: skip
        """Per-token log-probs of the completion tokens under ``model`` (:mod:`.policy_logps`): chunked from the last
        hidden states for a model on the fused path, else from its logits.

        Args:
            model: a causal LM (the policy ``self.model``, the reference, or DDP around the policy: plain path).
            batch: ``prompt_ids``/``prompt_mask`` ``[N, Lp]`` and ``completion_ids``/``completion_mask`` ``[N, T]``.
            with_entropy: also return the per-token entropy (detached unless ``entropy_grad``, on the plain path).

        Returns:
            ``logps [N, T]`` float32 (differentiable when grad is on); with ``with_entropy`` also ``entropy [N, T]``.
        """
        autocast = bf16_autocast(self.use_bf16, self.device)
        fused = self.ref_fused if model is self.ref_model else self.policy_fused and model is self.model
        if fused:
            with autocast:
                return fused_token_logps(model, model, batch, self.config.temperature, with_entropy)
        backend = "plain" if self.config.logps_backend == "fused" else self.config.logps_backend
        return plain_token_logps(model, batch, self.config.temperature, backend, autocast, with_entropy, entropy_grad)

    def _generate_and_score(self) -> None:
        """One generation batch (:meth:`RolloutGenerator.generate_batch`): queue its micro-batches, keep its metrics."""
        micro, self._rollout_metrics, self._sample_completions = self.rollouts.generate_batch(self.reward_names)
        # Each iteration passes over the whole generation batch before the next one (as TRL does).
        self._micro_batches.extend(mb for _ in range(self.config.num_iterations) for mb in micro)

    # ------------------------------------------------------------------------------------------------------------
    # Optimization
    # ------------------------------------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, Any]:
        """The next queued micro-batch, generating a new batch when the queue is empty."""
        if not self._micro_batches:
            self._generate_and_score()
        return self._micro_batches.pop(0)

    def _grad_sync(self, enabled: bool) -> AbstractContextManager:
        """Context of one micro-batch's forward and backward: gradients are reduced across ranks only if enabled."""
        if self.use_fsdp:
            self.model.set_requires_gradient_sync(enabled)
            return nullcontext()
        if enabled or self._train_model is self.model:
            return nullcontext()
        return self._train_model.no_sync()  # DDP: accumulate locally, all-reduce with the last micro-batch

    def _training_step(self) -> dict[str, float]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns its metrics.

        The metrics are those of the global step: summed over ranks, token-weighted (``kl``, clip ratios: each
        micro-batch's share weighted by its tokens, or rows for sequence-level ratios), the same on every rank.
        """
        cfg = self.config
        micro = [self._next_micro_batch() for _ in range(cfg.gradient_accumulation_steps)]
        use_sample_mask = cfg.beta != 0 and cfg.mask_zero_std_groups

        def kept_rows(mb: dict[str, Any]) -> Tensor | None:
            """``[B]`` bool: the rows of ``mb`` entering the loss, or None when zero-std rows are not masked."""
            return ~mb["zero_std"] if use_sample_mask else None

        def loss_tokens(mb: dict[str, Any]) -> Tensor:
            """The number of ``mb``'s tokens entering the loss (int64 scalar)."""
            mask = mb["completion_mask"]
            return (mask & kept_rows(mb).unsqueeze(1) if use_sample_mask else mask).sum()

        # Tokens entering the loss (masked zero-std rows excluded): this rank's per micro-batch, [M] int64, and the
        # whole step's on all ranks (one all-reduce, one host sync per step).
        counts = torch.stack([loss_tokens(mb) for mb in micro]).long()
        total_tokens = dist_utils.all_reduce_sum(counts.sum().reshape(1))
        counts_list = counts.tolist()
        step_tokens = max(int(total_tokens.item()), 1)

        # Loss scaling. DDP and FSDP average the gradients of the W ranks, so each rank's loss is W times its
        # share of the loss of the global step (M micro-batches on each of W ranks):
        # - grpo, sapo, luspo, dr_grpo: the op divides by the micro-batch's rows B (dr_grpo: B * max_completion_length),
        #   the same on every rank; the global denominator is M * W * B, so loss_scale = W / (M * W) = 1 / M.
        # - dapo, cispo: num_items_in_batch is the step's token count over all ranks and micro-batches; loss_scale = W.
        # - bnpo: the op divides by the micro-batch's own tokens n_k; loss_scale = W * n_k / N turns that into / N.
        num_micro, world = len(micro), self.world_size
        token_level = cfg.loss_type in TOKEN_LEVEL_LOSS_TYPES

        def scale_of(k: int) -> float:
            """``loss_scale`` of micro-batch ``k``."""
            if token_level:
                return float(world)
            if cfg.loss_type == "bnpo":
                return world * counts_list[k] / step_tokens
            return 1.0 / num_micro

        # The entropy bonus: entropy_coef times the mean entropy over the step's N kept tokens, so each token's entropy
        # weighs W * entropy_coef / N on its rank (the ranks' gradients are averaged, as for the loss).
        bonus_per_token = world * cfg.entropy_coef / step_tokens

        self._train_model.train()
        # sequence level: the clip ratios are shares of rows (docs/math.md section 7)
        per_row_ratios = cfg.importance_sampling_level == "sequence"
        sums = StepMetrics(per_row_ratios, self.device)
        for k, mb in enumerate(micro):
            options = dict(
                old_logps=mb["old_logps"], ref_logps=mb["ref_logps"], sample_mask=kept_rows(mb),
                loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta,
                beta=self.beta, kl_estimator=cfg.kl_estimator, importance_sampling_level=cfg.importance_sampling_level,
                max_completion_length=cfg.max_completion_length,
                num_items_in_batch=step_tokens if token_level else None, loss_scale=scale_of(k),
                sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                vespo_lambda_neg=cfg.vespo_lambda_neg,
            )  # fmt: skip
            with self._grad_sync(k == num_micro - 1):
                if self.policy_fused:  # the loss from hidden states: no [B, T, V] logits
                    # the kernels' bonus is entropy_coef * loss_scale * (the micro-batch's mean entropy)
                    scale = options["loss_scale"]
                    coef = bonus_per_token * counts_list[k] / scale if cfg.entropy_coef and scale else 0.0
                    with bf16_autocast(self.use_bf16, self.device):
                        out = fused_policy_loss(self._train_model, self.model, mb, cfg.temperature, entropy_coef=coef,
                                                **options)  # fmt: skip
                    entropy = out.metrics["entropy"]
                else:
                    logps, token_entropy = self.token_logps(self._train_model, mb, with_entropy=True,
                                                            entropy_grad=cfg.entropy_coef != 0)  # fmt: skip
                    out = grpo_ext.grpo_loss(logps, mb["advantages"], mb["completion_mask"], **options)
                    entropy = masked_mean_entropy(token_entropy, mb["completion_mask"], options["sample_mask"])
                    if cfg.entropy_coef:  # the micro-batch's entropy sum, differentiated: its mean times its tokens
                        out = out._replace(loss=out.loss - bonus_per_token * counts_list[k] * entropy)
                    entropy = entropy.detach()
                out.loss.backward()
            sums.add(out, entropy, mb["completion_mask"].shape[0], counts_list[k])
        row_total = world * num_micro * micro[0]["completion_mask"].shape[0]
        metrics, loss_sum, entropy_mean = sums.reduce(step_tokens, row_total)

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = dist_utils.clip_grad_norm(params, cfg.max_grad_norm, self.use_fsdp)
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        loss = loss_sum / world
        # A non-finite loss or gradient norm (global numbers: every rank decides alike) skips the update, never a
        # NaN model; the schedule still follows the step.
        skipped = not is_finite_step(loss, grad_norm)
        if not skipped:
            self.optimizer.step()
        scheduler_step(self.lr_scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.record(self.global_step + 1, loss, grad_norm, skipped)

        if self.beta != 0:
            metrics["beta"] = self.beta
        if cfg.kl_target is not None and not skipped:
            self._update_beta(metrics["kl"])  # a global kl: beta stays the same on every rank
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate, entropy=entropy_mean)
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of ``eval_dataset`` scored by the reward functions: :func:`.evaluation.evaluate_greedy`.

        Under torch.distributed every rank must call it (the rows are split over the ranks, the sums all-reduced).

        Raises:
            ValueError: the trainer has no ``eval_dataset``.
        """
        if self.eval_dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (GRPOTrainer(..., eval_dataset=rows))")
        cfg = self.config
        metrics = evaluate_greedy(
            self.rollouts, self.eval_dataset, self._score_completions, self.reward_names, cfg.reward_weights,
            cfg.per_device_eval_batch_size or cfg.per_device_train_batch_size,
        )  # fmt: skip
        self.last_eval_reward = metrics[EVAL_REWARD]
        if self.is_main_process:
            tqdm.write(f"[step {self.global_step}] held-out {EVAL_REWARD} = {self.last_eval_reward:.4f} "
                       f"({len(self.eval_dataset)} prompts, greedy)")  # fmt: skip
            sys.stdout.flush()  # a log file sees it now, beside the progress bar (stderr, unbuffered)
        return metrics

    def _update_beta(self, kl: float) -> None:
        """Adaptive KL control: scale beta by ``1 + clip(kl / target - 1, +-0.2) / horizon`` after each step."""
        error = min(max(kl / self.config.kl_target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error / self.config.kl_horizon

    def train(self, resume_from_checkpoint: str | bool | None = None) -> list[dict[str, float]]:
        """Run until ``config.max_steps`` optimizer steps (or ``config.max_time_s``).

        Args:
            resume_from_checkpoint: a checkpoint folder, or True for the latest ``checkpoint-N`` in ``output_dir``.

        Returns:
            The logged metrics, one dict per logged step (also in ``output_dir/metrics.jsonl``). Under
            torch.distributed every rank returns them; only rank 0 writes files, TensorBoard events and progress.

        Raises:
            OutputFolderError: another run holds ``output_dir``, or a fresh run finds a previous run's outputs there
                (without ``config.overwrite_output_dir``).
            TrainingInterrupted: SIGINT or SIGTERM, after a checkpoint of the last finished step was saved.
            NonFiniteStepsError: ``config.max_consecutive_nonfinite_steps`` skipped steps in a row.
        """
        cfg = self.config
        resume = bool(resume_from_checkpoint)
        with claim_output_dir(self.output_dir, resume, cfg.overwrite_output_dir, self.is_main_process):
            if resume:
                self.load_checkpoint(self.checkpoints.resume_path(resume_from_checkpoint))
            if self.is_main_process:
                self.metrics_logger.open(self.global_step)
            with StopSignals(verbose=self.is_main_process) as stop:
                history = self._run_steps(stop)
            if cfg.plot and self.is_main_process:
                self.metrics_logger.plot()
            dist_utils.barrier()  # rank 0's files are complete when train() returns on any rank
        return history

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
                metrics["tokens_per_second"] = self._rollout_metrics["num_tokens"] / metrics["step_time"]
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
                if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                    saved = self.save_checkpoint()
                self.nonfinite.raise_if_exceeded(self.global_step)
                signal_number = stop.requested(self.device)  # the same on every rank
                if signal_number and self.global_step < cfg.max_steps:
                    raise TrainingInterrupted(signal_number, self.global_step, saved or self.save_checkpoint())
                if out_of_time:
                    if self.is_main_process:
                        tqdm.write(f"stopping at step {self.global_step}: max_time_s={cfg.max_time_s} reached")
                    break
        finally:
            bar.close()
            self.metrics_logger.close()
        return history

    def _out_of_time(self, start: float) -> bool:
        """Whether ``max_time_s`` has passed, by rank 0's clock: every rank must stop at the same step."""
        return dist_utils.broadcast_flag(time.perf_counter() - start > self.config.max_time_s, self.device)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def latest_checkpoint(self) -> Path | None:
        """The ``checkpoint-N`` folder of ``output_dir`` with the largest N, or None."""
        return self.checkpoints.latest()

    def save_checkpoint(self) -> Path:
        """Write ``output_dir/checkpoint-<step>`` atomically (a temp folder renamed into place) and return it.

        Under torch.distributed every rank must call it: the full (unsharded) state and every rank's queued
        micro-batches are gathered, rank 0 alone writes, and no rank returns before the folder is in place.
        """
        state = {"rollout_metrics": self._rollout_metrics, **self.rollouts.state_dict(), "beta": self.beta,
                 "nonfinite_steps": self.nonfinite.total}  # fmt: skip
        return self.checkpoints.save(self.global_step, self._micro_batches, state)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, RNG states, queued rollouts and step from a checkpoint folder.

        Under torch.distributed every rank calls it; rank 0 reads the folder and sends the state to the others
        (they need not see the files). The checkpoint may come from another number of processes if the global batch
        is the same: ``per_device_train_batch_size * world_size`` must equal the saving run's. Queued micro-batches
        are then re-cut into this run's per-rank slices (the same rows per global micro-batch, so the same updates
        up to float rounding; with the saving run's world size they are restored bit for bit).

        Raises:
            ValueError: naming ``per_device_train_batch_size`` when the global batch differs or this world size
                does not divide it.
        """
        state, self._micro_batches = self.checkpoints.load(path)
        self.global_step = state["step"]
        self._rollout_metrics = state["rollout_metrics"]
        self.rollouts.load_state_dict(state)
        self.beta = state["beta"]
        self.nonfinite.total = state.get("nonfinite_steps", 0)
