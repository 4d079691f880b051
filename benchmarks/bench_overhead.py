"""Per-call overhead of grpo_ext's Python layer: the losses on inputs so small that a call's host work is its time.

On a GPU, ``grpo_ext.grpo_loss`` at B=64, T=1024 took 0.30 ms a call against 0.028 ms for its CUDA-graph replay:
nearly all of a call was host work (argument checks, the dispatcher, autograd, the result), and the same work shows on
the CPU on a tiny input. This script times it there, beside the same math in eager PyTorch, in one run.

Cases (B=8, T=16, V=64 by default; float32; ``loss_type="grpo"``, ``beta=0.04`` with ``old_logps`` and
``ref_logps``, an int32 mask as TRL builds it):

* ``grpo_loss fwd``: the loss under ``torch.no_grad()`` (a loss computed for logging or evaluation).
* ``grpo_loss fwd+bwd``: the loss, then ``torch.autograd.grad(loss, logps)``.
* ``grpo_loss_from_logits fwd`` and ``fwd+bwd``: the same from ``[B, T, V]`` logits (gradient w.r.t. the logits).

Peers of each case:

* ``eager``: TRL's way in eager PyTorch (``trl_style.trl_style_loss``, after
  ``trl_style.trl_style_selective_log_softmax`` for the logits cases).
* ``grpo_ext``: the public function, as a user calls it (keyword options, every check, the result tuple).
* ``native``: the op's kernels alone, called below the autograd key with arguments prepared once (the forward
  cases only): the floor that no Python layer can go under. ``grpo_ext`` minus ``native`` is the layer's cost.

Before timing, every peer's loss (and gradient) is checked against ``grpo_ext.reference`` in float64; a peer that
disagrees is not timed: its row is n/a with the reason (``harness.checks.check_peer``). On the CPU
the timing runs on ``--threads`` threads (default 1: the kernels' threading would only add noise at this size); the
peers are timed in ``--rounds`` interleaved rounds (so that a busy machine slows them alike), each row reporting the
median of its rounds' medians and its best round (``min_ms``). The summary prints the ratios the overhead targets
are stated in (issue 31), from the best rounds. No timing here is an assertion.

``--host-profile``: after the timing, ``torch.profiler`` over 50 calls of each native forward, its table of host ops
and CUDA runtime calls by self CPU time: where a native call's host time goes (issue 31 item 3: the logits op's
native forward took 121 us on an H200 against 37 for ``grpo_loss``'s, RESULTS.md).

Usage::

    python benchmarks/bench_overhead.py                # B=8, T=16, V=64 on the default device
    python benchmarks/bench_overhead.py --quick        # smoke run (CI)
    python benchmarks/bench_overhead.py --sizes 64x1024x64 --device cuda
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and `trl_style`, wherever it is run from

import torch
from torch import Tensor

import grpo_ext
from grpo_ext import reference
from grpo_ext.validation import validate_grpo_loss_args
from grpo_ext.validation.options import LogitOptions, LossOptions
from harness import checks, cli, environment, reporting, timing
from trl_style import EPSILON, MASK_DTYPE, trl_style_loss, trl_style_selective_log_softmax

BETA = 0.04
LOSS_TYPE = "grpo"
IMPLS = ("eager", "grpo_ext", "native")
Step = Callable[[], Any]


def make_inputs(batch: int, length: int, vocab: int, device: torch.device, seed: int) -> dict[str, Tensor]:
    """Logits, ids, their log-probs as the ``logps`` leaf, old/ref log-probs near them, advantages and a prefix mask;
    drawn on the CPU, so that every device gets the same values."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, length, vocab, generator=gen)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    logps = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    inputs = {
        "logits": logits,
        "ids": ids,
        "logps": logps,
        "old_logps": logps + 0.2 * torch.randn(batch, length, generator=gen),
        "ref_logps": logps + 0.2 * torch.randn(batch, length, generator=gen),
        "advantages": torch.randn(batch, generator=gen),
        "completion_mask": (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(MASK_DTYPE),
    }
    inputs = {name: t.to(device) for name, t in inputs.items()}
    inputs["logits"].requires_grad_()
    inputs["logps"].requires_grad_()
    return inputs


def loss_options(inputs: dict[str, Tensor]) -> dict[str, Any]:
    """The keyword options of every grpo_ext call here."""
    return dict(old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], loss_type=LOSS_TYPE, beta=BETA,
                epsilon=EPSILON)  # fmt: skip


def eager_loss(inputs: dict[str, Tensor], from_logits: bool) -> Tensor:
    """TRL's loss in eager PyTorch, from the log-probs leaf or from the logits."""
    logps = inputs["logps"]
    if from_logits:
        logps, _ = trl_style_selective_log_softmax(inputs["logits"], inputs["ids"], 1.0)
    loss, _ = trl_style_loss(logps, inputs["old_logps"], inputs["ref_logps"], inputs["advantages"],
                             inputs["completion_mask"], loss_type=LOSS_TYPE, beta=BETA)  # fmt: skip
    return loss


