"""The fused logits pass's layouts on the emulated device: the single-read kernel over thread-block clusters (small
shared memory per block, so that small rows take every path), the layout candidates chosen at run time
(GRPO_EXT_LOGITS_*), the two-read kernel's block size, and the entropy bonus in the single-read kernel. The launcher's
fallbacks and clusters of every size: test_logits_small_blocks.py; the rest of the logits kernels: test_logits.py."""

from __future__ import annotations

import pytest
import torch

from test_grpo_loss_from_logits import make_problem

from .checks import check_op
from .client import kernels_launched, launch_dims
from .test_logits import PASS_NAMES, PASS_TOL, pass_args

# The single-read pass on a device with 2552 bytes of shared memory per block (emu_small_shared), so that small rows
# take every path: which kernel the launcher picks for each (dtype, V), from small_block_layout
# (csrc/cuda/grpo_loss_from_logits_single_read.cuh): a block stages (2552 - sizeof(SingleReadShared)) / element size
# - one vector of elements (396 float32, 792 bf16/fp16, 82 float64), a cluster holds up to 16 blocks (over 8: the
# non-portable size); a larger row takes the two-read kernel.
CLUSTER_CASES = [
    (torch.float32, 33, "single-read lone block"),  # one block: its own kernel, exchanging nothing
    (torch.float32, 1000, "single-read"),  # a cluster of 3
    (torch.float32, 3001, "single-read"),  # of 8
    (torch.float32, 4099, "single-read"),  # of 11: over the portable size
    (torch.float32, 7001, "two-read"),  # 18 blocks: too many
    (torch.bfloat16, 1000, "single-read"),  # 2
    (torch.bfloat16, 4099, "single-read"),  # 6
    (torch.float16, 7001, "single-read"),  # 9
    (torch.float64, 1000, "single-read"),  # 13
    (torch.float64, 2501, "two-read"),  # 31
]
PASS_KERNELS = {"single-read": "grpo_loss_from_logits_small_block_kernel",
                "single-read lone block": "grpo_loss_from_logits_lone_block_kernel",
                "two-read": "grpo_loss_from_logits_kernel",
                "two-read full occupancy": "grpo_loss_from_logits_full_occupancy_kernel"}


@pytest.mark.parametrize(("dtype", "vocab", "path"), CLUSTER_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "misaligned in place", "strided rows"])
def test_logits_pass_single_read_in_clusters(emu_small_shared, dtype, vocab, path, layout):
    """Masked rows (never read), a confident token, rows that start off a 16-byte boundary written in place, and
    rows of a ``logits[:, :-1]`` view (row stride V + 1) whose gradient goes to a new contiguous tensor (row stride
    V); the outputs match the CPU kernel's whichever path the row size selects, under every schedule."""
    logits, ids, adv, mask, old, ref = make_problem(2, 3, vocab, seed=vocab, per_token_adv=True)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    options = dict(old_logps=old.to(acc), ref_logps=ref.to(acc), beta=0.1, loss_type="dapo")
    x = logits.to(dtype).reshape(6, vocab)
    op, names = "grpo_loss_from_logits_pass", PASS_NAMES
    if layout == "misaligned in place":  # rows one element past a 16-byte boundary (row stride V + 1)
        wide = torch.zeros(6, vocab + 1, dtype=dtype)
        wide[:, 1:] = x
        x, op, names = wide[:, 1:], "grpo_loss_from_logits_pass_", ("logps", "entropy", "logits")
    elif layout == "strided rows":  # the gradient's rows (V apart) are not the logits' (V + 1 apart)
        wide = torch.full((6, vocab + 1), float("nan"), dtype=dtype)
        wide[:, :-1] = x
        x = wide[:, :-1]
    args = pass_args(x, ids.reshape(-1), adv.to(acc), mask, temperature=0.7, logit=(1.5, 20.0), **options)
    launched = kernels_launched(emu_small_shared, lambda: check_op(emu_small_shared, op, *args, tol=PASS_TOL,
                                                                   names=names))  # fmt: skip
    assert PASS_KERNELS[path] in launched
    assert not launched & (set(PASS_KERNELS.values()) - {PASS_KERNELS[path]})


