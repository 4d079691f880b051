"""How the grpo_ext microbenchmarks time a call, measure the copy bandwidth and the peak memory.

Timing method:
    * CUDA: each repetition first overwrites a buffer several times the L2 size (so inputs come from HBM, as in a
      training step where they were written long before), synchronizes, then records a ``torch.cuda.Event`` pair
      around one call. The GPU is idle when the start event fires, so the time includes the host-side cost of the
      call (Python, dispatcher, kernel launches) that the GPU waits on: the latency of one isolated call. CUDA-graph
      replay removes most of that host cost, which is why it is reported as its own row. The median over many
      repetitions is reported.
    * CPU: ``time.perf_counter`` around a loop of calls sized to last about 1 ms, repeated to fill a time budget;
      the median per-call time is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

COPY_BYTES = 1 << 30  # 1 GiB source for the device-to-device copy that sets the bandwidth yardstick


class L2Flusher:
    """Overwrites a buffer larger than the L2 cache, so the next kernel reads its inputs from HBM."""

    def __init__(self, device: torch.device) -> None:
        """Allocates the buffer: four times the L2 size, at least 64 MiB.

        Args:
            device: a CUDA device.
        """
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
        self.buffer = torch.empty(max(4 * l2, 64 << 20), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        """Evicts the L2 cache (asynchronously, on the current stream)."""
        self.buffer.zero_()


def time_cuda(
    fn: Callable[[], Any],
    *,
    target_s: float,
    min_reps: int = 50,
    max_reps: int = 2000,
    warmup: int = 5,
    flusher: L2Flusher | None = None,
) -> dict[str, Any]:
    """Median latency of one isolated call on CUDA, timed with CUDA events (see the module docstring).

    Args:
        fn: the call to time (its result is discarded).
        target_s: approximate total of timed seconds.
        min_reps: at least this many repetitions.
        max_reps: at most this many repetitions.
        warmup: untimed calls first (allocator, autotuning, lazy initialization).
        flusher: evicts L2 before each repetition; None keeps the cache warm.

    Returns:
        ``{"median_ms", "min_ms", "reps"}``.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    probe = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = max((time.perf_counter() - probe) / 3, 1e-6)
    reps = int(min(max(target_s / per_call, min_reps), max_reps))

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if flusher is not None:
            flusher()
        torch.cuda.synchronize()  # the call starts on an idle GPU: its host cost is part of its latency
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def time_cpu(fn: Callable[[], Any], *, target_s: float, warmup: int = 3, min_samples: int = 5) -> dict[str, Any]:
    """Median per-call time on CPU with ``time.perf_counter``.

    Each sample times a loop of calls lasting about 1 ms (so the timer's own cost does not count); samples are taken
    until ``target_s`` is spent.

    Args:
        fn: the call to time.
        target_s: approximate total of timed seconds.
        warmup: untimed calls first.
        min_samples: at least this many samples.

    Returns:
        ``{"median_ms", "min_ms", "reps"}`` with ``reps`` the total number of timed calls.
    """
    for _ in range(warmup):
        fn()
    probe = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - probe, 1e-7)
    inner = max(1, int(1e-3 / per_call))
    samples = int(max(min_samples, target_s / (inner * per_call)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": samples * inner}


def time_call(
    fn: Callable[[], Any], device: torch.device, *, target_s: float, flusher: L2Flusher | None = None
) -> dict[str, Any]:
    """Dispatches to :func:`time_cuda` or :func:`time_cpu` by device."""
    if device.type == "cuda":
        return time_cuda(fn, target_s=target_s, flusher=flusher)
    return time_cpu(fn, target_s=target_s)


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 20) -> dict[str, float]:
    """Device-to-device copy bandwidth, the yardstick of the ``%copy`` column.

    Args:
        device: a CUDA device.
        nbytes: size of the source (and of the destination).
        reps: timed copies (after two untimed ones); the median is used.

    Returns:
        ``{"bytes", "median_ms", "gbps"}`` with ``gbps`` counting bytes read plus bytes written, in 1e9 B/s.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median_ms = statistics.median(times)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": moved, "median_ms": median_ms, "gbps": moved / (median_ms * 1e-3) / 1e9}


def peak_memory_above(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one call, above what was allocated before it (CUDA only).

    Args:
        fn: the call; its outputs are kept alive until the peak is read, so they count.
        device: the device.

    Returns:
        The bytes, or None on CPU.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def lm_head_gemms(rows: int, size: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """The three products of an LM head over ``rows`` tokens into preallocated outputs, the floor a head's forward +
    backward cannot beat: logits ``[N, H] x [H, V]``, the input's gradient ``[N, V] x [V, H]`` and the weight's
    ``[V, N] x [N, H]`` (random operands; a fresh output would add its page faults on the CPU)."""
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, size, device=device, dtype=dtype, generator=generator)
    weight = torch.randn(vocab, size, device=device, dtype=dtype, generator=generator)
    grad_logits = torch.randn(rows, vocab, device=device, dtype=dtype, generator=generator)
    logits = torch.empty(rows, vocab, device=device, dtype=dtype)
    grad_hidden = torch.empty(rows, size, device=device, dtype=dtype)
    grad_weight = torch.empty(vocab, size, device=device, dtype=dtype)

    def products() -> None:
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(grad_logits, weight, out=grad_hidden)
        torch.mm(grad_logits.t(), hidden, out=grad_weight)

    return products
