"""grpo_ext's raw ops (``torch.ops.grpo_ext.*``) run by the CUDA kernels on cuda_emu's emulated device.

``EmuDevice().grpo_loss_forward(*args)`` takes the arguments of ``torch.ops.grpo_ext.grpo_loss_forward`` (CPU
tensors), runs the op through its CUDA launchers in one driver process per schedule (build.py, driver.cpp), checks
that every schedule gave bit-identical outputs, and returns them as the torch op does: a tensor or a tuple; an
in-place op writes into its tensor argument (over the whole memory span it covers, so that a write between its rows
shows) and returns what the torch op returns.

Failures raise :class:`EmuError`: a launch the harness refused (a divergent barrier, a deadlock, a shuffle reading
outside its mask, a device assert, a launch over the launch bounds, ...), an op that left a refused launch's CUDA
error pending, a sanitizer report (the driver process dies; its report is in the message), outputs that differ
between schedules, or a bool output that was never written.
"""

from __future__ import annotations

import collections
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from .build import build

#: (name, thread order, grid cap): the launcher's grid in forward order; then grids of at most 2, 1 and 3 blocks per
#: dimension (so that every grid-stride loop wraps) in reverse order and the two greedy orders (runtime.h).
SCHEDULES: tuple[tuple[str, str, int], ...] = (
    ("forward", "forward", 0),
    ("reverse", "reverse", 2),
    ("greedy-high", "greedy-high", 1),
    ("greedy-low", "greedy-low", 3),
)

_DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int32: "int32", torch.int64: "int64",
}  # fmt: skip
_NAMES = {name: dtype for dtype, name in _DTYPES.items()}
# Sanitizer options: stop at the first report, with a stack; leaks are reported when the driver exits.
# Defaults the environment may override: the emulated devices take the single-read logits pass where a row fits (the
# GPU default is the two-read pass: with_layout_from_env, csrc/cuda/grpo_loss_from_logits_row.cuh), so that the
# suite runs both kernels: the two-read one on devices without clusters (max_cluster=0), rows too large, or
# GRPO_EXT_LOGITS_SINGLE_READ=0.
_ENV_DEFAULTS = {"GRPO_EXT_LOGITS_SINGLE_READ": "1"}
_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
# Ops that write into their first argument: how many of the driver's outputs the torch op returns.
_INPLACE_RETURNS = {"grpo_loss_from_logits_pass_": 2, "grpo_loss_from_logits_": 5, "scale_grad_": 0}


class EmuError(AssertionError):
    """The emulated device reported a kernel bug, a sanitizer error, or schedules that disagree."""


