"""Benchmark of one full GRPO training step, as TRL ships it: grpo_ext's trainer, TRL 1.16's and GRPOExtTrainer's.

Each contender runs in a fresh process (so that its peak memory is its own) on the same random-init Qwen2-style model
(``--shape``: ``small``, hidden 256, 2 layers, 4 heads, 2 key/value heads, MLP 2 x hidden, untied LM head;
``qwen2.5-0.5b``: H 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, V 151936, tied embeddings as the real model;
``qwen2.5-1.5b``: H 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, V 151936, tied; ``--layers N`` cuts the depth,
and the case then says so; ``--hidden``, ``--heads``, ``--kv-heads``, ``--intermediate`` override the preset; built
in the script, nothing downloaded) and the same batch (``--batch`` completions, ``num_generations`` 4, prompts of
``--prompt-length`` tokens, completions of exactly ``T`` tokens, ``loss_type="dapo"``, one micro-batch per step).
Contenders:

* ``grpo_ext/<backend>``: :class:`grpo_ext.trainer.GRPOTrainer` with ``GRPOConfig(logps_backend=<backend>)``, for
  ``plain`` and ``fused``; a backend the installed GRPOConfig does not accept is reported n/a, and then the backends it
  does accept are run instead (so the script measures whatever exists in the checkout);
* ``trl``: TRL 1.16's own ``trl.GRPOTrainer``, unpatched (its ``add_fused_lm_head`` chunked LM head included);
* ``trl+grpo_ext/<backend>``: ``grpo_ext.integrations.trl.GRPOExtTrainer(logps_backend=<backend>)``.

The step as TRL ships it (each setting a row of the case, or a case):

* ``--precision bf16,fp32`` (default bf16, TRL's default ``bf16=True``). TRL's contenders get the model the way TRL
  1.16 loads it by default: the script saves the random-init model and passes its directory, which TRL's
  ``create_model_from_path`` loads in float32 (its default ``dtype``; not the checkpoint's); with ``bf16=True``
  transformers sets ``mixed_precision="bf16"`` and the step runs as ``Trainer.train()`` runs it:
  ``accelerator.prepare(model, optimizer)`` wraps the model's forward in ``torch.autocast(<device>, bfloat16)``
  (TRL's loss also enters ``accelerator.autocast()``), so weights, gradients and AdamW state stay float32 and the
  forward (and the checkpoint recompute) autocasts to bfloat16. grpo_ext's trainer gets ``GRPOConfig(bf16=True)``,
  its own option: bfloat16 autocast around its forward, loss and generation, on CUDA only; on the CPU that autocast
  is a no-op, so the script gives it ``torch.autocast("cpu", bfloat16)`` at the same places (its trainer and rollout
  modules' ``bf16_autocast``), float32 weights as TRL's. ``fp32``: ``bf16=False`` everywhere.
* ``--gradient-checkpointing on|off|both`` (default on, TRL's default): transformers' activation checkpointing with
  ``use_reentrant=False``, enabled for TRL's contenders as ``Trainer.train()`` enables it
  (``activation_checkpointing_enable``, ``gradient_checkpointing_enable`` before transformers 5; this script calls
  TRL's loss itself, so it repeats that step), and by ``GRPOConfig(gradient_checkpointing=...)`` for grpo_ext's
  trainer; a row without it ends in ``[no ckpt]``. ``both`` gives each contender both rows.
* ``--beta 0,0.04`` (default 0): each value a case. ``beta > 0`` builds a reference model as each contender does
  (TRL: ``create_model_from_path`` of the policy's directory; grpo_ext's trainer: a deep copy of the policy); the
  fixed batch then carries reference log-probs (the float32 model's, plus seeded noise of std 0.05, so that the KL
  term has a gradient from the first step on), and the reference forward is part of ``gen+step``, where both
  trainers run it (scoring), not of ``step``.

Figures per contender, case by case:

* ``step``: forward, backward, gradient clipping and the AdamW update of one step on a fixed batch (generation
  excluded), median of ``--steps`` timed steps after one warm-up step;
* ``gen+step``: the same contender's own generation of a batch (``T`` new tokens at most, sampling) and scoring (the
  reference model's forward with ``beta > 0``), then the step on it, timed once; ``gen %``: the share of it spent
  in the model's ``generate`` (timed around it);
* ``peak MiB``: on the CPU the process's peak RSS during the timed steps above its RSS just before them (Linux
  ``VmHWM`` reset through ``/proc/self/clear_refs``; glibc is told to return large blocks to the system), so the
  model, its gradients, the optimizer state and the reference model, allocated before or by the warm-up step, are
  not counted; on CUDA the allocator's peak above what was allocated before.
* ``--profile``: where the time of the timed steps goes (torch.profiler over them), per step: the decoder layers'
  forward, their backward (the checkpoint recompute included), the LM head + log-probs + loss forward and backward,
  the optimizer (AdamW's step and zero_grad) and the rest (gradient clipping, embedding and its gradient, final
  norm, input preparation, metrics, Python). Method: each profiler event's self time goes to one part. Forward: module
  hooks put the decoder layers in ``record_function`` ranges and mark the backbone's end; what runs after it and
  before the backward is the head + loss. Backward: autograd runs each node in an ``evaluate_function`` event whose
  sequence number is that of the forward op that made the node (on the forward thread, ``fwd_thread_id``); the hooks
  record the sequence numbers at each layer's start and end and at the backbone's end, so each backward event goes
  to the part whose forward made it, and the checkpoint recompute, run inside the first backward node of its layer,
  goes with it. On CUDA the parts are device (kernel) time and ``rest`` is the step's wall time less them (idle
  included); the CPU rows check that the parts' events sum to the profiled step time (printed). The profiled steps
  are the timed ones. Also per contender the GEMM floor: the median time of the three ``[N, H] x [H, V]`` products
  of an LM head (forward logits, gradient of the input, gradient of the weight) at the case's N = B x T completion
  tokens, H, V and compute dtype (bfloat16 under ``bf16``), timed in the same process after the steps; ``head / GEMMs``
  is the LM head + loss part (forward + backward) over it. (TRL's chunked head scores only the completion tokens on
  Triton devices; elsewhere, the CPU included, every position of every row: B x (P + T - 1).)
* ``--memory-sites``: one more step with its allocations recorded (CUDA: the allocator's history; the CPU:
  ``torch.profiler``'s memory events); what is alive at its peak, summed by the innermost Python frame outside torch
  that allocated it (``memory_sites.py``): where a contender's peak above another's comes from.

``--hidden-chunk-rows R``: the grpo_ext contenders' ``grpo_loss_from_hidden`` in chunks of R rows instead of its
default (the case name gets ``chunk=R``): the step's time and peak against the chunk length.

``--max-logits-gib`` skips a contender (n/a) whose step would hold the ``[B, P + T, V]`` float32 logits above that
size (the plain path on a small machine).

Usage::

    python benchmarks/bench_trainer.py           # small shape, V in {32000, 151936} x T in {256, 1024}
    python benchmarks/bench_trainer.py --quick   # smoke run (CI): V=512, T=16, hidden 32
    python benchmarks/bench_trainer.py --shape qwen2.5-0.5b --layers 2 --lengths 128 --precision bf16,fp32 \\
        --beta 0,0.04 --contenders trl,trl+grpo_ext/fused,grpo_ext/fused --profile
    python benchmarks/bench_trainer.py --contenders trl,trl+grpo_ext/fused --options top_entropy_quantile=0.2

``--options KEY=VALUE,...`` sets loss options of every contender's config (TRL's names: ``entropy_coef``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, ...); a grpo_ext trainer contender whose GRPOConfig lacks
one is reported n/a. The fixed batch has no old log-probs, so ``off_policy_mask_threshold`` keeps every row (the
sampling log-probs are the current ones) while still computing its mask.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness`, wherever run from

import torch

import memory_sites
from harness import cli, environment, reporting
from trainer_step import NUM_GENERATIONS, run_child

BACKENDS = ("plain", "fused")
CONTENDERS = ("grpo_ext/plain", "grpo_ext/fused", "trl", "trl+grpo_ext/fused", "trl+grpo_ext/plain")
RESULT_PREFIX = "RESULT "
NO_CHECKPOINTING = " [no ckpt]"
#: Model shapes: ``vocab`` None takes ``--vocabs``; ``intermediate`` None is 2 x hidden. Qwen2.5's from its configs.
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=None, vocab=None, tied=False),
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True),
}
#: Largest relative gap of the contenders' first-step gradient norms, per precision: bfloat16 autocast rounds the
#: logits and activations differently on each path (TRL's chunks, grpo_ext's fused head), float32 only sums apart.
GRAD_NORM_RTOL = {"fp32": 1e-3, "bf16": 2e-2}


# ---------------------------------------------------------------------------------------------------------------
# the parent: one fresh process per contender and case
# ---------------------------------------------------------------------------------------------------------------


def accepted_backends() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(the values of BACKENDS grpo_ext's GRPOConfig accepts as logps_backend, its other accepted values)``."""
    from grpo_ext.trainer import GRPOConfig

    def accepts(value: str) -> bool:
        try:
            GRPOConfig(logps_backend=value)
        except (TypeError, ValueError):
            return False
        return True

    if not hasattr(GRPOConfig(), "logps_backend"):
        return (), ()
    return tuple(v for v in BACKENDS if accepts(v)), tuple(v for v in ("torch", "grpo_ext") if accepts(v))


