"""The embedded default: a tiny LLaMA learns to reverse 3 digits with GRPO, nothing downloaded.

The model (about 133k parameters) and its 16-token tokenizer are built in code; prompts such as ``"472>"`` ask for
``"274"`` followed by EOS. Reversing forces the model to read the prompt (an answer that ignores it scores about
0.1), so a rising reward means the policy learned the task. Settings follow ``shared/notes/demo-findings.md``.
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
from .rewards import graded_answer_reward

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
    """Correct positions / max(target length, output length), plus 0.2 for stopping at the right length."""
    return graded_answer_reward(prompts, completions, answer, completion_truncated, stop_bonus=0.2)


def demo_config(**overrides: Any) -> GRPOConfig:
    """The demo's settings (demo-findings.md): 8 prompts x G=16, 4 new tokens, lr 3e-4, beta 0, 'grpo' loss."""
    options: dict[str, Any] = {
        "output_dir": "grpo_demo_output", "seed": 0, "max_steps": 1200, "max_time_s": 170.0,
        "num_generations": 16, "per_device_train_batch_size": 128, "max_completion_length": 4,
        "max_prompt_length": None, "learning_rate": 3e-4, "adam_beta1": 0.9, "adam_beta2": 0.99,
        "max_grad_norm": 1.0, "beta": 0.0, "loss_type": "grpo", "epsilon": 0.2, "lr_scheduler_type": "constant",
        "logging_steps": 1, "log_completions_steps": 200,
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