def _span(t: torch.Tensor) -> int:
    """Elements between the first and the last element ``t`` reaches, both included."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _encode(value) -> bytes:
    if value is None:
        return b"N\n"
    if isinstance(value, bool):
        return f"B {int(value)}\n".encode()
    if isinstance(value, int):
        return f"I {value}\n".encode()
    if isinstance(value, float):
        return f"F {value!r}\n".encode()
    if isinstance(value, str):
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"string arguments must be one word, got {value!r}")
        return f"S {value}\n".encode()
    if isinstance(value, torch.dtype):
        return f"D {_DTYPES[value]}\n".encode()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        flat = torch.as_strided(t, (_span(t),), (1,)).contiguous()
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        words = ["T", _DTYPES[t.dtype], t.dim(), *t.shape, *t.stride(), len(data)]
        return (" ".join(str(w) for w in words) + "\n").encode() + data
    raise TypeError(f"cannot pass {type(value).__name__} to the emulated device")


class _Driver:
    """One driver process (one schedule), started on first use and again after it died."""

    def __init__(self, exe: Path, name: str, order: str, grid_cap: int, device_flags: Sequence[str] = (),
                 env: dict[str, str] | None = None):  # fmt: skip
        self.exe, self.name, self.order, self.grid_cap = exe, name, order, grid_cap
        self.device_flags = list(device_flags)  # the emulated device's limits (driver.cpp)
        self.env = dict(env or {})  # over the test process's environment (the layout variables)
        self.process: subprocess.Popen | None = None
        self.stderr = None
        self.problems: list[str] = []  # reports at exit (leaks) and bad exits, for the session's end

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.stderr = tempfile.TemporaryFile()
        cmd = [str(self.exe), "--order", self.order, "--grid-cap", str(self.grid_cap), *self.device_flags]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env={**_ENV_DEFAULTS, **os.environ, **self.env, **_ENV})  # fmt: skip

    def send(self, request: bytes) -> None:
        self.start()
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died; receive() reports why

    def _stderr_text(self) -> str:
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace")
        lines = [line for line in text.splitlines() if "doesn't fully support makecontext/swapcontext" not in line]
        return "\n".join(lines)

    def _died(self) -> EmuError:
        rc = self.process.wait()
        report = self._stderr_text()
        self.process = None
        return EmuError(f"the driver ({self.name} schedule) died (exit code {rc}):\n{report[-8000:]}")

    def receive(self) -> tuple[list[torch.Tensor], str, str]:
        """The outputs of the request sent last, the kernels it launched ("name(types)#count;...") and their
        traffic (runtime.h: take_traffic_log)."""
        out = self.process.stdout
        header = out.readline().decode()
        if not header:
            raise self._died()
        if header.startswith("ERR "):
            raise EmuError(f"[{self.name} schedule] {header[4:].strip()}")
        _, count, launched = header.rstrip("\n").split(" ", 2)
        tensors = []
        for _ in range(int(count)):
            words = out.readline().decode().split()
            dtype, ndim = _NAMES[words[1]], int(words[2])
            sizes, strides = [int(x) for x in words[3 : 3 + ndim]], [int(x) for x in words[3 + ndim : 3 + 2 * ndim]]
            nbytes = int(words[3 + 2 * ndim])
            data = out.read(nbytes)
            if len(data) != nbytes:
                raise self._died()
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensors.append((raw, dtype, sizes, strides))
        traffic = out.readline().decode()
        if not traffic.startswith("TRAFFIC "):
            raise self._died()
        return [_decode(*t) for t in tensors], launched, traffic[len("TRAFFIC ") :].rstrip("\n")

    def close(self) -> None:
        if self.process is None:
            return
        self.process.stdin.close()
        rc = self.process.wait(timeout=120)
        report = self._stderr_text()
        if rc != 0 or "ERROR" in report or "runtime error" in report:
            self.problems.append(f"{self.name}: exit {rc}\n{report[-4000:]}")
        self.process = None


def _decode(raw: torch.Tensor, dtype: torch.dtype, sizes: list[int], strides: list[int]) -> torch.Tensor:
    if dtype == torch.bool:
        if raw.numel() and int(raw.max()) > 1:
            raise EmuError("a bool output holds a byte that is neither 0 nor 1: an element the kernel never wrote")
        flat = raw.view(torch.bool)
    else:
        flat = raw.view(dtype)
    return torch.as_strided(flat, sizes, strides) if flat.numel() else flat.reshape(sizes) if 0 in sizes else flat


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements (bit-exact comparison, NaN payloads included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class Access(NamedTuple):
    """One launch's traffic in one buffer (traffic.cpp): every thread's loads, the distinct bytes among them, stores."""

    read: int
    distinct: int
    written: int


class Launch(NamedTuple):
    """One kernel launch's global-memory traffic by buffer, the buffers named ``arg<i>`` (the op's argument ``i``)
    and ``new<k>`` (the ``k``-th tensor the op allocated: outputs, temporaries)."""

    kernel: str
    buffers: dict[str, Access]


def parse_traffic(text: str) -> list[Launch]:
    """The launches of a driver's traffic line ("kernel|label:read:distinct:written|...", tab-separated)."""
    launches = []
    for entry in filter(None, text.split("\t")):
        kernel, *buffers = entry.split("|")
        counts = {}
        for item in buffers:
            label, *numbers = item.split(":")
            counts[label] = Access(*(int(n) for n in numbers))
        launches.append(Launch(kernel, counts))
    return launches


def kernels_launched(device, run) -> set[str]:
    """The kernel names ``run()`` launched on ``device``."""
    before = device.launches.copy()
    run()
    return {signature.split("(", 1)[0] for signature in device.launches - before}


def launch_dims(launches) -> dict[str, tuple[int, int]]:
    """{kernel name: (blocks, threads per block)} of the launch log's entries (``name(types)<<<blocks,threads>>>``)."""
    dims = {}
    for signature in launches:
        blocks, threads = signature.rsplit("<<<", 1)[1].rstrip(">").split(",")
        dims[signature.split("(", 1)[0]] = (int(blocks), int(threads))
    return dims


