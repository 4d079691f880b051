"""GRPOTrainer: rollouts with ``model.generate``, rewards, grpo_ext advantages and loss, AdamW, checkpoints.

This module is the outline of the GRPO-specific parts: the trainer's arguments and setup, rollouts and their rewards,
the per-token log-probs, the GRPO loss of a micro-batch with its options and entropy bonus, the adaptive KL
coefficient, and the held-out evaluation. The rest comes from mixins: one optimizer step (gradient accumulation,
loss scaling across ranks, clipping, the update) in :mod:`.step`, ``train()`` and its loop (progress, logging, the
stops on ``max_time_s``, signals and non-finite steps) in :mod:`.loop`, checkpoints and the final model in
:mod:`.run_state`. Sampling is in :mod:`.rollout`, the checkpoint files in :mod:`.checkpoint`, the model saved at the
end in :mod:`.final_model`, and the logged metrics and their files in :mod:`.metrics`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .. import ops
from ..ops.grpo_loss_from_logits import masked_mean_entropy
from . import distributed as dist_utils
from .checkpoint import CheckpointManager
from .config import GRPOConfig
from .evaluation import EVAL_REWARD, evaluate_greedy
from .guards import NonFiniteSteps
from .loop import TrainingLoopMixin
from .metrics import MetricsLogger
from .optimizer import build_optimizer
from .policy_logps import causal_lm, fused_policy_loss, fused_token_logps, is_peft_model, plain_token_logps, use_fused
from .prompts import check_prompts
from .rewards import score_completions
from .rollout import RolloutGenerator
from .run_state import RunStateMixin
from .sampling import bf16_autocast
from .seeding import seed_everything
from .step import OptimizerStepMixin

RewardFunc = Callable[..., list]


def _reward_name(func: RewardFunc) -> str:
    """The name a reward function's metrics are logged under."""
    return getattr(func, "__name__", type(func).__name__)


def enable_gradient_checkpointing(model: torch.nn.Module, checkpoint_kwargs: dict[str, Any] | None = None) -> None:
    """Turn on transformers' activation checkpointing of ``model``'s decoder layers, as ``transformers.Trainer`` does
    for TRL's ``gradient_checkpointing``: each layer's forward runs under ``torch.utils.checkpoint.checkpoint`` with
    ``checkpoint_kwargs`` (``use_reentrant=False`` unless given).

    A layer recomputes only in a forward with grad on and the model in training mode: ``generate`` (eval mode, KV
    cache) and the no-grad old-policy and reference passes run as before. Called before DDP or FSDP2 wraps the
    model: transformers checkpoints the layer's ``forward``, inside FSDP2's hooks, so the recompute finds the
    block's parameters gathered. A peft ``PeftModel``'s wrapped causal LM is the one enabled; its input embeddings'
    output then requires grad (peft's and TRL's rule), which reentrant checkpointing needs to reach the adapters.

    Args:
        model: a ``transformers`` causal LM or a ``PeftModel`` around one.
        checkpoint_kwargs: ``torch.utils.checkpoint.checkpoint``'s options
            (``GRPOConfig.gradient_checkpointing_kwargs``).

    Raises:
        ValueError: naming ``GRPOConfig.gradient_checkpointing`` when the model does not support it.
    """
    lm = causal_lm(model)
    if not getattr(lm, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"GRPOConfig.gradient_checkpointing=True needs a model that supports it (transformers' "
            f"supports_gradient_checkpointing), and {type(lm).__name__} does not: set gradient_checkpointing=False"
        )
    kwargs = {"use_reentrant": False, **(checkpoint_kwargs or {})}
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns there
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers 5 hooks the embeddings itself; older versions only for their own peft integration
    hooked = getattr(lm, "_require_grads_hooks", None) or getattr(lm, "_require_grads_hook", None)
    if is_peft_model(model) and not hooked:
        lm.enable_input_require_grads()


