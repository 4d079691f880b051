"""The emulated devices for the tests of tests/cuda_emu: one set of driver processes for all of them per device.

``emu`` is an H100's limits; ``emu_small_shared`` has 2 KiB of shared memory per block (and clusters of up to 8
blocks), so that an op's cluster path runs at small V; ``emu_small_blocks`` takes the logits pass's small-block
layout with little shared memory per SM (clusters of up to 16 blocks at small V). ``GRPO_EMU_CSRC=<dir>`` runs
the tests on another copy of ``csrc/`` (the mutation check, mutate.py, uses it). At the end of the session: the
sanitizer reports of the drivers (leaks are reported when they exit) fail the session, and, when every test here ran,
so does a kernel of csrc/cuda/*.cuh that no test launched on any of these devices (checked when the last device
closes). The summary line counts
the kernels, their instantiations and the cases run on both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .build import KERNEL_NAME
from .client import SCHEDULES, EmuDevice

CSRC = Path(os.environ.get("GRPO_EMU_CSRC") or Path(__file__).resolve().parents[2] / "csrc")
HERE = Path(__file__).resolve().parent
# bytes: emu_small_shared's device; SingleReadShared<float> (944) leaves a block 1608 bytes of row part
SMALL_SHARED_PER_BLOCK = 2552
SMALL_MAX_CLUSTER = 8
# emu_small_blocks' shared memory per SM: 4 blocks, each with 1 KiB reserved, SingleReadShared<float> (944 bytes: its
# 16-byte aligned inbox fixes the size), the alignment pad and 256 bytes of row part, so that parts are 64 float32 or
# 128 bf16 entries (test_logits_small_blocks.py counts the clusters again).
SMALL_BLOCK_SHARED_PER_SM = 4 * (1024 + 944 + 16 + 256)
# Every device the session opened (launch counts outlive close), and those still open.
_state: dict = {"devices": [], "open": 0, "deselected": False, "complete": False}


def header_kernels(csrc: Path = CSRC) -> set[str]:
    """The name of every ``__global__`` function in ``csrc/cuda/*.cuh``."""
    names = set()
    for path in (csrc / "cuda").glob("*.cuh"):
        names |= set(KERNEL_NAME.findall(path.read_text()))
    return names


def pytest_deselected(items) -> None:
    if any(Path(item.path).parent == HERE for item in items):
        _state["deselected"] = True


def pytest_collection_finish(session) -> None:
    """The kernel coverage is checked only when every test of tests/cuda_emu runs."""
    files = {Path(item.path) for item in session.items if Path(item.path).parent == HERE}
    _state["complete"] = files == set(HERE.glob("test_*.py")) and not _state["deselected"]


def _launched() -> set[str]:
    """The kernels (names) launched on any device of the session."""
    return {signature.split("(", 1)[0] for device in _state["devices"] for signature in device.launches}


def _device(**limits):
    """An EmuDevice with ``limits`` (client.EmuDevice's), closed at the end with the session's checks."""
    device = EmuDevice(CSRC, **limits)
    _state["devices"].append(device)
    _state["open"] += 1
    yield device
    _state["open"] -= 1
    problems = device.close()
    assert not problems, "the drivers reported sanitizer errors or bad exits:\n" + "\n".join(problems)
    if _state["open"] == 0 and _state["complete"]:  # the last device to close checks the coverage of all
        missing = header_kernels() - _launched()
        assert not missing, f"kernels of csrc/cuda no test launched: {sorted(missing)}"


@pytest.fixture(scope="package")
def emu():
    """grpo_ext's raw ops on the emulated device (client.EmuDevice, an H100's limits), under every schedule."""
    yield from _device()


@pytest.fixture(scope="package")
def emu_small_shared():
    """The emulated device with 2 KiB of shared memory per block and clusters of up to 8 blocks, under every
    schedule: an op's cluster (or fallback) path at small shapes."""
    yield from _device(shared_per_block=SMALL_SHARED_PER_BLOCK, max_cluster=SMALL_MAX_CLUSTER)


@pytest.fixture(scope="package")
def emu_small_blocks():
    """The emulated device with SMALL_BLOCK_SHARED_PER_SM bytes of shared memory per SM and the small-block layout
    of the logits pass chosen (GRPO_EXT_LOGITS_SINGLE_READ=small-blocks), under every schedule: rows of a few
    hundred entries over clusters of up to 16 blocks."""
    yield from _device(shared_per_sm=SMALL_BLOCK_SHARED_PER_SM, env={"GRPO_EXT_LOGITS_SINGLE_READ": "small-blocks"})


@pytest.fixture
def emu_with_env():
    """A factory: ``make(env, **limits)`` gives the emulated device (an H100's limits unless ``limits`` says
    otherwise) under every schedule with the environment ``env`` (a layout candidate's variables), counted in the
    session's kernel coverage; each is closed with its checks at the test's end."""
    devices = []

    def make(env: dict[str, str], **limits) -> EmuDevice:
        devices.append(_device(env=env, **limits))
        return next(devices[-1])

    yield make
    for device in devices:
        next(device, None)  # _device's teardown: close, its checks, and the coverage check where it is the last


def pytest_terminal_summary(terminalreporter) -> None:
    devices = _state["devices"]
    if not devices:
        return
    launched = {}  # signature -> launches, on every device
    for device in devices:
        for signature, count in device.launches.items():
            launched[signature] = launched.get(signature, 0) + count
    kernels = _launched() & header_kernels()
    instantiations = [s for s in launched if s.split("(", 1)[0] in kernels]
    cases = sum(count for d in devices for op, count in d.calls.items() if not op.startswith("selftest"))
    launches = sum(launched[s] for s in instantiations)
    terminalreporter.write_line(
        f"cuda_emu: {len(kernels)} of {len(header_kernels())} kernels of csrc/cuda ({len(instantiations)} "
        f"instantiations) ran {launches} launches in {cases} op calls on {len(devices)} emulated device"
        f"{'s' if len(devices) > 1 else ''}, each under {len(SCHEDULES)} schedules "
        f"({', '.join(name for name, _, _ in SCHEDULES)}) with ASan and UBSan"
    )
