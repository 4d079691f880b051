"""What ``bench_grpo_loss_from_logits.py`` and ``bench_grpo_loss_from_hidden.py`` share.

The two fused-loss benchmarks differ only in their peers (the scripts build them) and in the hidden path's GEMM
yardstick; everything else is here: the loss options, the eager loss (TRL's way), the grpo_ext and torch.compile
steps, the float64 check on the first rows, one case's run, and the command line and main loop.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import logits_inputs
from grpo_ext import reference
from harness import checks, cli, environment, peers, reporting
from harness.timing import L2Flusher
from logits_inputs import HIDDEN_SIZES, LOGITS_SIZES, TEMPERATURE, fill_defaults, first_rows, make_inputs, make_parser
from trl_style import EPSILON, trl_style_loss, trl_style_selective_log_softmax

LOSS_TYPE = "dapo"  # masked token mean: the normalization Liger's kernels and TRL's default share
Step = Callable[[], Any]
MakeSteps = Callable[[dict[str, Any], float, torch.device], tuple[dict[str, Step | None], dict[str, str]]]
GemmTime = Callable[[dict[str, Any], torch.device, float, L2Flusher | None], float]
ExtraCases = Callable[[argparse.Namespace, torch.device, L2Flusher | None], list[dict[str, Any]]]


class LossPath(NamedTuple):
    """One of the two paths: its reference (float64 check, compile peer), the inputs of its gradient, its sizes."""

    reference_loss: Callable[..., Any]
    leaves: tuple[str, ...]
    arity: int  # 2: NxV, 3: NxVxH
    sizes: tuple[str, str, str]  # --sizes when not given: --quick, CUDA, CPU
    sizes_help: str


PATHS = {
    "logits": LossPath(reference.grpo_loss_from_logits, ("logits",), 2, LOGITS_SIZES, "NxV pairs, e.g. 8192x151936"),
    "hidden": LossPath(
        reference.grpo_loss_from_hidden, ("hidden", "weight"), 3, HIDDEN_SIZES, "NxVxH triples, e.g. 8192x151936x4096"
    ),
}


def loss_kwargs(inputs: dict[str, Any], beta: float) -> dict[str, Any]:
    """The loss options every peer is called with (besides ids, advantages and mask)."""
    return dict(old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], beta=beta, loss_type=LOSS_TYPE,
                epsilon=EPSILON, temperature=TEMPERATURE)  # fmt: skip


def eager_loss(logits: Tensor, inputs: dict[str, Any], beta: float) -> Tensor:
    """TRL's selective log-softmax on float32 logits, entropy as a metric, then TRL's loss."""
    logps, _ = trl_style_selective_log_softmax(logits, inputs["ids"], TEMPERATURE)
    loss, _ = trl_style_loss(logps, inputs["old_logps"], inputs["ref_logps"], inputs["advantages"], inputs["mask"],
                             loss_type=LOSS_TYPE, beta=beta)  # fmt: skip
    return loss


def loss_step(fn: Callable[..., Any], leaves: Sequence[Tensor], inputs: dict[str, Any], beta: float) -> Step:
    """A step calling ``fn(*leaves, ids, advantages, mask, **loss options)`` (``grpo_ext.grpo_loss_from_<path>`` or
    its reference, maybe compiled), then the gradient of the loss w.r.t. ``leaves``: ``(loss, *grads)``.
    """
    kwargs = loss_kwargs(inputs, beta)
    ids, adv, mask = inputs["ids"], inputs["advantages"], inputs["mask"]

    def step():
        out = fn(*leaves, ids, adv, mask, **kwargs)
        return (out.loss, *torch.autograd.grad(out.loss, leaves))

    return step


def logits_bytes(inputs: dict[str, Any], beta: float) -> int:
    """The bytes the logits path must move on these inputs: the logits of the kept rows read once (a masked row is
    never read), the gradient written once for every row (a masked row's is zeros), the per-token inputs of the kept
    rows (id, ``old_logps``, ``ref_logps`` when ``beta != 0``), the mask once, an advantage per scored sequence.
    """
    logits, mask = inputs["logits"], inputs["mask"]
    rows, vocab, elt = mask.numel(), logits.shape[-1], logits.element_size()
    kept = logits_inputs.kept_tokens(mask)
    per_kept = inputs["ids"].element_size() + inputs["old_logps"].element_size()
    if beta != 0:
        per_kept += inputs["ref_logps"].element_size()
    scored = int((mask != 0).any(-1).sum())
    return (kept + rows) * vocab * elt + kept * per_kept + rows * mask.element_size() + scored * 4


def compiled_step(inputs: dict[str, Any], beta: float, path: str) -> Step:
    """``torch.compile`` of the path's reference as a step; compilation happens on its first calls."""
    torch._dynamo.reset()  # a fresh, static-shape compile per case (and no recompile limit across cases)
    leaves = [inputs[key].detach().requires_grad_(True) for key in PATHS[path].leaves]
    return loss_step(torch.compile(PATHS[path].reference_loss, dynamic=False), leaves, inputs, beta)


def check_peers(steps: dict[str, Step | None], notes: dict[str, str], inputs: dict[str, Any], beta: float,
                path: str, dtype: torch.dtype, case: str, check_rows: int, make_steps: MakeSteps) -> None:  # fmt: skip
    """Runs every peer on the first rows and compares loss and gradients with the float64 reference.

    The peers are built again on those rows by ``make_steps`` (the compile peer is not: it would compile again).
    A peer that disagrees becomes n/a with the reason (``checks.check_peer``); the run goes on.
    """
    small = first_rows(inputs, check_rows)
    small_steps, _ = make_steps(small, beta, small["ids"].device)
    kwargs = loss_kwargs(small, beta)
    as64 = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    adv, mask, ids = small["advantages"].double(), small["mask"], small["ids"]
    leaves = [small[key].detach().double().requires_grad_(True) for key in PATHS[path].leaves]
    truth = PATHS[path].reference_loss(*leaves, ids, adv, mask, **as64).loss
    truth_grads = torch.autograd.grad(truth, leaves)
    errors = []
    for name in list(small_steps):
        step = small_steps[name]
        if step is None or steps.get(name) is None:
            continue
        loss, *grads = step()

        def compare(name=name, loss=loss, grads=grads) -> float:
            err = checks.assert_matches(f"{case} {name} loss", loss, truth, dtype, 1.0)
            for g, t in zip(grads, truth_grads, strict=True):
                err = max(err, checks.assert_matches(f"{case} {name} grad", g, t, dtype))
            return err

        err = checks.check_peer(name, steps, notes, compare, case)
        if err is not None:
            errors.append(f"{name} {err:.1e}")
    print(f"check {case} on {small['batch'] * small['length']} rows: " + ", ".join(errors))


def run_case(path: str, rows: int, vocab: int, size: int | None, dtype: torch.dtype, args: argparse.Namespace,
             device: torch.device, flusher: L2Flusher | None, make_steps: MakeSteps,
             gemm_time: GemmTime | None = None) -> list[dict]:  # fmt: skip
    """Checks and times every peer on one case; returns one row per peer.

    ``gemm_time`` (hidden path) times the GEMMs at this size before the peers: recorded as ``gemm_ms``, and each
    row's ``x_gemm`` is that time over the row's.
    """
    case = f"{path} N={rows} V={vocab}" + (f" H={size}" if size else "") + f" {cli.dtype_name(dtype)}"
    inputs = make_inputs(rows, vocab, size, dtype, device, args.seed)
    steps, notes = make_steps(inputs, args.beta, device)
    compile_notes, compile_s = peers.add_compile_peer(
        case, steps, lambda: compiled_step(inputs, args.beta, path), device, args
    )
    notes.update(compile_notes)
    check_peers(steps, notes, inputs, args.beta, path, dtype, case, args.check_rows, make_steps)
    base_row = {"case": case, "op": f"grpo_loss_from_{path} fwd+bwd", "N": rows, "V": vocab, "H": size,
                "dtype": cli.dtype_name(dtype), "loss_type": LOSS_TYPE, "beta": args.beta,
                "kept_tokens": logits_inputs.kept_tokens(inputs["mask"]),
                "bytes": logits_bytes(inputs, args.beta) if size is None else 0}  # fmt: skip
    if gemm_time is not None:
        base_row["gemm_ms"] = gemm_time(inputs, device, args.target_s, flusher)
    out = peers.time_peers(steps, notes, base_row, device, target_s=args.target_s, flusher=flusher,
                           compile_s=compile_s)  # fmt: skip
    for row in out:
        if gemm_time is not None and row.get("median_ms"):
            row["x_gemm"] = base_row["gemm_ms"] / row["median_ms"]
    return out


def main(script_file: str, doc: str, path: str, make_steps: MakeSteps, gemm_time: GemmTime | None = None,
         extra_cases: ExtraCases | None = None) -> None:  # fmt: skip
    """A fused-loss script's main: command line, every case, the table and the JSON record.

    Args:
        script_file: the script's ``__file__`` (names the JSON file).
        doc: the script's docstring (its first line is the ``--help`` description).
        path: ``"logits"`` or ``"hidden"``.
        make_steps: builds the script's peers (all but compile) on given inputs: ``(steps, notes)``.
        gemm_time: see :func:`run_case`.
        extra_cases: the script's own cases, run after the others: ``(args, device, flusher) -> rows``.
    """
    # no --no-graph: neither script has a CUDA-graph row
    parser = make_parser(doc, PATHS[path].sizes_help, PATHS[path].arity, ("target-s", "no-compile", "no-l2-flush"))
    parser.add_argument("--beta", type=float, default=0.04)
    args = parser.parse_args()
    device, env, copy, flusher = environment.start(args)
    fill_defaults(args, device, PATHS[path].sizes)
    rows: list[dict[str, Any]] = []
    for dtype in map(cli.parse_dtype, cli.parse_list(args.dtypes)):
        for n, v, *h in cli.parse_sizes(args.sizes, PATHS[path].arity):
            size = h[0] if h else None
            rows.extend(run_case(path, n, v, size, dtype, args, device, flusher, make_steps, gemm_time))
    if extra_cases is not None:
        rows.extend(extra_cases(args, device, flusher))
    title = f"grpo_loss_from_{path} forward + backward"
    bytes_note = ("the kept rows' logits read once, every row's gradient written once" if path == "logits"
                  else None)  # fmt: skip
    reporting.report(script_file, title, rows, env, copy, args, device, flusher, bytes_note)
    for row in rows:
        if row.get("x_gemm"):
            print(f"{row['case']} {row['impl']}: {row['median_ms']:.3g} ms = {1 / row['x_gemm']:.2f}x its 3 GEMMs")
