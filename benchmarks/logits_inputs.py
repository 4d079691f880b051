"""Inputs and options of the benchmarks that start from logits or hidden states.

``bench_selective_log_softmax.py``, ``bench_grpo_loss_from_logits.py`` and ``bench_grpo_loss_from_hidden.py`` draw
their inputs here, so the three see the same problem for the same sizes and seed, and share their options
(``--sizes``, ``--dtypes``, ``--check-rows``) and defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

import grpo_ext
from harness import cli
from trl_style import MASK_DTYPE

TEMPERATURE = 0.9
# --sizes when not given: (--quick, CUDA, CPU). Logits NxV and hidden NxVxH share N and V: Qwen2.5's and Llama 3's
# vocabularies on CUDA. The CPU hidden sizes include issue 14's N = 512 at Qwen2.5's V (2048 x 151936 x 512 is left
# out: its float64 check alone would take an estimated 10 GB; benchmarks/interleave_hidden.py times it).
LOGITS_SIZES = ("64x1000", "8192x151936,16384x128256", "2048x32000")
HIDDEN_SIZES = ("64x1000x64", "8192x151936x4096", "1024x32000x512,512x151936x512")


MAX_LENGTH = 1024  # tokens per sequence: TRL's usual completion length


def sequence_layout(rows: int) -> tuple[int, int]:
    """``(B, T)`` with ``B * T == rows`` exactly: ``T`` the largest divisor of ``rows`` up to :data:`MAX_LENGTH`
    (1024 for the usual sizes, 750 for 1500; a prime above 1024 gives sequences of one token, all kept).

    Args:
        rows: the case's N, at least 1.

    Returns:
        ``(batch, length)``.
    """
    length = next(t for t in range(min(rows, MAX_LENGTH), 0, -1) if rows % t == 0)
    return rows // length, length


def kept_tokens(mask: Tensor) -> int:
    """How many tokens (rows of logits) ``mask`` keeps: those the ops read."""
    return int((mask != 0).sum())


def make_inputs(
    rows: int,
    vocab: int,
    size: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    loss_inputs: bool = True,
) -> dict[str, Any]:
    """Random logits (or hidden + weight) and ids for ``rows`` tokens, then the loss's advantages, mask and old/ref
    log-probs (unless ``loss_inputs`` is False); drawn on the CPU, so every device gets the same values.

    The rows form ``[B, T]`` (:func:`sequence_layout`: exactly ``rows`` of them); mask lengths are uniform in
    ``[1, T]``.
    """
    batch, length = sequence_layout(rows)
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {"batch": batch, "length": length}
    if size is None:
        logits = 2.0 * torch.randn(batch, length, vocab, generator=gen)
        inputs["logits"] = logits.to(device=device, dtype=dtype)
    else:
        inputs["hidden"] = torch.randn(batch, length, size, generator=gen).to(device=device, dtype=dtype)
        inputs["weight"] = (torch.randn(vocab, size, generator=gen) / size**0.5).to(device=device, dtype=dtype)
    inputs["ids"] = torch.randint(0, vocab, (batch, length), generator=gen).to(device)
    if not loss_inputs:
        return inputs
    # old and ref near the policy's own log-probs, as in training: ratios straddle the clip range, KL stays small
    logps = policy_logps(inputs).cpu()
    inputs["old_logps"] = (logps + 0.2 * torch.randn(batch, length, generator=gen)).to(device)
    inputs["ref_logps"] = (logps + 0.2 * torch.randn(batch, length, generator=gen)).to(device)
    inputs["advantages"] = torch.randn(batch, generator=gen).to(device)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    inputs["mask"] = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(MASK_DTYPE).to(device)
    return inputs


@torch.no_grad()
def policy_logps(inputs: dict[str, Any]) -> Tensor:
    """``[B, T]`` float32 log-probs of the ids under the inputs' logits (chunks of 1024 rows on the hidden path)."""
    if "logits" in inputs:
        return grpo_ext.selective_log_softmax(inputs["logits"], inputs["ids"], temperature=TEMPERATURE).logps
    hidden, weight, ids = inputs["hidden"], inputs["weight"], inputs["ids"]
    flat_hidden, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    parts = [
        grpo_ext.selective_log_softmax(flat_hidden[i : i + 1024] @ weight.t(), flat_ids[i : i + 1024],
                                       temperature=TEMPERATURE).logps
        for i in range(0, flat_ids.numel(), 1024)
    ]  # fmt: skip
    return torch.cat(parts).view_as(ids)


def first_rows(inputs: dict[str, Any], check_rows: int) -> dict[str, Any]:
    """The same problem restricted to its first sequences (at least one), for the float64 check."""
    keep = max(1, min(inputs["batch"], check_rows // inputs["length"]))
    return {k: (v[:keep] if isinstance(v, Tensor) and k != "weight" else v) for k, v in inputs.items()} | {
        "batch": keep
    }


def make_parser(doc: str, sizes_help: str, arity: int = 2,
                options: Iterable[str] = cli.SHARED_OPTIONS) -> argparse.ArgumentParser:  # fmt: skip
    """A script's parser: :func:`harness.cli.make_parser`'s options, then ``--sizes``, ``--dtypes``, ``--check-rows``.

    Args:
        doc: the script's docstring (the description ``--help`` shows).
        sizes_help: the help of ``--sizes`` (``NxV`` pairs or ``NxVxH`` triples).
        arity: 2 for ``NxV`` pairs, 3 for ``NxVxH`` triples (checked while parsing).
        options: the shared options the script honours (:func:`harness.cli.make_parser`).
    """
    parser = cli.make_parser(doc, options)
    parser.add_argument("--sizes", default=None, type=cli.sizes_arg(arity),
                        help=sizes_help + "; N rows form [B, T], T the largest divisor of N up to 1024")  # fmt: skip
    parser.add_argument("--dtypes", default=None, type=cli.dtypes_arg, help="e.g. bfloat16,float32")
    parser.add_argument("--check-rows", type=cli.positive_int, default=2048,
                        help="rows checked against float64 (whole sequences)")  # fmt: skip
    return parser


def fill_defaults(args: argparse.Namespace, device: torch.device, sizes: tuple[str, str, str]) -> None:
    """Sets the options left unset: ``--sizes`` from ``sizes`` (--quick, CUDA, CPU), bf16 on CUDA and float32 on
    CPU, and the timed seconds per peer.
    """
    cuda = device.type == "cuda"
    if args.sizes is None:
        args.sizes = sizes[0] if args.quick else (sizes[1] if cuda else sizes[2])
    if args.dtypes is None:
        args.dtypes = "bfloat16" if cuda else "float32"
    if args.target_s is None:
        args.target_s = 0.02 if args.quick else 0.5
