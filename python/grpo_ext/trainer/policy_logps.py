"""The trainer's log-probs and policy loss: from the model body's last hidden states (``fused``), or from the model's
``[B, T, V]`` logits (``plain``: selective_log_softmax; ``torch``: float32 log_softmax + gather).

The fused path runs ``model.base_model`` (the body, final norm included), keeps the completion positions' hidden
states only and hands them with the LM head's weight and bias to :func:`grpo_ext.grpo_loss_from_hidden` (training)
or to a chunked log-prob pass (no grad: old and reference log-probs), so logits exist one chunk of rows at a time.
The body and the head run inside the model's own forward (:func:`call_through`), so DDP's and FSDP2's hooks fire
and FSDP2's sharded LM head is whole when the fused op reads it.

A peft ``PeftModel`` (LoRA and the other adapters peft injects into the layers in place) is scored the same way: its
wrapped causal LM (:func:`causal_lm`) gives the body, whose adapter layers run as they are, and the head; a LoRA LM
head enters as its effective weight ``W + scaling * B @ A`` (:func:`lm_head_weights`). The forward redirected is
the ``PeftModel``'s under DDP (the module DDP calls), else the wrapped causal LM's, FSDP2's root
(:func:`redirect_target`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from .. import ops
from ..ops import tied_embedding
from ..ops.lm_head import chunk_rows, project
from ..results import GRPOLossOutput

#: transformers classes whose forward is exactly ``lm_head(base_model(...).last_hidden_state)``, then Cohere's
#: ``* logit_scale`` or Gemma 2's ``final_logit_softcapping`` (read from transformers 5's sources). Other classes
#: are probed once (:func:`fused_refusal`).
VERIFIED_CAUSAL_LMS = frozenset({
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    "MistralForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "CohereForCausalLM",
})  # fmt: skip


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (also once FSDP2 swapped in its generated subclass).

    peft is looked up in ``sys.modules``, not imported: a ``PeftModel`` exists only once peft was imported.
    """
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM whose body and LM head the fused path runs: ``model`` itself, or for a ``PeftModel`` the model
    it wraps (``get_base_model()``: the ``transformers`` causal LM, its adapter layers injected in place).

    (A ``PeftModel``'s own ``base_model`` is peft's tuner wrapper, which returns the logits, not the body.)
    """
    return model.get_base_model() if is_peft_model(model) else model


def _peft_refusal(model: torch.nn.Module) -> str | None:
    """Why the fused path cannot score the ``PeftModel`` ``model`` (its adapter, not its causal LM), or None.

    Adapters injected into the layers in place (LoRA, LoHa, IA3, ...) run inside the body as they are. Prompt learning
    (prompt and prefix tuning, ...) adds virtual tokens in the ``PeftModel``'s own forward, and an activated LoRA's
    offsets are computed there too: the body alone would not see them.
    """
    config = model.active_peft_config
    kind = getattr(config.peft_type, "value", config.peft_type)
    if config.is_prompt_learning:
        return f"its peft adapter ({kind}) adds virtual tokens in the PeftModel's forward"
    if getattr(config, "alora_invocation_tokens", None):
        return "its peft adapter is an activated LoRA (alora_invocation_tokens), whose offsets the PeftModel computes"
    return None


def _lora_linear_class() -> type | None:
    """peft's LoRA ``Linear`` layer class, or None when peft is not imported."""
    lora = sys.modules.get("peft.tuners.lora")
    return getattr(lora, "Linear", None)


def _head_refusal(head: Any) -> str | None:
    """Why the LM head ``head`` cannot be scored as a linear map by the fused path, or None.

    Scored: a ``torch.nn.Linear``, and peft's LoRA ``Linear`` around one with plain LoRA adapters (the effective
    weight of :func:`lm_head_weights`). Refused: a LoRA head with dropout (a random mask on the LoRA input only), a
    LoRA variant (DoRA, ...) or a LoRA bias, or merged into its base layer (peft unmerges it when adapters are off).
    """
    if isinstance(head, torch.nn.Linear):
        return None
    lora_linear = _lora_linear_class()
    if lora_linear is None or not isinstance(head, lora_linear):
        return f"its output embeddings are {type(head).__name__}, not a torch.nn.Linear"
    if not isinstance(head.get_base_layer(), torch.nn.Linear):
        return f"its LoRA LM head wraps a {type(head.get_base_layer()).__name__}, not a torch.nn.Linear"
    if head.merged:
        return "its LoRA LM head is merged into its base layer"
    for adapter in _active_lora_adapters(head):
        if adapter in getattr(head, "lora_variant", {}):
            return f"its LM head's LoRA adapter {adapter!r} is a variant (DoRA, ...), not plain LoRA"
        if not isinstance(head.lora_dropout[adapter], torch.nn.Identity):
            return f"its LM head's LoRA adapter {adapter!r} has dropout (lora_dropout > 0)"
        if head.lora_B[adapter].bias is not None:
            return f"its LM head's LoRA adapter {adapter!r} has a bias (lora_bias)"
    return None