def grpo_ext_loss(inputs: dict[str, Tensor], from_logits: bool) -> Tensor:
    """The public grpo_ext function, called as a user calls it."""
    adv, mask = inputs["advantages"], inputs["completion_mask"]
    if from_logits:
        return grpo_ext.grpo_loss_from_logits(inputs["logits"], inputs["ids"], adv, mask, **loss_options(inputs)).loss
    return grpo_ext.grpo_loss(inputs["logps"], adv, mask, **loss_options(inputs)).loss


def native_forward(inputs: dict[str, Tensor], from_logits: bool) -> Step:
    """The kernels alone, below the autograd key, with the options resolved once: the forward's floor."""
    logps, adv, mask = inputs["logps"].detach(), inputs["advantages"], inputs["completion_mask"]
    option_args = validate_grpo_loss_args(logps, adv, mask, LossOptions(**loss_options(inputs))).op_args()
    ops = torch.ops.grpo_ext
    logits, ids = inputs["logits"].detach(), inputs["ids"].reshape(-1)
    logit_args = LogitOptions().op_args()

    def step() -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            if not from_logits:
                return ops.grpo_loss_forward.default(logps, adv, mask, *option_args, False)[0]
            return ops.grpo_loss_from_logits.default(logits, ids, adv, mask, *option_args, *logit_args, 0.0, None,
                                                     False)[0]  # fmt: skip

    return step


def make_steps(inputs: dict[str, Tensor], from_logits: bool, backward: bool) -> dict[str, Step]:
    """The peers of one case; each returns ``(loss,)`` or ``(loss, grad)``."""
    leaf = inputs["logits"] if from_logits else inputs["logps"]

    def timed(loss_fn: Callable[[dict[str, Tensor], bool], Tensor]) -> Step:
        if backward:
            return lambda: (lambda loss: (loss, *torch.autograd.grad(loss, leaf)))(loss_fn(inputs, from_logits))

        def forward() -> tuple[Tensor]:
            with torch.no_grad():
                return (loss_fn(inputs, from_logits),)

        return forward

    steps = {"eager": timed(eager_loss), "grpo_ext": timed(grpo_ext_loss)}
    if not backward:
        native = native_forward(inputs, from_logits)
        steps["native"] = lambda: (native(),)
    return steps


def float64_truth(inputs: dict[str, Tensor], from_logits: bool) -> tuple[Tensor, Tensor]:
    """``(loss, grad of the leaf)`` of ``grpo_ext.reference`` in float64 on the same (upcast) inputs."""
    up = {name: t.detach().double() if t.is_floating_point() else t for name, t in inputs.items()}
    kwargs = loss_options(up)
    if from_logits:
        leaf = up["logits"].requires_grad_()
        loss = reference.grpo_loss_from_logits(leaf, up["ids"], up["advantages"], up["completion_mask"], **kwargs).loss
    else:
        leaf = up["logps"].requires_grad_()
        loss = reference.grpo_loss(leaf, up["advantages"], up["completion_mask"], **kwargs).loss
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def check_steps(case: str, steps: dict[str, Step | None], notes: dict[str, str], inputs: dict[str, Tensor],
                from_logits: bool) -> None:  # fmt: skip
    """Every peer's loss (and gradient) against the float64 reference, before timing; a peer that disagrees becomes
    None in ``steps``, with the reason in ``notes`` (``checks.check_peer``)."""
    truth_loss, truth_grad = float64_truth(inputs, from_logits)
    scale = inputs["advantages"].abs().mean().item()  # the loss is a small difference of terms this big
    worst = 0.0
    for name, step in list(steps.items()):
        out = step()

        def compare(name=name, out=out) -> float:
            err = checks.assert_matches(f"{case} {name} loss", out[0], truth_loss, torch.float32, scale)
            if len(out) > 1:
                err = max(err, checks.assert_matches(f"{case} {name} grad", out[1], truth_grad, torch.float32))
            return err

        worst = max(worst, checks.check_peer(name, steps, notes, compare, case) or 0.0)
    agree = ", ".join(name for name, step in steps.items() if step is not None)
    print(f"check {case}: {agree or 'no peer'} match the float64 reference (max |err| {worst:.1e})")


