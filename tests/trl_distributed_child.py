"""One rank of tests/test_trl_distributed.py: TRL's GRPOTrainer, unpatched then patched, on this rank's rows.

Started by ``accelerate launch --multi_gpu --num_processes 2`` (torchrun); the trainers' ``use_cpu=True`` makes
accelerate set up its MULTI_CPU state on gloo. For every case of the spec file written by the test, each rank builds a
TRL trainer, wraps its model as TRL's training loop would (DDP through ``accelerator.prepare``, or FSDP2 through
accelerate's ``fsdp2_prepare_model``), and runs ``compute_loss`` + backward on its half of the global batch, first
with TRL's own code, then patched by grpo_ext. It saves the loss, the full (reduced) gradients, the metrics TRL logs
and the entropy controller's state of both runs to ``rank{N}.pt``; the test compares them.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # two ranks share the CI machine's cores

import grpo_ext  # noqa: E402
from grpo_ext.integrations import trl as grpo_trl  # noqa: E402
from grpo_ext.ops import tied_embedding  # noqa: E402
from grpo_ext.trainer.demo import build_tokenizer  # noqa: E402

# The script's folder (tests/) is sys.path[0]: the TRL tests' helpers (tests/trl_utils.py) are importable.
from trl_utils import entropy_control_state, make_trainer, restore_entropy_control_state  # noqa: E402

# GRPOConfig options asking accelerate for FSDP2 (what a TRL user sets; accelerate ignores them on CPU, see wrap_fsdp2)
FSDP2_CONFIG = dict(fsdp=True, fsdp_config={"fsdp_version": 2})


def rank_rows(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's contiguous slice of the global batch's rows; ``num_items_in_batch`` stays the global count."""
    rows = batch["completion_ids"].shape[0] // world
    return {key: value if key == "num_items_in_batch" else value[rank * rows : (rank + 1) * rows]
            for key, value in batch.items()}  # fmt: skip


def wrap_fsdp2(trainer) -> torch.nn.Module:
    """Shards ``trainer.model`` in place with accelerate's FSDP2 code, from the plugin TRL's config asked for.

    On CPU accelerate keeps the MULTI_CPU (DDP) state even with an FSDP plugin (``AcceleratorState`` switches to
    FSDP only from the multi-accelerator types), so ``trainer.is_fsdp_enabled`` is False there: the plugin built
    from the trainer's arguments is handed to ``fsdp2_prepare_model`` directly, which shards as on GPUs (each decoder
    layer, the embeddings, [final norm, LM head] as one unit, the root).
    """
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    accelerator = trainer.accelerator
    if not trainer.is_fsdp_enabled:
        plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        # the attributes fsdp2_prepare_model reads without a device mesh, ignored modules or RAM-efficient loading
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, mixed_precision="no",
            device=accelerator.device, is_main_process=accelerator.is_main_process,
        )  # fmt: skip
    return fsdp2_prepare_model(accelerator, trainer.model)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, FSDP2's reduce-scattered shards gathered (a collective: same order on all ranks)."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def step(trainer, model: torch.nn.Module, batch: dict[str, Any], calls: list[int]) -> dict[str, Any]:
    """One ``compute_loss`` + backward from zero gradients through the wrapped model."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    before = list(calls)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return dict(
        loss=loss.detach(), grads=full_grads(trainer.model), fused_calls=calls[0] - before[0],
        tied_lookups=calls[1] - before[1],
        metrics={name: values[-1] for name, values in trainer._metrics["train"].items()},
        entropy_control=entropy_control_state(trainer),
    )  # fmt: skip


def run_case(case: dict[str, Any], spec: dict[str, Any], tokenizer, run_dir: Path, calls: list[int]) -> dict:
    """TRL's compute_loss, then grpo_ext's, on one trainer and this rank's rows; the results and the setup seen."""
    # ddp_timeout: a rank waiting for a failed peer gives up within minutes (TrainingArguments' default is 30)
    config = dict(case["config"], ddp_timeout=120, **(FSDP2_CONFIG if case["backend"] == "fsdp2" else {}))
    trainer = make_trainer(case.get("model_dir", spec["model_dir"]), tokenizer, run_dir, **config)
    accelerator = trainer.accelerator
    setup = dict(distributed_type=str(accelerator.distributed_type), num_processes=accelerator.num_processes,
                 fsdp_enabled=trainer.is_fsdp_enabled)  # fmt: skip
    if case["backend"] == "fsdp2":
        model = wrap_fsdp2(trainer)
        weight = trainer.model.get_output_embeddings().weight
        setup["wrapper"] = type(model).__name__
        setup["lm_head_shard"] = (type(weight).__name__, tuple(weight.to_local().shape))
    else:
        model = accelerator.prepare(trainer.model)
        setup["wrapper"] = type(model).__name__
    batch = rank_rows(spec["batch"], accelerator.process_index, accelerator.num_processes)
    initial = entropy_control_state(trainer)
    results = dict(setup=setup)
    for impl in ("trl", "grpo_ext"):
        restore_entropy_control_state(trainer, initial)
        if impl == "grpo_ext":
            grpo_trl.patch(trainer)
        for name, value in case["attrs"].items():
            setattr(trainer, name, value)
        results[impl] = step(trainer, model, batch, calls)
    return results


def exit_with_launcher() -> None:
    """Exits this rank when its launcher (torchrun, whose ranks run in sessions of their own) is gone."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    exit_with_launcher()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="torch.save'd dict: model_dir, batch, cases")
    parser.add_argument("--out", required=True, help="folder for rank{N}.pt")
    args = parser.parse_args()
    spec = torch.load(args.spec, weights_only=False)
    out = Path(args.out)
    # counts grpo_loss_from_hidden calls, so a patch that did nothing cannot pass (fused.py calls it through ops),
    # and the tied embedding's lookups (sharing_tied_gradient calls tied_lookup through its module)
    calls = [0, 0]
    fused, lookup = grpo_ext.ops.grpo_loss_from_hidden, tied_embedding.tied_lookup

    def counted(*a, **kw):
        calls[0] += 1
        return fused(*a, **kw)

    def counted_lookup(*a, **kw):
        calls[1] += 1
        return lookup(*a, **kw)

    grpo_ext.ops.grpo_loss_from_hidden = counted
    tied_embedding.tied_lookup = counted_lookup
    tokenizer = build_tokenizer()
    results = {name: run_case(case, spec, tokenizer, out / name, calls) for name, case in spec["cases"].items()}
    import torch.distributed as dist

    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
