"""GRPOConfig: the training options, under TRL's names where TRL has the concept, validated on construction."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..validation import check_finite, validate_loss_option_values  # and their ranges
from ..validation.options import SCALE_REWARDS, LossOptions  # the loss options' defaults, defined once

_LOSS_DEFAULTS = LossOptions._field_defaults
_MAX_SEED = 2**32 - 1

LR_SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")


def _fail(field: str, message: str, value: Any) -> None:
    raise ValueError(f"GRPOConfig.{field} {message}, got {value!r}")


# What each annotation word of a field accepts, and how an error says it.
_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: isinstance(v, bool), "a boolean (true or false)"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[float]": (lambda v: isinstance(v, list), "a list of numbers"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a mapping"),
    "None": (lambda v: v is None, "null (None)"),
}


def _check_type(name: str, annotation: str, value: Any) -> None:
    """Raises naming the field unless ``value`` has one of the types of ``annotation`` (e.g. ``"bool | None"``).

    A YAML run file or a ``--key value`` override can hand over the string ``"false"``, which Python would read as
    true: a boolean field takes only ``true``/``false``.
    """
    kinds = [kind.strip() for kind in annotation.split("|")]
    if not any(_TYPE_CHECKS[kind][0](value) for kind in kinds):
        expected = " or ".join(_TYPE_CHECKS[kind][1] for kind in kinds)
        raise ValueError(f"GRPOConfig.{name} must be {expected}, got {value!r} ({type(value).__name__})")


def unknown_keys_error(unknown: list[str], known: list[str], where: str) -> ValueError:
    """A ValueError naming the unknown keys of ``where``, each with the closest valid key when one is close."""
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"{where} has no field {', '.join(parts)}")


@dataclasses.dataclass
class GRPOConfig:
    """Options of :class:`GRPOTrainer`.

    One optimizer step consumes ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``
    completions. One generation produces ``per_device_train_batch_size * steps_per_generation`` completions
    (``num_generations`` per prompt), scored once and reused ``num_iterations`` times. Under torch.distributed these
    counts are per process: the global batch is ``world_size`` times larger, and results depend on the global batch
    only, not on how many processes share it.

    Gradient checkpointing (``gradient_checkpointing``, on by default as in TRL): each decoder layer keeps only its
    input in the forward and runs again in the backward (transformers' activation checkpointing,
    :func:`~grpo_ext.trainer.trainer.enable_gradient_checkpointing`), so a training step holds one layer's
    activations instead of all of them. It stays on because that is what a long-sequence run needs to fit (a 4-layer
    Qwen2-style model of hidden 256 at 8 x 1056 tokens: peak RSS above the model 1136 -> 608 MiB,
    ``benchmarks/bench_trainer.py``), at the price of one more forward of the body per micro-batch: measured on the
    CPU (CPU time, one thread), +19-20% per training pass for a 4-layer LLaMA of hidden 256 at 8 x 288 tokens and
    +19-26% for the demo's 133k-parameter model (+21-23% of its whole step, generation included). A small model or
    short sequences, whose activations fit anyway, pay that for nothing: the demo and ``examples/smollm2_sums.yaml``
    turn it off. Only the training forward recomputes: generation (KV cache) and the no-grad old-policy and reference
    passes run as they are. The model must support it (transformers' ``supports_gradient_checkpointing``), or the
    trainer refuses it naming this option.
    """

    output_dir: str = "grpo_output"
    seed: int = 42
    max_steps: int = 100
    # A safety net only (runs are capped by steps): training stops early past it, saving a checkpoint (--resume
    # continues) and the final model. Seconds of this process's training (a scheduler's slot), not of the whole run:
    # each resume trains for up to max_time_s again.
    max_time_s: float | None = None

    # Generation
    num_generations: int = 8
    max_prompt_length: int | None = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k, so the sampled distribution is the one whose log-probs enter the loss
    mask_truncated_completions: bool = False

    # Batching
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # default: gradient_accumulation_steps
    num_iterations: int = 1

    # Loss
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "grpo"
    kl_estimator: str = "k3"
    importance_sampling_level: str = "token"
    # loss_type="sapo" and "vespo" only (TRL's names and defaults; docs/math.md section 3)
    sapo_temperature_pos: float = _LOSS_DEFAULTS["sapo_temperature_pos"]
    sapo_temperature_neg: float = _LOSS_DEFAULTS["sapo_temperature_neg"]
    vespo_k_pos: float = _LOSS_DEFAULTS["vespo_k_pos"]
    vespo_lambda_pos: float = _LOSS_DEFAULTS["vespo_lambda_pos"]
    vespo_k_neg: float = _LOSS_DEFAULTS["vespo_k_neg"]
    vespo_lambda_neg: float = _LOSS_DEFAULTS["vespo_lambda_neg"]
    # Entropy bonus (TRL's entropy_coef): the step's loss minus entropy_coef times the mean entropy of the policy over
    # the step's tokens entering the loss (docs/math.md section 5, "Entropy bonus"); fused into the logits pass.
    entropy_coef: float = 0.0
    scale_rewards: str = "group"
    reward_weights: list[float] | None = None
    mask_zero_std_groups: bool = True  # drop zero-std groups from the loss when beta != 0 (docs/math.md section 6)
    # Adaptive KL controller (off when None): beta moves toward the KL target, proportionally, over kl_horizon
    # steps (Ziegler et al. 2019). Needs beta > 0 to start from.
    kl_target: float | None = None
    kl_horizon: int = 10000
    # DAPO dynamic sampling (off by default): drop groups whose rewards are all equal and sample new prompts until
    # the generation batch is full, at most max_sampling_rounds rounds (then zero-std groups fill the rest).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Log-probs and loss: "fused" (grpo_loss_from_hidden and chunked log-probs from the last hidden states, no
    # [B, T, V] logits; models it cannot score exactly fall back to "plain" with a warning), "plain" (the model's
    # logits, the selective_log_softmax kernel, grpo_loss) or "torch" (the logits, log_softmax + gather in float32).
    logps_backend: str = "fused"

    # Distributed (under torchrun): DDP by default; True shards the policy and the reference model with FSDP2
    fsdp: bool = False

    # Memory (TRL's names and default; the class docstring says why it is on): recompute each decoder layer in the
    # backward instead of keeping its activations. Changes no result, so it may change on resume.
    gradient_checkpointing: bool = True
    # torch.utils.checkpoint.checkpoint's options: use_reentrant (default False, as transformers' default),
    # determinism_check, debug (CHECKPOINT_KWARGS). Not preserve_rng_state: False would recompute other dropout masks.
    gradient_checkpointing_kwargs: dict[str, Any] | None = None

    # Optimization
    learning_rate: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    bf16: bool | None = None  # None: bf16 autocast on CUDA, float32 elsewhere

    # Logging and checkpoints
    logging_steps: int = 1
    # A checkpoint every save_steps steps and at the last one (as HF Trainer); 0: none (a signal or a max_time_s stop
    # still saves one)
    save_steps: int = 0
    save_total_limit: int | None = None
    report_to: str = "tensorboard"  # "tensorboard" (when importable) or "none"; the JSONL file is always written
    log_completions: bool = True
    log_completions_steps: int = 100
    num_completions_to_print: int = 2
    disable_tqdm: bool = False
    plot: bool = True  # write metrics.png with the curves at the end of train()

    # Held-out evaluation (GRPOTrainer's eval_dataset): greedy completions scored by the reward functions, before the
    # first step, every eval_steps steps (0: none in between) and after the last step; logged as eval/reward.
    eval_steps: int = 0
    per_device_eval_batch_size: int | None = None  # prompts per generate call; None: per_device_train_batch_size

    # Faults (README "Failure behaviour")
    # A fresh run (no resume) into an output_dir holding a previous run's outputs is refused unless this is set; then
    # those outputs (checkpoint-N, abandoned-after-step-K, final_model(.previous), metrics.jsonl, metrics.png, runs/)
    # are deleted first.
    overwrite_output_dir: bool = False
    # A step whose loss or gradient norm is not finite is skipped (no update); this many in a row stop the run.
    max_consecutive_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        # TRL accepts booleans for scale_rewards: True means per-group std, False none (Dr. GRPO).
        if self.scale_rewards is True:
            self.scale_rewards = "group"
        elif self.scale_rewards is False:
            self.scale_rewards = "none"
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if isinstance(self.reward_weights, tuple):
            self.reward_weights = list(self.reward_weights)
        for field in dataclasses.fields(self):
            _check_type(field.name, field.type, getattr(self, field.name))
        if self.reward_weights is not None:
            if isinstance(self.reward_weights, (str, bytes)) or not isinstance(self.reward_weights, Sequence):
                _fail("reward_weights", "must be a list of numbers", self.reward_weights)
            weights = []
            for w in self.reward_weights:
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                    _fail("reward_weights", "must hold finite numbers", self.reward_weights)
                weights.append(float(w))
            self.reward_weights = weights
        if self.gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = dict(self.gradient_checkpointing_kwargs)  # the caller's stays theirs
        self._validate()

    @property
    def generation_batch_size(self) -> int:
        """Completions one process produces per generation (``world_size`` times more in all)."""
        return self.per_device_train_batch_size * self.steps_per_generation

    def _validate(self) -> None:
        ints = {
            "seed": 0, "max_steps": 1, "num_generations": 2, "top_k": 0,
            "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
            "num_iterations": 1, "warmup_steps": 0, "logging_steps": 1, "save_steps": 0, "log_completions_steps": 1,
            "num_completions_to_print": 0, "kl_horizon": 1, "max_sampling_rounds": 1,
            "max_consecutive_nonfinite_steps": 1, "eval_steps": 0,
        }  # fmt: skip
        for name, minimum in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(name, "must be an integer", value)
            if value < minimum:
                _fail(name, f"must be >= {minimum}", value)
        for name in ("max_prompt_length", "save_total_limit", "per_device_eval_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _fail(name, "must be None or an integer >= 1", value)

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _fail(name, "must be a finite number", value)
            return float(value)

        for name in ("temperature", "learning_rate", "adam_epsilon"):
            if number(name) <= 0:
                _fail(name, "must be > 0", getattr(self, name))
        # The sampler and the fused loss scale the logits by 1 / temperature in float32, which must be a normal number
        float32 = torch.finfo(torch.float32)
        if not float32.tiny <= 1.0 / self.temperature <= float32.max:
            _fail("temperature", f"must be in [{1 / float32.max:.3g}, {1 / float32.tiny:.3g}] (1 / temperature "
                  "scales the logits in float32, as a normal number)", self.temperature)  # fmt: skip
        if self.seed > _MAX_SEED:  # numpy's and torch's generators take a seed below 2**32
            _fail("seed", f"must be <= {_MAX_SEED} (2**32 - 1)", self.seed)
        if number("weight_decay") < 0:
            _fail("weight_decay", "must be >= 0", self.weight_decay)
        if not 0 < number("top_p") <= 1:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= number(name) < 1:
                _fail(name, "must be in [0, 1)", getattr(self, name))
        if not 0 <= number("warmup_ratio") < 1:
            _fail("warmup_ratio", "must be in [0, 1)", self.warmup_ratio)
        self._validate_loss_options()
        if self.max_grad_norm is not None and number("max_grad_norm") <= 0:
            _fail("max_grad_norm", "must be None or > 0", self.max_grad_norm)
        if self.kl_target is not None:
            if number("kl_target") <= 0:
                _fail("kl_target", "must be None or > 0", self.kl_target)
            if self.beta == 0:
                _fail("kl_target", "needs beta > 0 (the adaptive controller scales beta)", self.kl_target)
        if self.max_time_s is not None and number("max_time_s") <= 0:
            _fail("max_time_s", "must be None or > 0", self.max_time_s)

        choices = {
            "scale_rewards": SCALE_REWARDS, "lr_scheduler_type": LR_SCHEDULERS, "report_to": ("tensorboard", "none"),
            "logps_backend": ("fused", "plain", "torch"),
        }  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _fail(name, f"must be one of {', '.join(allowed)}", getattr(self, name))
        if self.generation_batch_size % self.num_generations != 0:
            _fail(
                "num_generations",
                f"must divide the generation batch per_device_train_batch_size * steps_per_generation = "
                f"{self.generation_batch_size} (whole groups are generated together)",
                self.num_generations,
            )
        if not isinstance(self.output_dir, str) or not self.output_dir:
            _fail("output_dir", "must be a non-empty path", self.output_dir)
        self.output_dir = os.path.expanduser(self.output_dir)  # a run file's ~/runs/x, not a folder named ~
        self._validate_checkpointing_kwargs()

    def _validate_checkpointing_kwargs(self) -> None:
        """``gradient_checkpointing_kwargs``: known keys of :data:`CHECKPOINT_KWARGS`, each of its type and values."""
        options = self.gradient_checkpointing_kwargs
        if options is None:
            return
        for key, value in options.items():
            if key not in CHECKPOINT_KWARGS:
                _fail("gradient_checkpointing_kwargs", f"takes only {', '.join(CHECKPOINT_KWARGS)} (keys of "
                      f"torch.utils.checkpoint.checkpoint that change no result), not {key!r}", options)  # fmt: skip
            kind, allowed = CHECKPOINT_KWARGS[key]
            if not isinstance(value, kind) or (allowed and value not in allowed):
                expected = " or ".join(repr(v) for v in allowed) if allowed else "true or false"
                _fail("gradient_checkpointing_kwargs", f"[{key!r}] must be {expected}", options)
        if options.get("use_reentrant") and options.get("debug"):
            _fail("gradient_checkpointing_kwargs", "debug=True needs use_reentrant=False (torch's checkpoint)", options)

    def _validate_loss_options(self) -> None:
        """Checks the loss options this config carries with the loss's own checks, so that a bad value fails here,
        before a model loads, and the ranges stay defined once (``validation.validate_loss_option_values``)."""
        try:
            validate_loss_option_values(LossOptions(**{name: getattr(self, name) for name in LOSS_OPTION_FIELDS}))
            check_finite("entropy_coef", self.entropy_coef)  # the fused losses' own check of it
        except ValueError as err:  # each message starts with the option's name, which is the field's
            raise ValueError(f"GRPOConfig.{err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict (JSON/YAML-serializable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> GRPOConfig:
        """Build from a dict, rejecting unknown keys with an error that names them and the closest valid ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise unknown_keys_error(unknown, known, "GRPOConfig")
        return cls(**options)


#: The keys ``GRPOConfig.gradient_checkpointing_kwargs`` takes: ``(type, allowed values or None)``. Options of
#: ``torch.utils.checkpoint.checkpoint`` that change no result: ``preserve_rng_state=False`` would recompute a dropout
#: layer with another mask (a wrong gradient), and a ``context_fn`` is no run-file value.
CHECKPOINT_KWARGS: dict[str, tuple[type, tuple[Any, ...] | None]] = {
    "use_reentrant": (bool, None),
    "determinism_check": (str, ("default", "none")),
    "debug": (bool, None),
}

#: The fields that are loss options (``beta``, ``epsilon``, ``sapo_temperature_pos``, ...): the trainer passes them to
#: the loss as they are, and the config checks them as the loss does.
LOSS_OPTION_FIELDS: tuple[str, ...] = tuple(
    field.name for field in dataclasses.fields(GRPOConfig) if field.name in LossOptions._fields
)

#: The fields a resumed run may change (README "Failure behaviour"): how long it runs, the optimizer's schedule and
#: hyperparameters, precision, layout, gradient checkpointing and logging; not what it samples, scores and optimizes.
#: Every other field must equal the checkpoint's (:func:`check_resume_config`). ``per_device_train_batch_size`` may
#: change with the number of processes as long as the global batch stays the same (checked when the checkpoint loads).
RESUMABLE_FIELDS: frozenset[str] = frozenset({
    "output_dir", "overwrite_output_dir", "max_steps", "max_time_s", "learning_rate", "lr_scheduler_type",
    "warmup_steps", "warmup_ratio", "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "per_device_train_batch_size", "fsdp", "bf16", "logps_backend", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "logging_steps", "save_steps", "save_total_limit", "report_to", "log_completions",
    "log_completions_steps", "num_completions_to_print", "disable_tqdm", "plot", "max_consecutive_nonfinite_steps",
    "eval_steps", "per_device_eval_batch_size",
})  # fmt: skip


def check_resume_config(saved: dict[str, Any], config: GRPOConfig) -> None:
    """Raises unless ``config`` differs from a checkpoint's ``saved`` options only in :data:`RESUMABLE_FIELDS`.

    Fields the checkpoint does not know (added to GRPOConfig since) are not compared.

    Raises:
        ValueError: listing every changed field with its saved and its new value.
    """
    current = config.to_dict()
    changed = [
        f"{name}: {saved[name]!r} -> {value!r}"
        for name, value in current.items()
        if name not in RESUMABLE_FIELDS and name in saved and saved[name] != value
    ]
    if changed:
        raise ValueError(
            "cannot resume with changed GRPOConfig fields (" + "; ".join(changed) + "): they define what the run "
            "samples, scores and optimizes. Set them back to the checkpoint's values, or start a new run (another "
            "output_dir) from the checkpoint's model folder. Fields that may change on resume: "
            + ", ".join(sorted(RESUMABLE_FIELDS))
        )
