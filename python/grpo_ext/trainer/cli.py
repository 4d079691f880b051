"""``grpo-ext train --config run.yaml [--key value ...]`` and ``grpo-ext demo [--key value ...]``.

A run file holds GRPOConfig fields plus ``model_name_or_path`` (a local model folder), optionally ``gguf_file`` (a
GGUF file in that folder, or a path to one: transformers dequantizes its weights to float32 and builds the tokenizer,
chat template included, from it), ``dataset`` (a JSONL file with a ``prompt`` column, a string or a list of
messages, and any others for the rewards), optionally ``eval_dataset`` (held-out rows of the same form: greedy
completions scored before, every ``eval_steps`` and after training), ``reward_funcs`` (built-in names ``accuracy``,
``format``, ``graded_answer``, ``package.module:function``, or ``path/to/file.py:function``) and optionally ``lora``
(a mapping of ``peft.LoraConfig`` fields: the model is wrapped with ``peft.get_peft_model`` and only the adapter
trains). ``--key value`` overrides a key; values are read as YAML, so ``--learning_rate 1e-5``, ``--bf16 false``,
``--reward_weights [1,0.5]`` and ``--lora "{r: 16}"`` work.

Under ``torchrun`` (``torchrun --nproc_per_node=N -m grpo_ext.trainer.cli train ...``) each process joins the
default process group (NCCL on GPUs, gloo on CPUs) and trains its share with DDP, or FSDP2 with ``--fsdp``;
``per_device_train_batch_size`` is per process.

A finished run leaves the trained model (a LoRA run: its adapter) and the tokenizer in ``output_dir/final_model``,
named by the last line it prints. Errors are one line naming the file, line or field and what to do (exit status 1;
``--debug`` shows the traceback); SIGINT/SIGTERM save a checkpoint and exit with 130/143 (README "Failure behaviour").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .run_file import (
    OPTIONAL_RUN_KEYS,
    RUN_KEYS,
    jsonl_line_number,
    load_jsonl,
    load_run_file,
    load_yaml,
    lora_config,
    parse_overrides,
    resolve_reward,
    reward_spec_list,
)


def gguf_path(model_name_or_path: Any, gguf_file: Any) -> Path:
    """The GGUF file a run names: ``gguf_file`` inside the ``model_name_or_path`` folder (or an absolute path).

    Raises:
        ValueError: naming ``gguf_file`` when it is not a string or there is no such file.
    """
    if not isinstance(gguf_file, str) or not gguf_file:
        raise ValueError(f"gguf_file must be a file name (in the model_name_or_path folder) or a path, got "
                         f"{gguf_file!r} ({type(gguf_file).__name__})")  # fmt: skip
    folder = Path(str(model_name_or_path)).expanduser()
    path = folder / Path(gguf_file).expanduser()  # an absolute gguf_file stays as it is
    if not path.is_file():
        raise ValueError(f"gguf_file: no GGUF file {path} (gguf_file {gguf_file!r} in model_name_or_path "
                         f"{model_name_or_path})")  # fmt: skip
    return path


def load_model_and_tokenizer(model_name_or_path: Any, gguf_file: str | None = None, device: Any = None):
    """The causal LM and its tokenizer, as ``grpo-ext train`` loads them.

    Args:
        model_name_or_path: a local folder written by ``save_pretrained`` (config.json and the weights), or, with
            ``gguf_file``, the folder that holds the GGUF file (it needs no config.json).
        gguf_file: a GGUF file in that folder (or a path to one). transformers reads it with the ``gguf``
            package: the weights are dequantized to float32, the tokenizer (and its chat template) comes from the
            file's metadata.
        device: where to put the model (default: where it loads, the CPU).

    Returns:
        ``(model, tokenizer)``. A tokenizer without a pad token pads with its EOS (padding is on the left for
        generation, and padded positions are masked). A GGUF model is a plain float32 model (``is_quantized`` False),
        which ``save_pretrained`` writes as safetensors.

    Raises:
        ValueError: naming ``model_name_or_path`` or ``gguf_file`` when the folder or the file is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra: dict[str, Any] = {}
    if gguf_file is not None:
        path = gguf_path(model_name_or_path, gguf_file)
        model_name_or_path, extra = str(path.parent), {"gguf_file": path.name}
    else:
        check_model_folder(model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **extra)
    quantizer = getattr(model, "hf_quantizer", None)
    if gguf_file is not None and quantizer is not None:
        # The GGUF weights are dequantized to plain float32 tensors, but transformers keeps the GGUF quantizer on the
        # model, and with it save_pretrained refuses the model ("not serializable"): checkpoints would fail.
        quantizer.remove_quantization_config(model)
    if device is not None:
        model.to(device)
    return model, tokenizer


