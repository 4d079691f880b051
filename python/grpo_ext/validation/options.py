"""The loss options, defined once: names, types, defaults, meaning, and the value sets of every string option.

:class:`LossOptions` is the one Python definition of the options every loss takes (``grpo_loss``,
``grpo_loss_from_logits``, ``grpo_loss_from_hidden`` and their references): the public functions' signatures, the
native ops' argument tuples and the metrics dict are all built from it. Its C++ twin is ``GRPO_LOSS_OPTIONS`` in
``csrc/plan/loss_options.h`` (same names, same order); adding an option means one field here and one line there
(docs/architecture.md). The math of each option is docs/math.md sections 3-7.
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from torch import Tensor

# ---------------------------------------------------------------------------------------------------------------
# The values each string option accepts (imported by the validation, the trainer's config, the TRL integration
# and the tests)
# ---------------------------------------------------------------------------------------------------------------

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
#: The loss types whose policy term is PPO's clipped surrogate (docs/math.md section 3).
CLIP_FAMILY_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: The loss types normalized by the tokens of the batch, ``num_items_in_batch`` (docs/math.md section 5).
TOKEN_LEVEL_LOSS_TYPES: tuple[str, ...] = ("dapo", "cispo", "vespo")
#: k1-k3 (Schulman), and verl's ``abs``, straight-through ``k1+``/``k3+`` and ``low_var_kl`` (docs/math.md section 4).
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k1+", "k3+", "low_var_kl")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
BASELINES: tuple[str, ...] = ("mean", "leave_one_out")
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
#: group_advantages' singleton_groups: "zero" (A = 0 alone in a group) or "verl" (mean 0, std 1; docs/math.md 1).
SINGLETON_GROUPS: tuple[str, ...] = ("zero", "verl")
#: verl's clamp of the k3 estimate for ``low_var_kl`` and ``k3+`` (``kLowVarKLCap`` in csrc/grpo_loss_math.h).
LOW_VAR_KL_CAP: float = 10.0

#: Default absolute ratio cap of ``loss_type="cispo"`` when ``epsilon_high`` is left unset (docs/math.md section 3).
CISPO_DEFAULT_CAP: float = 5.0

#: VESPO's bounds (TRL 1.16's get_gamma_weights; ``kVespo*`` in csrc/grpo_loss_math.h): a token's log-ratio and a
#: log IS weight are clamped to +-20 (the latter to log 1e-8 below), the row's log-weight to [log 1e-8, 20], and
#: lambda to at least 1e-4.
VESPO_LOG_RATIO_BOUND: float = 20.0
VESPO_MIN_LOG_WEIGHT: float = math.log(1e-8)
VESPO_MIN_LAMBDA: float = 1e-4

#: A group whose reward std is at most this (and that has >= 2 scored members) is a zero-std group (section 1).
ZERO_STD_TOL: float = 1e-8


class LossOptions(NamedTuple):
    """The options of every GRPO loss, with their defaults, in the order the native ops take them.

    Attributes:
        old_logps: ``[B, T]`` log-probs of the sampling policy (detached); None means on-policy
            (``old = logps.detach()``).
        ref_logps: ``[B, T]`` reference-model log-probs (detached); required when ``beta != 0``.
        is_weights: ``[B, T]``, ``[B, 1]`` or ``[B]`` rollout importance-sampling weights (detached; multiply the
            policy term only; for ``vespo`` they enter each row's weight instead).
        sample_mask: ``[B]`` bool/int/float rows to keep (zero-std masking), multiplied into ``completion_mask``
            before anything else; a dropped row counts in no token denominator.
        loss_type: one of ``LOSS_TYPES``: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo`` (the clip family),
            ``cispo``, ``sapo``, ``vespo``.
        epsilon: lower clip ``1 - epsilon`` (clip family); >= 0.
        epsilon_high: upper clip ``1 + epsilon_high`` (clip family; defaults to ``epsilon``); for ``cispo`` the
            absolute cap on the ratio (default 5.0); >= 0.
        delta: two-sided clipping cap on the unclipped ratio (INTELLECT-2), must exceed 1.
        beta: KL coefficient, finite and >= 0; the KL term is computed only when ``beta != 0``.
        kl_estimator: ``k3`` (``exp(r) - r - 1``), ``k1`` (``-r``) or ``k2`` (``r^2 / 2``) of ``r = ref - logps``;
            verl's ``abs``, ``low_var_kl`` (k3 capped at 10) and straight-through ``k1+``/``k3+``.
        kl_clamp: > 0 bound: ``r`` is clamped to ``[-kl_clamp, kl_clamp]`` before the estimator.
        use_bias_correction_kl: multiply the KL by the importance ratio, with its gradient (DeepSeek-V3.2).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        max_completion_length: ``dr_grpo``'s constant denominator, >= 1 (default ``T``).
        num_items_in_batch: ``dapo``/``cispo``/``vespo`` denominator, a number > 0 or a 0-dim floating or integer
            tensor (default: the kept tokens, at least 1). The native ops take it as two arguments, a float and a
            tensor; a CUDA tensor is read by the kernels, never by the host.
        sapo_temperature_pos: SAPO temperature for positive advantages; finite, > 0.
        sapo_temperature_neg: SAPO temperature for non-positive advantages; finite, > 0.
        vespo_k_pos: VESPO's power exponent ``k`` where ``A >= 0`` (TRL's name and default); finite.
        vespo_lambda_pos: VESPO's decay ``lambda`` where ``A >= 0``; finite, used as at least 1e-4 (as TRL).
        vespo_k_neg: VESPO's ``k`` where ``A < 0``; finite.
        vespo_lambda_neg: VESPO's ``lambda`` where ``A < 0``; finite, used as at least 1e-4.
        loss_scale: a finite number or a 0-dim floating or integer tensor multiplying the loss and its gradient
            (gradient accumulation or a loss scaler), not the metrics. The native ops take it as two arguments, a
            float and a tensor; a CUDA tensor is read by the kernels, never by the host (no device sync).
        skip_empty_rows: the per-row means (``grpo``, ``sapo``, ``luspo``, ``dr_grpo``) divide by the rows that have a
            kept token instead of ``B`` (verl's ``seq-mean-*`` aggregation).
        policy_weights: ``[B, T]``, ``[B, 1]`` or ``[B]`` weights (detached) that multiply the policy term of every
            loss type and nothing else, and never enter vespo's row weight (TRL's token masks on vespo's term); for
            the other loss types the same as ``is_weights``.
    """

    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    is_weights: Tensor | None = None
    sample_mask: Tensor | None = None
    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    num_items_in_batch: float | Tensor | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    loss_scale: float | Tensor = 1.0
    skip_empty_rows: bool = False
    policy_weights: Tensor | None = None

    @property
    def gradient_needs_whole_rows(self) -> bool:
        """Whether a token's gradient depends on the other log-probs of its row (GSPO's ratio, vespo's weight), so
        that the losses from logits compute the log-probs before the gradient (two passes)."""
        return self.importance_sampling_level != "token" or self.loss_type == "vespo"

    @classmethod
    def from_kwargs(cls, function: str, kwargs: dict[str, Any]) -> LossOptions:
        """The options a public function received as keywords; unknown names raise ``TypeError``."""
        unknown = sorted(set(kwargs) - set(cls._fields))
        if unknown:
            raise TypeError(f"{function}() got unexpected keyword argument(s) {unknown}; it takes grpo_loss' options")
        return cls(**kwargs)

    def op_args(self) -> tuple:
        """The options as the native ops take them (validated values): ``num_items_in_batch`` as (float or None,
        tensor or None), ``loss_scale`` as (float, tensor or None), the float 1.0 beside a tensor.

        Numbers are converted to the Python type their annotation starts with (``float`` or ``int``). A tensor number
        goes to the ops as it is: its value is read by the kernels, never by the host here (a CUDA tensor's would be a
        host sync).
        """
        values: list[Any] = []
        for name, kind, value in zip(self._fields, _NUMBER_KINDS, self, strict=True):
            if name in SPLIT_NUMBERS:
                is_tensor = isinstance(value, Tensor)
                number = SPLIT_NUMBERS[name].placeholder if is_tensor or value is None else float(value)
                values += [number, value if is_tensor else None]
            elif value is not None and kind is not None:
                values.append(number_of(kind, value))
            else:
                values.append(value)
        return tuple(values)

    @classmethod
    def from_op_args(cls, values: tuple) -> LossOptions:
        """Inverse of :meth:`op_args` (the composite ops receive the options as the native ops do)."""
        fields, rest = [], iter(values)
        for name in cls._fields:
            value = next(rest)
            if name in SPLIT_NUMBERS:
                tensor = next(rest)
                value = tensor if tensor is not None else value
            fields.append(value)
        return cls(*fields)


def number_of(kind: type, value: Any) -> Any:
    """``kind(value)`` for a native op's number argument; a meta tensor (a shape, no value: tracing, FakeTensor-free
    shape checks) counts as 1, since no output of a meta call has values either."""
    if isinstance(value, Tensor) and value.device.type == "meta":
        return kind(1)
    return kind(value)


# Each option's annotation as text ("float | None"): NamedTuple keeps postponed annotations as ForwardRefs.
_ANNOTATIONS: dict[str, str] = {
    name: getattr(annotation, "__forward_arg__", annotation) for name, annotation in LossOptions.__annotations__.items()
}
#: ``float`` or ``int`` for each option whose annotation starts with that type (converted by ``op_args``), else None.
_NUMBER_KINDS: tuple[type | None, ...] = tuple(
    {"float": float, "int": int}.get(_ANNOTATIONS[name].split(" ")[0]) for name in LossOptions._fields
)

class SplitNumber(NamedTuple):
    """How the native ops take an option that is a number or a 0-dim tensor: as two arguments, the number (or
    ``placeholder`` beside a tensor) and the tensor argument ``tensor_arg`` (None beside a number)."""

    tensor_arg: str
    placeholder: float | None


#: The options passed to the native ops as two arguments (:class:`SplitNumber`), by name.
SPLIT_NUMBERS: dict[str, SplitNumber] = {
    "num_items_in_batch": SplitNumber("num_items_tensor", None),
    "loss_scale": SplitNumber("loss_scale_tensor", 1.0),
}

#: The native ops' option names, in schema order (must equal ``_native.LOSS_OPTIONS_SCHEMA``'s; a test checks it).
NATIVE_OPTION_NAMES: tuple[str, ...] = tuple(
    name for field in LossOptions._fields
    for name in ((field, SPLIT_NUMBERS[field].tensor_arg) if field in SPLIT_NUMBERS else (field,))
)  # fmt: skip

_F = TypeVar("_F", bound=Callable[..., Any])


def _option_entries(doc: str | None) -> dict[str, str]:
    """Each field's entry of LossOptions' ``Attributes:`` section, its lines joined (empty under ``python -OO``)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Attributes:" not in lines:  # under -OO NamedTuple writes its own one-line docstring
        return {}
    entries: dict[str, str] = {}
    name = ""
    for line in lines[lines.index("Attributes:") + 1 :]:
        if not line.strip():
            break
        if line.startswith(" " * 8):  # a continuation line of the entry above
            entries[name] += " " + line.strip()
        else:
            name, _, text = line.strip().partition(": ")
            entries[name] = text
    return entries


