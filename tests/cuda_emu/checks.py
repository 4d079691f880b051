"""How the tests check the emulated CUDA kernels: against grpo_ext's CPU kernels run in float64 on the same inputs.

The CPU kernels are checked against the float64 reference (docs/math.md) by the rest of the suite; run in float64
they are a float64 oracle for every output of a raw op, the internal ones too (``grad_raw``, ``row_stats``). The
tolerances are the CUDA tests': a float32 output within the op's (rtol, atol); a bfloat16 or float16 output (a
gradient rounded once from float32) within half a unit in the last place of that dtype plus the float32 tolerance,
with float16 given half its subnormal step, 2^-25, as an absolute floor; float64 within 1e-10 relative, 1e-12
absolute; integers and bools exactly. NaN must match NaN, and a float64 value beyond the output dtype's range is that
dtype's +-inf.
"""

from __future__ import annotations

import torch

from .client import EmuDevice

# (rtol, atol) of a float32 output, from the CUDA tests of each op.
VALUES = (2e-5, 2e-5)  # advantages, log-probs, entropies (test_group_advantages, test_selective_log_softmax)
LOSS = (1e-5, 1e-6)  # loss and metrics (test_grpo_loss)
LOSS_GRAD = (1e-4, 1e-6)  # d loss / d logps (test_grpo_loss)
LOGITS_GRAD = (1e-4, 1e-7)  # d loss / d logits (test_grpo_loss_from_logits)

# Ops that write into their first argument, and how many outputs they return besides it.
INPLACE = {"grpo_loss_from_logits_pass_": 2, "grpo_loss_from_logits_": 5, "scale_grad_": 0}


def _as_float64(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64, copy=True)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width: a bit-exact comparison, NaN included."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _outputs(op: str, result, args: list) -> tuple:
    """An op's outputs as a tuple; an in-place op's written argument last."""
    if op in INPLACE:
        return (*(result or ()), args[0])
    return result if isinstance(result, tuple) else (result,)


def tolerance(dtype: torch.dtype, fp32: tuple[float, float]) -> tuple[float, float]:
    """(rtol, atol) of an output of ``dtype`` whose float32 tolerance is ``fp32``."""
    rtol, atol = fp32
    if dtype == torch.float64:
        return 1e-10, 1e-12
    if dtype == torch.bfloat16:
        return 2.0**-8 + rtol, atol
    if dtype == torch.float16:
        return 2.0**-11 + rtol, 2.0**-25 + atol
    return rtol, atol


def check_op(emu: EmuDevice, op: str, *args, tol=VALUES, names: tuple[str, ...] = ()) -> tuple:
    """Runs ``op(*args)`` on the emulated device and checks every output; returns the device's outputs.

    Args:
        emu: the emulated device.
        op: a ``torch.ops.grpo_ext`` op name.
        *args: its arguments (CPU tensors, in the dtypes under test).
        tol: the float32 (rtol, atol) of each output, or one pair for all.
        names: output names for messages.

    The outputs' dtypes and shapes must be the CPU op's on the same arguments, their values within ``tolerance``
    of the CPU op on float64 copies. An in-place op must leave the memory between the elements of its tensor (the
    gaps of a strided view) as it was.
    """
    native = getattr(torch.ops.grpo_ext, op)
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    if op in INPLACE:  # the CPU op on a copy with the same strides
        cpu_args[0] = torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype).copy_(args[0])
    same_dtype = _outputs(op, native(*cpu_args), cpu_args)
    f64_args = [_as_float64(a) for a in args]
    expected = _outputs(op, native(*f64_args), f64_args)
    span = None
    if op in INPLACE:
        target = args[0]
        count = 1 + sum((s - 1) * st for s, st in zip(target.shape, target.stride(), strict=True))
        span = torch.as_strided(target, (count,), (1,)).clone()
        covered = torch.zeros(count, dtype=torch.bool)
        torch.as_strided(covered, target.shape, target.stride()).fill_(True)
    got = _outputs(op, emu.call(op, *args), list(args))
    if span is not None:
        after = torch.as_strided(args[0], span.shape, (1,))
        assert torch.equal(_bits(after[~covered]), _bits(span[~covered])), (
            f"{op} wrote memory between the rows of its strided tensor"
        )
    tols = tol if isinstance(tol, list) else [tol] * len(got)
    assert len(got) == len(expected) == len(same_dtype), op
    for i, (g, e, s) in enumerate(zip(got, expected, same_dtype, strict=True)):
        name = names[i] if i < len(names) else f"output {i}"
        assert g.dtype == s.dtype and g.shape == s.shape, (op, name, g.dtype, s.dtype, g.shape, s.shape)
        if not g.is_floating_point():
            assert torch.equal(g, s), (op, name)
            continue
        rtol, atol = tolerance(g.dtype, tols[i])
        # A float64 value beyond the output dtype's range is that dtype's +-inf (a float32 std above 3.4e38).
        e = torch.where(torch.isfinite(e) & torch.isinf(e.to(g.dtype)), e.to(g.dtype).double(), e.double())
        torch.testing.assert_close(g.double(), e, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, op=op, name=name: f"{op} {name}: {m}")  # fmt: skip
    return got