def _active_lora_adapters(head: torch.nn.Module) -> list[str]:
    """The adapters a LoRA layer's forward adds (none while adapters are disabled), as peft's forward picks them."""
    if head.disable_adapters:
        return []
    return [adapter for adapter in head.active_adapters if adapter in head.lora_A]


def lm_head_weights(head: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    """The LM head's weight ``[V, H]`` and bias ``[V]`` (or None) as a linear map, differentiably.

    For peft's LoRA ``Linear`` (checked by :func:`_head_refusal`) the weight is the base weight plus each active
    adapter's ``scaling * B @ A`` (peft's ``get_delta_weight``): the same logits as its forward ``W x + scaling *
    B (A x)`` up to rounding, with the gradient reaching ``A`` and ``B`` through it.
    """
    if isinstance(head, torch.nn.Linear):
        return head.weight, head.bias
    base = head.get_base_layer()
    weight = base.weight
    for adapter in _active_lora_adapters(head):
        weight = weight + head.get_delta_weight(adapter)
    return weight, base.bias


def logits_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    """What ``model`` does to ``lm_head(hidden)``: ``(logit_scale, softcap)``, applied as ``softcap * tanh(scale * x
    / softcap)``. Cohere multiplies by ``logit_scale``; Gemma 2 and 3 cap with ``final_logit_softcapping``;
    Granite divides by ``logits_scaling``. A ``PeftModel``'s are those of the model it wraps.
    """
    model = causal_lm(model)
    config = getattr(model, "config", None)
    scale = getattr(model, "logit_scale", None)  # Cohere copies config.logit_scale onto the model
    if not isinstance(scale, (int, float)):
        scale = getattr(config, "logit_scale", None)
    scale = 1.0 if scale is None else float(scale)
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and divisor != 1:
        scale /= divisor
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, None if softcap is None else float(softcap)


def fused_refusal(model: torch.nn.Module) -> str | None:
    """Why the fused path cannot score ``model`` exactly (a short reason), or None when it can.

    Refused: a ``PeftModel`` whose adapter acts in its own forward (:func:`_peft_refusal`), no separate body
    (``base_model``), an LM head that is neither a ``torch.nn.Linear`` nor a plain LoRA one (:func:`_head_refusal`),
    or, for a class outside :data:`VERIFIED_CAUSAL_LMS` (a ``PeftModel``: the class it wraps), logits that differ from
    the head's output on a probe of 8 tokens, once the logit scale and soft-capping of :func:`logits_transform` (which
    the fused kernels apply) are taken into account.
    """
    if is_peft_model(model) and (reason := _peft_refusal(model)) is not None:
        return reason
    lm = causal_lm(model)
    body = getattr(lm, "base_model", lm)
    if body is lm:
        return "it has no separate model body (base_model)"
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if (reason := _head_refusal(head)) is not None:
        return reason
    if type(lm).__name__ in VERIFIED_CAUSAL_LMS and type(lm).__module__.startswith("transformers."):
        return None
    return _probe_logits(model, body, head)


@torch.no_grad()
def _probe_logits(model: torch.nn.Module, body: torch.nn.Module, head: torch.nn.Module) -> str | None:
    """Compares ``model``'s logits with the head applied to the body's last hidden state on 8 tokens (eval mode)."""
    was_training = model.training
    model.eval()
    try:
        weight, bias = lm_head_weights(head)
        ids = (torch.arange(8, device=weight.device) % weight.shape[0]).unsqueeze(0)
        logits = model(input_ids=ids).logits.float()
        hidden = getattr(body(input_ids=ids), "last_hidden_state", None)
        if not isinstance(hidden, Tensor):
            return "its base_model does not return last_hidden_state"
        expected = project(hidden, weight, bias, *logits_transform(model)).float()
    finally:
        model.train(was_training)
    if logits.shape != expected.shape or not torch.allclose(logits, expected, rtol=1e-4, atol=1e-4):
        return "its logits differ from lm_head(last hidden state) (an unknown logits transform)"
    return None


def call_through(wrapper: torch.nn.Module, inner: torch.nn.Module, fn: Callable[..., Any], *args: Tensor) -> Any:
    """``fn(*args)`` run as ``inner``'s forward, called through ``wrapper`` (``inner`` itself, or DDP around it).

    The module hooks fire as for ``inner(...)``: FSDP2 unshards the root's parameters (embeddings, final norm, LM
    head) before ``fn`` and schedules their gradients' reduce-scatter; DDP prepares its gradient all-reduce. (The
    forward redirection of Lightning and TRL.)
    """
    had_own = "forward" in inner.__dict__
    saved = inner.__dict__.get("forward")
    inner.forward = fn
    try:
        return wrapper(*args)
    finally:
        if had_own:
            inner.forward = saved
        else:
            del inner.forward


def redirect_target(wrapper: torch.nn.Module, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(wrapper, inner)`` for :func:`call_through`: the module called and the one whose forward runs the fused pass.

    DDP around ``model``: DDP and ``model`` (DDP calls ``model``). Otherwise, for a ``PeftModel`` that holds no
    parameter of its own, the causal LM it wraps, which :func:`distributed.shard_fsdp` makes FSDP2's root (its forward
    runs in ``generate`` and inside the ``PeftModel``'s); else ``model`` itself.
    """
    if wrapper is model:
        lm = causal_lm(model)
        if lm is not model and owns_all_parameters(lm, model):
            return lm, lm
    return wrapper, model


def owns_all_parameters(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    """Whether every parameter of ``outer`` lies in its submodule ``inner`` (a LoRA ``PeftModel``'s causal LM does; a
    prompt-tuning one's does not: the prompt encoder is the ``PeftModel``'s)."""
    return {id(p) for p in outer.parameters()} == {id(p) for p in inner.parameters()}


def model_inputs(batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` ``[B, Lp + T]`` of a micro-batch (left-padded prompts).

    Positions as generate() counts them with left padding: the first real token is at position 0.
    """
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"].long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in effect on ``device`` (the LM head's matmul runs in it), or None."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _completion_head(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                     prompt_len: int, share_tied_gradient: bool = False,
                     ) -> tuple[Tensor, Tensor, Tensor | None, torch.dtype]:  # fmt: skip
    """The completion positions' last hidden states ``[B, T, H]``, the LM head's weight ``[V, H]`` and bias as the
    model holds them, and the dtype the head computes in.

    Hidden state ``t`` predicts token ``t + 1``: the completion's tokens are predicted from ``prompt_len - 1`` to
    ``-2``. The compute dtype is the autocast dtype when autocast is on (as the model's own LM head would run), else
    the hidden states'. With ``share_tied_gradient`` and a trained tied embedding, the body's lookup is
    :func:`tied_embedding.tied_lookup` and the weight returned is its alias
    (:func:`tied_embedding.sharing_tied_gradient`: one ``[V, H]`` gradient buffer in the backward, not two).
    """
    lm = causal_lm(model)
    body = lm.base_model
    weight, bias = lm_head_weights(lm.get_output_embeddings())
    with tied_embedding.sharing_tied_gradient(body, weight) if share_tied_gradient else nullcontext() as shared:
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if shared is not None:
        weight = shared.head_weight(weight)
    hidden = out.last_hidden_state[:, prompt_len - 1 : -1]
    return hidden, weight, bias, _autocast_dtype(hidden.device) or hidden.dtype


def fused_token_logps(wrapper: torch.nn.Module, model: torch.nn.Module, batch: dict[str, Any], temperature: float,
                      with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Per-token log-probs ``[B, T]`` float32 of the completion tokens (and the entropy), chunk by chunk of rows.

    Meant for no-grad scoring (old and reference log-probs): with grad on it stays correct, but each chunk's
    logits are kept for the backward.
    """
    completion_ids = batch["completion_ids"]

    def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        hidden, weight, bias, dtype = _completion_head(model, input_ids, attention_mask, position_ids,
                                                       batch["prompt_ids"].shape[1])  # fmt: skip
        hidden, weight, bias = hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        rows, vocab = completion_ids.numel(), weight.shape[0]
        scale, softcap = logits_transform(model)
        flat_hidden, flat_ids = hidden.reshape(rows, -1), completion_ids.reshape(rows)
        logps, entropy = [], []
        step = chunk_rows(rows, vocab, flat_hidden.element_size())
        with torch.autocast(flat_hidden.device.type, enabled=False):
            for start in range(0, rows, step):
                logits = project(flat_hidden[start : start + step], weight, bias)
                chunk = ops.selective_log_softmax(
                    logits, flat_ids[start : start + step], temperature=temperature, logit_scale=scale,
                    logit_softcap=softcap, return_entropy=with_entropy,
                )  # fmt: skip
                logps.append(chunk.logps)
                entropy.append(chunk.entropy.detach() if with_entropy else chunk.logps.new_empty(0))
                del logits, chunk  # before the next chunk's logits exist (not two chunks alive at once)
        return torch.cat(logps).view_as(completion_ids), torch.cat(entropy)

    logps, entropy = call_through(*redirect_target(wrapper, model), forward, *model_inputs(batch))
    return (logps, entropy.view_as(completion_ids)) if with_entropy else logps


def fused_policy_loss(wrapper: torch.nn.Module, model: torch.nn.Module, batch: dict[str, Any], temperature: float,
                      **loss_options: Any) -> GRPOLossOutput:  # fmt: skip
    """:func:`grpo_ext.grpo_loss_from_hidden` of a micro-batch: the loss (autograd to the body and the LM head) and
    its metrics, ``entropy`` (mean over the tokens entering the loss) included.

    Args:
        wrapper: what the training forward goes through (``model``, or DDP around it).
        model: the causal LM (FSDP2-sharded or not).
        batch: ``prompt_ids``/``prompt_mask`` ``[B, Lp]``, ``completion_ids``/``completion_mask`` ``[B, T]``,
            ``advantages [B]``.
        temperature: the sampling temperature (``z = logits / temperature``).
        **loss_options: :func:`grpo_ext.grpo_loss`'s options (``old_logps``, ``ref_logps``, ``loss_type``, ...).
    """

    scale, softcap = logits_transform(model)

    def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> GRPOLossOutput:
        prompt_len = batch["prompt_ids"].shape[1]
        hidden, weight, bias, dtype = _completion_head(model, input_ids, attention_mask, position_ids, prompt_len,
                                                       share_tied_gradient=True)  # fmt: skip
        with torch.autocast(hidden.device.type, enabled=False):  # the master weight as it is: the op casts it
            return ops.grpo_loss_from_hidden(
                hidden, weight, batch["completion_ids"], batch["advantages"], batch["completion_mask"],
                lm_head_bias=bias, temperature=temperature, logit_scale=scale, logit_softcap=softcap,
                compute_dtype=dtype, **loss_options,
            )  # fmt: skip

    return call_through(*redirect_target(wrapper, model), forward, *model_inputs(batch))


def plain_token_logps(model: torch.nn.Module, batch: dict[str, Any], temperature: float, backend: str,
                      autocast: AbstractContextManager | None = None, with_entropy: bool = False,
                      entropy_grad: bool = False) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Per-token log-probs ``[B, T]`` float32 (and entropy) from the model's full ``[B, Lp + T, V]`` logits.

    Args:
        backend: ``"plain"`` (grpo_ext.selective_log_softmax: no ``[B, T, V]`` log-softmax temporary) or
            ``"torch"`` (float32 log_softmax + gather, the reference path).
        autocast: the context the model runs in (bf16 autocast on CUDA), default none.
        entropy_grad: the entropy keeps its graph (the entropy bonus); detached otherwise.
    """
    prompt_len = batch["prompt_ids"].shape[1]
    input_ids, attention_mask, position_ids = model_inputs(batch)
    with autocast or nullcontext():  # no KV cache: nothing reads it (and gradient checkpointing refuses one)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits  # fmt: skip
    logits = logits[:, prompt_len - 1 : -1]
    if backend == "plain":
        selected = ops.selective_log_softmax(
            logits, batch["completion_ids"], temperature=temperature, return_entropy=with_entropy
        )
        if not with_entropy:
            return selected.logps
        return selected.logps, selected.entropy if entropy_grad else selected.entropy.detach()
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logps = log_probs.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logps
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


def use_fused(model: torch.nn.Module, backend: str, role: str, verbose: bool = True) -> bool:
    """Whether ``model`` is scored on the fused path: ``backend == "fused"`` and :func:`fused_refusal` finds no
    reason against it; otherwise (with ``verbose``) a one-line warning names the reason for the plain path.

    Args:
        role: ``"policy"`` or ``"reference"`` (for the warning).
    """
    if backend != "fused":
        return False
    reason = fused_refusal(model)
    if reason is not None and verbose:
        warnings.warn(f"logps_backend='fused': the {role} model ({type(model).__name__}) falls back to the plain "
                      f"path: {reason}", stacklevel=3)  # fmt: skip
    return reason is None
