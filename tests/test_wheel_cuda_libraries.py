"""tests/wheel/cuda_libraries.py: when a smoke venv may link the build venv's CUDA libraries (their releases no older
than the ones its torch pins, same major) and when it must install its own."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

SCRIPT = Path(__file__).resolve().parent / "wheel" / "cuda_libraries.py"
spec = importlib.util.spec_from_file_location("cuda_libraries", SCRIPT)
cuda_libraries = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_libraries)


def test_a_pin_is_met_by_that_release_or_a_newer_one_of_its_major():
    have = Version(importlib.metadata.version("packaging"))  # any package this environment holds
    cases = {
        str(have): True,
        f"{have.major}.0": True,  # an older release of the same major: the libraries load
        f"{have.major}.{have.minor + 1}": False,  # a newer one: torch may need its symbols
        f"{have.major - 1}.0": False,  # another major: another soname
        f"{have.major + 1}.0": False,
    }
    for pin, met in cases.items():
        assert cuda_libraries.met_here(Requirement(f"packaging=={pin}")) is met, pin
    assert cuda_libraries.met_here(Requirement(f"packaging>={have}"))
    assert not cuda_libraries.met_here(Requirement("no-such-package-here==1.0"))


def test_only_the_cuda_packages_of_this_platform_are_read(tmp_path):
    info = tmp_path / "torch-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Name: torch\nVersion: 9.9.9\nRequires-Dist: filelock\n"
        'Requires-Dist: cuda-toolkit[cublas,cudart]==13.2.2; platform_system == "Linux"\n'
        'Requires-Dist: cuda-bindings<14,>=13.0.3; platform_system == "Linux"\n'
        'Requires-Dist: nvidia-nccl-cu13==2.30.7; platform_system == "Linux"\n'
        'Requires-Dist: nvidia-cudnn-cu13==9.26.0.51; platform_system == "Nowhere"\n'
        'Requires-Dist: optree>=0.13.0; extra == "optree"\n'
    )
    names = [r.name for r in cuda_libraries.cuda_requirements(tmp_path)]
    assert names == (["cuda-toolkit", "nvidia-nccl-cu13"] if platform.system() == "Linux" else [])