def parse_options(text: str | None) -> dict[str, Any]:
    """``KEY=VALUE,...`` as config overrides: numbers as numbers, ``true``/``false`` as bools, the rest as text.

    Raises:
        ValueError: an item that is not ``KEY=VALUE``.
    """
    options: dict[str, Any] = {}
    for item in cli.parse_list(text or ""):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"takes KEY=VALUE items, got {item!r}")
        try:
            options[key] = json.loads(value.lower() if value.lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def select_contenders(
    requested: list[str], options: dict[str, Any], checkpointing: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The contenders to run, and those that cannot run in this checkout with the reason (GRPOConfig's backends and
    fields; ``checkpointing`` needs its ``gradient_checkpointing``)."""
    import dataclasses

    from grpo_ext.trainer import GRPOConfig

    found, others = accepted_backends()
    needed = set(options) | ({"gradient_checkpointing"} if checkpointing else set())
    lacking = sorted(needed - {field.name for field in dataclasses.fields(GRPOConfig)})
    run: list[str] = []
    missing: dict[str, str] = {}
    for name in requested:  # each one of CONTENDERS (--contenders' type checked it)
        backend = name.removeprefix("grpo_ext/")
        if name.startswith("grpo_ext/") and backend not in found:
            missing[name] = f"grpo_ext's GRPOConfig does not accept logps_backend={backend!r} in this checkout"
        elif name.startswith("grpo_ext/") and lacking:
            missing[name] = f"grpo_ext's GRPOConfig has no {', '.join(lacking)}"
        else:
            run.append(name)
    if missing and not lacking:  # measure what exists instead: the backends the installed GRPOConfig has
        run += [f"grpo_ext/{value}" for value in others]
    return run, missing


def run_case(case: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One contender on one case in a fresh process; the row (times, peak) or a row with the reason it is n/a."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")  # freed blocks leave RSS
    cmd = [sys.executable, __file__, "--child", json.dumps(case)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return dict(note=f"over the {timeout_s:.0f} s limit per contender")
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(note=f"failed (exit {result.returncode}): {tail[0][:200]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def check_grad_norms(rows: list[dict[str, Any]]) -> bool:
    """Prints, per case, how far the contenders' first-step gradient norms are apart; False when above the case's
    tolerance (:data:`GRAD_NORM_RTOL` of its precision).

    Every contender starts from the same parameters and trains on the same batch, so the norms of their first
    gradients must agree (up to float32 summation order, or bfloat16 rounding under autocast): a check that each one
    computed the same step.
    """
    ok = True
    for case in dict.fromkeys(row["case"] for row in rows):
        norms = {row["impl"]: row["grad_norm"] for row in rows if row["case"] == case and "grad_norm" in row}
        if not norms:
            continue
        rtol = GRAD_NORM_RTOL[next(row["precision"] for row in rows if row["case"] == case)]
        reference = statistics.median(norms.values())
        spread = max(abs(n - reference) for n in norms.values()) / max(abs(reference), 1e-12)
        ok = ok and spread <= rtol
        status = "ok" if spread <= rtol else "MISMATCH"
        print(f"check {case}: first-step gradient norms {', '.join(f'{k} {v:.6g}' for k, v in norms.items())}; "
              f"largest relative gap {spread:.1e} ({status}, tolerance {rtol:g})")  # fmt: skip
    return ok


def shape_of(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The model's dimensions from ``--shape`` and the overrides, and the case's label for them."""
    preset = SHAPES[args.shape]
    small_quick = args.quick and args.shape == "small"
    dims = dict(
        hidden=args.hidden or (32 if small_quick else preset["hidden"]),
        layers=preset["layers"] if args.layers is None else args.layers,
        heads=args.heads or preset["heads"], kv_heads=args.kv_heads or preset["kv_heads"],
        intermediate=args.intermediate or preset["intermediate"], tied=preset["tied"],
    )  # fmt: skip
    label = args.shape
    if dims["layers"] < preset["layers"] and args.shape != "small":
        label += f" (cut to {dims['layers']} of {preset['layers']} layers)"
    elif args.shape != "small" and any(dims[key] != preset[key] for key in ("hidden", "heads", "kv_heads",
                                                                            "intermediate", "layers")):  # fmt: skip
        label += " (modified)"
    return dims, label


def add_derived(row: dict[str, Any], device: torch.device) -> None:
    """The table's columns computed from a child's result: the generation's share, the parts, head vs its GEMMs."""
    if row.get("gen_ms") is not None and row.get("gen_step_ms"):
        row["gen_pct"] = 100.0 * row["gen_ms"] / row["gen_step_ms"]
    profile = row.get("profile")
    if profile:
        parts = profile["device"] if device.type == "cuda" else profile["cpu"]
        row.update({f"part_{part}": ms for part, ms in parts.items()})
        row["head_ms"] = parts["head_fwd"] + parts["head_bwd"]
        if row.get("gemm_floor_ms"):
            row["head_vs_floor"] = row["head_ms"] / row["gemm_floor_ms"]


def positive_ints_arg(text: str) -> str:
    """The ``type`` of ``--vocabs`` and ``--lengths``: comma-separated positive integers (kept as text)."""
    values = cli.parse_list(text)
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no value: comma-separated positive integers")
    for value in values:
        cli.positive_int(value)
    return text


def betas_arg(text: str) -> str:
    """The ``type`` of ``--beta``: comma-separated numbers >= 0 (kept as text)."""
    try:
        betas = [float(b) for b in cli.parse_list(text)]
    except ValueError:
        betas = []
    if not betas or not all(0 <= b < float("inf") for b in betas):
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers >= 0")
    return text


def options_arg(text: str) -> str:
    """The ``type`` of ``--options``: :func:`parse_options`'s ``KEY=VALUE`` items (kept as text)."""
    try:
        parse_options(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main() -> None:
    # each contender's own loop times its steps (--steps) in its own process: none of the shared timing options
    parser = cli.make_parser(__doc__, ())
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small",
                        help="model shape preset (default small: hidden 256, 2 layers; the Qwen2.5 ones as released)")
    parser.add_argument("--vocabs", default=None, type=positive_ints_arg,
                        help="comma-separated V (default: the shape's, or 32000,151936 for small; quick: 512)")
    parser.add_argument("--lengths", default=None, type=positive_ints_arg,
                        help="comma-separated completion lengths T (default 256,1024)")  # fmt: skip
    parser.add_argument("--batch", type=cli.positive_int, default=None,
                        help=f"completions per step, a multiple of {NUM_GENERATIONS} (default 8; quick: 4)")
    parser.add_argument("--prompt-length", type=cli.positive_int, default=None,
                        help="prompt tokens (default 32; quick: 4)")  # fmt: skip
    parser.add_argument("--hidden", type=cli.positive_int, default=None,
                        help="hidden size (default: the shape's; quick: 32)")  # fmt: skip
    parser.add_argument("--layers", type=cli.positive_int, default=None,
                        help="decoder layers (default: the shape's; fewer cut the depth, said in the case)")
    parser.add_argument("--heads", type=cli.positive_int, default=None, help="attention heads (default: the shape's)")
    parser.add_argument("--kv-heads", type=cli.positive_int, default=None,
                        help="key/value heads (default: the shape's)")  # fmt: skip
    parser.add_argument("--intermediate", type=cli.positive_int, default=None,
                        help="MLP width (default: the shape's; small: 2 x hidden)")
    parser.add_argument("--precision", default="bf16", type=cli.choices_arg(tuple(GRAD_NORM_RTOL)),
                        help="comma-separated bf16 (TRL's default: float32 weights, bf16 autocast) and/or fp32")
    parser.add_argument("--beta", default="0", type=betas_arg,
                        help="comma-separated KL coefficients; > 0 builds a reference model")  # fmt: skip
    parser.add_argument("--steps", type=cli.positive_int, default=None,
                        help="timed steps per contender (default 3; quick: 1)")  # fmt: skip
    parser.add_argument("--contenders", default=",".join(CONTENDERS), type=cli.choices_arg(CONTENDERS),
                        help="comma-separated: " + ", ".join(CONTENDERS))  # fmt: skip
    parser.add_argument("--max-logits-gib", type=cli.positive_float, default=None,
                        help="skip a contender holding [B, P+T, V] float32 logits above this (default: none)")
    parser.add_argument("--no-generation", action="store_true", help="skip the gen+step figure (reported n/a)")
    parser.add_argument("--profile", action="store_true",
                        help="where the timed steps' time goes (torch.profiler), and the LM head's GEMM floor")
    parser.add_argument("--memory-sites", action="store_true",
                        help="one more step with its allocations recorded (CUDA: the allocator's history; CPU: "
                             "torch.profiler's memory events); what is alive at its peak, by the code that allocated "
                             "it (memory_sites.py)")  # fmt: skip
    parser.add_argument("--hidden-chunk-rows", type=cli.positive_int, default=None,
                        help="rows per chunk of grpo_loss_from_hidden in the grpo_ext contenders (default: the op's "
                             "own rule, default_chunk_size): longer chunks read and write the float32 weight-gradient "
                             "accumulator fewer times, for a chunk of logits that much larger")  # fmt: skip
    parser.add_argument("--timeout-s", type=cli.positive_float, default=1800.0, help="limit per contender and case")
    parser.add_argument("--options", default=None, type=options_arg,
                        help="KEY=VALUE,... loss options of every contender's config (e.g. entropy_coef=0.01)")
    parser.add_argument("--gradient-checkpointing", choices=("off", "on", "both"), default="on",
                        help="transformers' activation checkpointing for every contender (default on, as TRL; rows "
                             "without it end in [no ckpt]); both: each contender with and without")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON of one case: run it in this process
    args = parser.parse_args()
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    quick = args.quick
    batch = args.batch if args.batch is not None else (4 if quick else 8)
    if batch % NUM_GENERATIONS:
        parser.error(f"argument --batch: {batch} is not a multiple of num_generations={NUM_GENERATIONS}")

    device = environment.resolve_device(args.device)
    env = environment.environment(device)
    print(f"device: {env['device_name']} | torch {env['torch_version']} | CUDA {env['cuda_version']}")
    dims, shape_label = shape_of(args)
    preset_vocab = SHAPES[args.shape]["vocab"]
    default_vocabs = "512" if quick and args.shape == "small" else str(preset_vocab or "32000,151936")
    vocabs = [int(v) for v in cli.parse_list(args.vocabs or default_vocabs)]
    lengths = [int(t) for t in cli.parse_list(args.lengths or ("16" if quick else "256,1024"))]
    precisions = cli.parse_list(args.precision)
    betas = [float(b) for b in cli.parse_list(args.beta)]

    def given(value: int | None, default: int) -> int:  # None only: every value given was checked positive
        return default if value is None else value

    shape = dict(
        dims, batch=batch, prompt_length=given(args.prompt_length, 4 if quick else 32),
        steps=given(args.steps, 1 if quick else 3), seed=args.seed, device=str(device),
        generation=not args.no_generation, options=parse_options(args.options), profile=args.profile,
        memory_sites=args.memory_sites, hidden_chunk_rows=args.hidden_chunk_rows,
    )  # fmt: skip
    settings_on = {"off": [False], "on": [True], "both": [True, False]}[args.gradient_checkpointing]
    requested = cli.parse_list(args.contenders)
    contenders, missing = [], {}
    for checkpointing in settings_on:
        run, lacking = select_contenders(requested, shape["options"], checkpointing)
        suffix = "" if checkpointing else NO_CHECKPOINTING
        contenders += [(name + suffix, name, checkpointing) for name in run]
        missing.update({name + suffix: why for name, why in lacking.items()})
    for name, reason in missing.items():
        print(f"note: {name} not run: {reason}")

    rows: list[dict[str, Any]] = []
    for vocab in vocabs:
        for length in lengths:
            for precision in precisions:
                for beta in betas:
                    case_name = (f"{shape_label} V={vocab} T={length} B={shape['batch']} P={shape['prompt_length']} "
                                 f"H={shape['hidden']} L={shape['layers']} {precision} beta={beta:g}")  # fmt: skip
                    if shape["options"]:
                        case_name += " " + " ".join(f"{key}={value}" for key, value in shape["options"].items())
                    if shape["hidden_chunk_rows"]:
                        case_name += f" chunk={shape['hidden_chunk_rows']}"
                    logits_gib = shape["batch"] * (shape["prompt_length"] + length) * vocab * 4 / 2**30
                    for label, contender, checkpointing in contenders:
                        full_logits = contender in ("grpo_ext/plain", "grpo_ext/torch", "grpo_ext/grpo_ext")
                        row: dict[str, Any] = dict(case=case_name, impl=label, vocab=vocab, length=length,
                                                   precision=precision, beta=beta)  # fmt: skip
                        if full_logits and args.max_logits_gib is not None and logits_gib > args.max_logits_gib:
                            row["note"] = f"skipped: its logits take {logits_gib:.1f} GiB, over --max-logits-gib"
                        else:
                            started = time.perf_counter()
                            child = dict(shape, vocab=vocab, length=length, precision=precision, beta=beta,
                                         contender=contender, checkpointing=checkpointing)  # fmt: skip
                            row.update(run_case(child, args.timeout_s))
                            add_derived(row, device)
                            # the figures as each contender ends, so that a run stopped at its time limit keeps them
                            figures = ", ".join(f"{key} {row[key] / scale:.4g}" for key, scale in
                                                (("step_ms", 1), ("peak_bytes", 2**20), ("head_ms", 1),
                                                 ("gemm_floor_ms", 1), ("head_vs_floor", 1)) if key in row)
                            note = f" | {row['note']}" if row.get("note") else ""
                            print(f"{case_name} {label}: {time.perf_counter() - started:.0f} s"
                                  f"{' | ' + figures if figures else ''}{note}", flush=True)  # fmt: skip
                        rows.append(row)
                    rows += [dict(case=case_name, impl=name, vocab=vocab, length=length, precision=precision,
                                  beta=beta, note=why) for name, why in missing.items()]  # fmt: skip

    checked = check_grad_norms(rows)
    columns = [("impl", "impl", "s"), ("step_ms", "step ms", "ms"), ("peak_bytes", "peak MiB", "mib"),
               ("gen_step_ms", "gen+step ms", "ms"), ("gen_pct", "gen %", "f1")]  # fmt: skip
    if args.profile:
        columns += [("part_layers_fwd", "layers fwd", "ms"), ("part_layers_bwd", "layers bwd", "ms"),
                    ("part_head_fwd", "head+loss fwd", "ms"), ("part_head_bwd", "head+loss bwd", "ms"),
                    ("part_optimizer", "optim", "ms"), ("part_rest", "rest", "ms"),
                    ("gemm_floor_ms", "3 GEMMs ms", "ms"), ("head_vs_floor", "head+loss/GEMMs", "x")]  # fmt: skip
    memory = "allocator peak" if device.type == "cuda" else "peak RSS"
    print()
    print(f"one training step (step: generation excluded; gen+step: included, gen %: its share in generate); peak MiB: "
          f"{memory} above the model, optimizer state and reference")  # fmt: skip
    if args.profile:
        clock = "CUDA kernel time, rest = wall less the parts" if device.type == "cuda" else "CPU time"
        print(f"parts of a step (ms, {clock}): decoder layers fwd / bwd (recompute included), LM head + log-probs + "
              "loss fwd / bwd, optimizer (AdamW step, zero_grad), rest (clipping included); 3 GEMMs: the head's "
              "[N,H]x[H,V] products at N = B x T")  # fmt: skip
    for case in dict.fromkeys(row["case"] for row in rows):
        print(f"\n{case}")
        print(reporting.format_table([row for row in rows if row["case"] == case], columns))
    for row in rows:
        if row.get("profile"):
            profile = row["profile"]
            print(f"profile check {row['case']} {row['impl']}: CPU parts sum to {100 * profile['check']:.1f}% of the "
                  f"profiled step ({profile['wall_ms']:.0f} ms profiled, {row['step_ms']:.0f} ms timed)")  # fmt: skip
    if args.memory_sites:
        print("\nwhat is alive at each contender's step peak (allocated during the step; weights, optimizer state "
              "and earlier steps' buffers excluded), by the code that allocated it")  # fmt: skip
        for row in rows:
            if row.get("memory_sites"):
                print(f"{row['case']} {row['impl']}:\n{memory_sites.format_sites(row['memory_sites'])}")
    for row in rows:
        if row.get("note"):
            print(f"n/a  {row['case']} {row['impl']}: {row['note']}")
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    path = reporting.output_path(__file__, device, quick, args.out)
    payload = {"benchmark": "one GRPO training step", "environment": env, "settings": {**settings, **shape},
               "rows": rows}  # fmt: skip
    reporting.write_json(path, payload)
    print(f"wrote {path}")
    if not checked:  # the rows are timed and written above: the exit status marks them as not the same step
        raise SystemExit(f"the contenders disagree on the first step's gradient norm (above): their rows in {path} "
                         "are not the same step, so their times do not compare")


if __name__ == "__main__":
    main()
