"""The bench scripts' command lines: a bad option is argparse's error naming it before any work, the options that
benchmarks/gpu_session.sh, the Makefile and the smoke tests pass are accepted, and --help lists only what a script
honours (split from tests/test_benchmarks.py, which runs the scripts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_benchmarks import BENCHMARKS, SCRIPTS


class WorkStarted(Exception):
    """Raised where a script would start its work: a bad argument must stop it before."""


def run_script(monkeypatch, script: str, *args: str) -> None:
    """Runs ``benchmarks/<script>`` in this process as ``__main__`` with ``args`` (imports stay cached, so a case
    takes milliseconds); resolving the device, where every script's work begins, raises :class:`WorkStarted`."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import runpy

    from harness import environment

    def tripwire(*_args, **_kwargs):
        raise WorkStarted

    for name in ("start", "resolve_device", "environment"):
        monkeypatch.setattr(environment, name, tripwire)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
    runpy.run_path(str(BENCHMARKS / script), run_name="__main__")


BAD_ARGUMENTS = [
    ("bench_group_advantages.py", "--groups", "abc"),
    ("bench_group_advantages.py", "--groups", "8x0"),
    ("bench_group_advantages.py", "--groups=-8x4", None),
    ("bench_group_advantages.py", "--groups", "0x4"),
    ("bench_group_advantages.py", "--groups", "8x4x2"),
    ("bench_group_advantages.py", "--target-s", "0"),
    ("bench_process_advantages.py", "--sizes", "1x2x8x4"),  # S > T: steps cannot end at distinct tokens
    ("bench_grpo_loss.py", "--dtypes", "int32"),
    ("bench_grpo_loss.py", "--loss-types", "bnpo"),
    ("bench_grpo_loss.py", "--loss-types", "foo"),
    ("bench_grpo_loss.py", "--device", "gpu"),
    ("bench_grpo_loss.py", "--sizes", "8x"),
    ("bench_selective_log_softmax.py", "--dtypes", "bf16,int64"),
    ("bench_selective_log_softmax.py", "--sizes", "0x1000"),
    ("bench_grpo_loss_from_logits.py", "--sizes", "0x1000"),
    ("bench_grpo_loss_from_logits.py", "--check-rows", "0"),
    ("bench_grpo_loss_from_hidden.py", "--sizes", "64x1000"),
    ("bench_floor.py", "--logits", "64x96:bf17"),
    ("bench_floor.py", "--hidden", "64x96:float32"),
    ("bench_floor.py", "--selective", "0x96:bfloat16"),
    ("bench_overhead.py", "--sizes", "8x16x64,4x4x4"),
    ("bench_overhead.py", "--rounds", "0"),
    ("bench_overhead.py", "--threads", "0"),
    ("bench_trainer.py", "--steps", "0"),
    ("bench_trainer.py", "--batch", "0"),
    ("bench_trainer.py", "--hidden", "0"),
    ("bench_trainer.py", "--steps=-1", None),
    ("bench_trainer.py", "--lengths=-5", None),
    ("bench_trainer.py", "--batch=-4", None),
    ("bench_trainer.py", "--batch", "6"),  # not a multiple of num_generations
    ("bench_trainer.py", "--vocabs=0", None),
    ("bench_trainer.py", "--precision", "fp16"),
    ("bench_trainer.py", "--contenders", "trl,foo"),
    ("bench_trainer.py", "--beta=-0.1", None),
    ("bench_trainer.py", "--options", "entropy_coef"),
    ("bench_trl_real.py", "--steps", "0"),
]


@pytest.mark.parametrize(("script", "option", "value"), BAD_ARGUMENTS)
def test_a_bad_argument_is_an_argparse_error_naming_the_option(monkeypatch, capsys, script, option, value):
    """Each bad size, dtype, count or choice ends as argparse's error, exit status 2, naming the option, before the
    script resolves its device (where its work begins)."""
    with pytest.raises(SystemExit) as stop:
        run_script(monkeypatch, script, *([option] if value is None else [option, value]))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option.split('=')[0]}: " in err, err


