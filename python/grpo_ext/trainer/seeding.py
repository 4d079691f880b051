"""The global RNGs a run seeds and a checkpoint saves and restores: python, torch (CPU and CUDA), numpy, and the
trainer's data generator."""

from __future__ import annotations

import random
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    """Seed the python, torch (CPU and CUDA) and numpy global RNGs, the ones a checkpoint saves."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)  # noqa: NPY002  (the global RNG user reward functions may use)
    except ImportError:
        pass


def rng_state(data_generator: torch.Generator) -> dict[str, Any]:
    """The python, torch, CUDA and numpy global RNG states, and ``data_generator``'s under ``"data"``."""
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()  # noqa: NPY002
    except ImportError:
        pass
    rng["data"] = data_generator.get_state()
    return rng


def set_rng_state(rng: dict[str, Any], data_generator: torch.Generator) -> None:
    """Restore the RNG states :func:`rng_state` saved (those present)."""
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])  # noqa: NPY002
    if "data" in rng:
        data_generator.set_state(rng["data"].cpu())
