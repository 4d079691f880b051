"""How GRPOTrainer's rollouts sample: ``generate``'s options pinned to their no-op values, every row drawn from its
own uniforms (so a row's completion does not depend on its batch), and bfloat16 autocast for generation."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessor

# Generation options set to their no-op values in every ``generate`` call, so that a checkpoint's
# generation_config (read by ``generate`` for every option not given) cannot add a repetition penalty, a top-k or
# min-p cut-off, or a minimum length to the sampling: the completions are drawn from softmax(logits / temperature)
# with the GRPOConfig's top_k/top_p only, the distribution the loss assumes. (Options with no no-op value, such as
# bad_words_ids or suppress_tokens, still come from the model's generation_config.)
NEUTRAL_GENERATION: dict[str, Any] = {
    "num_beams": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
}  # fmt: skip
# The same for the warpers, which only act when generate samples (do_sample=True).
NEUTRAL_SAMPLING: dict[str, Any] = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


class RowSeededSampler(LogitsProcessor):
    """Draws every row's next token from that row's own uniforms (inverse-CDF sampling), for ``generate``.

    Used with greedy decoding: the returned scores are 0 at the drawn token and -inf elsewhere. The distribution is
    ``softmax(scores / temperature)`` after top-k and top-p filtering, as ``generate(do_sample=True)`` samples it,
    but a row's draw depends only on its uniforms and its own logits, not on the rest of the batch or the global RNG.

    Args:
        uniforms: ``[N, max_new_tokens]`` float64 in ``(0, 1]``: row ``i``'s draw for each completion position.
        prompt_width: padded prompt length of the batch (the completion position is the input length minus this).
        temperature: divides the logits.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens with probability >= top_p (1.0: all).
    """

    def __init__(self, uniforms: Tensor, prompt_width: int, temperature: float, top_k: int, top_p: float) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.uniforms = uniforms
        self.prompt_width = prompt_width
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(temperature)]
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """``input_ids [N, L]`` int64 (prompt and tokens so far), ``scores [N, V]`` float -> ``[N, V]``."""
        position = input_ids.shape[1] - self.prompt_width
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        # float64 cumulative sum: in float32 tokens below ~1e-7 of probability would lose their share of a large
        # vocabulary's mass.
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
        target = self.uniforms[:, position : position + 1] * cdf[:, -1:]
        # The first index whose cdf reaches the target; target > 0, so a zero-probability token is never drawn.
        token = torch.searchsorted(cdf, target).clamp_(max=scores.shape[1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, token, 0.0)


def bf16_autocast(enabled: bool, device: torch.device) -> AbstractContextManager:
    """bfloat16 autocast when ``enabled`` and ``device`` is CUDA, else a context that does nothing."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()
