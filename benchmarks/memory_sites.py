"""What is alive at a step's allocator peak, by the code that allocated it (``bench_trainer.py --memory-sites``).

On CUDA, torch's allocator records every allocation and free with its Python stack while
``torch.cuda.memory._record_memory_history(stacks="python")`` is on. On the CPU, ``torch.profiler`` with
``profile_memory=True, with_stack=True`` records the same events (the CPU allocator's, those of grpo_ext's native
ops included) under the Python calls that made them; :func:`profiler_trace` turns them into the CUDA trace's form,
each frame's name followed by the outermost and innermost torch ops under it (``f [aten::linear > aten::empty]``,
or an autograd node's name in the backward: the profiler knows the function, not the line). :func:`peak_sites`
replays one device's trace, finds the moment the bytes allocated since recording began were highest, and sums the
blocks alive then by their *site*: the innermost frame outside torch itself (a transformers module, TRL's chunked
head, a grpo_ext op). Blocks
allocated before recording began (weights, optimizer state) are not in the trace and not counted: the figure is the
step's own peak, which is what differs between contenders (issue 39: TRL + grpo_ext's peak 346 MiB above TRL's at T
1024 on an H200, RESULTS.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

#: Frames in these paths are torch's own (autograd, modules, the allocator's callers): a site is the first frame
#: outside them, so that an activation is charged to the model's module and a GEMM's output to the op that asked.
TORCH_PATHS = ("/torch/", "/torch_stable/", "<frozen ", "/contextlib.py", "/functools.py")
FREES = ("free_completed",)


def site_of(frames: list[dict[str, Any]]) -> str:
    """``path:line function`` of the innermost frame outside torch (``frames`` innermost first); the path cut to its
    last three parts. ``"torch"`` when every frame is torch's, ``"?"`` when there are none."""
    if not frames:
        return "?"
    for frame in frames:
        filename = str(frame.get("filename", ""))
        # "/" first: the profiler's paths are relative to sys.path ("torch/nn/modules/linear.py")
        if filename and not any(part in "/" + filename for part in TORCH_PATHS):
            short = "/".join(filename.split("/")[-3:])
            return f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "torch"


def peak_sites(snapshot: dict[str, Any], device: int = 0, top: int = 8) -> dict[str, Any]:
    """The step's allocator peak and the sites holding it.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` taken while history was recorded (``device_traces``: per device,
            events with ``action``, ``addr``, ``size`` and ``frames``).
        device: which device's trace.
        top: how many sites to list; the rest are summed as ``"other"``.

    Returns:
        ``peak_bytes`` (the most bytes allocated at once since recording began, less those freed), ``events`` (the
        trace's length) and ``sites``: ``[(site, bytes)]`` alive at the peak, largest first.
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    live: dict[int, int] = {}
    total = peak = peak_index = 0
    for index, event in enumerate(trace):
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index + 1
        elif action in FREES and addr in live:  # blocks from before recording began are not tracked
            total -= live.pop(addr)
    alive: dict[int, dict[str, Any]] = {}  # the second pass: the blocks alive right after the peak's allocation
    for event in trace[:peak_index]:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            alive[addr] = event
        elif action in FREES:
            alive.pop(addr, None)
    by_site = Counter()
    for event in alive.values():
        by_site[site_of(event.get("frames") or [])] += event["size"]
    ranked = by_site.most_common()
    sites = ranked[:top]
    rest = sum(size for _, size in ranked[top:])
    if rest:
        sites.append(("other", rest))
    return {"peak_bytes": peak, "events": len(trace), "sites": sites}


def format_sites(result: dict[str, Any]) -> str:
    """One line per site: MiB and the site."""
    lines = [f"  traced peak {result['peak_bytes'] / 2**20:.1f} MiB ({result['events']} allocator events)"]
    lines += [f"  {size / 2**20:9.1f} MiB  {site}" for site, size in result["sites"]]
    return "\n".join(lines)


def profiler_trace(profiler: torch.profiler.profile, device: str = "cpu") -> list[dict[str, Any]]:
    """One device's allocations and frees from a finished ``torch.profiler.profile(profile_memory=True,
    with_stack=True)``, in time order, as :func:`peak_sites` reads a CUDA trace: ``action`` (``alloc`` or
    ``free_completed``), ``addr``, ``size`` and ``frames`` (innermost first; a frame's ``line`` is where it called
    the next frame in, its definition's line for the innermost one).

    Args:
        profiler: the profile, after its context has exited.
        device: ``"cpu"`` or ``"cuda"`` (the allocations of that device type only).
    """
    from torch._C._profiler import _EventType  # the profiler's event tree: where each allocation was made

    events = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))  # pre-order, children in time order
        if node.tag != _EventType.Allocation or node.extra_fields.device.type != device:
            continue
        ops, calls, parent = [], [], node.parent  # the torch ops below the innermost Python call, innermost first
        while parent is not None:
            if parent.tag == _EventType.TorchOp and not calls:
                ops.append(parent.name)
            elif parent.tag == _EventType.PyCall:
                calls.append(parent.extra_fields)
            parent = parent.parent
        suffix = f" [{ops[-1]} > {ops[0]}]" if len(ops) > 1 else f" [{ops[0]}]" if ops else ""
        frames = [{"filename": call.callsite.file_name,
                   "line": calls[i - 1].caller.line_number if i else call.callsite.line_number,
                   "name": call.callsite.function_name + suffix} for i, call in enumerate(calls)]  # fmt: skip
        size = node.extra_fields.alloc_size
        action = "alloc" if size > 0 else "free_completed"
        event = {"action": action, "addr": node.extra_fields.ptr, "size": abs(size), "frames": frames}
        events.append((node.start_time_ns, event))
    events.sort(key=lambda pair: pair[0])
    return [event for _, event in events]