#: Each loss option's meaning, read from LossOptions' docstring: the one place it is written, from which every loss
#: function's docstring lists the options (``with_loss_options_doc``), so no list is kept by hand.
OPTION_DOCS: dict[str, str] = _option_entries(LossOptions.__doc__)
if OPTION_DOCS and tuple(OPTION_DOCS) != LossOptions._fields:  # a new field without its line, or out of order
    raise RuntimeError(f"LossOptions' docstring must document each field once, in order: {LossOptions._fields}, "
                       f"got {tuple(OPTION_DOCS)}")  # fmt: skip


def loss_options_doc(names: Iterable[str] = LossOptions._fields, indent: str = "") -> str:
    """Docstring entries of the loss options ``names``: ``name (type, default value): meaning`` from LossOptions.

    Args:
        names: LossOptions fields, in the order to list them.
        indent: prefix of each entry's first line (continuation lines get four more spaces).

    Returns:
        The entries, each wrapped at 120 columns, one after another.
    """
    entries = []
    for name in names:
        head = f"{name} ({_ANNOTATIONS[name]}, default {LossOptions._field_defaults[name]!r}): {OPTION_DOCS[name]}"
        # no line break inside a ``literal``: its spaces are hidden from the wrapper, then put back
        head = re.sub(r"``.*?``", lambda literal: literal.group().replace(" ", "\0"), head)
        entry = textwrap.fill(head, width=120, initial_indent=indent, subsequent_indent=indent + "    ",
                              break_long_words=False, break_on_hyphens=False)  # fmt: skip
        entries.append(entry.replace("\0", " "))
    return "\n".join(entries)


