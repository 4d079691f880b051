"""The single-read logits pass in its small-block layout (GRPO_EXT_LOGITS_SINGLE_READ=small-blocks): a row split over a
thread-block cluster of up to 16 small blocks (csrc/cuda/grpo_loss_from_logits_single_read.cuh, small_block_layout and
grpo_loss_from_logits_small_block_kernel), on emulated devices whose SM shared memory is small enough that rows of a
few hundred entries take clusters of every size from 1 to 16; the launcher's choice and its fallbacks (a row too long
for 16 blocks, a device on which no such cluster fits). Outputs against the CPU kernel in float64 (checks.check_op),
under every schedule."""

from __future__ import annotations

import math

import pytest
import torch

from test_grpo_loss_from_logits import make_problem

from .checks import check_op
from .client import EmuDevice, kernels_launched, launch_dims
from .conftest import CSRC, SMALL_BLOCK_SHARED_PER_SM
from .test_logits import PASS_NAMES, PASS_TOL, pass_args

SMALL_BLOCKS = {"GRPO_EXT_LOGITS_SINGLE_READ": "small-blocks"}
PASS_KERNELS = {
    "small-blocks": "grpo_loss_from_logits_small_block_kernel",
    "lone block": "grpo_loss_from_logits_lone_block_kernel",  # a row that fits one block: no cluster, no exchange
    "two-read": "grpo_loss_from_logits_kernel",
}
SINGLE_READ_SHARED = {4: 944, 8: 1872}  # sizeof(SingleReadShared<T>) by accumulation bytes (float, double)
SHARED_PER_SM = SMALL_BLOCK_SHARED_PER_SM


def small_block_cluster(vocab: int, itemsize: int, shared_per_sm: int = SHARED_PER_SM,
                        shared_per_block: int = 232448, max_cluster: int = 16) -> int | None:  # fmt: skip
    """The cluster size small_block_layout picks for a row (None: the row takes the two-read pass), counted again
    here from the rule its comment states: the most blocks per SM (4, 3, 2) whose parts keep the cluster within 16."""
    width, static = 16 // itemsize, SINGLE_READ_SHARED[8 if itemsize == 8 else 4]
    for per_sm in (4, 3, 2):
        free = min(shared_per_sm // per_sm - 1024, shared_per_block) - static
        per_block = (free // itemsize - width) // width * width
        if per_block >= width and math.ceil(vocab / per_block) <= max_cluster:
            return math.ceil(vocab / per_block)
    return None


# (dtype, V, cluster size): 16 blocks, every odd size between, one block, and clusters taken at 3 and 2 blocks per SM.
CLUSTER_CASES = [
    (torch.float32, 1000, 16),
    (torch.float32, 33, 1),
    (torch.float32, 150, 3),
    (torch.float32, 300, 5),
    (torch.float32, 400, 7),
    (torch.float32, 520, 9),
    (torch.float32, 700, 11),
    (torch.float32, 800, 13),
    (torch.float32, 900, 15),
    (torch.bfloat16, 2001, 16),
    (torch.bfloat16, 1300, 11),
    (torch.float16, 1601, 13),
    (torch.float64, 1100, 6),  # 2 blocks per SM: float64's SingleReadShared (1872 bytes) leaves 3 or 4 no room
    (torch.float32, 1400, 6),  # over 16 at 4 blocks per SM: 3 blocks per SM, bigger parts
]


def test_the_cases_take_the_cluster_sizes_they_name():
    for dtype, vocab, blocks in CLUSTER_CASES:
        assert small_block_cluster(vocab, dtype.itemsize) == blocks, (dtype, vocab)


@pytest.mark.parametrize(("dtype", "vocab", "blocks"), CLUSTER_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "misaligned in place", "strided rows", "far from 0"])
def test_small_block_pass_in_clusters_of_up_to_16(emu_small_blocks, dtype, vocab, blocks, layout):
    """Masked rows, a confident token, rows one element past a 16-byte boundary written in place, rows of a
    ``logits[:, :-1]`` view, and rows whose logits all lie 1e4 from 0 (+ and -): the CPU kernel's outputs, with
    temperature and the soft cap."""
    logits, ids, adv, mask, old, ref = make_problem(2, 3, vocab, seed=vocab + blocks, per_token_adv=True)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    options = dict(old_logps=old.to(acc), ref_logps=ref.to(acc), beta=0.1, loss_type="dapo")
    x = logits.to(dtype).reshape(6, vocab)
    op, names, logit, temperature = "grpo_loss_from_logits_pass", PASS_NAMES, (1.5, 20.0), 0.7
    if layout == "misaligned in place":
        wide = torch.zeros(6, vocab + 1, dtype=dtype)
        wide[:, 1:] = x
        x, op, names = wide[:, 1:], "grpo_loss_from_logits_pass_", ("logps", "entropy", "logits")
    elif layout == "strided rows":
        wide = torch.full((6, vocab + 1), float("nan"), dtype=dtype)
        wide[:, :-1] = x
        x = wide[:, :-1]
    elif layout == "far from 0":  # no cap (it would bring them back); the rows' softmax is shift-invariant
        shift = torch.tensor([1e4, -1e4, 1e4, -1e4, 1e4, -1e4], dtype=torch.float64)[:, None]
        x = (logits.reshape(6, vocab) + shift).to(dtype)
        # No cap, no temperature: z = x exactly, and z - max exact in float32 (a float32 z near 1e4 carries 1e-3 of
        # rounding, which a temperature would put into every log-prob).
        logit, temperature = (1.0, 0.0), 1.0
    args = pass_args(x, ids.reshape(-1), adv.to(acc), mask, temperature=temperature, logit=logit, **options)
    device = emu_small_blocks
    launched = kernels_launched(device, lambda: check_op(device, op, *args, tol=PASS_TOL, names=names))
    assert launched & set(PASS_KERNELS.values()) == {PASS_KERNELS["lone block" if blocks == 1 else "small-blocks"]}


def test_small_block_pass_grid_stride_and_sequence_gradients(emu_small_blocks):
    """More rows than the schedules' grid cap (every cluster of 16 loops over rows, alternating its shared states),
    with the per-token gradients of a sequence-level loss."""
    logits, ids, adv, mask, old, _ = make_problem(4, 6, 1000, seed=22)
    token_grad = torch.randn(24, generator=torch.Generator().manual_seed(22))
    args = pass_args(logits.float().reshape(24, 1000), ids.reshape(-1), adv.float(), mask, token_grad=token_grad,
                     old_logps=old.float(), loss_type="grpo", importance_sampling_level="sequence")  # fmt: skip
    device = emu_small_blocks
    launched = kernels_launched(device, lambda: check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL,
                                                         names=PASS_NAMES))  # fmt: skip
    assert PASS_KERNELS["small-blocks"] in launched