def test_logits_pass_single_read_grid_stride_and_sequence_gradients(emu_small_shared):
    """More rows than the schedules' grid cap (every cluster loops over rows, alternating its shared states), with the
    per-token gradients of a sequence-level loss."""
    logits, ids, adv, mask, old, _ = make_problem(4, 6, 1000, seed=21)
    g = torch.Generator().manual_seed(21)
    token_grad = torch.randn(24, generator=g)
    args = pass_args(logits.float().reshape(24, 1000), ids.reshape(-1), adv.float(), mask, token_grad=token_grad,
                     old_logps=old.float(), loss_type="grpo", importance_sampling_level="sequence")  # fmt: skip
    launched = kernels_launched(emu_small_shared, lambda: check_op(emu_small_shared, "grpo_loss_from_logits_pass",
                                                                   *args, tol=PASS_TOL, names=PASS_NAMES))  # fmt: skip
    assert PASS_KERNELS["single-read"] in launched


@pytest.mark.parametrize(
    ("layout", "path"),
    [
        ({"GRPO_EXT_LOGITS_SINGLE_READ": "small-blocks"}, "single-read"),  # the earlier name: clusters of 2 blocks
        ({"GRPO_EXT_LOGITS_PERSISTENT": "1"}, "single-read"),  # as many clusters as run at once, over several rows
        ({"GRPO_EXT_LOGITS_THREADS": "128"}, "single-read"),  # blocks of 128 threads
        ({"GRPO_EXT_LOGITS_THREADS": "256", "GRPO_EXT_LOGITS_SINGLE_READ": "0"}, "two-read"),
    ],
)
def test_logits_pass_layout_candidates(emu_with_env, layout, path):
    """Issues 32 and 38's layouts, chosen at run time by the binding's environment variables (with_layout_from_env
    in csrc/cuda/grpo_loss_from_logits_row.cuh): the same outputs as the CPU kernel under every schedule, on a device
    with 4 KiB of shared memory per block (V=1000 float32: a cluster of 2 blocks)."""
    device = emu_with_env(layout, shared_per_block=4096, max_cluster=8)
    logits, ids, adv, mask, old, ref = make_problem(2, 3, 1000, seed=31, per_token_adv=True)
    args = pass_args(logits.float().reshape(6, 1000), ids.reshape(-1), adv.float(), mask, temperature=0.7,
                     old_logps=old.float(), ref_logps=ref.float(), beta=0.1, loss_type="dapo",
                     entropy_coef=0.2)  # fmt: skip
    launched = kernels_launched(device, lambda: check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL,
                                                         names=PASS_NAMES))  # fmt: skip
    assert PASS_KERNELS[path] in launched


BLOCK_SIZE_CASES = [({}, torch.float32, 512), ({}, torch.bfloat16, 256),
                    ({"GRPO_EXT_LOGITS_THREADS": "1024"}, torch.float32, 1024),
                    ({"GRPO_EXT_LOGITS_THREADS": "512"}, torch.bfloat16, 512),
                    ({"GRPO_EXT_LOGITS_THREADS": "256"}, torch.float32, 256)]  # fmt: skip


@pytest.mark.parametrize(("layout", "dtype", "threads"), BLOCK_SIZE_CASES)
def test_two_read_kernel_block_size(emu_with_env, layout, dtype, threads):
    """The two-read kernel's blocks by default: 256 threads for bf16 logits, 512 for float32 (two_read_threads: the
    faster of each on an H200, RESULTS.md, 2026-11-27); GRPO_EXT_LOGITS_THREADS=256|512|1024 to compare; the same
    outputs as the CPU kernel under every schedule. V=9000 asks for the most threads (row_threads: 1125 wanted for
    float32, 563 for bf16)."""
    device = emu_with_env({"GRPO_EXT_LOGITS_SINGLE_READ": "0", **layout})
    logits, ids, adv, mask, old, _ = make_problem(2, 2, 9000, seed=41, per_token_adv=True)
    args = pass_args(logits.to(dtype).reshape(4, 9000), ids.reshape(-1), adv.float(), mask, old_logps=old.float(),
                     loss_type="dapo")  # fmt: skip
    check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    launched = {name: dims[1] for name, dims in launch_dims(device.launches).items()}
    assert launched[PASS_KERNELS["two-read"]] == threads, launched