def with_loss_options_doc(doc: str | None, owner: str, names: Iterable[str] = LossOptions._fields) -> str | None:
    """``doc`` with the loss options ``names`` listed (:func:`loss_options_doc`) under its ``**options:`` argument.

    Args:
        doc: a Google-style docstring whose ``Args:`` hold a ``**options:`` entry (None under ``python -OO``).
        owner: the documented function or class, for the error.
        names: the options it takes through ``**options``.

    Returns:
        The docstring, cleaned (``inspect.cleandoc``), with the list after the ``**options:`` entry's own lines.

    Raises:
        ValueError: ``doc`` has no ``**options:`` entry.
    """
    if doc is None or not OPTION_DOCS:
        return doc
    lines = inspect.cleandoc(doc).splitlines()
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("**options:")), None)
    if at is None:
        raise ValueError(f"{owner}'s docstring has no '**options:' argument to list the loss options under")
    indent = len(lines[at]) - len(lines[at].lstrip())
    end = at + 1
    while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    return "\n".join(lines[:end] + loss_options_doc(names, " " * (indent + 4)).splitlines() + lines[end:])


class LogitOptions(NamedTuple):
    """The logits options (docs/math.md section 2), validated: from raw logits ``x``, ``y = logit_scale * x``, then
    ``y = logit_softcap * tanh(y / logit_softcap)`` when a cap is given, then ``z = y / temperature``.

    Not loss options: every op that reads logits takes them (``selective_log_softmax`` too), next to temperature.
    """

    temperature: float = 1.0
    #: Multiplies the raw logits (Cohere's ``logit_scale``); finite, > 0.
    logit_scale: float = 1.0
    #: Gemma 2's ``final_logit_softcapping``: finite, > 0, or None for no cap.
    logit_softcap: float | None = None

    def op_args(self) -> tuple[float, float, float]:
        """The native ops' ``(temperature, logit_scale, logit_softcap)`` arguments (0.0 for no cap)."""
        return (self.temperature, self.logit_scale, 0.0 if self.logit_softcap is None else self.logit_softcap)


def takes_loss_options(function: _F) -> _F:
    """Declares that ``function(..., **options)`` takes the loss options: its signature lists them as keywords, and
    its docstring lists them with their meaning under its ``**options:`` argument (:func:`with_loss_options_doc`).

    ``inspect.signature``, ``help()`` and IDEs then show every option with its type, default and meaning, while the
    options themselves stay defined once (:class:`LossOptions`).
    """
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=LossOptions._field_defaults[name],
                          annotation=_ANNOTATIONS[name])
        for name in LossOptions._fields
    ]  # fmt: skip
    function.__signature__ = signature.replace(parameters=own + options)  # type: ignore[attr-defined]
    function.__doc__ = with_loss_options_doc(function.__doc__, function.__qualname__)
    return function