class GRPOTrainer(TrainingLoopMixin, RunStateMixin, OptimizerStepMixin):
    """GRPO on a causal LM from ``transformers`` (or any module with the same ``generate``/``forward``).

    Args:
        model: the policy, a ``PreTrainedModel`` (``forward(input_ids, attention_mask, position_ids).logits`` and
            ``generate``); trained in place. With ``logps_backend="fused"`` its loss and log-probs come from its
            body's last hidden states and its LM head (:mod:`.policy_logps`), never from ``[B, T, V]`` logits.
            With ``config.gradient_checkpointing`` (the default) its decoder layers are checkpointed here
            (:func:`enable_gradient_checkpointing`); a model without transformers' support for it needs that off.
        reward_funcs: one callable or a list, each ``f(prompts, completions, **columns) -> list[float | None]``.
            As in TRL, a completion is its text (special tokens removed) when its prompt is a string, and
            ``[{"role": "assistant", "content": text}]`` when its prompt is a list of messages; ``prompts`` are the
            dataset's prompts as they are.
        train_dataset: a sequence of dicts with a ``prompt`` and any other columns (given to the rewards). A prompt
            is a string (tokenized as it is, with the tokenizer's special tokens, no chat template) or a list of
            messages ``[{"role": "user", "content": ...}, ...]`` (rendered with the tokenizer's chat template and
            the generation prompt), as TRL takes them (:func:`.prompts.prompt_token_ids`). A prompt that gives no
            tokens (an empty string with a tokenizer that adds no BOS) is refused here, naming its row.
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

    :meth:`train` and its loop come from :class:`.loop.TrainingLoopMixin`, the checkpoint and final-model methods
    from :class:`.run_state.RunStateMixin`, one optimizer step from :class:`.step.OptimizerStepMixin`.
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
        # Every prompt tokenized once now: one that gives no tokens would fail inside generate, steps into the run.
        check_prompts(tokenizer, train_dataset, "train_dataset")
        if eval_dataset is not None:
            check_prompts(tokenizer, eval_dataset, "eval_dataset")
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

        # After the reference copy (it runs under no_grad: nothing to recompute), before DDP or FSDP2 wraps the policy.
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model, cfg.gradient_checkpointing_kwargs)
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
    # The loss (the optimizer step around it: .step)
    # ------------------------------------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, Any]:
        """The next queued micro-batch, generating a new batch when the queue is empty."""
        if not self._micro_batches:
            self._generate_and_score()
        return self._micro_batches.pop(0)

    def _loss_options(self, mb: dict[str, Any], sample_mask: Tensor | None, num_items_in_batch: int | None,
                      loss_scale: float) -> dict[str, Any]:  # fmt: skip
        """The keyword options of the GRPO loss for micro-batch ``mb``, from the config and the current ``beta``.

        ``sample_mask``, ``num_items_in_batch`` and ``loss_scale`` come from the step (:mod:`.step`): the rows
        entering the loss, the step's token count for the token-level losses, and this micro-batch's share.
        """
        cfg = self.config
        return dict(
            old_logps=mb["old_logps"], ref_logps=mb["ref_logps"], sample_mask=sample_mask,
            loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta,
            beta=self.beta, kl_estimator=cfg.kl_estimator, importance_sampling_level=cfg.importance_sampling_level,
            max_completion_length=cfg.max_completion_length,
            num_items_in_batch=num_items_in_batch, loss_scale=loss_scale,
            sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
            vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
            vespo_lambda_neg=cfg.vespo_lambda_neg,
        )  # fmt: skip

    def _micro_batch_loss(self, mb: dict[str, Any], options: dict[str, Any], entropy_weight: float):
        """The GRPO loss of one micro-batch with its entropy bonus, before ``backward`` (called by :mod:`.step`).

        Args:
            mb: a queued micro-batch (:meth:`_generate_and_score`).
            options: the loss options (:meth:`_loss_options`).
            entropy_weight: the weight of the micro-batch's mean entropy in the step's loss (its tokens times
                ``world_size * entropy_coef / step_tokens``).

        Returns:
            ``(out, entropy)``: the loss op's result (``out.loss`` minus the bonus) and the micro-batch's mean entropy,
            detached.
        """
        cfg = self.config
        if self.policy_fused:  # the loss from hidden states: no [B, T, V] logits
            # the kernels' bonus is entropy_coef * loss_scale * (the micro-batch's mean entropy)
            scale = options["loss_scale"]
            coef = entropy_weight / scale if cfg.entropy_coef and scale else 0.0
            with bf16_autocast(self.use_bf16, self.device):
                out = fused_policy_loss(self._train_model, self.model, mb, cfg.temperature, entropy_coef=coef,
                                        **options)  # fmt: skip
            entropy = out.metrics["entropy"]
        else:
            logps, token_entropy = self.token_logps(self._train_model, mb, with_entropy=True,
                                                    entropy_grad=cfg.entropy_coef != 0)  # fmt: skip
            out = ops.grpo_loss(logps, mb["advantages"], mb["completion_mask"], **options)
            entropy = masked_mean_entropy(token_entropy, mb["completion_mask"], options["sample_mask"])
            if cfg.entropy_coef:  # the micro-batch's entropy sum, differentiated: its mean times its tokens
                out = out._replace(loss=out.loss - entropy_weight * entropy)
            entropy = entropy.detach()
        return out, entropy

    def _update_beta(self, kl: float) -> None:
        """Adaptive KL control: scale beta by ``1 + clip(kl / target - 1, +-0.2) / horizon`` after each step."""
        error = min(max(kl / self.config.kl_target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error / self.config.kl_horizon

    # ------------------------------------------------------------------------------------------------------------
    # Evaluation
    # ------------------------------------------------------------------------------------------------------------

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
