"""Microbenchmark of the GRPO loss, forward + backward: eager "TRL way" vs torch.compile(reference) vs grpo_ext.

Peers, timed side by side on the same inputs:
    * ``eager``: the loss written the way TRL 1.16's ``GRPOTrainer._compute_loss`` writes it in eager PyTorch
      (``trl_style.trl_style_loss``, shared with the fused-loss benchmarks: ``coef_1 = exp(logps - old)``,
      ``coef_2 = clamp(coef_1, 1 - eps, 1 + eps)``, ``-min(coef_1 * A, coef_2 * A)``,
      ``+ beta * (exp(ref - logps) - (ref - logps) - 1)``, masked per-row mean then batch mean for ``grpo``, masked
      token mean for ``dapo``), plus the metrics TRL computes (mean KL, clip ratios) as tensors. TRL's
      ``gather(...).item()`` logging is left out: it is a host sync that no kernel choice removes.
    * ``compile``: ``torch.compile(grpo_ext.reference.grpo_loss)``, compilation excluded from the timing; "n/a" with
      the reason when compiling fails on the machine.
    * ``grpo_ext``: ``grpo_ext.grpo_loss`` (one fused forward kernel that also writes the gradient, one backward
      kernel that scales it), and on CUDA the same call captured in a CUDA graph and replayed (``grpo_ext+graph``).

Each call computes the loss and ``torch.autograd.grad(loss, logps)``. Before timing, every peer's loss and gradient
are checked against ``grpo_ext.reference.grpo_loss`` run in float64 on the same inputs; a peer that disagrees is
not timed: its row is n/a with the reason (``harness.checks.check_peer``), and the run goes on.

Inputs: ``logps``, ``old_logps``, ``ref_logps`` ``[B, T]`` in the case's dtype, ``advantages [B]`` float32, and an
int32 completion mask (TRL's mask dtype) with row lengths uniform in ``[1, T]``. ``beta = 0.04`` so ``ref_logps`` is
read, and ``old_logps`` is given (off-policy) so it is read and clipping happens.

Bandwidth (CUDA): bytes that must move on the case's inputs divided by the median time, where ``K`` = the kept
tokens (about half of ``B*T`` here), ``R`` = the rows with a kept token, ``e`` = bytes per element of the case's
dtype, ``m`` = 4 for the int32 mask, ``g`` = the saved gradient's bytes (4: float32, the compute dtype; 8 for
float64 inputs)::

    forward  = B*T*m          # the mask read once
             + K*2*e          # logps and old_logps read once, kept tokens only (a masked one is never read)
             + K*e*[beta!=0]  # ref_logps likewise, read only with the KL term
             + R*4            # advantages read once per scored row
             + B*T*g          # the saved gradient written once (a masked token's is 0)
    backward = B*T*g          # the saved gradient read once
             + B*T*e          # grad_logps written once
    bytes    = forward + backward

(Until 2026-11-28 every token's logps, old and ref counted, and ``g`` was 4 for float64 too: benchmarks/NOTES.md.)

``%copy`` is that bandwidth as a share of a device-to-device ``copy_`` of 1 GiB measured in the same run (bytes read
plus written over time). Peak memory (CUDA) is the allocator's peak during one call above what was allocated before
it, outputs included.

Usage::

    python benchmarks/bench_grpo_loss.py           # default sizes for the device
    python benchmarks/bench_grpo_loss.py --quick   # smoke run (CI)
    python benchmarks/bench_grpo_loss.py --sizes 64x1024 --dtypes float32,bf16 --loss-types grpo
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and `trl_style`, wherever it is run from

import torch
from torch import Tensor

import grpo_ext
from grpo_ext import reference
from harness import checks, cli, environment, peers, reporting, timing
from trl_style import EPSILON, MASK_DTYPE, trl_style_loss

# Relative band around the clip edges 1 -+ epsilon where the gradient check skips tokens: the gradient jumps there
# (to 0 when clipped), and an eager peer computing the ratio in bf16 (relative rounding 2^-8) legitimately lands on
# the other side for tokens that close to an edge.
CLIP_EDGE_BAND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DEFAULT_CLIP_EDGE_BAND = 1e-6
LOSS_TYPES = ("grpo", "dapo")  # those trl_style_loss, the eager peer, implements
Step = Callable[[], tuple[Tensor, Tensor]]


def make_inputs(batch: int, length: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Tensor]:
    """Random log-probs, advantages and mask; drawn on the CPU so every device gets the same values.

    ``logps - old_logps`` and ``ref_logps - logps`` have a 0.2 standard deviation, so a good share of the tokens is
    clipped at ``1 +- 0.2`` and both branches of the ``min`` are exercised.
    """
    gen = torch.Generator().manual_seed(seed)
    old = -0.05 - 3.0 * torch.rand(batch, length, generator=gen)
    logps = old + 0.2 * torch.randn(batch, length, generator=gen)
    ref = logps + 0.2 * torch.randn(batch, length, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(MASK_DTYPE)
    return {
        "logps": logps.to(device=device, dtype=dtype).requires_grad_(),
        "old_logps": old.to(device=device, dtype=dtype),
        "ref_logps": ref.to(device=device, dtype=dtype),
        "advantages": advantages.to(device),
        "completion_mask": mask.to(device),
    }


def bytes_moved(inputs: dict[str, Tensor], beta: float) -> int:
    """Bytes that must move in forward + backward on ``inputs`` (formula in the module docstring)."""
    logps, mask = inputs["logps"], inputs["completion_mask"]
    elt = logps.element_size()
    grad = 8 if logps.dtype == torch.float64 else 4  # the saved gradient is in the compute dtype
    tokens = mask.numel()
    kept = int((mask != 0).sum())
    scored = int((mask != 0).any(-1).sum())
    reads = 2 + (beta != 0)  # logps, old_logps, and ref_logps with the KL term
    forward = tokens * mask.element_size() + kept * reads * elt + scored * inputs["advantages"].element_size()
    forward += tokens * grad
    backward = tokens * grad + tokens * elt
    return forward + backward


def _loss_step(loss_fn, inputs: dict[str, Tensor], loss_type: str, beta: float) -> Step:
    """A step running ``loss_fn`` (grpo_ext.grpo_loss or its reference, maybe compiled), then d loss / d logps."""
    logps = inputs["logps"]

    def step() -> tuple[Tensor, Tensor]:
        out = loss_fn(
            logps,
            inputs["advantages"],
            inputs["completion_mask"],
            old_logps=inputs["old_logps"],
            ref_logps=inputs["ref_logps"],
            loss_type=loss_type,
            beta=beta,
            epsilon=EPSILON,
        )
        (grad,) = torch.autograd.grad(out.loss, logps)
        return out.loss, grad

    return step


def make_steps(inputs: dict[str, Tensor], loss_type: str, beta: float) -> dict[str, Step]:
    """The eager and grpo_ext steps (loss, then gradient w.r.t. logps) on fixed inputs."""
    logps = inputs["logps"]

    def eager() -> tuple[Tensor, Tensor]:
        loss, _ = trl_style_loss(
            logps,
            inputs["old_logps"],
            inputs["ref_logps"],
            inputs["advantages"],
            inputs["completion_mask"],
            loss_type=loss_type,
            beta=beta,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        return loss, grad

    return {"eager": eager, "grpo_ext": _loss_step(grpo_ext.grpo_loss, inputs, loss_type, beta)}


def make_compiled_step(inputs: dict[str, Tensor], loss_type: str, beta: float) -> Step:
    """``torch.compile(reference.grpo_loss)`` as a step; compilation happens on its first calls."""
    torch._dynamo.reset()  # a fresh, static-shape compile per case (and no recompile limit across cases)
    compiled = torch.compile(reference.grpo_loss, dynamic=False)
    return _loss_step(compiled, inputs, loss_type, beta)


def float64_truth(inputs: dict[str, Tensor], loss_type: str, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """The yardstick: ``reference.grpo_loss`` in float64 on the same (upcast) inputs.

    Returns:
        ``(loss, grad, near_clip_edge)``, the last a bool ``[B, T]`` mask of the tokens whose ratio lies within
        the dtype's :data:`CLIP_EDGE_BAND` of a clip edge (left out of the gradient check).
    """
    logps = inputs["logps"].detach().double().requires_grad_()
    out = reference.grpo_loss(
        logps,
        inputs["advantages"].double(),
        inputs["completion_mask"],
        old_logps=inputs["old_logps"].double(),
        ref_logps=inputs["ref_logps"].double(),
        loss_type=loss_type,
        beta=beta,
        epsilon=EPSILON,
    )
    (grad,) = torch.autograd.grad(out.loss, logps)
    band = CLIP_EDGE_BAND.get(inputs["logps"].dtype, DEFAULT_CLIP_EDGE_BAND)
    rho = torch.exp(logps.detach() - inputs["old_logps"].double())
    near_edge = torch.zeros_like(rho, dtype=torch.bool)
    for edge in (1 - EPSILON, 1 + EPSILON):
        near_edge |= (rho - edge).abs() <= band * edge
    near_edge &= inputs["completion_mask"] != 0  # only tokens that count (the count is printed)
    return out.loss.detach(), grad, near_edge


def run_case(
    batch: int,
    length: int,
    dtype: torch.dtype,
    loss_type: str,
    args: argparse.Namespace,
    device: torch.device,
    flusher: timing.L2Flusher | None,
) -> list[dict[str, Any]]:
    """Checks and times every peer on one case; returns one row per peer."""
    case = f"B={batch} T={length} {cli.dtype_name(dtype)} {loss_type}"
    inputs = make_inputs(batch, length, dtype, device, seed=args.seed)
    steps: dict[str, Step | None] = dict(make_steps(inputs, loss_type, args.beta))
    notes, graph_outputs, compile_s = peers.add_optional_peers(
        case, steps, lambda: make_compiled_step(inputs, loss_type, args.beta), device, args
    )

    # agreement with the float64 reference, before any timing: a peer that disagrees is an n/a row with the reason
    truth_loss, truth_grad, near_edge = float64_truth(inputs, loss_type, args.beta)
    loss_magnitude = inputs["advantages"].abs().mean().item()  # the loss is a small difference of terms this big
    outputs = peers.outputs_of(steps, graph_outputs)
    err_loss = err_grad = 0.0
    for name, (loss, grad) in outputs.items():

        def compare(name=name, loss=loss, grad=grad) -> tuple[float, float]:
            err_l = checks.assert_matches(f"{case} {name} loss", loss, truth_loss, dtype, loss_magnitude)
            return err_l, checks.assert_matches(f"{case} {name} grad", grad, truth_grad, dtype, ignore=near_edge)

        errors = checks.check_peer(name, steps, notes, compare, case)
        if errors is not None:
            err_loss, err_grad = max(err_loss, errors[0]), max(err_grad, errors[1])
    del outputs
    print(
        f"check {case}: {peers.available(steps)} match the float64 reference "
        f"(max |err| loss {err_loss:.1e}, grad {err_grad:.1e}; {int(near_edge.sum())} tokens within "
        f"{CLIP_EDGE_BAND.get(dtype, DEFAULT_CLIP_EDGE_BAND):g} of a clip edge left out of the gradient check)"
    )

    base_row = {
        "case": case,
        "op": "grpo_loss fwd+bwd",
        "B": batch,
        "T": length,
        "dtype": cli.dtype_name(dtype),
        "loss_type": loss_type,
        "beta": args.beta,
        "kept_tokens": int((inputs["completion_mask"] != 0).sum()),
        "bytes": bytes_moved(inputs, args.beta),
        "check_max_abs_err": {"loss": err_loss, "grad": err_grad},
    }
    return peers.time_peers(
        steps, notes, base_row, device, target_s=args.target_s, flusher=flusher, compile_s=compile_s
    )


def parse_args() -> argparse.Namespace:
    """Command line; size defaults depend on the device and on ``--quick``."""
    parser = cli.make_parser(__doc__)
    parser.add_argument("--sizes", default=None, type=cli.sizes_arg(2), help="BxT pairs, e.g. 64x1024,256x4096")
    parser.add_argument("--dtypes", default=None, type=cli.dtypes_arg, help="e.g. float32,bfloat16")
    parser.add_argument("--loss-types", default="grpo,dapo", type=cli.choices_arg(LOSS_TYPES),
                        help="grpo and/or dapo")  # fmt: skip
    parser.add_argument("--beta", type=float, default=0.04)
    return parser.parse_args()


def main() -> None:
    """Runs every case, prints the table and writes the JSON record."""
    args = parse_args()
    device, env, copy, flusher = environment.start(args)
    cuda = device.type == "cuda"
    if args.sizes is None:
        args.sizes = "8x64" if args.quick else ("64x1024,256x4096" if cuda else "64x1024")
    if args.dtypes is None:
        args.dtypes = "float32,bfloat16" if cuda else "float32"
    if args.target_s is None:
        args.target_s = 0.02 if args.quick else 0.25

    rows: list[dict[str, Any]] = []
    for batch, length in cli.parse_sizes(args.sizes, 2):
        for dtype in map(cli.parse_dtype, cli.parse_list(args.dtypes)):
            for loss_type in cli.parse_list(args.loss_types):
                rows.extend(run_case(batch, length, dtype, loss_type, args, device, flusher))
    reporting.report(__file__, "grpo_loss forward + backward", rows, env, copy, args, device, flusher,
                     "the kept tokens' logps, old and ref read once, the mask and the gradients over every token")


if __name__ == "__main__":
    main()
