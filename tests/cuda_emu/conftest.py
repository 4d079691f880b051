"""The emulated device for the tests of tests/cuda_emu: one set of driver processes for all of them.

``GRPO_EMU_CSRC=<dir>`` runs the tests on another copy of ``csrc/`` (the mutation check, mutate.py, uses it). At the
end of the session: the sanitizer reports of the drivers (leaks are reported when they exit) fail the session, and,
when every test here ran, so does a kernel of csrc/cuda/*.cuh that no test launched. The summary line counts
the kernels, their instantiations and the cases run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .client import SCHEDULES, EmuDevice

CSRC = Path(os.environ.get("GRPO_EMU_CSRC") or Path(__file__).resolve().parents[2] / "csrc")
HERE = Path(__file__).resolve().parent
_state: dict = {"device": None, "deselected": False, "complete": False}


def header_kernels(csrc: Path = CSRC) -> set[str]:
    """The name of every ``__global__`` function in ``csrc/cuda/*.cuh``."""
    names = set()
    for path in (csrc / "cuda").glob("*.cuh"):
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\(\s*\d+\s*\)\s*)?(\w+)", path.read_text()))
    return names


def pytest_deselected(items) -> None:
    if any(Path(item.path).parent == HERE for item in items):
        _state["deselected"] = True


def pytest_collection_finish(session) -> None:
    """The kernel coverage is checked only when every test of tests/cuda_emu runs."""
    files = {Path(item.path) for item in session.items if Path(item.path).parent == HERE}
    _state["complete"] = files == set(HERE.glob("test_*.py")) and not _state["deselected"]


@pytest.fixture(scope="package")
def emu():
    """grpo_ext's raw ops on the emulated device (client.EmuDevice), under every schedule."""
    device = EmuDevice(CSRC)
    _state["device"] = device
    yield device
    problems = device.close()
    assert not problems, "the drivers reported sanitizer errors or bad exits:\n" + "\n".join(problems)
    launched = {signature.split("(", 1)[0] for signature in device.launches}
    missing = header_kernels() - launched
    assert not _state["complete"] or not missing, f"kernels of csrc/cuda no test launched: {sorted(missing)}"


def pytest_terminal_summary(terminalreporter) -> None:
    device = _state["device"]
    if device is None:
        return
    kernels = {signature.split("(", 1)[0] for signature in device.launches} & header_kernels()
    instantiations = [s for s in device.launches if s.split("(", 1)[0] in kernels]
    cases = sum(count for op, count in device.calls.items() if not op.startswith("selftest"))
    launches = sum(device.launches[s] for s in instantiations)
    terminalreporter.write_line(
        f"cuda_emu: {len(kernels)} of {len(header_kernels())} kernels of csrc/cuda ({len(instantiations)} "
        f"instantiations) ran {launches} launches in {cases} op calls, each under {len(SCHEDULES)} schedules "
        f"({', '.join(name for name, _, _ in SCHEDULES)}) with ASan and UBSan"
    )
