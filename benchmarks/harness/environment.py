"""The device to benchmark on, the facts about the machine and the software, and the start of a run."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path
from typing import Any

import torch

from .timing import L2Flusher, measure_copy_bandwidth


def resolve_device(name: str | None) -> torch.device:
    """Returns the device to benchmark on: ``name``, or CUDA when available, else CPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    """Facts about the machine and the software, for the JSON record.

    Args:
        device: the benchmarked device.

    Returns:
        A JSON-ready dict: device name, torch/CUDA versions, UTC date, ``grpo_ext.build_info()`` and more.
    """
    import grpo_ext

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_type": device.type,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "torch_num_threads": torch.get_num_threads(),
        "grpo_ext_build_info": grpo_ext.build_info(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        info["total_memory_bytes"] = props.total_memory
        info["l2_cache_bytes"] = getattr(props, "L2_cache_size", None)
    else:
        info["device_name"] = info["cpu"]
    try:
        import triton

        info["triton_version"] = triton.__version__
    except Exception:  # triton is optional; its absence only matters to torch.compile on CUDA
        info["triton_version"] = None
    return info


def start(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any], dict[str, float] | None, L2Flusher | None]:
    """Resolves the device, prints its facts and measures the copy bandwidth (CUDA).

    Args:
        args: the parsed command line (``device``; ``no_l2_flush`` where the script has that option: without it,
            no L2 flusher is made).

    Returns:
        ``(device, environment, copy_bandwidth_or_None, l2_flusher_or_None)``.
    """
    device = resolve_device(args.device)
    env = environment(device)
    print(f"device: {env['device_name']} | torch {env['torch_version']} | CUDA {env['cuda_version']}")
    copy, flusher = None, None
    if device.type == "cuda":
        copy = measure_copy_bandwidth(device)
        print(f"device-to-device copy: {copy['gbps']:.0f} GB/s (bytes read + written, 1 GiB source)")
        if not getattr(args, "no_l2_flush", True):  # a script without the option uses no flusher
            flusher = L2Flusher(device)
    return device, env, copy, flusher
