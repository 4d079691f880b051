"""Checkpoints of GRPOTrainer: atomic ``checkpoint-<step>`` folders, resume (also on another number of processes).

A folder holds ``model_state.pt`` (the full model state), ``trainer_state.pt`` (optimizer, scheduler, RNG states,
every rank's queued micro-batches and the trainer's own state), ``config.grpo.json``, and with ``save_pretrained``
the ``transformers`` model and tokenizer files. A peft ``PeftModel`` (LoRA) writes its adapter alone: peft's adapter
files, and in ``model_state.pt`` its trainable parameters and buffers (a resumed run rebuilds the frozen base).

The optimizer and its schedule are built in ``optimizer.py``, the RNG states saved here come from ``seeding.py``, and
the queued micro-batches are re-cut with ``batches.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from . import distributed as dist_utils
from .batches import concat_rollouts, map_tensors
from .config import GRPOConfig, check_resume_config
from .model_files import (
    WRITE_ERRORS,
    full_model_state_dict,
    full_state_options,
    space_shortage,
    tensor_bytes,
    write_pretrained,
)
from .optimizer import scheduler_step
from .policy_logps import is_peft_model
from .run_folder import TEMP_CHECKPOINT_PREFIX, numbered_checkpoints, remove_temp_checkpoints, replace_folder
from .seeding import rng_state, set_rng_state


class CheckpointManager:
    """Writes and reads the ``checkpoint-<step>`` folders of ``output_dir`` for one trainer.

    Under torch.distributed every rank holds one and calls :meth:`save` and :meth:`load` together: the full
    (unsharded) state is gathered to rank 0, which alone touches the files, and sent back from it on load.

    Args:
        output_dir: the run's folder.
        config: the run's options (saved with each checkpoint; ``fsdp``, ``save_total_limit``).
        model: the policy (FSDP2-sharded when ``config.fsdp``).
        optimizer: its AdamW.
        lr_scheduler: the learning-rate scheduler.
        tokenizer: saved beside the model; its pad token pads re-cut micro-batches.
        data_generator: the prompt order's generator (its state is saved with the RNG states).
        param_names: names of the optimizer's parameters, in its order.
        model_class_name: the model's class name before FSDP2 wrapping (written into the saved ``config.json``).
        device: where a single process loads the state.
    """

    def __init__(
        self,
        output_dir: Path,
        config: GRPOConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        tokenizer: Any,
        data_generator: torch.Generator,
        param_names: list[str],
        model_class_name: str,
        device: torch.device,
    ) -> None:
        self.output_dir = output_dir
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.tokenizer = tokenizer
        self.data_generator = data_generator
        self.param_names = param_names
        self.model_class_name = model_class_name
        self.device = device
        self.world_size = dist_utils.world_size()
        self.rank = dist_utils.rank()
        self.is_main_process = self.rank == 0

    def latest(self) -> Path | None:
        """The ``checkpoint-N`` folder of ``output_dir`` with the largest N, or None."""
        if not self.output_dir.is_dir():
            return None
        found = numbered_checkpoints(self.output_dir)
        return found[-1][1] if found else None

    def resume_path(self, resume_from_checkpoint: str | os.PathLike | bool) -> str | os.PathLike:
        """The folder to resume from: ``resume_from_checkpoint`` itself, or for True the latest by rank 0's view.

        Raises:
            FileNotFoundError: True was given and ``output_dir`` has no ``checkpoint-N`` folder.
        """
        path = resume_from_checkpoint
        if path is True:
            # Rank 0's view of output_dir decides (other machines need not share its file system).
            path = dist_utils.broadcast_object(self.latest() if self.is_main_process else None)
            if path is None:
                raise FileNotFoundError(f"no checkpoint-N folder in {self.output_dir} to resume from")
        return path

    def save(self, step: int, micro_batches: list[dict[str, Any]], trainer_state: dict[str, Any]) -> Path:
        """Write ``output_dir/checkpoint-<step>`` atomically (a temp folder renamed into place) and return it.

        Every rank must call it: the full state and every rank's queued micro-batches are gathered, rank 0 alone
        writes, and no rank returns before the folder is in place. A kill at any moment leaves the previous
        checkpoints intact and at most a ``.tmp-checkpoint-*`` folder, which the next run removes.

        Args:
            step: the global step.
            micro_batches: this rank's queued micro-batches (dicts of ``[B, ...]`` tensors).
            trainer_state: the trainer's own entries of ``trainer_state.pt`` (picklable).

        Raises:
            CheckpointWriteError: on every rank, when rank 0 could not write (a full disk says how much space a
                checkpoint needs and how much is free).
        """
        final = self.output_dir / f"checkpoint-{step}"
        model_state, optimizer_state = self._full_state_dicts()
        queue = [map_tensors(mb, lambda t: t.cpu()) for mb in micro_batches]
        queues = dist_utils.gather_objects(queue)  # rank order; None on ranks other than 0
        failure = None
        if self.is_main_process:
            state = {
                "step": step, "optimizer": optimizer_state, "lr_scheduler": self.lr_scheduler.state_dict(),
                "rng": rng_state(self.data_generator), "micro_batches_by_rank": queues,
                "world_size": self.world_size, **trainer_state, "config": self.config.to_dict(),
            }  # fmt: skip
            tmp = self.output_dir / f"{TEMP_CHECKPOINT_PREFIX}{step}-{os.getpid()}"
            try:
                self._write(tmp, final, model_state, state)
            except WRITE_ERRORS as err:  # safetensors' SafetensorError too: save_pretrained on a full disk
                shutil.rmtree(tmp, ignore_errors=True)
                with_pretrained = hasattr(self.model, "save_pretrained")
                failure = _write_failure(err, final, self._saved_model_state(model_state)[0], state, with_pretrained)
        # Instead of a barrier: every rank learns whether rank 0's write failed, so none waits for the others.
        failure = dist_utils.broadcast_object(failure)
        if failure is not None:
            raise CheckpointWriteError(failure)
        return final

    def _write(self, tmp: Path, final: Path, model_state: dict[str, Any], state: dict[str, Any]) -> None:
        """Rank 0's files of a checkpoint into ``tmp``, then renamed to ``final``; older ones pruned, leftovers gone."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        saved_state, adapter_only = self._saved_model_state(model_state)
        torch.save({"model": saved_state, "adapter_only": adapter_only}, tmp / "model_state.pt")
        if hasattr(self.model, "save_pretrained"):
            write_pretrained(tmp, self.model, self.tokenizer, model_state, self.config.fsdp, self.model_class_name)
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "config.grpo.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        replace_folder(tmp, final)  # flushed to the disk, and an older checkpoint-<step> deleted only after it
        self._prune(keep=final)
        remove_temp_checkpoints(self.output_dir)  # any a killed save left

    def _saved_model_state(self, model_state: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``model_state.pt``'s entries and whether they are an adapter alone: for a ``PeftModel`` the trainable
        parameters (``param_names``) and buffers, not the frozen base weights (a resumed run's model holds them)."""
        if not is_peft_model(self.model):
            return model_state, False
        keep = {*self.param_names, *(name for name, _ in self.model.named_buffers())}
        return {name: value for name, value in model_state.items() if name in keep}, True

    def _full_state_dicts(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The model's and the optimizer's full state dicts on rank 0 (None elsewhere); a collective under FSDP.

        The optimizer's is in ``torch.optim``'s own format (parameters by index), whatever the wrapping, so a
        checkpoint can be resumed with or without FSDP.
        """
        model_state = full_model_state_dict(self.model, self.config.fsdp)
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=full_state_options())
            if not self.is_main_process:
                return None, None
            return model_state, _optimizer_state_by_index(optimizer_state, self.param_names)
        if not self.is_main_process:
            return None, None
        return model_state, self.optimizer.state_dict()

    def _prune(self, keep: Path) -> None:
        """Delete the oldest ``checkpoint-N`` folders beyond ``save_total_limit``, never ``keep`` (the one just
        written)."""
        limit = self.config.save_total_limit
        if limit is None:
            return
        others = [path for _, path in numbered_checkpoints(self.output_dir) if path != keep]
        for path in others[: max(len(others) - (limit - 1), 0)]:
            shutil.rmtree(path)

    def prune_to_limit(self) -> None:
        """Delete the oldest ``checkpoint-N`` folders beyond ``save_total_limit`` (rank 0; a resumed run's start): a
        kill between a save's rename and its pruning leaves one more."""
        latest = self.latest()
        if latest is not None:
            self._prune(keep=latest)

    def load(
        self, path: str | os.PathLike, reward_names: list[str] | None = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Restore model, optimizer, scheduler and RNG states from a checkpoint folder.

        Every rank calls it; rank 0 reads the folder and sends the state to the others. Queued micro-batches saved
        by another number of processes are re-cut into this run's per-rank slices (see
        :meth:`GRPOTrainer.load_checkpoint`).

        Args:
            path: the checkpoint folder.
            reward_names: this run's reward functions' names, compared with the checkpoint's (a checkpoint saved
                before they were recorded cannot be checked, and is accepted).

        Returns:
            The saved ``trainer_state.pt`` dict (the trainer's own entries among others) and this rank's queued
            micro-batches, on this rank's device.

        The learning-rate schedule and the optimizer's hyperparameters follow this run's config (which may change
        them, :data:`config.RESUMABLE_FIELDS`) at the checkpoint's step.

        Raises:
            ValueError: a field outside :data:`config.RESUMABLE_FIELDS` differs from the checkpoint's, or the
                reward functions (naming ``reward_funcs``; every rank raises, before anything is loaded); or naming
                ``per_device_train_batch_size`` when the global batch differs or this world size does not divide it.
            FileNotFoundError: ``path`` is not a folder.
            CheckpointReadError: a file of the checkpoint cannot be read (damaged, cut short): naming it and the
                newest other checkpoint to resume from.
        """
        path = Path(path)
        # Rank 0 reads; every rank raises what it found (none waits in a collective for rank 0), before anything
        # is loaded.
        saved_config, problem = None, None
        if self.is_main_process:
            if not path.is_dir():
                problem = FileNotFoundError(f"no checkpoint folder {path} to resume from (resume_from_checkpoint)")
            else:
                try:
                    saved_config = _read_checkpoint_file(path, "config.grpo.json", "cpu")
                except CheckpointReadError as err:
                    problem = err
        saved_config, described = dist_utils.broadcast_object((saved_config, _picklable(problem)))
        _raise(described, problem)
        check_resume_config(saved_config, self.config)
        distributed = self.world_size > 1
        location = "cpu" if distributed else self.device
        model_state, state, adapter_only, problem = None, None, False, None
        if self.is_main_process:
            try:
                saved = _read_checkpoint_file(path, "model_state.pt", location)
                model_state, adapter_only = saved["model"], saved.get("adapter_only", False)
                state = _read_checkpoint_file(path, "trainer_state.pt", location)
            except CheckpointReadError as err:
                problem = err
            if problem is None:
                problem = _reward_funcs_problem(state.get("reward_funcs"), reward_names)
            if problem is None and adapter_only:
                message = _adapter_state_problem(model_state, self.model, self.param_names, path)
                message = message or _adapter_config_problem(path, self.model)
                problem = ValueError(message) if message is not None else None
        adapter_only, described = dist_utils.broadcast_object((adapter_only, _picklable(problem)))
        _raise(described, problem)
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # An adapter-only state leaves the frozen base weights as they are (checked complete above).
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not adapter_only)
            set_model_state_dict(self.model, model_state if self.is_main_process else {}, options=options)
            optimizer_state = state.pop("optimizer") if self.is_main_process else None
            state = dist_utils.broadcast_object(state)
            by_name = _optimizer_state_by_name(optimizer_state, self.param_names) if self.is_main_process else {}
            set_optimizer_state_dict(self.model, self.optimizer, by_name, options=options)
        else:
            if self.is_main_process:
                self.model.load_state_dict(model_state, strict=not adapter_only)  # adapter: checked complete above
            if distributed:
                dist_utils.broadcast_module(self.model)
            state = dist_utils.broadcast_object(state)
            self.optimizer.load_state_dict(state["optimizer"])
        del model_state

        saved_world = state.get("world_size", 1)
        saved_per_device = state["config"]["per_device_train_batch_size"]
        per_device = check_resume_batch(saved_per_device * saved_world, self.world_size, self.config)
        queues = state.get("micro_batches_by_rank") or [state["micro_batches"]]  # (a checkpoint of one process)
        if saved_world == self.world_size and saved_per_device == per_device:
            queue = queues[self.rank]
        else:
            queue = _reshard_queues(queues, self.rank, per_device, self.tokenizer.pad_token_id)
        micro_batches = [map_tensors(mb, lambda t: t.to(self.device)) for mb in queue]
        self._follow_config_schedule(state["step"])
        set_rng_state(state["rng"], self.data_generator)
        return state, micro_batches

    def _follow_config_schedule(self, step: int) -> None:
        """The optimizer's hyperparameters from this run's config, and its scheduler moved to ``step``.

        The saved scheduler state is not restored: a run resumed with a new ``learning_rate`` or ``max_steps`` gets
        the schedule of its own config at ``step`` (LambdaLR's closed form ``base_lr * lambda(step)``, the value an
        uninterrupted run computes too, so an unchanged config resumes bit for bit).
        """
        cfg = self.config
        for group in self.optimizer.param_groups:
            group.update(initial_lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                         weight_decay=cfg.weight_decay)  # fmt: skip
        self.lr_scheduler.base_lrs = [cfg.learning_rate] * len(self.optimizer.param_groups)
        self.lr_scheduler.last_epoch = step - 1
        scheduler_step(self.lr_scheduler)  # last_epoch = step, every group's lr = base_lr * lambda(step)


class CheckpointReadError(OSError):
    """A file of a checkpoint cannot be read (the file and the newest other checkpoint are in the message)."""


def _read_checkpoint_file(path: Path, name: str, location: Any) -> Any:
    """``path/name``: JSON for a ``.json`` file, else ``torch.load``'s object on ``location``.

    Raises:
        CheckpointReadError: the file is missing, empty, cut short or not what it should be; naming it and the
            newest other checkpoint of ``path``'s folder.
    """
    file = path / name
    try:
        if name.endswith(".json"):
            return json.loads(file.read_text())
        return torch.load(file, map_location=location, weights_only=False)
    except Exception as err:  # a damaged file fails in many ways (EOFError, UnpicklingError, torch's RuntimeError)
        first_line = str(err).splitlines()[0] if str(err) else "no details"
        first_line = first_line.split(". ")[0]  # torch's message goes on with advice for its own API
        others = [other for _, other in numbered_checkpoints(path.parent) if other.name != path.name]
        if others:
            way_out = f"resume from the newest other checkpoint: --resume {others[-1]}"
        else:
            way_out = f"{path.parent} holds no other checkpoint to resume from"
        raise CheckpointReadError(
            f"cannot read {file} ({type(err).__name__}: {first_line}): the checkpoint is damaged or incomplete (a "
            f"disk fault, or a copy cut short); {way_out}"
        ) from err


def _reward_funcs_problem(saved: list[str] | None, mine: list[str] | None) -> ValueError | None:
    """Why a run scored by the reward functions ``mine`` cannot resume a checkpoint scored by ``saved`` (by name, in
    order: ``reward_weights`` pair with them), or None. A checkpoint without the names (saved before they were
    recorded) cannot be checked: accepted."""
    if saved is None or mine is None or list(saved) == list(mine):
        return None
    return ValueError(
        f"reward_funcs: the checkpoint's run was scored by {list(saved)} and this run by {list(mine)}: what a run "
        "scores may not change on resume. Resume with the same reward functions (in the same order), or start a "
        "new run from the checkpoint's model folder"
    )


def _picklable(problem: BaseException | None) -> tuple[str, str] | None:
    """A problem found by rank 0, as ``(kind, message)`` for :func:`dist_utils.broadcast_object`."""
    return None if problem is None else (type(problem).__name__, str(problem))


def _raise(described: tuple[str, str] | None, found: BaseException | None) -> None:
    """Raise what :func:`_picklable` ``described`` on every rank: rank 0 its own ``found`` (with its cause)."""
    if found is not None:
        raise found
    if described is not None:
        kinds = {cls.__name__: cls for cls in (ValueError, FileNotFoundError, CheckpointReadError)}
        raise kinds[described[0]](described[1])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the folder and, for a full disk, the space needed are in the message)."""


def _write_failure(
    err: BaseException, final: Path, model_state: dict[str, Any], state: dict[str, Any], with_pretrained: bool
) -> str:
    """One message for a failed checkpoint write; a full disk named as such, with the space needed and free."""
    needed = tensor_bytes(model_state) * (2 if with_pretrained else 1) + tensor_bytes(state)
    shortage = space_shortage(err, final, needed)
    first_line = str(err).splitlines()[0] if str(err) else ""
    if shortage is not None:
        return (
            f"no space left to write {final}: a checkpoint {shortage}. Free some space (or lower save_total_limit) "
            f"and resume with --resume; the previous checkpoints are intact ({type(err).__name__}: {first_line})"
        )
    return f"could not write {final}: {type(err).__name__}: {err}"


def check_resume_batch(saved_global_batch: int, world_size: int, config: GRPOConfig) -> int:
    """Checks that a checkpoint of global batch ``saved_global_batch`` can be resumed on ``world_size`` processes.

    Args:
        saved_global_batch: ``per_device_train_batch_size * world_size`` of the run that saved the checkpoint.
        world_size: this run's number of processes.
        config: this run's options.

    Returns:
        The per-process batch, ``config.per_device_train_batch_size``.

    Raises:
        ValueError: naming ``per_device_train_batch_size`` (and the world size when it does not divide the batch).
    """
    per_device = config.per_device_train_batch_size
    if saved_global_batch % world_size != 0:
        raise ValueError(
            f"cannot resume on world_size={world_size} processes: the checkpoint's global batch "
            f"(per_device_train_batch_size x world_size = {saved_global_batch}) is not divisible by {world_size}"
        )
    if per_device * world_size != saved_global_batch:
        raise ValueError(
            f"GRPOConfig.per_device_train_batch_size must be {saved_global_batch // world_size} to resume this "
            f"checkpoint on {world_size} process(es) (its global batch is {saved_global_batch}), got {per_device}"
        )
    return per_device


def _optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch.distributed.checkpoint's optimizer state (parameters by name) -> ``Optimizer.state_dict()``'s format."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]],
    }


def _optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_optimizer_state_by_index`."""
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _adapter_state_problem(state: dict[str, Any], model: torch.nn.Module, names: list[str], path: Path) -> str | None:
    """Why the adapter-only ``state`` of a ``PeftModel``'s checkpoint cannot be loaded into ``model``, or None: it
    must hold every trainable parameter (``names``) and nothing ``model`` lacks (another LoRA config is named)."""
    if not is_peft_model(model):
        return f"{path} holds a peft adapter alone: resume it with its PeftModel, not a {type(model).__name__}"
    missing, unexpected = sorted(set(names) - state.keys()), sorted(state.keys() - model.state_dict().keys())
    if missing or unexpected:
        return (f"{path}'s adapter does not match the model's (another LoRA config?): missing {missing[:3]} "
                f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")  # fmt: skip
    return None


#: adapter_config.json entries that do not define the adapter a run trains (where it was loaded from, how its
#: weights were first drawn: a resumed run loads them), or that peft fills in by version.
_ADAPTER_CONFIG_IGNORED = frozenset({
    "base_model_name_or_path", "revision", "inference_mode", "peft_version", "init_lora_weights", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "auto_mapping",
})  # fmt: skip


def _json_value(value: Any) -> Any:
    """An adapter config value as adapter_config.json holds it, lists of names sorted (peft keeps sets)."""
    if isinstance(value, (set, frozenset, list, tuple)):
        items = [_json_value(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))  # peft's enums (PeftType, TaskType)


def _adapter_config_problem(path: Path, model: torch.nn.Module) -> str | None:
    """Why the checkpoint's adapter (``adapter_config.json``) is not the model's (``lora_alpha``, ``r``,
    ``target_modules``, ...: a resumed run would train another adapter), or None."""
    saved_file = path / "adapter_config.json"
    peft_config = getattr(model, "peft_config", {}).get("default")
    if not saved_file.is_file() or peft_config is None:
        return None
    saved = {k: _json_value(v) for k, v in json.loads(saved_file.read_text()).items()}
    mine = {k: _json_value(v) for k, v in peft_config.to_dict().items()}
    changed = [f"{key}: {saved[key]!r} -> {mine[key]!r}" for key in sorted(saved.keys() & mine.keys())
               if key not in _ADAPTER_CONFIG_IGNORED and saved[key] != mine[key]]  # fmt: skip
    if not changed:
        return None
    return (f"lora: the checkpoint's adapter ({saved_file}) has another config than this run's ({'; '.join(changed)}): "
            "resume with the same lora options, or start a new run from the checkpoint's model folder")


def _reshard_queues(
    queues: list[list[dict[str, Any]]], rank: int, per_device: int, pad_token_id: int
) -> list[dict[str, Any]]:
    """Queued micro-batches saved by ``len(queues)`` ranks, re-cut for ``rank`` of a run with ``per_device`` rows.

    Position ``q`` of every saved queue is one global micro-batch (saved ranks in order); this rank takes rows
    ``[rank * per_device, (rank + 1) * per_device)`` of it, as distributed.local_rows lays out a fresh batch.
    """
    if len({len(queue) for queue in queues}) > 1:
        raise ValueError("corrupt checkpoint: the ranks' queued micro-batch counts differ")
    out = []
    for position in range(len(queues[0])):
        merged = concat_rollouts([queue[position] for queue in queues], pad_token_id)
        rows = slice(rank * per_device, (rank + 1) * per_device)
        out.append({key: None if value is None else value[rows] for key, value in merged.items()})
    return out
