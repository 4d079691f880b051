"""The command line every bench script shares, and the parsers of its option values.

Every option value is checked while the command line is parsed (the ``*_arg`` functions below are argparse ``type``
callables): a bad value is argparse's own error naming the option, exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

#: The dtypes a benchmark's floating inputs may take, by the names the options accept.
FLOAT_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64,
}  # fmt: skip
#: The options of :func:`make_parser` a script may leave out (those it does not honour).
SHARED_OPTIONS = ("target-s", "no-compile", "no-graph", "no-l2-flush")


def make_parser(doc: str, options: Iterable[str] = SHARED_OPTIONS) -> argparse.ArgumentParser:
    """A bench script's parser, holding the options every script shares; the script adds its own (sizes, dtypes).

    Args:
        doc: the script's docstring; its first line is the description ``--help`` shows.
        options: which of :data:`SHARED_OPTIONS` the script honours (``--device``, ``--quick``, ``--out`` and
            ``--seed`` are always there): ``--help`` lists no option that does nothing.

    Returns:
        The parser.
    """
    options = set(options)
    if unknown := options - set(SHARED_OPTIONS):
        raise ValueError(f"unknown shared options {sorted(unknown)}: choose among {SHARED_OPTIONS}")
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default=None, type=device_arg, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short timing: a smoke run for CI")
    if "target-s" in options:
        parser.add_argument("--target-s", type=positive_float, default=None,
                            help="seconds of timed calls per implementation and case")  # fmt: skip
    if "no-compile" in options:
        parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (reported n/a)")
    if "no-graph" in options:
        parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay row")
    if "no-l2-flush" in options:
        parser.add_argument("--no-l2-flush", action="store_true", help="CUDA: keep L2 warm between repetitions")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/out/<script>-<dev>.json, <script>-<dev>-quick.json with "
                             "--quick)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return parser


def parse_sizes(text: str, arity: int) -> list[tuple[int, ...]]:
    """Parses ``"64x16x32x4096,16x8x16x1024"`` into ``[(64, 16, 32, 4096), (16, 8, 16, 1024)]`` (``arity`` = 4).

    Args:
        text: comma-separated ``AxBx...`` tuples of ``arity`` positive integers.
        arity: how many integers each tuple has.

    Returns:
        The tuples, in order.

    Raises:
        ValueError: an item that is not ``arity`` positive integers joined by ``x``, or no item at all.
    """
    sizes = []
    for item in parse_list(text):
        try:
            values = tuple(int(value) for value in item.lower().split("x"))
        except ValueError:
            values = ()
        if len(values) != arity or min(values) < 1:
            raise ValueError(f"{item!r} is not {arity} positive integers joined by 'x'")
        sizes.append(values)
    if not sizes:
        raise ValueError(f"{text!r} holds no size")
    return sizes


def parse_list(text: str) -> list[str]:
    """Splits a comma-separated option value, dropping empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_dtype(name: str) -> torch.dtype:
    """Maps ``float32``/``fp32``/``bfloat16``/``bf16``/``float16``/``fp16``/``float64``/``fp64`` to a torch dtype.

    Raises:
        ValueError: any other name (an integer dtype included: the benchmarks' inputs are floating).
    """
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# --- argparse ``type`` callables: each checks a value and returns it (an ArgumentTypeError names the option) ---


def checked(parse: Callable[[str], object], text: str) -> str:
    """``text`` once ``parse(text)`` accepted it; its ValueError as argparse's error (which names the option)."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def sizes_arg(arity: int, most: int | None = None) -> Callable[[str], str]:
    """The ``type`` of a sizes option: :func:`parse_sizes`'s ``arity``-tuples (at most ``most`` of them); the text
    is kept as given (the JSON records it, the script parses it where it uses it)."""

    def parse(text: str) -> None:
        if len(parse_sizes(text, arity)) > (most or float("inf")):
            raise ValueError(f"{text!r} holds more than {most} size{'s' if most > 1 else ''}")

    def check(text: str) -> str:
        return checked(parse, text)

    check.__name__ = "sizes"  # argparse names the type in some of its messages
    return check


def dtypes_arg(text: str) -> str:
    """The ``type`` of a ``--dtypes`` option: a comma-separated list of :data:`FLOAT_DTYPES` names."""

    def parse(value: str) -> None:
        names = parse_list(value)
        if not names:
            raise ValueError(f"{value!r} holds no dtype")
        for name in names:
            parse_dtype(name)

    return checked(parse, text)


def choices_arg(choices: Sequence[str]) -> Callable[[str], str]:
    """The ``type`` of a comma-separated list whose items are among ``choices`` (at least one)."""

    def parse(text: str) -> None:
        items = parse_list(text)
        if not items:
            raise ValueError(f"{text!r} holds nothing: one or more of {', '.join(choices)}")
        if unknown := [item for item in items if item not in choices]:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}: one or more of {', '.join(choices)}")

    def check(text: str) -> str:
        return checked(parse, text)

    check.__name__ = "list"
    return check


def device_arg(text: str) -> str:
    """The ``type`` of ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, CUDA only where torch sees a CUDA device."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but torch.cuda.is_available() is False")
    return text


def _positive(text: str, kind: type, what: str) -> float:
    """``kind(text)`` where it is finite and above 0, else argparse's error naming ``what``."""
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}")
    return value


def positive_int(text: str) -> int:
    """The ``type`` of an option that takes an integer of at least 1."""
    return _positive(text, int, "positive integer")


def positive_float(text: str) -> float:
    """The ``type`` of an option that takes a finite number above 0."""
    return _positive(text, float, "positive number")
