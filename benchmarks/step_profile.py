"""Where a profiled training step's time goes (``bench_trainer.py --profile``): module hooks mark the decoder
layers, the backbone and each step in the profiler's trace, and every event (a backward node by the sequence number
of the forward op that made it) is charged to one of :data:`PARTS`."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import DeviceType

#: The parts of a profiled step (``--profile``), in table order.
PARTS = ("layers_fwd", "layers_bwd", "head_fwd", "head_bwd", "optimizer", "rest")
STEP_RANGE = "bench::step"
LAYER_RANGE = "bench::decoder_layer"
BACKBONE_RANGE = "bench::backbone"
BACKWARD_EVENT = "autograd::engine::evaluate_function"
OPTIMIZER_EVENTS = ("Optimizer.step#", "Optimizer.zero_grad#")  # torch.optim's own ranges


class StepMarkers:
    """Module hooks marking the forward of the profiled steps: each decoder layer in a ``record_function`` range with
    the autograd sequence numbers at its start and end, and the backbone (embedding, layers, final norm) in a range
    with the sequence number at its end. Only the forward that builds the step's graph is marked (grad on, outside a
    backward: the checkpoint recompute runs inside one and belongs to the backward node that triggers it)."""

    def __init__(self, model) -> None:
        backbone = model.base_model
        self._leaf = torch.zeros((), requires_grad=True)
        self.step_starts: list[int] = []
        self.layer_ranges: list[tuple[int, int]] = []
        self.backbone_ends: list[int] = []
        self._open: dict[str, list[tuple[Any, int]]] = {LAYER_RANGE: [], BACKBONE_RANGE: []}
        self._handles = [backbone.register_forward_pre_hook(self._opener(BACKBONE_RANGE)),
                         backbone.register_forward_hook(self._closer(BACKBONE_RANGE))]  # fmt: skip
        for layer in backbone.layers:
            self._handles += [layer.register_forward_pre_hook(self._opener(LAYER_RANGE)),
                              layer.register_forward_hook(self._closer(LAYER_RANGE))]  # fmt: skip

    def sequence_nr(self) -> int:
        """The sequence number of a throwaway autograd node: above every node made before, below every one after."""
        return (self._leaf * 1).grad_fn._sequence_nr()

    @staticmethod
    def _marking() -> bool:
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _opener(self, name: str) -> Callable:
        def hook(module, args) -> None:
            if self._marking():
                marker = torch.profiler.record_function(name)
                marker.__enter__()
                self._open[name].append((marker, self.sequence_nr()))

        return hook

    def _closer(self, name: str) -> Callable:
        def hook(module, args, output) -> None:
            if self._marking() and self._open[name]:
                marker, start = self._open[name].pop()
                end = self.sequence_nr()
                marker.__exit__(None, None, None)
                if name == LAYER_RANGE:
                    self.layer_ranges.append((start, end))
                else:
                    self.backbone_ends.append(end)

        return hook

    @contextlib.contextmanager
    def step(self):
        """The context of one profiled step."""
        self.step_starts.append(self.sequence_nr())
        with torch.profiler.record_function(STEP_RANGE):
            yield

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def backward_part(self, sequence_nr: int) -> str:
        """The part of the backward node made by the forward op of ``sequence_nr``."""
        starts = [start for start, _ in self.layer_ranges]  # increasing: the layers run one after the other
        k = bisect.bisect_right(starts, sequence_nr) - 1
        if k >= 0 and sequence_nr < self.layer_ranges[k][1]:
            return "layers_bwd"
        step = bisect.bisect_right(self.step_starts, sequence_nr) - 1
        j = bisect.bisect_right(self.backbone_ends, sequence_nr) - 1
        if step >= 0 and j >= 0 and self.backbone_ends[j] > self.step_starts[step]:
            return "head_bwd"  # made after the backbone's end in the same step: the LM head, log-probs and loss
        return "rest"


def classify_events(events, markers: StepMarkers) -> Iterator[tuple[Any, Any, str]]:
    """``(step, event, part)`` for each profiler event of each profiled step (``bench::step`` range), any thread.

    Device-side events (kernels, GPU-timeline annotations) are left out: a kernel's time is its launching op's.
    An event belongs to one of :data:`PARTS`: under a backward node (``evaluate_function``), the part of the forward op
    that made the node (:meth:`StepMarkers.backward_part`); else under torch.optim's step or zero_grad range,
    ``optimizer``; else in a decoder layer's range, ``layers_fwd``; else, when it starts between the backbone's end
    and the step's first backward node, ``head_fwd``; else ``rest``.
    """
    # Host events only. With CUDA activity the profiler also lists each kernel, and each record_function range again
    # as a GPU-timeline annotation (a second "bench::step" per step); their time is already on the CPU op that
    # launched them (self_device_time_total), and their timestamps are the GPU's, which lags the host.
    events = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    steps = [e for e in events if e.name == STEP_RANGE]
    if not steps:
        raise RuntimeError("no profiled step")

    def part_of(event, head_start: float, backward_start: float) -> str:
        in_layer = in_optimizer = False
        node = event
        while node is not None:
            if node.name.startswith(BACKWARD_EVENT):
                return markers.backward_part(node.sequence_nr)
            in_optimizer = in_optimizer or node.name.startswith(OPTIMIZER_EVENTS)
            in_layer = in_layer or node.name == LAYER_RANGE
            node = node.cpu_parent
        if in_optimizer:
            return "optimizer"
        if in_layer:
            return "layers_fwd"
        return "head_fwd" if head_start <= event.time_range.start < backward_start else "rest"

    for step in steps:
        inside = [e for e in events if step.time_range.start <= e.time_range.start < step.time_range.end]
        backward = [e.time_range.start for e in inside if e.name.startswith(BACKWARD_EVENT)]
        backbone = [e.time_range.end for e in inside if e.name == BACKBONE_RANGE and e.thread == step.thread]
        backward_start = min(backward, default=step.time_range.end)
        head_start = max((end for end in backbone if end <= backward_start), default=backward_start)
        for event in inside:
            yield step, event, part_of(event, head_start, backward_start)


def step_parts(events, markers: StepMarkers, device: torch.device) -> dict[str, Any]:
    """Where the profiled steps' time went: ms per step of each of :data:`PARTS`.

    Each event's self time goes to its part (:func:`classify_events`). The CPU parts then sum to the steps' wall time
    (returned as ``check``: the ratio, the test of the method); time of threads other than the step's (CUDA's
    autograd thread) is taken off the step's own self time, in which the step's thread waited for them. On CUDA also
    the device (kernel) time per part, its ``rest`` the wall time less the named parts.

    Returns:
        ``cpu``: {part: ms per step}; ``device``: the same for CUDA kernels, or None; ``wall_ms``: profiled ms per step;
        ``check``: the CPU parts' sum over the wall time.
    """
    cpu = dict.fromkeys(PARTS, 0.0)
    kernels = dict.fromkeys(PARTS, 0.0)
    steps: dict[int, Any] = {}
    waited: dict[int, float] = {}
    for step, event, part in classify_events(events, markers):
        steps[id(step)] = step
        if event.thread != step.thread and event.cpu_parent is None:
            waited[id(step)] = waited.get(id(step), 0.0) + event.cpu_time_total
        cpu[part] += event.self_cpu_time_total
        kernels[part] += getattr(event, "self_device_time_total", 0.0)
    cpu["rest"] -= sum(waited.values())  # the step's thread waited in its own self time (a "rest" event)
    wall = sum(step.cpu_time_total for step in steps.values())
    count = len(steps)
    result: dict[str, Any] = dict(
        cpu={part: value / 1e3 / count for part, value in cpu.items()}, wall_ms=wall / 1e3 / count,
        check=sum(cpu.values()) / wall if wall else None, device=None,
    )  # fmt: skip
    if device.type == "cuda":
        named = {part: kernels[part] / 1e3 / count for part in PARTS if part != "rest"}
        result["device"] = dict(named, rest=max(0.0, result["wall_ms"] - sum(named.values())))
    return result
