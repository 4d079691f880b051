"""The CUDA library packages a smoke venv's torch needs that the build venv does not hold (run by the build venv's
Python, whose installed packages it reads).

tests/wheel/test_in_venv.sh links the build venv's ``nvidia/`` folder into each smoke venv rather than installing a
second 3-5 GB copy of the CUDA libraries (a second copy filled CI's disk). That works only where the build venv's
releases are no older than the ones the smoke venv's torch pins: torch 2.15.0 pins CUDA 13.2 and NVSHMEM 3.7 where
torch 2.14.1 pinned 13.0 and 3.4, and it fails to import against the older ones (an undefined NVSHMEM symbol).
Prints nothing when every one of torch's ``nvidia-*`` and ``cuda-toolkit`` requirements is met here (link the
folder), else all of them, one a line (install them into the smoke venv: a mixed folder cannot be linked).

usage: python tests/wheel/cuda_libraries.py SMOKE_VENV_SITE_PACKAGES
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def cuda_requirements(site_packages: Path) -> list[Requirement]:
    """torch's requirements whose files go to ``nvidia/`` (on this platform), from its installed metadata."""
    (metadata,) = site_packages.glob("torch-*.dist-info/METADATA")
    requirements = []
    for line in metadata.read_text().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if not (requirement.name.startswith("nvidia-") or requirement.name == "cuda-toolkit"):
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            requirements.append(requirement)
    return requirements


def met_here(requirement: Requirement) -> bool:
    """Whether this Python's environment holds a release of the requirement's package that can stand in for it.

    A pinned ``==X`` is met by X or a newer release of the same major version (the CUDA libraries load in a torch
    built against an older release of theirs: torch 2.11.0, pinning cuDNN 9.19 and CUDA 13.0.2, runs on 2.14.1's 9.24
    and 13.0.3); any other specifier by a release it contains.
    """
    try:
        have = Version(importlib.metadata.version(requirement.name))
    except importlib.metadata.PackageNotFoundError:
        return False
    pins = [Version(s.version) for s in requirement.specifier if s.operator == "=="]
    if pins:
        return all(have >= pin and have.major == pin.major for pin in pins)
    return requirement.specifier.contains(have, prereleases=True)


if __name__ == "__main__":
    needed = cuda_requirements(Path(sys.argv[1]))
    if not all(met_here(r) for r in needed):
        print("\n".join(str(r) for r in needed))