class EmuDevice:
    """grpo_ext's raw ops on the emulated device, under every schedule of ``schedules``.

    Attribute access gives the op: ``EmuDevice().selective_log_softmax_forward(logits, ids, 1.0, True)``.

    Args:
        csrc: the kernel headers to run (default: the repository's ``csrc/``).
        schedules: (name, order, grid cap) triples; default :data:`SCHEDULES`.
        variant: the driver build (build.py): ``"sanitize"``, or ``"traffic"``, whose calls leave the bytes each
            launch moved in :attr:`last_traffic` (the first schedule's).
        shared_per_block: the emulated device's max shared memory per block in bytes, static plus dynamic (None: an
            H100's, 232448); the ops' code reads it (runtime.h: device_limits) to pick a path.
        max_cluster: the emulated device's largest thread-block cluster in blocks (None: an H100's, 8).
        max_nonportable_cluster: the largest with GRPO_ALLOW_NONPORTABLE_CLUSTER (None: 16, or max_cluster below 8).
        shared_per_sm: shared memory per SM in bytes (None: an H100's, 233472), for the small-block layout and
            GRPO_MAX_ACTIVE_CLUSTERS.
        gpc_sms: the SMs one cluster may span (None: 16), for GRPO_MAX_ACTIVE_CLUSTERS.
        env: environment variables of the drivers over the test process's (e.g. the layout, GRPO_EXT_LOGITS_*).
    """

    def __init__(self, csrc: Path | None = None, schedules: Sequence[tuple[str, str, int]] = SCHEDULES,
                 variant: str = "sanitize", shared_per_block: int | None = None,
                 max_cluster: int | None = None, max_nonportable_cluster: int | None = None,
                 shared_per_sm: int | None = None, gpc_sms: int | None = None,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.exe = build(csrc, variant=variant)
        flags = []
        for flag, value in (("--shared-per-block", shared_per_block), ("--max-cluster", max_cluster),
                            ("--max-nonportable-cluster", max_nonportable_cluster),
                            ("--shared-per-sm", shared_per_sm), ("--gpc-sms", gpc_sms)):  # fmt: skip
            if value is not None:
                flags += [flag, str(int(value))]
        self.drivers = [_Driver(self.exe, *s, device_flags=flags, env=env) for s in schedules]
        self.calls = collections.Counter()  # op -> calls
        # "kernel(parameter types)<<<blocks,threads per block>>>" (x) -> launches (the first schedule's)
        self.launches = collections.Counter()
        self.last_traffic: list[Launch] = []

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda *args: self.call(op, *args)

    def call(self, op: str, *args):
        """Runs ``op(*args)`` under every schedule; returns what ``torch.ops.grpo_ext.<op>`` returns."""
        request = f"{op} {len(args)}\n".encode() + b"".join(_encode(a) for a in args)
        for driver in self.drivers:
            driver.send(request)
        results, errors = [], []
        for driver in self.drivers:
            try:
                results.append((driver.name, *driver.receive()))
            except EmuError as e:
                errors.append(str(e))
        if errors:
            raise EmuError("\n".join(errors))
        self.calls[op] += 1
        self.last_traffic = parse_traffic(results[0][3])
        for entry in results[0][2].split(";"):
            if entry != "-":
                signature, count = entry.rsplit("#", 1)
                self.launches[signature] += int(count)
        first_name, first = results[0][:2]
        for name, outputs, *_ in results[1:]:
            for i, (a, b) in enumerate(zip(first, outputs, strict=True)):
                if not torch.equal(_bytes(a), _bytes(b)):
                    diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
                    raise EmuError(f"{op}: output {i} differs between the {first_name} and {name} schedules "
                                   f"(max abs difference {diff:.3g}): a race, or a kernel that depends on the "
                                   "thread order or the grid size")  # fmt: skip
        if op in _INPLACE_RETURNS:
            target = args[0]
            torch.as_strided(target, (_span(target),), (1,)).copy_(torch.as_strided(first[-1], (_span(target),), (1,)))
            kept = first[: _INPLACE_RETURNS[op]]
            return None if not kept else tuple(kept)
        return first[0] if len(first) == 1 else tuple(first)

    def close(self) -> list[str]:
        """Ends the driver processes; returns their sanitizer reports and bad exits (leaks are reported at exit)."""
        problems = []
        for driver in self.drivers:
            driver.close()
            problems += driver.problems
        return problems