FULL_OCCUPANCY = {"GRPO_EXT_LOGITS_FULL_OCCUPANCY": "1"}
FULL_OCCUPANCY_CASES = [(FULL_OCCUPANCY, torch.bfloat16, "two-read full occupancy", 256),
                        (FULL_OCCUPANCY, torch.float16, "two-read full occupancy", 256),
                        (dict(FULL_OCCUPANCY, GRPO_EXT_LOGITS_THREADS="128"), torch.bfloat16, "two-read full occupancy",
                         128),
                        (dict(FULL_OCCUPANCY, GRPO_EXT_LOGITS_THREADS="512"), torch.bfloat16, "two-read", 512),
                        (FULL_OCCUPANCY, torch.float32, "two-read", 512)]  # fmt: skip


@pytest.mark.parametrize(("layout", "dtype", "path", "threads"), FULL_OCCUPANCY_CASES)
def test_two_read_full_occupancy_build(emu_with_env, layout, dtype, path, threads):
    """GRPO_EXT_LOGITS_FULL_OCCUPANCY=1: bf16/fp16 rows of the two-read pass in its 32-register build (8 blocks of at
    most 256 threads an SM), the same outputs as the CPU kernel under every schedule, with a temperature, without and
    with the soft cap, and the entropy bonus; blocks of more than 256 threads (GRPO_EXT_LOGITS_THREADS=512) and
    float32 logits (which would spill at 32 registers) keep the 1024-thread build."""
    device = emu_with_env({"GRPO_EXT_LOGITS_SINGLE_READ": "0", **layout})
    logits, ids, adv, mask, old, _ = make_problem(2, 2, 9000, seed=43, per_token_adv=True)
    for logit in [(1.0, 0.0), (1.5, 20.0)]:  # uncapped, then capped
        args = pass_args(logits.to(dtype).reshape(4, 9000), ids.reshape(-1), adv.float(), mask, temperature=0.7,
                         logit=logit, entropy_coef=0.3, old_logps=old.float(), loss_type="dapo")  # fmt: skip
        check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    launched = {name: dims[1] for name, dims in launch_dims(device.launches).items()}
    assert launched.get(PASS_KERNELS[path]) == threads, launched
    assert not set(launched) & (set(PASS_KERNELS.values()) - {PASS_KERNELS[path]}), launched


@pytest.mark.parametrize(("dtype", "vocab", "path"), [CLUSTER_CASES[1], CLUSTER_CASES[4], CLUSTER_CASES[6]])
def test_logits_pass_entropy_bonus_single_read(emu_small_shared, dtype, vocab, path):
    """The bonus in the single-read kernel (a cluster's blocks each write their part with the row's E_p[z]) and in
    the two-read kernel, with the soft-cap."""
    logits, ids, adv, mask, old, _ = make_problem(2, 3, vocab, seed=vocab + 1, per_token_adv=True)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    args = pass_args(logits.to(dtype).reshape(6, vocab), ids.reshape(-1), adv.to(acc), mask, temperature=0.7,
                     logit=(1.5, 20.0), entropy_coef=0.8, old_logps=old.to(acc), loss_type="dapo")  # fmt: skip
    launched = kernels_launched(emu_small_shared, lambda: check_op(emu_small_shared, "grpo_loss_from_logits_pass",
                                                                   *args, tol=PASS_TOL, names=PASS_NAMES))  # fmt: skip
    assert PASS_KERNELS[path] in launched
