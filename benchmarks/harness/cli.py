"""The command line every bench script shares, and the parsers of its option values."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A bench script's parser, holding the options every script shares; the script adds its own (sizes, dtypes).

    Args:
        doc: the script's docstring; its first line is the description ``--help`` shows.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short timing: a smoke run for CI")
    parser.add_argument(
        "--target-s", type=float, default=None, help="seconds of timed calls per implementation and case"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (reported n/a)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay row")
    parser.add_argument("--no-l2-flush", action="store_true", help="CUDA: keep L2 warm between repetitions")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/out/<script>-<dev>.json)")
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
        ValueError: an item that is not ``arity`` integers joined by ``x``.
    """
    sizes = []
    for item in parse_list(text):
        values = tuple(int(value) for value in item.lower().split("x"))
        if len(values) != arity:
            raise ValueError(f"{item!r} is not {arity} sizes joined by 'x'")
        sizes.append(values)
    return sizes


def parse_list(text: str) -> list[str]:
    """Splits a comma-separated option value, dropping empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_dtype(name: str) -> torch.dtype:
    """Maps ``float32``/``fp32``/``bfloat16``/``bf16``/``float16``/``fp16``/``float64`` to a torch dtype."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")
