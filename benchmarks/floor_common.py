"""What ``bench_floor.py``'s three kinds of case share: the case lists' parser, the inputs drawn on the device, the
float64 check of every peer, and the timer with its rows (median ms, peak MiB, time over the case's yardstick).

The cases themselves: ``bench_floor.py`` (the fused logits pass and its layouts), ``floor_selective.py``
(``selective_log_softmax`` and the pass's forward beside TRL's Triton kernel), ``floor_hidden.py``
(``grpo_loss_from_hidden`` beside its three GEMMs and TRL's chunked head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import fused_loss
from harness import checks, cli, peers, timing
from logits_inputs import policy_logps, sequence_layout

BETA = 0.04
ENTROPY_COEF = 0.01
# The single-read pass in its small-block layout (csrc/cuda/grpo_loss_from_logits_row.cuh, with_layout_from_env)
SINGLE_READ = {"GRPO_EXT_LOGITS_SINGLE_READ": "1"}

Step = Callable[[], Any]


def parse_cases(text: str, arity: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``"8192x151936:bfloat16,..."`` -> ``[((8192, 151936), torch.bfloat16), ...]``; ``"none"`` -> ``[]``.

    Raises:
        ValueError: an item that is not ``arity`` positive integers joined by ``x``, then ``:`` and a float dtype
            (or no dtype: bfloat16).
    """
    if text.strip().lower() == "none":
        return []
    out = []
    for item in cli.parse_list(text):
        size, _, dtype = item.partition(":")
        out.append((cli.parse_sizes(size, arity)[0], cli.parse_dtype(dtype or "bfloat16")))
    if not out:
        raise ValueError(f"{text!r} holds no case ('none' for none)")
    return out


def cases_arg(arity: int) -> Callable[[str], str]:
    """The ``type`` of ``--logits``/``--selective``/``--hidden``: :func:`parse_cases` checks the text while the
    command line is parsed (argparse's error names the option); the text is kept as given."""

    def check(text: str) -> str:
        return cli.checked(lambda value: parse_cases(value, arity), text)

    check.__name__ = "cases"
    return check


def draw_inputs(rows: int, vocab: int, size: int | None, dtype: torch.dtype, device: torch.device,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """The case's inputs drawn on ``device``: as ``logits_inputs.make_inputs`` (same shapes and laws), faster."""
    batch, length = sequence_layout(rows)
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs: dict[str, Any] = {"batch": batch, "length": length}
    if size is None:
        logits = torch.empty(batch, length, vocab, device=device, dtype=dtype)
        inputs["logits"] = logits.normal_(0.0, 2.0, generator=gen)
    else:
        inputs["hidden"] = torch.randn(batch, length, size, device=device, generator=gen).to(dtype)
        inputs["weight"] = (torch.randn(vocab, size, device=device, generator=gen) / size**0.5).to(dtype)
    inputs["ids"] = torch.randint(0, vocab, (batch, length), device=device, generator=gen)
    logps = policy_logps(inputs)
    # Near the policy's own log-probs. The logits path's ratios straddle the clip range (spread 0.2); the hidden
    # path's stay inside it (spread 0.05): its bf16 logits differ from float64 ones by about 1e-2, enough to move a
    # token across a clip boundary, where the gradient jumps (a disagreement with the float64 check, not an error).
    spread = 0.2 if size is None else 0.05
    inputs["old_logps"] = logps + spread * torch.randn(batch, length, device=device, generator=gen)
    inputs["ref_logps"] = logps + spread * torch.randn(batch, length, device=device, generator=gen)
    inputs["advantages"] = torch.randn(batch, device=device, generator=gen)
    lengths = torch.randint(1, length + 1, (batch, 1), device=device, generator=gen)
    inputs["mask"] = (torch.arange(length, device=device) < lengths).to(torch.int32)
    return inputs


def kwargs64(small: dict[str, Any]) -> dict[str, Any]:
    """The loss options of :func:`fused_loss.loss_kwargs`, their tensors in float64 (the reference's inputs)."""
    return {k: v.double() if isinstance(v, Tensor) else v for k, v in fused_loss.loss_kwargs(small, BETA).items()}


def check(case: str, steps: dict[str, Step | None], notes: dict[str, str], small_steps: dict[str, Step | None],
          truths: Callable[[str], dict[str, Tensor]], dtype: torch.dtype, rows: int) -> None:  # fmt: skip
    """Runs each peer on the small inputs against the float64 truth; a peer that disagrees becomes n/a.

    A step returns its outputs in the order of ``truths(name)`` (label -> float64 tensor); a ``"loss"`` is compared
    with an absolute tolerance relative to 1, the others relative to their largest magnitude.
    """
    errors = []
    for name, step in small_steps.items():
        if step is None or steps.get(name) is None:
            continue

        def compare(name=name, step=step) -> float:
            got, want = step(), truths(name)
            err = 0.0
            for value, (label, expected) in zip(got, want.items(), strict=True):
                scale = 1.0 if label == "loss" else None
                err = max(err, checks.assert_matches(f"{case} {name} {label}", value, expected, dtype, scale))
            return err

        try:
            err = checks.check_peer(name, steps, notes, compare, case)
        except Exception as exc:  # a peer that cannot even run on this machine (e.g. a Triton compile error)
            steps[name], notes[name], err = None, f"failed: {peers.short_reason(exc)}", None
        if err is not None:
            errors.append(f"{name} {err:.1e}")
    print(f"check {case} on {rows} rows: " + (", ".join(errors) or "no peer agreed"), flush=True)


def time_ms(fn: Step, device: torch.device, target_s: float) -> float:
    """Median ms of one call: ``do_bench`` on CUDA (L2 flushed between calls), the harness' timer on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(25, int(target_s * 250)), rep=max(100, int(target_s * 1000)),
                              return_mode="median"))  # fmt: skip
    return timing.time_call(fn, device, target_s=target_s)["median_ms"]


def time_rows(case: str, steps: dict[str, Step | None], notes: dict[str, str], floors: dict[str, str],
              device: torch.device, target_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """One row per peer: median ms, peak MiB and ``x floor`` (time over the yardstick named in ``floors``)."""
    rows, times = [], {}
    for name, step in steps.items():
        row: dict[str, Any] = {"case": case, "impl": name, "median_ms": None, "x_floor": None, "peak_mib": None,
                               "note": notes.get(name)}  # fmt: skip
        if step is not None:
            try:
                step()  # compile, autotune, allocator
                peak = timing.peak_memory_above(step, device)
                row["peak_mib"] = peak / 2**20 if peak is not None else None
                row["median_ms"] = times[name] = time_ms(step, device, target_s)
            except Exception as exc:  # out of memory, a peer's own failure: the run goes on
                row["note"] = f"failed: {peers.short_reason(exc)}"
        rows.append(row)
    for row in rows:
        base = times.get(floors.get(row["impl"], ""))
        if base and row["median_ms"]:
            row["x_floor"] = row["median_ms"] / base
    return rows
