"""Microbenchmark of the GRPO loss from logits and from hidden states, forward + backward.

Peers, side by side on the same inputs (``--path logits``, ``--path hidden`` or both):

* ``eager``: TRL's way in eager PyTorch: ``logits.float() / temperature``, log-softmax through ``logsumexp`` and a
  gather, the entropy under ``no_grad`` (a metric), then the loss of ``bench_grpo_loss.trl_style_loss``. On the hidden
  path the logits come from ``hidden @ weight.T`` first.
* ``compile``: ``torch.compile`` of ``grpo_ext.reference.grpo_loss_from_logits`` (or ``..._from_hidden``).
* ``liger``: Liger-Kernel's ``triton_grpo_loss`` (logits path) or ``LigerFusedLinearGRPOLoss`` (hidden path), when
  ``liger-kernel`` is installed and the device is CUDA; n/a with the reason otherwise.
* ``grpo_ext``: ``grpo_ext.grpo_loss_from_logits`` / ``grpo_ext.grpo_loss_from_hidden``.
* ``grpo_ext+inplace`` (logits path): ``inplace_grad=True``; each call first clones the logits (the in-place call
  consumes them), and that clone is part of the time: the row is about memory.

Each call computes the loss and its gradient (w.r.t. the logits, or hidden and weight). Before timing, every peer is
checked against ``grpo_ext.reference`` in float64 on the first rows of the same inputs (``--check-rows``).

Bytes (logits path): the one-read-one-write floor, ``2 * N * V * e`` (read the logits once, write the gradient once,
``e`` bytes per element); ``%copy`` compares the achieved rate with a measured device copy. Hidden path: the time of
its three GEMMs (``hidden @ W.T``, ``g @ W``, ``g.T @ hidden``) is measured in the same run, and ``x gemm`` is that
time over the row's. Peak memory (CUDA): the allocator's peak above what was allocated before the call.

Usage::

    python benchmarks/bench_grpo_loss_from_logits.py           # default sizes for the device
    python benchmarks/bench_grpo_loss_from_logits.py --quick   # smoke run (CI)
    python benchmarks/bench_grpo_loss_from_logits.py --path logits --sizes 8192x151936 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `common` and `bench_grpo_loss`

import torch
from torch import Tensor

import common
import grpo_ext
from bench_grpo_loss import EPSILON, MASK_DTYPE, trl_style_loss
from grpo_ext import reference

TEMPERATURE = 0.9
LOSS_TYPE = "dapo"  # masked token mean: the normalization Liger's kernels and TRL's default share
Step = Callable[[], Any]


def make_inputs(rows: int, vocab: int, size: int | None, dtype: torch.dtype, device: torch.device, seed: int):
    """Random logits (or hidden + weight), ids, advantages, mask and old/ref log-probs for ``rows`` tokens.

    The rows form ``[B, T]`` with ``T = min(rows, 1024)``; mask lengths are uniform in ``[1, T]``.
    """
    length = min(rows, 1024)
    batch = rows // length
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {"batch": batch, "length": length}
    if size is None:
        logits = 2.0 * torch.randn(batch, length, vocab, generator=gen)
        inputs["logits"] = logits.to(device=device, dtype=dtype)
    else:
        inputs["hidden"] = torch.randn(batch, length, size, generator=gen).to(device=device, dtype=dtype)
        inputs["weight"] = (torch.randn(vocab, size, generator=gen) / size**0.5).to(device=device, dtype=dtype)
    inputs["ids"] = torch.randint(0, vocab, (batch, length), generator=gen).to(device)
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


def loss_kwargs(inputs: dict[str, Any], beta: float) -> dict[str, Any]:
    return dict(old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], beta=beta, loss_type=LOSS_TYPE,
                epsilon=EPSILON, temperature=TEMPERATURE)  # fmt: skip


def eager_logits_loss(logits: Tensor, inputs: dict[str, Any], beta: float) -> Tensor:
    """TRL's selective log-softmax on float32 logits, entropy as a metric, then TRL's loss."""
    z = logits.float() / TEMPERATURE
    logps = torch.gather(z, -1, inputs["ids"].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    with torch.no_grad():
        p = torch.softmax(z, dim=-1)
        entropy = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    loss, _ = trl_style_loss(logps, inputs["old_logps"], inputs["ref_logps"], inputs["advantages"], inputs["mask"],
                             loss_type=LOSS_TYPE, beta=beta)  # fmt: skip
    del entropy
    return loss


def logits_steps(inputs: dict[str, Any], beta: float, device: torch.device) -> tuple[dict[str, Step | None], dict]:
    base = inputs["logits"]
    leaf = base.detach().requires_grad_(True)
    kwargs = loss_kwargs(inputs, beta)
    ids, adv, mask = inputs["ids"], inputs["advantages"], inputs["mask"]
    steps: dict[str, Step | None] = {}
    notes: dict[str, str] = {}

    def eager():
        loss = eager_logits_loss(leaf, inputs, beta)
        return loss, torch.autograd.grad(loss, leaf)[0]

    def fused():
        out = grpo_ext.grpo_loss_from_logits(leaf, ids, adv, mask, **kwargs)
        return out.loss, torch.autograd.grad(out.loss, leaf)[0]

    source = base.detach().requires_grad_(True)

    def fused_inplace():
        logits = source.clone()  # a non-leaf the call may consume
        out = grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, inplace_grad=True, **kwargs)
        return out.loss, torch.autograd.grad(out.loss, source)[0]

    steps.update(eager=eager, grpo_ext=fused, **{"grpo_ext+inplace": fused_inplace})
    steps["liger"], reason = liger_logits_step(inputs, leaf, beta, device)
    if reason:
        notes["liger"] = reason
    return steps, notes


def liger_logits_step(inputs: dict[str, Any], leaf: Tensor, beta: float, device: torch.device):
    """Liger-Kernel's triton_grpo_loss (it takes logits with one extra final position), or (None, why)."""
    if device.type != "cuda":
        return None, "Liger-Kernel's Triton kernels need a CUDA device"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:  # not installed, or its Triton does not import
        return None, f"liger-kernel unavailable ({common.short_reason(exc)}); pip install liger-kernel"
    padded = torch.cat([leaf.detach(), leaf.detach()[:, -1:]], dim=1).requires_grad_(True)
    mask = inputs["mask"]

    def step():
        out = triton_grpo_loss(padded, inputs["old_logps"], inputs["ref_logps"], inputs["ids"], inputs["advantages"],
                               mask, TEMPERATURE, beta, EPSILON, EPSILON, False)  # fmt: skip
        per_token = out[0] if isinstance(out, tuple) else out
        if per_token.dim() == 0:  # newer versions reduce themselves
            loss = per_token
        else:
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        grad = torch.autograd.grad(loss, padded)[0][:, :-1]
        return loss, grad

    return step, None


