"""The global-memory traffic of every op's kernels, counted on the emulated device (traffic.cpp: every load and store
of the compiled kernels, by buffer), pinned at its floor: each input read once and each output written once, the
extras named. "read" counts every thread's loads (a per-row scalar that all threads of a block load counts once per
thread, where a GPU serves it by one broadcast); "distinct" counts each byte once per launch.

Shapes cover the vector paths' edges: rows that start off a 16-byte boundary, V not a multiple of the vector width,
every float dtype. One schedule (the launcher's grid in forward order); the traffic build has no sanitizer, so this
module is cheap (its build shares the ASan build's sources, about a minute of compile on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_loss_batch
from test_process_advantages import random_steps
from test_selective_log_softmax import make_logits

from .client import SCHEDULES, Access, EmuDevice
from .conftest import CSRC, SMALL_SHARED_PER_BLOCK
from .test_advantages import group_args
from .test_logits import pass_args
from .test_logits_small_blocks import SHARED_PER_SM as SMALL_BLOCK_SHARED_PER_SM
from .test_logits_small_blocks import small_block_cluster
from .test_loss import forward_args

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ACC = {torch.float64: 8}  # the accumulation dtype's bytes: float64 for float64 inputs, else float32


@pytest.fixture(scope="module")
def counted():
    device = EmuDevice(CSRC, schedules=SCHEDULES[:1], variant="traffic")
    yield device
    assert not device.close()


# The logits pass on three emulated devices: an H100 (a row of V = 1003 fits one block's shared memory), 2552 bytes of
# shared memory per block (the row split over a cluster of `blocks[dtype]` blocks,
# test_logits_layouts.CLUSTER_CASES), and no cluster launch (the two-read kernel); and the small-block layout with
# clusters of up to 16 blocks.
PASS_DEVICES = {
    "one block": ({}, {torch.float32: 1, torch.bfloat16: 1, torch.float16: 1, torch.float64: 1}),
    "cluster": ({"shared_per_block": SMALL_SHARED_PER_BLOCK},
                {torch.float32: 3, torch.bfloat16: 2, torch.float16: 2, torch.float64: 13}),
    "two-read": ({"max_cluster": 0}, None),
    # the small-block layout (test_logits_small_blocks.py's device): clusters of up to 16 small blocks
    "small blocks": (
        {"shared_per_sm": SMALL_BLOCK_SHARED_PER_SM, "env": {"GRPO_EXT_LOGITS_SINGLE_READ": "small-blocks"}},
        {torch.float32: 16, torch.bfloat16: 8, torch.float16: 8, torch.float64: 6},
    ),
}


def test_the_small_block_device_takes_the_clusters_named():
    blocks = PASS_DEVICES["small blocks"][1]
    assert {dtype: small_block_cluster(1003, dtype.itemsize) for dtype in blocks} == blocks


@pytest.fixture(scope="module", params=list(PASS_DEVICES))
def counted_pass(request):
    limits, blocks = PASS_DEVICES[request.param]
    device = EmuDevice(CSRC, schedules=SCHEDULES[:1], variant="traffic", **limits)
    yield device, blocks
    assert not device.close()


def op_traffic(device: EmuDevice, op: str, *args) -> tuple[object, dict[str, Access]]:
    """``op``'s outputs and its traffic by buffer, summed over its launches."""
    out = device.call(op, *args)
    total: dict[str, Access] = {}
    for launch in device.last_traffic:
        for name, a in launch.buffers.items():
            t = total.get(name, Access(0, 0, 0))
            total[name] = Access(t.read + a.read, t.distinct + a.distinct, t.written + a.written)
    return out, total


def logits_cases(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    """Contiguous logits, and a view whose rows start one element past a 16-byte boundary (V + 1 row stride)."""
    logits, ids = make_logits(rows, vocab, seed=seed)
    wide = torch.zeros(rows, vocab + 1, dtype=dtype)
    wide[:, 1:] = logits
    return [("contiguous", logits.to(dtype)), ("misaligned", wide[:, 1:])], ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [5, 1003])
