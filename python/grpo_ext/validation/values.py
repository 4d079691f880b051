"""Checks of plain values (strings, numbers, flags): each returns the value normalized or raises a ``ValueError``
that starts with the argument's name and says what was expected. Part of :mod:`grpo_ext.validation`."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

from .options import LogitOptions

#: The dtypes a fused op computes in (``compute_dtype``).
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Raises ValueError unless ``value`` is one of ``allowed``; the message lists the allowed values."""
    if not isinstance(value, str) or value not in allowed:
        allowed_list = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {allowed_list}; got {value!r}")


def check_int(name: str, value: object, minimum: int) -> int:
    """Returns ``value`` as a Python int, raising ValueError unless it is an integer >= ``minimum``.

    A 0-dim integer tensor is taken from the CPU only; on another device its value is refused rather than read (a
    host synchronization inside an op)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        # read on the host: a device tensor's value would make the host wait for the device
        raise ValueError(
            f"{name} must be a Python int or a CPU tensor, got a tensor on {value.device} (reading it would make the "
            "host wait for the device)"
        )
    try:
        as_int = operator.index(value)  # accepts int, numpy ints, 0-dim integer tensors
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if as_int < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {as_int}")
    return as_int


def check_real_number(name: str, value: object) -> float:
    """Returns ``value`` as a Python float, raising ValueError unless it is a real (non-bool) Python number."""
    if value.__class__ is float or value.__class__ is int:  # the common case, without the ABC check's cost
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number > 0 (NaN is rejected)."""
    x = check_real_number(name, value)
    if not x > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def check_finite_positive(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a finite number > 0."""
    x = check_real_number(name, value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return x


def check_non_negative(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number >= 0 (NaN is rejected)."""
    x = check_real_number(name, value)
    if not x >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def check_finite(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a finite real number (not NaN, not +-inf)."""
    x = check_real_number(name, value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return x


def check_bool(name: str, value: object) -> bool:
    """Returns ``value`` as a bool, raising ValueError unless it is a bool or a ``numpy.bool_`` (an element of a numpy
    array or config); ``"false"`` from a YAML or command line, which is true in Python, is refused."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # numpy 2's name, numpy 1's
        return bool(value)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def check_compute_dtype(value: object) -> torch.dtype | None:
    """Returns ``value`` (None or one of :data:`COMPUTE_DTYPES`), raising ValueError naming ``compute_dtype``."""
    if value is None or value in COMPUTE_DTYPES:
        return value
    names = ", ".join(str(d) for d in COMPUTE_DTYPES)
    raise ValueError(f"compute_dtype must be None or one of {names}; got {value!r}")


_DEFAULT_LOGIT = LogitOptions()
_FLOAT32_NORMAL_MIN, _FLOAT32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def validate_logit_options(
    temperature: object, logit_scale: object = 1.0, logit_softcap: object = None
) -> LogitOptions:
    """Checks the logits options (docs/math.md section 2) of every op that reads logits; returns them as floats.

    Raises:
        ValueError: temperature not > 0, logit_scale not finite and > 0, or logit_softcap neither None nor finite > 0.
    """
    if (temperature.__class__ is float and logit_scale.__class__ is float and logit_softcap is None
            and temperature == 1.0 and logit_scale == 1.0):  # fmt: skip
        return _DEFAULT_LOGIT  # the defaults of every call that reads logits, without the checks' cost
    options = LogitOptions(
        check_positive("temperature", temperature),
        check_finite_positive("logit_scale", logit_scale),
        None if logit_softcap is None else check_finite_positive("logit_softcap", logit_softcap),
    )
    # the kernels' factors, in float32 (docs/math.md section 2): inf or 0 there would make every log-prob NaN
    _check_float32_factor("logit_scale / temperature", options.logit_scale / options.temperature)
    if options.logit_softcap is not None:
        _check_float32_factor("logit_scale / logit_softcap", options.logit_scale / options.logit_softcap)
        _check_float32_factor("logit_softcap / temperature", options.logit_softcap / options.temperature)
    return options


def _check_float32_factor(name: str, value: float) -> None:
    if not _FLOAT32_NORMAL_MIN <= value <= _FLOAT32_MAX:
        raise ValueError(f"{name} must be a normal float32 number (1.2e-38 to 3.4e38), got {value!r}")