def time_interleaved(steps: dict[str, Step | None], device: torch.device, rounds: int,
                     target_s: float) -> dict[str, dict]:  # fmt: skip
    """Times each available peer in ``rounds`` interleaved rounds: ``{"median_ms", "min_ms", "reps"}`` per peer."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, step in steps.items() if step is not None}
    for _ in range(rounds):
        for name in samples:
            samples[name].append(timing.time_call(steps[name], device, target_s=target_s / rounds))
    return {
        name: {
            "median_ms": statistics.median(s["median_ms"] for s in runs),
            "min_ms": min(s["min_ms"] for s in runs),
            "reps": sum(s["reps"] for s in runs),
        }
        for name, runs in samples.items()
    }


def print_summary(rows: list[dict[str, Any]]) -> None:
    """The ratios of issue 31's targets, from each row's best round (``min_ms``)."""
    best = {(row["op"], row["mode"], row["impl"]): row["min_ms"] * 1e3 for row in rows if row.get("min_ms")}
    print("\nper call, best round (us): op, mode: eager | grpo_ext | native (kernels alone)")
    for op in ("grpo_loss", "grpo_loss_from_logits"):
        for mode in ("fwd", "fwd+bwd"):
            cells = [f"{best[(op, mode, impl)]:8.1f}" if (op, mode, impl) in best else "       -" for impl in IMPLS]
            print(f"  {op:22s} {mode:8s}" + " | ".join(cells))
    ratios = [
        ("grpo_loss fwd+bwd / eager fwd+bwd", ("grpo_loss", "fwd+bwd", "grpo_ext"), ("grpo_loss", "fwd+bwd", "eager")),
        ("grpo_loss fwd / eager fwd+bwd", ("grpo_loss", "fwd", "grpo_ext"), ("grpo_loss", "fwd+bwd", "eager")),
        ("grpo_loss fwd / eager fwd", ("grpo_loss", "fwd", "grpo_ext"), ("grpo_loss", "fwd", "eager")),
    ]
    for mode in ("fwd", "fwd+bwd"):
        ratios.append((f"grpo_loss_from_logits {mode} / grpo_loss {mode}", ("grpo_loss_from_logits", mode, "grpo_ext"),
                       ("grpo_loss", mode, "grpo_ext")))  # fmt: skip
    for label, top, bottom in ratios:
        value = f"{best[top] / best[bottom]:6.3f}" if top in best and bottom in best else "   n/a"  # a peer disagreed
        print(f"  {label:48s} {value}")


def host_profile(inputs: dict[str, Tensor], device: torch.device, calls: int = 50) -> None:
    """Prints, for each native forward, torch.profiler's table of its host ops and CUDA runtime calls over ``calls``
    calls, by self CPU time (after one unprofiled call)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for op, from_logits in (("grpo_loss", False), ("grpo_loss_from_logits", True)):
        step = native_forward(inputs, from_logits)
        step()
        sync()
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(calls):
                step()
            sync()
        print(f"\nhost profile: {op} native forward, {calls} calls (self CPU time; per call: divide by {calls})")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    """Checks and times every case, prints the table and the target ratios, writes the JSON record."""
    parser = cli.make_parser(__doc__, ("target-s",))  # no graph row, no L2 flush: host work is what is timed
    # accepted as every op script accepts it (tests/test_benchmarks.py passes it to each), but this one has no
    # torch.compile peer at all
    parser.add_argument("--no-compile", action="store_true",
                        help="ignored: this script has no torch.compile peer (host overhead is what it measures)")
    parser.add_argument("--sizes", default="8x16x64", type=cli.sizes_arg(3, most=1),
                        help="BxTxV, e.g. 8x16x64 (one size)")  # fmt: skip
    parser.add_argument("--threads", type=cli.positive_int, default=1, help="CPU threads of torch (default 1)")
    parser.add_argument("--rounds", type=cli.positive_int, default=None,
                        help="interleaved timing rounds (default 7, quick 2)")  # fmt: skip
    parser.add_argument("--host-profile", action="store_true",
                        help="then torch.profiler's table of each native forward's host ops and CUDA runtime calls")
    args = parser.parse_args()
    if environment.resolve_device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)  # before start() records torch_num_threads in the environment
    device, env, copy, _ = environment.start(args)
    if args.target_s is None:
        args.target_s = 0.05 if args.quick else 1.0
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    ((batch, length, vocab),) = cli.parse_sizes(args.sizes, 3)
    inputs = make_inputs(batch, length, vocab, device, args.seed)

    rows: list[dict[str, Any]] = []
    for op, from_logits in (("grpo_loss", False), ("grpo_loss_from_logits", True)):
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            case = f"{op} {mode} B={batch} T={length}" + (f" V={vocab}" if from_logits else "")
            steps: dict[str, Step | None] = dict(make_steps(inputs, from_logits, backward))
            notes: dict[str, str] = {}
            check_steps(case, steps, notes, inputs, from_logits)
            times = time_interleaved(steps, device, args.rounds, args.target_s)
            for name in steps:
                timed = times.get(name, {"median_ms": None, "min_ms": None, "reps": 0})
                rows.append({"case": case, "op": op, "mode": mode, "B": batch, "T": length, "V": vocab,
                             "dtype": "float32", "impl": name, "bytes": 0, "note": notes.get(name),
                             **timed})  # fmt: skip
    reporting.report(__file__, "per-call overhead", rows, env, copy, args, device, None)
    print_summary(rows)
    if args.host_profile:
        host_profile(inputs, device)


if __name__ == "__main__":
    main()