def small_block_launch(env: dict[str, str], batch: int, group: int, vocab: int, seed: int,
                       **device_options) -> tuple[int, int]:  # fmt: skip
    """Runs the float32 pass (dapo, old log-probs, the entropy bonus) on a fresh device with ``env`` set, checks its
    outputs against the CPU kernel, and returns the small-block kernel's (blocks, threads per block)."""
    device = EmuDevice(CSRC, env=env, **device_options)
    try:
        logits, ids, adv, mask, old, _ = make_problem(batch, group, vocab, seed=seed, per_token_adv=True)
        args = pass_args(logits.float().reshape(batch * group, vocab), ids.reshape(-1), adv.float(), mask,
                         old_logps=old.float(), loss_type="dapo", entropy_coef=0.1)  # fmt: skip
        before = device.launches.copy()
        check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
        return launch_dims(device.launches - before)[PASS_KERNELS["small-blocks"]]
    finally:
        assert not device.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_small_block_pass_persistent_clusters(persistent):
    """GRPO_EXT_LOGITS_PERSISTENT=1: no more clusters than the occupancy query says run at once, each walking rows.
    V=520 float32 takes clusters of 9; on a device whose GPCs hold 2 SMs, one cluster a GPC, 8 at once, so 24 rows
    take 8 clusters (72 blocks) instead of 24 (216); the same outputs as the CPU kernel either way."""
    env = dict(SMALL_BLOCKS, GRPO_EXT_LOGITS_PERSISTENT="1" if persistent else "0")
    blocks, _ = small_block_launch(env, 4, 6, 520, seed=44, shared_per_sm=SHARED_PER_SM, gpc_sms=2)
    assert blocks == (72 if persistent else 24 * 9)


@pytest.mark.parametrize(("threads_env", "threads"), [(None, 256), ("128", 128)])
def test_small_block_threads(threads_env, threads):
    """Blocks of kSmallBlockThreads (256) threads, or 128 with GRPO_EXT_LOGITS_THREADS=128 (a layout candidate:
    twice the elements a thread); the same outputs as the CPU kernel. V=20000 float32 on a device with 64 KiB of
    shared memory an SM: clusters of 6 blocks of about 3.4K elements, which ask for 425 threads (row_threads)."""
    env = dict(SMALL_BLOCKS, **({"GRPO_EXT_LOGITS_THREADS": threads_env} if threads_env else {}))
    assert small_block_launch(env, 2, 2, 20000, seed=45, shared_per_sm=64 * 1024) == (4 * 6, threads)


@pytest.mark.parametrize(("dtype", "vocab"), [(torch.float32, 1000), (torch.bfloat16, 1300), (torch.float32, 520)])
def test_small_block_pass_entropy_bonus(emu_small_blocks, dtype, vocab):
    """The bonus's term in every block of a cluster (each writes its part with the row's E_p[z]), with the soft cap
    and temperature, against the pass without the bonus's CPU kernel."""
    logits, ids, adv, mask, old, _ = make_problem(2, 3, vocab, seed=vocab + 2, per_token_adv=True)
    args = pass_args(logits.to(dtype).reshape(6, vocab), ids.reshape(-1), adv.float(), mask, temperature=0.7,
                     logit=(1.5, 20.0), entropy_coef=0.8, old_logps=old.float(), loss_type="dapo")  # fmt: skip
    device = emu_small_blocks
    launched = kernels_launched(device, lambda: check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL,
                                                         names=PASS_NAMES))  # fmt: skip
    assert PASS_KERNELS["small-blocks"] in launched


