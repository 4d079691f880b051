"""The embedded default: a tiny LLaMA learns to reverse 3 digits with GRPO, nothing downloaded.

The model (about 133k parameters) and its 16-token tokenizer are built in code; prompts such as ``"472>"`` ask for
``"274"`` followed by EOS. Reversing forces the model to read the prompt (digits that ignore it score about 0.1 of
the 1.0 the digits are worth; stopping after three adds 0.5), so the held-out accuracy rises only when the policy
learned the task. Settings: ``shared/notes/demo-findings.md``, then :func:`demo_config` says what changed and why.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from .config import GRPOConfig
from .rewards import completion_text, graded_answer_reward

DIGITS = "0123456789"
SEPARATOR = ">"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
VOCAB = (*SPECIAL_TOKENS, *DIGITS, SEPARATOR, "|")  # 16 tokens; "|" is spare


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over digits, ``>`` and the special tokens (built in code)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4):
    """A randomly initialized ``LlamaForCausalLM`` sized for the task (hidden 64, 2 layers, 4 heads by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def reversal_dataset(num_digits: int = 3, num_heldout: int = 100, seed: int = 0):
    """Every ``num_digits``-digit string as a prompt ``"abc>"`` with answer ``"cba"``, split train / held-out.

    Returns:
        ``(train, heldout)``: lists of ``{"prompt": str, "answer": str}``; the split is a seeded shuffle.
    """
    rows = [
        {"prompt": "".join(d) + SEPARATOR, "answer": "".join(reversed(d))}
        for d in itertools.product(DIGITS, repeat=num_digits)
    ]
    random.Random(seed).shuffle(rows)
    return rows[num_heldout:], rows[:num_heldout]


def reversal_reward(prompts, completions, answer, completion_truncated=None, **columns) -> list[float]:
    """Correct positions / max(target length, output length), plus 0.5 for stopping at the right length.

    The bonus is large so that the few early completions that stop after three digits stand out while the digits are
    still mostly wrong: at 0.2 the policy grew sure of a junk fourth token first in some runs and stopped trying EOS.
    A completion cut at the length cap without EOS counts as one position longer than its answer at least, whatever
    its text shows: decoding drops special tokens, so ``"2<bos>58"`` reads ``"258"``, which the graded reward alone
    scores as the right answer without the bonus, a plateau that some runs never left (no EOS, 0% held-out
    accuracy); scored as four positions it is worth what ``"258x"`` is (0.75).

    Returns:
        ``[N]`` floats in ``[0, 1.5]``.
    """
    rewards = graded_answer_reward(prompts, completions, answer, completion_truncated, stop_bonus=0.5)
    if completion_truncated is None:
        return rewards
    scored = []
    for reward, completion, target, cut in zip(rewards, completions, answer, completion_truncated, strict=True):
        hidden_tokens = cut and len(completion_text(completion).strip()) <= len(target)
        scored.append(reward * len(target) / (len(target) + 1) if hidden_tokens else reward)  # correct / (len + 1)
    return scored


def demo_config(**overrides: Any) -> GRPOConfig:
    """The demo's settings: 4 prompts x G=32, 4 new tokens, 2000 steps, lr 1e-3 (5% warm-up, cosine decay),
    unscaled advantages (``scale_rewards="none"``), entropy bonus 0.03, sampling temperature 1.3, beta 0, the
    'grpo' loss.

    Three seeds under three CPU float paths (``examples/demo_spread.py``, 2026-11-27) all end at 100% held-out
    accuracy and a reward of 1.50 (the most there is). The earlier settings (8 prompts x G=16, constant lr 3e-4,
    group-std advantages, a stop bonus of 0.2, 1200 steps) ended at 0-98%: the float path and the seed only picked
    which of a few outcomes a run fell into. Measured on the way, each over the 9 runs: the settings here at
    temperature 1 and 1200 steps, 6 of 9 at 100% and seed 2 at 18-33%; with an entropy bonus of 0.06, 7 of 9 (40%
    and 74% the others); at temperature 1.3 and 1200 steps, 8 of 9 (68% the other); 2000 steps then gave every run
    100%. The failures, and what each change does against them:

    - No EOS (a junk fourth token, or a hidden special one, see :func:`reversal_reward`): the stop bonus of 0.5 gets
      EOS learned within the first 300 steps.
    - The first digit in the middle (``"280>"`` -> ``"022"``) for a third of the prompts: dividing by the group's
      std turned the last differences inside a nearly settled group (one odd sample) into full-size advantages that
      sharpened whatever the group already said, until the right middle digit had a probability of 1e-4 and was
      never sampled again. Unscaled advantages, the entropy bonus and twice the samples per prompt keep it sampled
      (it stays at 0.1-0.3 on the prompts still wrong), so the higher learning rate can fix it before the cosine
      decay settles the policy.
    - A run still stuck on one digit late in the schedule (a training reward of 1.2-1.4): sampling at temperature
      1.3 keeps the unlikely digit sampled, and 2000 steps (about 2 minutes of 2 cores) leave the learning rate
      time to move it before the decay ends.
    """
    options: dict[str, Any] = {
        "output_dir": "grpo_demo_output", "seed": 0, "max_steps": 2000, "max_time_s": 170.0,
        "num_generations": 32, "per_device_train_batch_size": 128, "max_completion_length": 4,
        "max_prompt_length": None, "learning_rate": 1e-3, "lr_scheduler_type": "cosine", "warmup_ratio": 0.05,
        "adam_beta1": 0.9, "adam_beta2": 0.99, "max_grad_norm": 1.0, "beta": 0.0, "loss_type": "grpo",
        "epsilon": 0.2, "scale_rewards": "none", "entropy_coef": 0.03, "temperature": 1.3, "logging_steps": 1,
        "log_completions_steps": 200,
        # 133k parameters and 8-token sequences hold next to no activations: recomputing them would only cost time
        # (about 20% of each step's CPU time, GRPOConfig's docstring)
        "gradient_checkpointing": False,
        "overwrite_output_dir": True,  # a canned run: `make demo` again starts over in the same folder
    }  # fmt: skip
    options.update(overrides)
    return GRPOConfig.from_dict(options)


@torch.no_grad()
def greedy_accuracy(trainer, rows: list[dict[str, str]]) -> float:
    """Fraction of ``rows`` whose greedy completion equals the answer exactly (EOS-terminated)."""
    prompts = [r["prompt"] for r in rows]
    _, _, completion_ids, completion_mask, truncated = trainer.generate(prompts, 1, greedy=True)
    texts = trainer.decode_completions(completion_ids, completion_mask)
    hits = [t == r["answer"] and not cut for t, r, cut in zip(texts, rows, truncated.tolist(), strict=True)]
    return sum(hits) / len(rows)


@dataclasses.dataclass
class DemoResult:
    """What the demo measured."""

    steps: int
    reward_first: float  # mean reward over the first 5% of steps
    reward_last: float  # mean reward over the last 10% of steps
    accuracy_before: float  # greedy exact-answer accuracy on held-out prompts
    accuracy_after: float
    wall_time_s: float
    metrics_path: str
    plot_path: str
    model_path: str  # the trained model (save_pretrained), output_dir/final_model

    @property
    def learned(self) -> bool:
        """The issue's criterion: reward last/first >= 2x and +0.3, held-out accuracy from near 0 to >= 50%."""
        reward_ok = self.reward_last >= 2 * self.reward_first and self.reward_last >= self.reward_first + 0.3
        return reward_ok and self.accuracy_before <= 0.1 and self.accuracy_after >= 0.5


def run_demo(num_threads: int | None = None, verbose: bool = True, **overrides: Any) -> DemoResult:
    """Train the tiny model on digit reversal and measure whether it learned.

    Args:
        num_threads: torch intra-op threads (default: min(2, CPU count); tiny matrices gain nothing from more).
        verbose: print the result.
        **overrides: GRPOConfig fields replacing the demo's defaults (e.g. ``max_steps``, ``output_dir``).

    Returns:
        DemoResult with the reward and accuracy before/after, the wall time and the paths of the metrics, the PNG
        and the trained model.
    """
    from .trainer import GRPOTrainer

    start = time.perf_counter()
    torch.set_num_threads(num_threads or min(2, os.cpu_count() or 1))
    config = demo_config(**overrides)
    metrics_path = Path(config.output_dir) / "metrics.jsonl"  # this run's only: the trainer starts it over
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=config.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    train_rows, heldout_rows = reversal_dataset(seed=config.seed)
    trainer = GRPOTrainer(model, [reversal_reward], train_rows, config, tokenizer=tokenizer)
    accuracy_before = greedy_accuracy(trainer, heldout_rows)
    trainer.train()
    accuracy_after = greedy_accuracy(trainer, heldout_rows)

    rewards = [json.loads(line)["reward"] for line in metrics_path.read_text().splitlines() if line.strip()]
    first = rewards[: max(1, round(0.05 * len(rewards)))]
    last = rewards[-max(1, round(0.10 * len(rewards))) :]
    result = DemoResult(
        steps=trainer.global_step, reward_first=sum(first) / len(first), reward_last=sum(last) / len(last),
        accuracy_before=accuracy_before, accuracy_after=accuracy_after, wall_time_s=time.perf_counter() - start,
        metrics_path=str(metrics_path), plot_path=str(trainer.plot_path), model_path=str(trainer.final_model_path),
    )  # fmt: skip
    if verbose:
        print(
            f"steps: {result.steps}  wall time: {result.wall_time_s:.1f} s\n"
            f"mean reward: first 5% of steps {result.reward_first:.3f} -> last 10% {result.reward_last:.3f}\n"
            f"held-out greedy exact accuracy: before {100 * result.accuracy_before:.1f}% -> "
            f"after {100 * result.accuracy_after:.1f}%\n"
            f"learned: {'yes' if result.learned else 'NO'}\n"
            f"curves: {result.plot_path}\nmetrics: {result.metrics_path}\nmodel: {result.model_path}"
        )
    return result