def hidden_steps(inputs: dict[str, Any], beta: float, device: torch.device) -> tuple[dict[str, Step | None], dict]:
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(True)
    kwargs = loss_kwargs(inputs, beta)
    ids, adv, mask = inputs["ids"], inputs["advantages"], inputs["mask"]

    def eager():
        loss = eager_logits_loss(hidden @ weight.t(), inputs, beta)
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    def fused():
        out = grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, **kwargs)
        return (out.loss, *torch.autograd.grad(out.loss, (hidden, weight)))

    steps: dict[str, Step | None] = {"eager": eager, "grpo_ext": fused}
    notes: dict[str, str] = {}
    steps["liger"], reason = liger_hidden_step(inputs, hidden, weight, beta, device)
    if reason:
        notes["liger"] = reason
    return steps, notes


def liger_hidden_step(inputs, hidden: Tensor, weight: Tensor, beta: float, device: torch.device):
    """Liger-Kernel's LigerFusedLinearGRPOLoss, or (None, why)."""
    if device.type != "cuda":
        return None, "Liger-Kernel's fused linear loss is benchmarked on CUDA only"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:
        return None, f"liger-kernel unavailable ({common.short_reason(exc)}); pip install liger-kernel"
    try:
        loss_fn = LigerFusedLinearGRPOLoss(beta=beta, epsilon_low=EPSILON, epsilon_high=EPSILON,
                                           temperature=TEMPERATURE, loss_type=LOSS_TYPE, use_ref_model=False)  # fmt: skip
    except TypeError as exc:
        return None, f"LigerFusedLinearGRPOLoss's signature differs: {common.short_reason(exc)}"

    def step():
        out = loss_fn(hidden, weight, inputs["ids"], inputs["mask"], inputs["advantages"],
                      ref_per_token_logps=inputs["ref_logps"], old_per_token_logps=inputs["old_logps"])  # fmt: skip
        loss = out[0] if isinstance(out, tuple) else out
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    return step, None


