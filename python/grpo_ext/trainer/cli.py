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
import functools
import gc
import importlib
import itertools
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_KEYS = ("model_name_or_path", "dataset", "reward_funcs")
OPTIONAL_RUN_KEYS = ("gguf_file", "eval_dataset", "lora")


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            """A mapping, refusing a key given twice (YAML forbids it; PyYAML would keep the last value silently).

            Keys that ``<<`` merges in may be overridden, as YAML allows; every nested mapping comes through here.
            """
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = first_lines.get(key)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if first is not None:
                    problem = f"duplicate key {key!r}: first on line {first}, again on line {line}"
                    raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
                first_lines[key] = line
            return super().construct_mapping(node, deep=deep)

    # Only forms with an exponent: plain integers keep resolving as ints (the int resolver runs first anyway).
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def load_yaml(text: str) -> Any:
    """YAML, with ``1e-5`` read as a number and a key given twice in a mapping refused.

    PyYAML follows YAML 1.1, where a float needs a dot, so ``1e-5`` would stay the string ``"1e-5"`` (and a
    ``learning_rate: 1e-5`` line in a run file would be refused). YAML 1.2 reads it as a float; so do we. PyYAML
    keeps the last of duplicate keys without a word; a ``yaml.YAMLError`` names the key and both lines here.
    """
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def load_run_file(path: str | Path) -> dict[str, Any]:
    """The options of a YAML run file.

    Raises:
        ValueError: the file is missing, is not valid YAML (naming the line and column), or is not a mapping.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such run file (--config)") from None
    try:
        options = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML ({problem})") from None
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(
            f"{path}: a run file is a mapping of options, one 'key: value' per line, got a {type(options).__name__}"
        )
    return options


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """``["--lr", "1e-5", "--flag", "true"]`` -> ``{"lr": 1e-05, "flag": True}`` (values parsed as YAML)."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise SystemExit(f"grpo-ext: expected --key value, got {token!r}")
        key = token[2:]
        if "=" in key:  # --key=value: the value is kept as given (only the key's dashes are underscores)
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            raw = tokens[i + 1]
            i += 2
        else:
            raise SystemExit(f"grpo-ext: --{key} needs a value")
        key = key.replace("-", "_")
        try:
            overrides[key] = load_yaml(raw)
        except Exception as err:  # yaml.YAMLError: a value that is not YAML, or a mapping with a duplicate key
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ValueError(f"--{key} {raw!r}: not a valid value ({problem})") from None
    return overrides


_REWARD_SPEC = "a reward (a built-in name or package.module:function)"


def reward_spec_list(value: Any) -> list[str]:
    """The run file's ``reward_funcs``: one reward's name or ``module:function``, or a list of them.

    Raises:
        ValueError: naming ``reward_funcs`` (and the entry) when it is something else, a number or a mapping, or an
            empty list.
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"reward_funcs must be {_REWARD_SPEC} or a list of them, got {value!r} "
                         f"({type(value).__name__})")  # fmt: skip
    if not value:
        raise ValueError("reward_funcs is empty: give at least one reward")
    for i, spec in enumerate(value):
        if not isinstance(spec, str):
            raise ValueError(f"reward_funcs[{i}] must be {_REWARD_SPEC}, got {spec!r} ({type(spec).__name__})")
    return value


def resolve_reward(spec: str):
    """A built-in reward by name, ``module:function`` (an importable module), or ``path/to/file.py:function`` (a
    Python file, relative to the working directory)."""
    from .rewards import BUILTIN_REWARDS

    if isinstance(spec, str) and spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward_funcs: unknown reward {spec!r}; use one of {', '.join(BUILTIN_REWARDS)}, "
                         "package.module:function or path/to/file.py:function")  # fmt: skip
    module_name, func_name = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        module = _import_file(module_name, spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"reward_funcs: cannot import {module_name!r} for {spec!r} ({err})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"reward_funcs: module {module_name!r} has no function {func_name!r}")
    return func


def _import_file(path: str, spec: str) -> Any:
    """The module of a Python file (run once per file and process: its module name is its resolved path)."""
    import importlib.util

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"reward_funcs: no file {path} for {spec!r} (a path relative to {Path.cwd()})")
    name = f"grpo_ext_reward_file_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"reward_funcs: importing {path} for {spec!r} failed ({type(err).__name__}: {err})") from None
    return module


def lora_config(lora: Any) -> Any:
    """``peft.LoraConfig(task_type="CAUSAL_LM", **lora)`` of the run file's ``lora`` mapping.

    Raises:
        ValueError: naming ``lora`` when it is not a mapping, peft is missing, or LoraConfig refuses a field.
    """
    if not isinstance(lora, dict):
        raise ValueError(f"lora must be a mapping of peft.LoraConfig fields (e.g. {{r: 16, lora_alpha: 32}}), got "
                         f"{lora!r} ({type(lora).__name__})")  # fmt: skip
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("lora needs the peft package: pip install peft") from None
    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
    except (TypeError, ValueError) as err:
        raise ValueError(f"lora: {err}") from None


def load_jsonl(path: str | Path, key: str = "dataset") -> list[dict[str, Any]]:
    """Rows of a JSONL file; each must be an object with a ``prompt``: a string, or a list of messages
    (``{"role": ..., "content": ...}`` objects, rendered with the tokenizer's chat template).

    Args:
        path: the JSONL file.
        key: the run key that names it (``dataset`` or ``eval_dataset``), for the errors.

    Raises:
        ValueError: the file is missing or empty, or a line is not JSON or has no prompt (naming file and line).
    """
    rows = []
    if not Path(path).is_file():
        raise ValueError(f"{key}: no such file {path}")
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict) or not _is_prompt(row.get("prompt")):
                raise ValueError(f"{path}:{number}: every row needs a 'prompt' string or list of messages "
                                 '([{"role": "user", "content": "..."}])')  # fmt: skip
            rows.append(row)
    if not rows:
        raise ValueError(f"{key}: {path} has no rows")
    return rows


def jsonl_line_number(path: str | Path, row: int) -> int:
    """The line of ``path`` that holds row ``row`` of :func:`load_jsonl` (which skips blank lines)."""
    with open(path) as f:
        filled = (number for number, line in enumerate(f, 1) if line.strip())
        return next(itertools.islice(filled, row, None))


def _is_prompt(value: Any) -> bool:
    """A string, or a non-empty list of ``{"role": str, "content": ...}`` messages."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
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
    check_fresh_run(Path(config.output_dir), bool(resume), config.overwrite_output_dir)
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

    if args.overwrite and args.resume:
        raise ValueError("--overwrite starts over, --resume continues: give one of them")
    options = load_run_file(args.config)
    options.update(overrides)
    if args.fsdp is not None:
        options["fsdp"] = args.fsdp
    if args.overwrite:
        options["overwrite_output_dir"] = True
    train_from_options(options, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
