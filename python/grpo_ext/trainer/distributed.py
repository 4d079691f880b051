"""torch.distributed plumbing of GRPOTrainer: process group, model wrapping (DDP, FSDP2), the row layout, seeds.

Only torch.distributed collectives are used. The layout makes a run's result a function of the global batch, not of
the number of processes:

- One generation produces ``R = per_device_train_batch_size * steps_per_generation * world_size`` rows, row ``j``
  being completion ``j % G`` of global prompt ``j // G``.
- The generation batch is cut into ``steps_per_generation`` global micro-batches of ``per_device * world_size``
  consecutive rows; rank ``r`` holds rows ``[r * per_device, (r + 1) * per_device)`` of each. With one process
  this is the single-process trainer's layout; with ``W`` processes the ranks together hold the same micro-batches.
- Each row is sampled from its own random stream, seeded from ``(seed, generation number, row)``
  (:func:`row_seed`), so a row's tokens do not depend on which rank generates it or with which other rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_MASK64 = (1 << 64) - 1


def is_distributed() -> bool:
    """True when a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes of the default group (1 without one)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if is_distributed() else 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_distributed():
        dist.barrier()


def init_from_env(timeout_s: float = 1800.0) -> tuple[bool, torch.device]:
    """Initialize the default process group from ``torchrun``'s environment, when there is one.

    NCCL when CUDA is available (each process on ``cuda:LOCAL_RANK``), gloo otherwise.

    Args:
        timeout_s: collective timeout; generation and rewards of a slow rank must fit in it.

    Returns:
        ``(created, device)``: whether this call created the group (the caller then destroys it) and the device
        this process should put its model on.
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if is_distributed() or "WORLD_SIZE" not in os.environ:
        return False, device
    dist.init_process_group(
        backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None
    )
    return True, device


def destroy() -> None:
    """Tear down the default process group (after :func:`init_from_env` created it)."""
    if is_distributed():
        dist.destroy_process_group()


def row_seed(seed: int, generation: int, row: int) -> int:
    """A 63-bit seed for one row's sampling stream: splitmix64 over ``(seed, generation, row)``.

    Distinct triples give unrelated streams (unlike ``seed + row``, where two generations would share rows).
    """

    def mix(state: int, value: int) -> int:
        z = ((state ^ value) + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    return mix(mix(mix(0, seed), generation), row) >> 1


def row_uniforms(seeds: Sequence[int], length: int, device: torch.device) -> Tensor:
    """``[len(seeds), length]`` float64 uniforms in ``(0, 1]``, row ``i`` from a CPU generator seeded ``seeds[i]``.

    CPU generators give the same numbers on every machine and device, so a row's samples do not depend on where it is
    generated.
    """
    out = torch.empty(len(seeds), length, dtype=torch.float64)
    generator = torch.Generator()
    for i, seed in enumerate(seeds):
        generator.manual_seed(seed)
        out[i] = torch.rand(length, generator=generator, dtype=torch.float64)
    return (1.0 - out).to(device)  # (0, 1]: a zero would select a leading zero-probability token


def local_rows(rank: int, world_size: int, per_device: int, steps: int) -> Tensor:
    """Global row indices of a generation batch held by ``rank``, in its local order.

    Returns:
        ``[per_device * steps]`` int64: micro-batch ``k`` of the rank is global rows
        ``k * per_device * world_size + rank * per_device + [0, per_device)``.
    """
    step = torch.arange(steps).unsqueeze(1) * (per_device * world_size)
    return (step + rank * per_device + torch.arange(per_device)).reshape(-1)


def gather_rows(local: Tensor, world_size: int, per_device: int, steps: int) -> Tensor:
    """All ranks' rows of a generation batch in global row order (see :func:`local_rows`).

    Args:
        local: ``[per_device * steps, *F]`` this rank's rows, same shape and dtype on every rank.

    Returns:
        ``[per_device * steps * world_size, *F]``, on every rank.
    """
    if world_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    features = local.shape[1:]
    stacked = torch.stack(parts).reshape(world_size, steps, per_device, *features)
    return stacked.transpose(0, 1).reshape(world_size * steps * per_device, *features)


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum over ranks, in place (no-op with one process); returns ``tensor``."""
    if is_distributed() and world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_flag(flag: bool, device: torch.device, src: int = 0) -> bool:
    """Rank ``src``'s ``flag`` on every rank (a decision every rank must take alike)."""
    if not is_distributed() or world_size() == 1:
        return flag
    box = torch.tensor([float(flag)], device=device)
    dist.broadcast(box, src=src)
    return bool(box.item())


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float | None, fsdp: bool) -> float:
    """The global gradient norm of ``params``, after clipping their gradients to ``max_norm`` (None: no clipping).

    Under FSDP the gradients are DTensors and ``clip_grad_norm_`` reduces the shards' norms across ranks.
    """
    if fsdp:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)  # inf: measure only
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    return torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()


def all_reduce_max(tensor: Tensor) -> Tensor:
    """Maximum over ranks, in place (no-op with one process); returns ``tensor``."""
    if is_distributed() and world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, CPU tensors only), in rank order."""
    if not is_distributed() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` (picklable, CPU tensors only) in rank order on rank ``dst``, None on the others."""
    if not is_distributed() or world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module`` (plain, unsharded tensors)."""
    if not is_distributed() or world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)


def wrap_for_training(
    model: torch.nn.Module, ref_model: torch.nn.Module | None, fsdp: bool, device: torch.device
) -> torch.nn.Module:
    """What the training forward goes through: DDP around ``model`` (its hooks all-reduce the gradients), or with
    ``fsdp`` the FSDP2-sharded model itself (``ref_model`` sharded too); ``model`` itself with one process.

    Generation and no-grad scoring use ``model`` directly.
    """
    if fsdp:
        shard_fsdp(model)
        if ref_model is not None:
            shard_fsdp(ref_model)
        return model
    if world_size() > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def shard_fsdp(module: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 (``fully_shard``): each transformer block (``module._no_split_modules``, as HF models name them) and
    then the root, so one block's parameters at a time are gathered in forward and backward.

    The root of a peft ``PeftModel`` (LoRA) is the causal LM it wraps: its forward runs both inside the
    ``PeftModel``'s and in ``generate`` (which peft hands to it directly, past a ``PeftModel`` root's hooks). A
    ``PeftModel`` with parameters of its own (a prompt encoder) is the root itself.

    Returns:
        ``module`` itself, sharded in place (its parameters become DTensors).
    """
    from torch.distributed.fsdp import fully_shard

    from .policy_logps import causal_lm, owns_all_parameters

    root = causal_lm(module)
    if not owns_all_parameters(root, module):
        root = module
    block_names = set(getattr(root, "_no_split_modules", None) or ())
    for sub in root.modules():
        if sub is not root and type(sub).__name__ in block_names:
            fully_shard(sub)
    fully_shard(root)
    return module