def check_model_folder(path: Any) -> None:
    """Raises ValueError naming ``model_name_or_path`` unless it is a folder that holds a ``config.json``.

    (transformers would report a missing folder as an invalid "Repo id" or try to download it.)
    """
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ValueError(f"model_name_or_path: no model folder {path} (give a local folder written by "
                         "save_pretrained, with config.json and the weights)")  # fmt: skip
    if not (folder / "config.json").is_file():
        raise ValueError(f"model_name_or_path: {path} has no config.json (is it a model folder?)")


def _expand_user(path: Any) -> Any:
    """``~`` and ``~user`` at the start of a path string expanded; anything else (None, a number) as it is."""
    return os.path.expanduser(path) if isinstance(path, str) else path


def train_from_options(options: dict[str, Any], resume: str | bool | None = None) -> list[dict[str, float]]:
    """Build model, tokenizer, dataset, rewards and config from a run's options and train.

    Args:
        options: GRPOConfig fields plus ``model_name_or_path``, ``dataset``, ``reward_funcs`` and optionally
            ``gguf_file``, ``eval_dataset`` and ``lora``.
        resume: a checkpoint folder, True for the latest in ``output_dir``, or None.

    Returns:
        The logged metrics (see :meth:`GRPOTrainer.train`).
    """
    from . import distributed
    from .config import GRPOConfig, unknown_keys_error
    from .prompts import EmptyPromptError
    from .run_folder import check_fresh_run
    from .trainer import GRPOTrainer

    options = dict(options)
    known = [f.name for f in dataclasses.fields(GRPOConfig)] + list(RUN_KEYS) + list(OPTIONAL_RUN_KEYS)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise unknown_keys_error(unknown, known, "the run config")
    missing = [key for key in RUN_KEYS if options.get(key) is None]
    if missing:
        raise ValueError(f"the run config lacks {', '.join(missing)} (give it in the run file or as --key value)")
    # A run file's paths are not expanded by a shell: ~ is the home folder here too (transformers would read a
    # literal ~/models/x as a Hub repo id)
    model_path = _expand_user(options.pop("model_name_or_path"))
    gguf_file = options.pop("gguf_file", None)
    dataset_path = _expand_user(options.pop("dataset"))
    eval_path = _expand_user(options.pop("eval_dataset", None))
    lora = options.pop("lora", None)
    reward_specs = reward_spec_list(options.pop("reward_funcs"))
    config = GRPOConfig.from_dict(options)
    # Everything that can be checked before a process group exists or a model loads.
    check_fresh_run(Path(config.output_dir), resume, config.overwrite_output_dir)
    if gguf_file is not None:
        gguf_path(model_path, gguf_file)
    else:
        check_model_folder(model_path)
    rows = load_jsonl(dataset_path)
    eval_rows = load_jsonl(eval_path, "eval_dataset") if eval_path is not None else None
    peft_config = lora_config(lora) if lora is not None else None
    reward_funcs = [resolve_reward(s) for s in reward_specs]
    created_group, device = distributed.init_from_env()  # a process group when launched by torchrun
    try:
        model, tokenizer = load_model_and_tokenizer(model_path, gguf_file, device)
        if peft_config is not None:
            from peft import get_peft_model

            from .seeding import seed_everything

            seed_everything(config.seed)  # the adapters' random init: the run's seed, as TRL seeds before peft
            model = get_peft_model(model, peft_config)
        try:
            trainer = GRPOTrainer(model, reward_funcs, rows, config, tokenizer=tokenizer, eval_dataset=eval_rows)
        except EmptyPromptError as err:  # the row's line in its file, which the trainer does not know
            path = dataset_path if err.dataset == "train_dataset" else eval_path
            raise ValueError(f"{path}:{jsonl_line_number(path, err.row)}: {err}") from None
        history = trainer.train(resume_from_checkpoint=resume)
        if trainer.is_main_process:
            print(f"metrics: {trainer.metrics_path}\ncurves: {trainer.plot_path if config.plot else '(plot off)'}\n"
                  f"model: {trainer.final_model_path}")  # fmt: skip
    finally:
        if created_group:
            # the trainer's DDP/FSDP2 wrappers hold the group: released and collected first, so that destroying it
            # stops gloo's/NCCL's threads now, not during the interpreter's exit (where a late teardown can abort)
            trainer = model = None
            gc.collect()
            distributed.destroy()
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-ext`` command.

    Returns:
        The exit status: 0, 1 for an error (one line on stderr naming the file, line or field), 128 + the signal
        number when SIGINT (130) or SIGTERM (143) stopped training after a checkpoint.
    """
    from .guards import TrainingInterrupted

    # allow_abbrev=False: a prefix such as --over must not be read as --overwrite (which deletes a run's outputs)
    parser = argparse.ArgumentParser(prog="grpo-ext", description="GRPO training with grpo_ext's kernels",
                                     allow_abbrev=False)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a local model on a JSONL dataset", allow_abbrev=False)
    train.add_argument("--config", required=True, help="YAML run file")
    train.add_argument(
        "--resume", nargs="?", const=True, default=None, help="resume from the latest checkpoint (or the one given)"
    )
    train.add_argument("--overwrite", action="store_true", help="delete a previous run's outputs in output_dir first")
    train.add_argument("--fsdp", nargs="?", const=True, default=None, type=_flag_value, metavar="true|false",
                       help="under torchrun: shard the model with FSDP2 (not DDP); --fsdp false overrides a run file")
    demo = sub.add_parser("demo", help="the embedded default: a tiny LLaMA learns to reverse digits",
                          allow_abbrev=False)  # fmt: skip
    demo.add_argument("--num-threads", type=int, default=None)
    for command in (train, demo):
        command.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args, rest = parser.parse_known_args(argv)
    try:
        return _run(args, rest)
    except TrainingInterrupted as stop:
        print(f"grpo-ext: {stop}", file=sys.stderr)
        return stop.exit_code
    except Exception as err:
        if args.debug:
            raise
        print(f"grpo-ext: error: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return 1


def _flag_value(text: str) -> bool:
    """A command-line flag's value: true or false (as YAML spells them), else argparse's error naming the flag."""
    value = load_yaml(text)
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _one_line(err: BaseException) -> str:
    """An exception as one line: grpo_ext's own errors are one line already; others get their type's name."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return text if isinstance(err, (ValueError, OSError, RuntimeError)) and text else f"{type(err).__name__}: {text}"


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    overrides = parse_overrides(rest)
    if args.command == "demo":
        from .demo import run_demo

        result = run_demo(num_threads=args.num_threads, **overrides)
        return 0 if result.learned else 1

    options = load_run_file(args.config)
    options.update(overrides)
    if args.overwrite and args.resume:
        from .config import GRPOConfig
        from .run_folder import foreign_checkpoint

        # Only another folder's checkpoint resumes into a cleaned output_dir; output_dir's own would be deleted.
        output_dir = _expand_user(options.get("output_dir", GRPOConfig.output_dir))
        if isinstance(output_dir, str) and foreign_checkpoint(Path(output_dir), args.resume) is None:
            raise ValueError("--overwrite starts over, --resume continues: give one of them (--overwrite goes with "
                             "--resume only for another folder's checkpoint, --resume path/checkpoint-N)")  # fmt: skip
    if args.fsdp is not None:
        options["fsdp"] = args.fsdp
    if args.overwrite:
        options["overwrite_output_dir"] = True
    train_from_options(options, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