def compiled_step(inputs: dict[str, Any], beta: float, path: str) -> Step:
    torch._dynamo.reset()
    kwargs = loss_kwargs(inputs, beta)
    ids, adv, mask = inputs["ids"], inputs["advantages"], inputs["mask"]
    if path == "logits":
        leaf = inputs["logits"].detach().requires_grad_(True)
        fn = torch.compile(reference.grpo_loss_from_logits, dynamic=False)

        def step():
            out = fn(leaf, ids, adv, mask, **kwargs)
            return out.loss, torch.autograd.grad(out.loss, leaf)[0]

        return step
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(True)
    fn = torch.compile(reference.grpo_loss_from_hidden, dynamic=False)

    def step():
        out = fn(hidden, weight, ids, adv, mask, **kwargs)
        return (out.loss, *torch.autograd.grad(out.loss, (hidden, weight)))

    return step


def first_rows(inputs: dict[str, Any], check_rows: int) -> dict[str, Any]:
    """The same problem restricted to its first sequences (at least one), for the float64 check."""
    keep = max(1, min(inputs["batch"], check_rows // inputs["length"]))
    return {k: (v[:keep] if isinstance(v, Tensor) and k != "weight" else v) for k, v in inputs.items()} | {
        "batch": keep
    }


def check_peers(steps: dict[str, Step | None], notes: dict[str, str], inputs: dict[str, Any], beta: float,
                path: str, dtype: torch.dtype, case: str, check_rows: int, make_steps) -> None:  # fmt: skip
    """Runs every peer on the first rows and compares loss and gradients with the float64 reference."""
    small = first_rows(inputs, check_rows)
    small_steps, _ = make_steps(small, beta, small["ids"].device)
    kwargs = loss_kwargs(small, beta)
    as64 = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    adv, mask, ids = small["advantages"].double(), small["mask"], small["ids"]
    if path == "logits":
        leaves = [small["logits"].detach().double().requires_grad_(True)]
        truth = reference.grpo_loss_from_logits(leaves[0], ids, adv, mask, **as64).loss
    else:
        leaves = [small[k].detach().double().requires_grad_(True) for k in ("hidden", "weight")]
        truth = reference.grpo_loss_from_hidden(*leaves, ids, adv, mask, **as64).loss
    truth_grads = torch.autograd.grad(truth, leaves)
    errors = []
    for name in list(small_steps):
        step = small_steps[name]
        if step is None or steps.get(name) is None:
            continue
        loss, *grads = step()
        try:
            err = common.assert_matches(f"{case} {name} loss", loss, truth, dtype, 1.0)
            for g, t in zip(grads, truth_grads, strict=True):
                err = max(err, common.assert_matches(f"{case} {name} grad", g, t, dtype))
        except AssertionError as exc:
            if name != "liger":
                raise
            steps[name], notes[name] = None, f"disagrees with the reference: {common.short_reason(exc)}"
            continue
        errors.append(f"{name} {err:.1e}")
    print(f"check {case} on {small['batch'] * small['length']} rows: " + ", ".join(errors))


def gemm_time(inputs: dict[str, Any], device: torch.device, target_s: float, flusher) -> float:
    """Milliseconds of the hidden path's three GEMMs at this size, timed in this run."""
    hidden = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1])
    weight = inputs["weight"]
    logits = hidden @ weight.t()
    total = 0.0
    for fn in (lambda: hidden @ weight.t(), lambda: logits @ weight, lambda: logits.t() @ hidden):
        total += common.time_call(fn, device, target_s=target_s / 3, flusher=flusher)["median_ms"]
    return total