def test_selective_log_softmax_reads_each_logit_once(counted, dtype, vocab):
    rows = 3
    cases, ids = logits_cases(rows, vocab, dtype, seed=vocab)
    es, acc = dtype.itemsize, ACC.get(dtype, 4)
    for name, logits in cases:
        logit = (0.9, 1.0, 0.0)  # temperature, logit_scale, logit_softcap (0: none)
        (logps, _, row_stats), t = op_traffic(counted, "selective_log_softmax_forward", logits, ids, *logit, True)
        # One read of every logit, plus the chosen one re-read by thread 0 for its log-prob.
        assert t["arg0"].distinct == rows * vocab * es, name
        assert t["arg0"].read == rows * vocab * es + rows * es, name
        assert t["arg1"] == Access(rows * 8, rows * 8, 0), name  # the ids, int64
        # logps, entropy, and row_stats (max, log(sum), E_p[z] - max)
        assert [t[k].written for k in ("new0", "new1", "new2")] == [rows * acc, rows * acc, 3 * rows * acc], name
        grad_logps = torch.ones(rows, dtype=logps.dtype)
        _, t = op_traffic(counted, "selective_log_softmax_backward", grad_logps, None, logits, ids, row_stats, *logit)
        assert t["arg2"] == Access(rows * vocab * es, rows * vocab * es, 0), name  # each logit read once
        assert t["new0"] == Access(0, 0, rows * vocab * es), name  # each gradient element written once
        # The per-row scalars (grad_logps, ids, row_stats) are loaded by every thread of the row's block: distinct
        # bytes at the floor, the rest broadcasts.
        assert (t["arg0"].distinct, t["arg3"].distinct, t["arg4"].distinct) == (rows * acc, rows * 8, 3 * rows * acc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_logits_pass_reads_unmasked_rows_once_or_twice_and_writes_each_row(counted_pass, dtype, in_place):
    counted, blocks = counted_pass
    batch, seq_len, vocab = 2, 3, 1003
    cases, ids = logits_cases(batch * seq_len, vocab, dtype, seed=7)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    unmasked, rows, es = int(mask.sum()), batch * seq_len, dtype.itemsize
    adv = torch.tensor([0.5, -1.0], dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for name, logits in cases:
        op = "grpo_loss_from_logits_pass_" if in_place else "grpo_loss_from_logits_pass"
        _, t = op_traffic(counted, op, *pass_args(logits, ids, adv, mask, loss_type="dapo"))
        x = t["arg0"]
        assert x.distinct == unmasked * vocab * es, name  # no masked row is read
        if blocks is None:  # an unmasked row twice (statistics, then gradient), plus its chosen logit
            assert x.read == 2 * unmasked * vocab * es + unmasked * es, name
        else:  # once (staged in shared memory: the chosen logit too, from the part that holds it)
            assert x.read == unmasked * vocab * es, name
        grad = x if in_place else t["new2"]
        # every row once (masked rows get zeros, not read), and a kept row's chosen entry again after its loop
        assert grad.written == rows * vocab * es + unmasked * es, name


def test_loss_reads_each_input_once(counted):
    b = make_loss_batch(4, 300, dtype=torch.float32)
    args = forward_args(b, dict(old_logps=b.old_logps, ref_logps=b.ref_logps, beta=0.04, loss_type="dapo"),
                        nan_under_mask=False)  # fmt: skip
    (_, _, grad_raw, grad_scale), t = op_traffic(counted, "grpo_loss_forward", *args)
    tokens = b.mask.numel()
    # Rows of 300 float32 tokens start on a 16-byte boundary: each thread reads 4-token chunks (token_io.cuh), and
    # reads a chunk's values only when one of its tokens is kept. The named extra: the masked tokens of such a chunk
    # (a GPU moves the 32-byte sector of a kept token anyway). Fully masked chunks (a row's padding) are not read.
    read_chunks = int(b.mask.reshape(4, 75, 4).any(-1).sum())
    assert t["arg2"] == Access(tokens, tokens, 0)  # the bool mask: every token once
    for arg in ("arg0", "arg3", "arg4"):  # logps, old, ref: once, in the chunks with a kept token
        assert t[arg] == Access(16 * read_chunks, 16 * read_chunks, 0), arg
    scored_rows = int((b.mask.sum(1) > 0).sum())  # row 0 has no token: its advantage is never read
    assert t["arg1"].distinct == 4 * scored_rows  # [B] advantages, one per row (a broadcast per token)
    assert t["new2"].written == 4 * tokens  # grad_raw, once
    _, t = op_traffic(counted, "grpo_loss_backward", torch.tensor(1.7), grad_raw, grad_scale, torch.float32)
    assert t["arg1"] == Access(4 * tokens, 4 * tokens, 0)  # grad_raw read once
    assert t["new1"] == Access(0, 0, 4 * tokens)  # the gradient written once


def test_advantages_read_each_reward_once(counted):
    rewards = torch.rand(64 * 16, dtype=torch.float32)
    _, t = op_traffic(counted, "group_advantages", *group_args(rewards, 16, ("group", "mean", "sum_then_normalize")))
    assert t["arg0"] == Access(4 * 64 * 16, 4 * 64 * 16, 0)
    # Each lane keeps R of its group member in a register (a team of 16 lanes per group of 16): the advantages are
    # written once and never read back.
    assert t["new0"] == Access(0, 0, 4 * 64 * 16)
    # With the batch std, R goes through the advantages buffer to the second kernel: one more write and one read.
    _, t = op_traffic(counted, "group_advantages", *group_args(rewards, 16, ("batch", "mean", "sum_then_normalize")))
    assert t["arg0"] == Access(4 * 64 * 16, 4 * 64 * 16, 0)
    assert t["new0"] == Access(4 * 64 * 16, 4 * 64 * 16, 2 * 4 * 64 * 16)
    rewards, ends = random_steps(16 * 6, 4, 50, seed=4)
    _, t = op_traffic(counted, "process_advantages", rewards.float(), ends, 16, 50, 1e-4, 1)
    # Each reward read; the step ends read up to where a row's steps stop covering its tokens; each token's
    # advantage written once. The extra: every token looks its step up among the row's K ends (up to K reads of a
    # [B, K] row per token, L1 hits).
    assert t["arg0"].distinct == rewards.numel() * 4
    assert 8 * ends.shape[0] <= t["arg1"].distinct <= 8 * ends.numel()
    assert t["new0"] == Access(0, 0, 16 * 6 * 50 * 4)


def test_shared_memory_is_not_global_traffic(counted):
    """cluster_exchange_kernel (selftest_kernels.cuh) reads only shared memory, its own block's (static and dynamic)
    and its cluster peers': none of it counts, and its global writes count exactly."""
    n, clusters, threads, words = 4, 2, 64, 300
    blocks = n * clusters
    codes, *_ = counted.selftest_cluster(n, blocks, threads, words, clusters, "cluster", -1)
    assert codes.tolist() == [0, 0, 0]
    (launch,) = counted.last_traffic
    assert launch.buffers == {  # new0: the error codes, written by the host
        "new1": Access(0, 0, blocks * words * 2 * 4),
        "new2": Access(0, 0, blocks * 3 * 4),
        "new3": Access(0, 0, blocks * threads * 4),
    }


def test_traffic_report_measures_every_op():
    """benchmarks/traffic_report.py (the bytes section of `make kernel-report`) calls the ops with their current
    arguments, and every case moves at least its floor."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "traffic_report.py"
    spec = importlib.util.spec_from_file_location("traffic_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["traffic_report"] = module
    spec.loader.exec_module(module)
    cases = dict((name, (floor, moved)) for name, floor, moved in module.measure())
    assert len(cases) == 8
    for name, (floor, moved) in cases.items():
        assert 0 < floor <= moved, name
    # one read of each row (plus the per-row scalars every thread loads: one broadcast on a GPU), or two
    for shape in ("N=8192, V=151936, bfloat16", "N=2048, V=32000, float32"):
        single, two = (cases[f"`grpo_loss_from_logits` pass (forward + gradient), {path}, {shape}, every row unmasked"]
                       for path in ("single-read", "two-read"))  # fmt: skip
        assert single[0] == two[0] and single[1] < 1.02 * single[0] and two[1] > 1.49 * two[0], shape