# What benchmarks/gpu_session.sh, the Makefile's bench target and the smoke tests above pass (on this CPU machine:
# --device cpu where the session says cuda): every option must still be accepted.
GOOD_ARGUMENTS = [
    ("bench_floor.py", "--out", "x.json"),
    ("bench_floor.py", "--quick", "--no-compile", "--device", "cpu", "--logits", "64x96:float32", "--selective",
     "none", "--hidden", "none", "--compile"),
    ("bench_group_advantages.py", "--no-compile", "--out", "x.json", "--groups", "8x8,65536x8"),
    ("bench_overhead.py", "--device", "cpu", "--sizes", "64x1024x64", "--host-profile", "--out", "x.json",
     "--quick", "--no-compile"),
    ("bench_trainer.py", "--shape", "qwen2.5-0.5b", "--lengths", "1024", "--batch", "8", "--steps", "3",
     "--precision", "bf16", "--beta", "0", "--profile", "--memory-sites", "--no-generation", "--contenders",
     "trl,trl+grpo_ext/fused", "--out", "x.json"),
    ("bench_trainer.py", "--quick", "--device", "cpu", "--hidden-chunk-rows", "16", "--beta", "0,0.04",
     "--options", "entropy_coef=0.01,top_entropy_quantile=0.2"),
    ("bench_grpo_loss.py", "--sizes", "1500x8", "--dtypes", "bf16,float32,fp64", "--loss-types", "grpo",
     "--no-graph", "--no-l2-flush", "--target-s", "0.1"),
    ("bench_grpo_loss_from_logits.py", "--sizes", "1500x512", "--dtypes", "float16", "--no-compile",
     "--no-l2-flush"),
    ("bench_grpo_loss_from_hidden.py", "--sizes", "64x1000x64", "--check-rows", "64"),
    ("bench_selective_log_softmax.py", "--quick", "--no-compile", "--no-graph"),
    ("bench_process_advantages.py", "--sizes", "2x4x4x16"),
]  # fmt: skip


@pytest.mark.parametrize("argv", GOOD_ARGUMENTS, ids=lambda argv: " ".join(argv[:3]))
def test_the_arguments_the_session_passes_are_accepted(monkeypatch, argv):
    script, *args = argv
    with pytest.raises(WorkStarted):
        run_script(monkeypatch, script, *args)


def help_text(monkeypatch, capsys, script: str) -> str:
    with pytest.raises(SystemExit) as stop:
        run_script(monkeypatch, script, "--help")
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone


# the shared options a script does not honour: not in its --help
NOT_OFFERED = {
    "bench_trainer.py": ("--target-s", "--no-compile", "--no-graph", "--no-l2-flush"),
    "bench_floor.py": ("--no-graph", "--no-l2-flush"),
    "bench_overhead.py": ("--no-graph", "--no-l2-flush"),
    "bench_grpo_loss_from_logits.py": ("--no-graph",),
    "bench_grpo_loss_from_hidden.py": ("--no-graph",),
}


@pytest.mark.parametrize("script", [*SCRIPTS, "bench_trainer.py"])
def test_help_lists_only_what_the_script_honours(monkeypatch, capsys, script):
    """--help offers no option that does nothing; the two scripts that accept --no-compile without a compile peer to
    skip (the smoke test above passes it to each) say it is ignored; --out names the --quick file."""
    text = help_text(monkeypatch, capsys, script)
    for option in NOT_OFFERED.get(script, ()):
        assert f"{option} " not in text, option
    if script in ("bench_floor.py", "bench_overhead.py"):
        assert "--no-compile ignored: " in text
    elif script != "bench_trainer.py":
        assert "--no-compile skip the torch.compile peer" in text
    assert "<script>-<dev>-quick.json with --quick" in text
    if script == "bench_trainer.py":
        assert "--memory-sites one more step with its allocations recorded (CUDA: the allocator's history; CPU:" in text


def test_trl_real_help_works_outside_a_checkout(tmp_path):
    """bench_trl_real.py imports examples/smollm2_sums.py where it is used: --help works without it, and a run says
    what is missing (exit status 1, no traceback) before any work."""
    import shutil

    copy = tmp_path / "benchmarks"
    shutil.copytree(BENCHMARKS / "harness", copy / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("bench_trl_real.py", "trl_real_report.py"):
        shutil.copy(BENCHMARKS / name, copy / name)
    script = str(copy / "bench_trl_real.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--steps" in shown.stdout, shown.stderr[-2000:]
    run = subprocess.run([sys.executable, script, "--steps", "1", "--no-results-md"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "needs examples/smollm2_sums.py of a grpo_ext checkout" in run.stderr