@pytest.mark.parametrize(("vocab", "blocks"), [(1000, 16), (800, 13)])
def test_every_block_of_a_cluster_uses_the_same_row_statistics(emu_small_blocks, vocab, blocks):
    """The same logit in each block's part gets bit-identical gradients: every block merged the cluster's states in
    the same fixed order (a merge whose order depends on the block's rank gives their sums different last bits; at
    16 blocks a rotation of the shuffle tree's leaves pairs the same states, so an odd cluster size is the sharper
    check)."""
    rows = 6
    slice_ = math.ceil(vocab / blocks / 4) * 4  # small_block_layout's part (float32)
    logits, ids, adv, mask, old, _ = make_problem(2, 3, vocab, seed=5, per_token_adv=True)
    x = 3 * logits.reshape(rows, vocab)
    # Position 1 of every part at its row's E_p[z] (pass_args' temperature 0.9), and only the entropy bonus's
    # gradient (zero advantages): there the gradient is p * (z - E_p[z]) up to factors, so a last-bit change of the
    # merged sums moves E_p[z] and shows. The saved statistics ([max, log(sum), E_p[z] - max]) round such a change away
    # from the log-prob's gradient, which the check used before (2026-11-29: a rank-rotated merge then passed it).
    for _ in range(4):
        z = x / 0.9
        x[:, 1 : vocab : slice_] = 0.9 * (torch.softmax(z, -1) * z).sum(-1, keepdim=True)
    x = x.float()
    ids = ids.reshape(-1) % slice_
    ids[ids == 1] = 0
    args = pass_args(x, ids, torch.zeros_like(adv).float(), mask, old_logps=old.float(), loss_type="dapo",
                     entropy_coef=0.5)  # fmt: skip
    _, _, grad = check_op(emu_small_blocks, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    kept = mask.reshape(-1)
    same = grad[kept][:, 1 : vocab : slice_]
    assert same.shape[1] == blocks
    assert torch.equal(same, same[:, :1].expand_as(same)), same


@pytest.mark.parametrize(
    ("env", "limits", "vocab", "path"),
    [
        (SMALL_BLOCKS, {}, 1000, "small-blocks"),
        ({}, {}, 1000, "small-blocks"),  # the emulated devices' default: GRPO_EXT_LOGITS_SINGLE_READ=1
        ({"GRPO_EXT_LOGITS_SINGLE_READ": "0"}, {}, 1000, "two-read"),
        (SMALL_BLOCKS, {}, 10001, "two-read"),  # over 16 blocks even at 2 blocks per SM
        (SMALL_BLOCKS, {"gpc_sms": 2}, 1000, "two-read"),  # 16 blocks: no GPC of 2 SMs holds the cluster
        (SMALL_BLOCKS, {"gpc_sms": 2}, 520, "small-blocks"),  # 9 blocks fit 2 SMs
        (SMALL_BLOCKS, {"max_cluster": 4}, 1000, "two-read"),  # the device refuses the cluster (no fallback to 4)
        (SMALL_BLOCKS, {"max_cluster": 4}, 150, "small-blocks"),  # 3 blocks
        (SMALL_BLOCKS, {"max_nonportable_cluster": 8}, 1000, "two-read"),  # a device that takes 8 at most
        (SMALL_BLOCKS, {"max_cluster": 0}, 300, "two-read"),  # no cluster launch
        (SMALL_BLOCKS, {}, 33, "lone block"),  # one block: the lone block's kernel
        (SMALL_BLOCKS, {"max_cluster": 0}, 33, "two-read"),  # a device without clusters: no single-read pass at all
    ],
)
def test_the_launcher_picks_the_layout_for_the_env_and_device(env, limits, vocab, path):
    """GRPO_EXT_LOGITS_SINGLE_READ picks the layout; the small-block one falls back to the two-read kernel where the
    row needs more than 16 blocks, where the occupancy query finds no GPC that holds the
    cluster (GRPO_MAX_ACTIVE_CLUSTERS: 0 clusters), or where the device refuses the cluster; any refusal's error is
    cleared (an op that leaves one pending fails). The outputs match the CPU kernel's on every path."""
    device = EmuDevice(CSRC, shared_per_sm=SHARED_PER_SM, env=env, **limits)
    try:
        logits, ids, adv, mask, old, _ = make_problem(2, 3, vocab, seed=40, per_token_adv=True)
        args = pass_args(logits.float().reshape(6, vocab), ids.reshape(-1), adv.float(), mask, old_logps=old.float(),
                         loss_type="dapo", entropy_coef=0.1)  # fmt: skip
        launched = kernels_launched(device, lambda: check_op(device, "grpo_loss_from_logits_pass", *args,
                                                             tol=PASS_TOL, names=PASS_NAMES))  # fmt: skip
        assert launched & set(PASS_KERNELS.values()) == {PASS_KERNELS[path]}
    finally:
        assert not device.close()