def run_case(rows: int, vocab: int, size: int | None, dtype: torch.dtype, args, device, flusher) -> list[dict]:
    path = "logits" if size is None else "hidden"
    case = f"{path} N={rows} V={vocab}" + (f" H={size}" if size else "") + f" {common.dtype_name(dtype)}"
    inputs = make_inputs(rows, vocab, size, dtype, device, args.seed)
    make_steps = logits_steps if path == "logits" else hidden_steps
    steps, notes = make_steps(inputs, args.beta, device)
    notes_compile, _, compile_s = {}, None, None
    if args.no_compile:
        steps["compile"], notes_compile["compile"] = None, "skipped (--no-compile)"
    else:
        try:
            step = compiled_step(inputs, args.beta, path)
            ok, reason, compile_s = common.warm_up(step, device)
        except Exception as exc:
            ok, reason = False, common.short_reason(exc)
        steps["compile"] = step if ok else None
        if not ok:
            notes_compile["compile"] = f"torch.compile failed: {reason}"
    notes.update(notes_compile)
    check_peers(steps, notes, inputs, args.beta, path, dtype, case, args.check_rows, make_steps)
    elt = torch.empty((), dtype=dtype).element_size()
    base_row = {"case": case, "op": f"grpo_loss_from_{path} fwd+bwd", "N": rows, "V": vocab, "H": size,
                "dtype": common.dtype_name(dtype), "loss_type": LOSS_TYPE, "beta": args.beta,
                "bytes": 2 * rows * vocab * elt if size is None else 0}  # fmt: skip
    if size is not None:
        base_row["gemm_ms"] = gemm_time(inputs, device, args.target_s, flusher)
    out = common.time_peers(steps, notes, base_row, device, target_s=args.target_s, flusher=flusher,
                            compile_s=compile_s)  # fmt: skip
    for row in out:
        if size is not None and row.get("median_ms"):
            row["x_gemm"] = base_row["gemm_ms"] / row["median_ms"]
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--path", default="logits,hidden", help="logits and/or hidden")
    parser.add_argument("--sizes", default=None, help="logits path: NxV pairs, e.g. 8192x151936")
    parser.add_argument("--hidden-sizes", default=None, help="hidden path: NxVxH triples, e.g. 8192x151936x4096")
    parser.add_argument("--dtypes", default=None, help="e.g. bfloat16,float32")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-rows", type=int, default=2048, help="rows checked against float64 (whole sequences)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device, env, copy, flusher = common.start(args)
    cuda = device.type == "cuda"
    if args.sizes is None:
        args.sizes = "64x1000" if args.quick else ("8192x151936,16384x128256" if cuda else "2048x32000")
    if args.hidden_sizes is None:
        args.hidden_sizes = "64x1000x64" if args.quick else ("8192x151936x4096" if cuda else "1024x32000x512")
    if args.dtypes is None:
        args.dtypes = "bfloat16" if cuda else "float32"
    if args.target_s is None:
        args.target_s = 0.02 if args.quick else 0.5
    paths = common.parse_list(args.path)
    rows: list[dict[str, Any]] = []
    for dtype in map(common.parse_dtype, common.parse_list(args.dtypes)):
        if "logits" in paths:
            for n, v in common.parse_pairs(args.sizes):
                rows.extend(run_case(n, v, None, dtype, args, device, flusher))
        if "hidden" in paths:
            for triple in common.parse_list(args.hidden_sizes):
                n, v, h = (int(x) for x in triple.lower().split("x"))
                rows.extend(run_case(n, v, h, dtype, args, device, flusher))
    common.report(__file__, "GRPO loss from logits / hidden, forward + backward", rows, env, copy, args, device,
                  flusher)  # fmt: skip
    for row in rows:
        if row.get("x_gemm"):
            print(f"{row['case']} {row['impl']}: {row['median_ms']:.3g} ms = {1 / row['x_gemm']:.2f}x its 3 GEMMs")


if __name__ == "__main__":
    main()
