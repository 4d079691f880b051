"""Fault injection into GRPOTrainer and ``grpo-ext train``: nothing lost, nothing silent (README "Failure behaviour").

A ``kill -9`` in the middle of a checkpoint save, SIGINT from outside, SIGTERM, a torn metrics line, a reward that is
not a finite number, a step whose loss is NaN, a second run into the same folder (one after the other, or at the
same time, or resumed from another run's checkpoint), a resume that goes back to an earlier step, a full disk, a
damaged checkpoint. Each fault ends in a clear error or a clean stop, and a resumed run reproduces the metrics of an
uninterrupted one. Two tests run ``grpo-ext train`` in a child process (tests/fault_child.py) so that the signal
really comes from outside; the rest run in this process. About 40 s on 2 CPU cores (the child processes have a 180 s
time limit each).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from grpo_ext.trainer import checkpoint as checkpoint_module
from grpo_ext.trainer import run_folder as run_folder_module
from grpo_ext.trainer.checkpoint import CheckpointReadError, CheckpointWriteError
from grpo_ext.trainer.cli import main as cli_main
from grpo_ext.trainer.demo import reversal_reward
from grpo_ext.trainer.final_model import FinalModelWriteError
from grpo_ext.trainer.guards import NonFiniteStepsError, TrainingInterrupted
from grpo_ext.trainer.metrics import plot_metrics
from grpo_ext.trainer.rewards import RewardFunctionError
from grpo_ext.trainer.run_folder import LOCK_NAME, OutputFolderError, RunFolderLock
from trainer_utils import (
    Killed,
    kill_after_rename_to,
    make_trainer,
    read_metrics,
    small_config,
    without_timing,
    write_cli_inputs,
)

TESTS = Path(__file__).parent
CHILD_TIMEOUT_S = 180

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def rows_without_timing(path: Path) -> list[dict]:
    return [without_timing(row) for row in read_metrics(path)]


@contextlib.contextmanager
def child_process(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """``grpo-ext train`` (through tests/fault_child.py) in a child process, its output into ``log``; killed if it
    is still running when the block ends (a failed test leaves no process behind)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    with log.open("w") as out:
        command = [sys.executable, str(TESTS / "fault_child.py"), *args]
        child = subprocess.Popen(command, stdout=out, stderr=out, env=env)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def wait_for(condition, child: subprocess.Popen, log: Path, what: str) -> None:
    """Poll ``condition()`` until true; fail with the child's output if it exits first or time runs out."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not condition():
        if child.poll() is not None:
            pytest.fail(f"the child exited ({child.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A model folder, a dataset and a run file (5 steps, a checkpoint every 2), and the metrics of the run
    uninterrupted."""
    folder = tmp_path_factory.mktemp("cli")
    run_file = write_cli_inputs(folder, save_steps=2)
    assert cli_main(["train", "--config", str(run_file)]) == 0
    return run_file, rows_without_timing(folder / "out" / "metrics.jsonl")


# ---------------------------------------------------------------------------------------------------------------
# kill -9 during a save, SIGINT and SIGTERM: a clean state, and a resume that reproduces the uninterrupted run
# ---------------------------------------------------------------------------------------------------------------


def test_kill_during_save_leaves_previous_checkpoints_and_resumes_exactly(cli_run, tmp_path):
    run_file, expected = cli_run
    out, marker, log = tmp_path / "out", tmp_path / "paused", tmp_path / "child.log"
    args = ["--pause-in-save", "4", str(marker), "train", "--config", str(run_file), "--output_dir", str(out)]
    with child_process(args, log) as child:
        wait_for(marker.exists, child, log, "the save of checkpoint-4")
        child.kill()  # SIGKILL: no handler runs
        child.wait(CHILD_TIMEOUT_S)
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-2" in names and "checkpoint-4" not in names
    assert any(name.startswith(".tmp-checkpoint-4-") for name in names)  # the torn save
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]

    killed_rows = read_metrics(out / "metrics.jsonl")
    with pytest.warns(UserWarning, match="taking over the lock of a run that died"):  # the killed run's lock file
        assert cli_main(["train", "--config", str(run_file), "--output_dir", str(out), "--resume"]) == 0
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-checkpoint-")]  # removed at start
    # checkpoint-5: the last step is saved too (save_steps=2), so that a larger max_steps continues from it
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-5"
    ]  # fmt: skip
    assert rows_without_timing(out / "metrics.jsonl") == expected
    # The killed run's lines 3-4, which the resumed run redid, are kept (the kill left no later checkpoint).
    assert sorted(p.name for p in (out / "abandoned-after-step-2").iterdir()) == ["metrics.jsonl"]
    assert read_metrics(out / "abandoned-after-step-2" / "metrics.jsonl") == killed_rows


def test_sigint_from_outside_saves_a_checkpoint_and_exits_130(cli_run, tmp_path, capsys):
    run_file, _ = cli_run
    out, log = tmp_path / "out", tmp_path / "child.log"
    # Many steps, a constant schedule: the run is stopped in the middle wherever the signal lands, and an
    # uninterrupted run of as many steps (plus two) is the reference.
    options = ["--output_dir", str(out), "--max_steps", "10000", "--lr_scheduler_type", "constant", "--save_steps", "0"]
    metrics = out / "metrics.jsonl"
    with child_process(["train", "--config", str(run_file), *options], log) as child:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, child, log, "two steps")
        child.send_signal(signal.SIGINT)
        assert child.wait(CHILD_TIMEOUT_S) == 130, log.read_text()[-3000:]
    last = read_metrics(metrics)[-1]["step"]
    assert (out / f"checkpoint-{last}" / "trainer_state.pt").is_file()  # the steps since the last save are kept
    assert "SIGINT at step" in log.read_text() and "--resume" in log.read_text()

    resumed = ["--max_steps", str(last + 2), "--lr_scheduler_type", "constant", "--save_steps", "0"]
    assert cli_main(["train", "--config", str(run_file), "--output_dir", str(out), "--resume", *resumed]) == 0
    assert cli_main(["train", "--config", str(run_file), "--output_dir", str(tmp_path / "ref"), *resumed]) == 0
    assert rows_without_timing(metrics) == rows_without_timing(tmp_path / "ref" / "metrics.jsonl")


def test_a_time_stop_saves_a_checkpoint_that_resume_continues(cli_run, tmp_path, capsys):
    run_file, expected = cli_run
    out = tmp_path / "out"
    args = ["train", "--config", str(run_file), "--output_dir", str(out)]
    assert cli_main([*args, "--max_time_s", "1e-9"]) == 0  # stops after step 1 of 5
    assert f"max_time_s=1e-09 reached; checkpoint: {out / 'checkpoint-1'}" in capsys.readouterr().out
    assert (out / "checkpoint-1" / "trainer_state.pt").is_file() and (out / "final_model" / "config.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]  # written the atomic way
    # max_time_s may change on resume: the run continues from step 1 as if it had never stopped.
    assert cli_main([*args, "--resume", "--max_time_s", "3600"]) == 0
    assert rows_without_timing(out / "metrics.jsonl") == expected


def test_sigterm_saves_a_checkpoint_and_raises_with_exit_code_143(tmp_path):
    calls = []

    def terminated_in_step_2(prompts, completions, answer, **columns):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption would
        return reversal_reward(prompts, completions, answer, **columns)

    terminated_in_step_2.__name__ = "reversal_reward"  # the metrics' names as the reference run's
    config = small_config(tmp_path, max_steps=4)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match="SIGTERM at step 2") as stop:
        make_trainer(config, reward_funcs=[terminated_in_step_2]).train()
    assert stop.value.exit_code == 143 and stop.value.step == 2
    assert signal.getsignal(signal.SIGTERM) is previous  # the trainer's handler is gone
    assert stop.value.checkpoint == tmp_path / "run" / "checkpoint-2"
    make_trainer(config).train(resume_from_checkpoint=True)
    make_trainer(small_config(tmp_path / "ref", max_steps=4)).train()
    assert rows_without_timing(tmp_path / "run" / "metrics.jsonl") == rows_without_timing(
        tmp_path / "ref" / "run" / "metrics.jsonl"
    )


# ---------------------------------------------------------------------------------------------------------------
# files: a torn metrics line, leftovers, a full disk
# ---------------------------------------------------------------------------------------------------------------


def test_torn_last_metrics_line_is_dropped_and_temp_leftovers_removed(tmp_path):
    out = tmp_path / "run"

    def leaves_a_temp_folder(prompts, completions, answer, **columns):
        if not (out / "metrics.jsonl").exists():  # in step 1
            (out / ".tmp-checkpoint-99-1").mkdir()  # as a killed save would leave it
        return reversal_reward(prompts, completions, answer, **columns)

    leaves_a_temp_folder.__name__ = "reversal_reward"

    config = small_config(tmp_path, max_steps=3, save_steps=2)
    make_trainer(config, reward_funcs=[leaves_a_temp_folder]).train()
    assert not list(out.glob(".tmp-checkpoint-*"))  # removed after the save of checkpoint-2
    expected = rows_without_timing(out / "metrics.jsonl")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 0.12')  # killed in mid-write
    plot_metrics(out / "metrics.jsonl", tmp_path / "curves.png")  # the plot skips it too
    make_trainer(config).train(resume_from_checkpoint=True)
    assert rows_without_timing(out / "metrics.jsonl") == expected

    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:20], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):  # not torn by a kill: an error
        make_trainer(config).train(resume_from_checkpoint=True)


def test_a_failed_metrics_rewrite_keeps_every_line(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl without the lines after its checkpoint, in one rename: a full disk (or a
    kill) in the middle leaves the old file whole (an outside audit, 2026-11-29: it was truncated, then written)."""
    out = tmp_path / "run"
    config = small_config(tmp_path, max_steps=3, save_steps=2)
    make_trainer(config).train()
    shutil.rmtree(out / "checkpoint-3")  # as if killed after step 3 was logged (its final save): resume at 2
    shutil.rmtree(out / "final_model")
    before = (out / "metrics.jsonl").read_text()
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]

    fsync = os.fsync

    def disk_full_in_the_rewrite(fd):  # the copy set aside first succeeds; the rewrite of metrics.jsonl fails
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".tmp-metrics.jsonl-"):
            raise OSError(28, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(run_folder_module.os, "fsync", disk_full_in_the_rewrite)
    with pytest.raises(OSError, match="No space left on device"):
        make_trainer(config).train(resume_from_checkpoint=True)
    monkeypatch.undo()
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "abandoned-after-step-2" / "metrics.jsonl").read_text() == before  # set aside before the rewrite
    assert not list(out.glob(".tmp-*"))
    make_trainer(config).train(resume_from_checkpoint=True)
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path):
    """A run resumed from checkpoint-2 of a run finished at step 5 abandons what that run wrote after step 2:
    checkpoint-4, checkpoint-5, its final model and its metrics go to abandoned-after-step-2/, so that
    save_total_limit keeps the new checkpoint-3, the next --resume continues the new run (an outside audit,
    2026-11-29: checkpoint-3 was pruned as the oldest), and the step-5 model is not replaced by the resumed run's
    (an outside audit, 2026-12: the final model was not set aside, and its weights were then nowhere)."""
    out = tmp_path / "run"
    finished = make_trainer(small_config(tmp_path, max_steps=5, save_steps=2, save_total_limit=3))
    finished.train()
    step_5 = {name: value.clone() for name, value in finished.model.state_dict().items()}
    abandoned_rows = read_metrics(out / "metrics.jsonl")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]

    resumed = make_trainer(small_config(tmp_path, max_steps=3, save_steps=1, save_total_limit=1))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    aside = out / "abandoned-after-step-2"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-4", "checkpoint-5", "final_model", "metrics.jsonl"]
    assert (aside / "checkpoint-4" / "trainer_state.pt").is_file()
    kept = load_file(aside / "final_model" / "model.safetensors")
    assert kept.keys() == step_5.keys() and all(torch.equal(kept[name], step_5[name]) for name in kept)
    assert json.loads((aside / "final_model" / "trainer_state.json").read_text()) == {"global_step": 5}
    assert json.loads((out / "final_model" / "trainer_state.json").read_text()) == {"global_step": 3}
    assert read_metrics(aside / "metrics.jsonl") == abandoned_rows
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert resumed.latest_checkpoint() == out / "checkpoint-3"
    with pytest.raises(OutputFolderError, match=r"abandoned-after-step-2"):  # an output of the run's, to a fresh run
        make_trainer(small_config(tmp_path, max_steps=1)).train()


def test_set_aside_keeps_a_final_model_of_unknown_step_and_flushes_the_metrics_copy(tmp_path, monkeypatch):
    """set_aside_later_outputs alone: a final_model without its step (saved before the step was recorded) is set
    aside, as the resumed run would replace it, and one of the resumed step stays; metrics lines after the step are
    enough to set a copy aside; the copy is on the disk (fsync) with its folder; nothing to abandon, no folder."""
    out = tmp_path / "run"
    for name in ("checkpoint-2", "checkpoint-3", "final_model"):
        (out / name).mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(run_folder_module.os, "fsync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))  # fmt: skip
    aside = run_folder_module.set_aside_later_outputs(out, 3, metrics_after_step=False)
    assert aside == out / "abandoned-after-step-3"
    assert sorted(p.name for p in aside.iterdir()) == ["final_model", "metrics.jsonl"]  # with the log as it stood
    assert {str(aside / "metrics.jsonl"), str(aside)} <= set(synced)

    (out / "final_model").mkdir()
    (out / "final_model" / "trainer_state.json").write_text('{"global_step": 2}')
    aside = run_folder_module.set_aside_later_outputs(out, 2, metrics_after_step=False)
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-3", "metrics.jsonl"]  # final_model is step 2's
    assert (out / "final_model").is_dir()
    assert run_folder_module.set_aside_later_outputs(out, 2, metrics_after_step=False) is None
    synced.clear()
    aside = run_folder_module.set_aside_later_outputs(out, 3, metrics_after_step=True)  # lines after step 3 alone
    assert aside == out / "abandoned-after-step-3-2" and sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl"]
    assert str(aside / "metrics.jsonl") in synced


def test_a_resume_from_another_runs_checkpoint_is_refused_unless_overwritten(tmp_path):
    """--resume A/checkpoint-2 into B, a finished run of its own, is refused naming both folders and the ways out,
    and B is untouched (an outside audit, 2026-12: B's metrics were cut and mixed with A's, its final model
    replaced); into an empty folder it resumes; with overwrite_output_dir B's outputs are deleted first, as for a
    fresh run into B."""
    a_run, b_run = tmp_path / "A" / "run", tmp_path / "B" / "run"
    a_checkpoint = a_run / "checkpoint-2"
    make_trainer(small_config(tmp_path / "A", max_steps=2, save_steps=2)).train()
    make_trainer(small_config(tmp_path / "B", max_steps=3), model_seed=1).train()
    b_files = {p.relative_to(b_run): p.read_bytes() for p in b_run.rglob("*") if p.is_file()}
    with pytest.raises(OutputFolderError, match=rf"cannot resume from {a_run / 'checkpoint-2'} \(another run's "
                                                rf"checkpoint\) into {b_run}: .*final_model, metrics\.jsonl.*another "
                                                r"output_dir.*--overwrite"):  # fmt: skip
        make_trainer(small_config(tmp_path / "B", max_steps=4)).train(resume_from_checkpoint=str(a_checkpoint))
    assert {p.relative_to(b_run): p.read_bytes() for p in b_run.rglob("*") if p.is_file()} == b_files

    make_trainer(small_config(tmp_path / "C", max_steps=3)).train(resume_from_checkpoint=str(a_run / "checkpoint-2"))
    assert [row["step"] for row in read_metrics(tmp_path / "C" / "run" / "metrics.jsonl")] == [3]
    overwritten = make_trainer(small_config(tmp_path / "B", max_steps=3, overwrite_output_dir=True))
    overwritten.train(resume_from_checkpoint=str(a_run / "checkpoint-2"))
    assert sorted(p.name for p in b_run.iterdir()) == ["final_model", "metrics.jsonl"]
    assert rows_without_timing(b_run / "metrics.jsonl") == rows_without_timing(tmp_path / "C" / "run" / "metrics.jsonl")
    assert (a_run / "checkpoint-2").is_dir()  # the checkpoint's own folder is not touched


def test_cli_refuses_another_runs_checkpoint_before_the_model_loads(cli_run, tmp_path, capsys):
    """One line before the model loads; --overwrite goes with --resume only for another folder's checkpoint."""
    run_file, expected = cli_run
    a_checkpoint = Path(run_file).parent / "out" / "checkpoint-4"
    args = ["train", "--config", str(run_file), "--output_dir", str(tmp_path / "out")]
    assert cli_main([*args, "--max_steps", "1"]) == 0
    capsys.readouterr()
    assert cli_main([*args, "--resume", str(a_checkpoint)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot resume from {a_checkpoint} (another run's checkpoint) into" in err
    assert cli_main([*args, "--overwrite", "--resume"]) == 1  # output_dir's own checkpoint: overwrite would delete it
    assert "give one of them" in capsys.readouterr().err
    assert cli_main([*args, "--overwrite", "--resume", str(a_checkpoint)]) == 0
    assert rows_without_timing(tmp_path / "out" / "metrics.jsonl") == expected[4:]  # step 5, as the first run's


def test_resuming_a_set_aside_checkpoint_into_its_folder_is_refused(tmp_path):
    """A checkpoint in output_dir/abandoned-after-step-K/ resumed into output_dir would mix the two runs, and
    --overwrite would delete it: refused either way, naming another output_dir."""
    out = tmp_path / "run"
    (out / "abandoned-after-step-2" / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-3").mkdir()
    for overwrite in (False, True):
        with pytest.raises(OutputFolderError, match=r"not one of the folder's own checkpoint-N .*another output_dir"):
            run_folder_module.check_fresh_run(out, str(out / "abandoned-after-step-2" / "checkpoint-4"), overwrite)
    run_folder_module.check_fresh_run(out, str(out / "checkpoint-3"), False)  # its own: a plain resume
    run_folder_module.check_fresh_run(out, True, False)


def test_extending_a_finished_run_continues_from_its_last_step(tmp_path):
    """The last step is saved as HF Trainer saves it (save_strategy="steps"), within save_total_limit: a resume
    with a larger max_steps continues from step 3, where an uninterrupted 5-step run (constant schedule) is, and
    drops or redoes nothing (an outside audit, 2026-12: it went back to checkpoint-2, redid step 3 and dropped its
    line)."""
    options = dict(save_steps=2, save_total_limit=1, lr_scheduler_type="constant")
    out = tmp_path / "run"
    make_trainer(small_config(tmp_path, max_steps=3, **options)).train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]  # checkpoint-2 pruned
    first = read_metrics(out / "metrics.jsonl")
    extended = make_trainer(small_config(tmp_path, max_steps=5, **options))
    assert [row["step"] for row in extended.train(resume_from_checkpoint=True)] == [4, 5]
    assert read_metrics(out / "metrics.jsonl")[:3] == first
    assert not list(out.glob("abandoned-*"))
    make_trainer(small_config(tmp_path / "ref", max_steps=5, **options)).train()
    assert rows_without_timing(out / "metrics.jsonl") == rows_without_timing(tmp_path / "ref" / "run" / "metrics.jsonl")


def test_a_resume_prunes_what_a_kill_left_beyond_save_total_limit(tmp_path, monkeypatch):
    """Killed between a save's rename and its pruning, a run leaves save_total_limit + 1 checkpoints: the resumed
    run prunes them when it starts."""
    out = tmp_path / "run"
    config = small_config(tmp_path, max_steps=3, save_steps=1, save_total_limit=2)
    prune = checkpoint_module.CheckpointManager._prune

    def killed_before_pruning_3(self, keep):
        if keep.name == "checkpoint-3":
            raise Killed
        prune(self, keep)

    monkeypatch.setattr(checkpoint_module.CheckpointManager, "_prune", killed_before_pruning_3)
    with pytest.raises(Killed):
        make_trainer(config).train()
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    make_trainer(config).train(resume_from_checkpoint=True)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_a_checkpoint_saved_again_is_replaced_without_a_moment_with_none(tmp_path, monkeypatch):
    """Saving a step that has a checkpoint (a resumed run's first save) moves the old one aside before the new one
    takes its place: killed between the two renames, the old one comes back when the next run starts (it was
    deleted first, so that a kill in the deletion left half a checkpoint)."""
    out = tmp_path / "run"
    trainer = make_trainer(small_config(tmp_path, max_steps=2, save_steps=2))
    trainer.train()
    saved = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)["step"]
    kill_after_rename_to(monkeypatch, "checkpoint-2.previous")
    with pytest.raises(Killed):
        trainer.save_checkpoint()
    monkeypatch.undo()
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-2.previous").is_dir()
    resumed = make_trainer(small_config(tmp_path, max_steps=2))
    resumed.train(resume_from_checkpoint=True)  # puts checkpoint-2 back first, then resumes from it
    assert torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)["step"] == saved
    assert not (out / "checkpoint-2.previous").exists()
    assert not list(out.glob(".tmp-*"))


def test_full_disk_names_the_folder_and_the_space_needed(tmp_path, monkeypatch):
    def disk_full(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")  # torch's words

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    config = small_config(tmp_path, max_steps=2, save_steps=1)
    # 4 KiB free: "0.0 MiB are free" hid it (an outside audit, 2026-12)
    with pytest.raises(CheckpointWriteError, match=r"no space left to write .*checkpoint-1: a checkpoint needs about "
                                                   r"[0-9.]+ (KiB|MiB) and 4\.0 KiB are free"):  # fmt: skip
        make_trainer(config).train()
    assert not list((tmp_path / "run").glob(".tmp-checkpoint-*"))


def safetensors_disk_full(*args, **kwargs):
    """What save_pretrained raises on a full disk (safetensors 0.8: a SafetensorError, which has no errno)."""
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')  # fmt: skip


def test_a_full_disk_in_save_pretrained_is_named_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """safetensors' SafetensorError (a plain Exception) from save_pretrained on a full disk ends in the checkpoint's
    and the final model's own errors, with the space needed and free, and their temporary folders removed (an
    outside audit, 2026-12: it escaped, leaving .tmp-checkpoint-N-<pid> on the full disk)."""
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=200 * 1024))
    trainer = make_trainer(small_config(tmp_path, max_steps=1, save_steps=1))
    monkeypatch.setattr(trainer.model, "save_pretrained", safetensors_disk_full)
    with pytest.raises(CheckpointWriteError, match=rf"no space left to write {out / 'checkpoint-1'}: a checkpoint "
                                                   r"needs about [0-9.]+ (KiB|MiB) and 200\.0 KiB are free\. .*"
                                                   r"\(SafetensorError: Error while serializing"):  # fmt: skip
        trainer.train()
    assert not list(out.glob(".tmp-*")) and not list(out.glob("checkpoint-*"))

    with pytest.raises(FinalModelWriteError, match=rf"could not write the final model to {out / 'final_model'}: "
                                                   r"SafetensorError: .*the disk is full: the final model needs about "
                                                   r"[0-9.]+ (KiB|MiB) and 200\.0 KiB are free"):  # fmt: skip
        trainer.save_final_model()
    assert not list(out.glob(".tmp-*")) and not (out / "final_model").exists()


# ---------------------------------------------------------------------------------------------------------------
# rewards and steps that are not finite
# ---------------------------------------------------------------------------------------------------------------


def bad_reward(kind: str):
    def reward(prompts, completions, answer, **columns):
        values = reversal_reward(prompts, completions, answer, **columns)
        if kind == "inf":
            values[5] = float("-inf")
        elif kind == "string":
            values[3] = "0.5 points"
        elif kind == "short":
            values = values[:-1]
        elif kind == "generator":
            values = (v for v in values)
        elif kind == "none":
            values = None
        elif kind == "huge":
            values[2] = 10**400  # a Python int beyond float64
        elif kind == "float32":
            values[4] = -1e39  # a float64 beyond float32, where the rewards are kept: it would become -inf
        return values

    reward.__name__ = f"{kind}_reward"
    return reward


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("inf", r"reward function inf_reward returned -inf for row 5 .* a reward must be finite"),
        ("string", r"reward function string_reward returned '0\.5 points' \(str\) for row 3"),
        ("short", r"reward function short_reward returned 15 values for 16 completions"),
        ("generator", r"reward function generator_reward returned generator; it must return 16 numbers \(a list"),
        ("none", r"reward function none_reward returned None; it must return 16 numbers"),
        ("huge", r"reward function huge_reward returned 1000000000000000000000000000000000000000\.\.\. for row 2 "),
        ("float32", r"reward function float32_reward returned -1e\+39 for row 4 .* within float32's range"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_names_the_function_and_row(tmp_path, kind, message):
    trainer = make_trainer(small_config(tmp_path, max_steps=2), reward_funcs=[bad_reward(kind)])
    initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert all(torch.equal(value, initial[name]) for name, value in trainer.model.state_dict().items())


def test_a_reward_that_raises_is_named_with_the_exceptions_type(tmp_path):
    def unreachable(prompts, completions, **columns):
        raise RuntimeError("reward server unreachable")

    trainer = make_trainer(small_config(tmp_path, max_steps=2), reward_funcs=[unreachable])
    initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    with pytest.raises(RewardFunctionError) as raised:
        trainer.train()
    assert str(raised.value) == (f"reward function '{unreachable.__qualname__}' raised RuntimeError: reward server "
                                 "unreachable")  # fmt: skip
    assert isinstance(raised.value.__cause__, RuntimeError)  # the traceback of the function's own error
    assert all(torch.equal(value, initial[name]) for name, value in trainer.model.state_dict().items())


class NaNHiddenStates:
    """A forward hook that makes the training forward's last hidden states (the final norm's output), hence its
    logits, NaN at the given (1-based) steps: the fused path (loss from hidden states) and the plain one alike."""

    def __init__(self, trainer, steps: set[int]) -> None:
        self.trainer, self.steps = trainer, steps
        trainer.model.model.norm.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if torch.is_grad_enabled() and self.trainer.global_step + 1 in self.steps:  # not generation, not scoring
            return output * float("nan")
        return output


def test_a_non_finite_step_is_skipped_and_counted_never_a_nan_model(tmp_path):
    one_step = make_trainer(small_config(tmp_path / "one", max_steps=1, lr_scheduler_type="constant"))
    one_step.train()
    config = small_config(tmp_path / "skip", max_steps=3, lr_scheduler_type="constant")
    trainer = make_trainer(config)
    NaNHiddenStates(trainer, steps={2})
    with pytest.warns(RuntimeWarning, match=r"step 2: loss nan / gradient norm nan is not finite; the step is skipped"):
        rows = trainer.train()
    assert [row["nonfinite_steps"] for row in rows] == [0, 1, 1]
    assert torch.isnan(torch.tensor(rows[1]["loss"])) and torch.isfinite(torch.tensor(rows[2]["loss"]))
    for name, value in trainer.model.state_dict().items():
        assert torch.isfinite(value).all(), name
    # Step 2 left model and optimizer as step 1 did: step 3 is the second update.
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == 2

    stopped = make_trainer(small_config(tmp_path / "stop", max_steps=6, lr_scheduler_type="constant",
                                        max_consecutive_nonfinite_steps=2))  # fmt: skip
    NaNHiddenStates(stopped, steps={2, 3, 4, 5, 6})
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteStepsError, match=r"steps 2-3: .* 2 times in a row"):
        stopped.train()
    for name, value in stopped.model.state_dict().items():  # as after its one good step
        assert torch.equal(value, one_step.model.state_dict()[name]), name


def test_a_resume_keeps_counting_non_finite_steps_in_a_row(tmp_path):
    """max_consecutive_nonfinite_steps=2, NaN at steps 2 and 3: the uninterrupted run stops at step 3, and so does a
    run stopped between the two (SIGTERM in step 2, or max_steps=2 then extended) and resumed (an outside audit,
    2026-12: the count in a row restarted at 0, and the resumed run went on)."""

    def run(folder, max_steps=5, reward_funcs=None, resume=None):
        trainer = make_trainer(small_config(folder, max_steps=max_steps, save_steps=2,
                                            max_consecutive_nonfinite_steps=2), reward_funcs=reward_funcs)  # fmt: skip
        NaNHiddenStates(trainer, steps={2, 3})
        with pytest.warns(RuntimeWarning, match="is not finite"):
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    with pytest.raises(NonFiniteStepsError, match=r"steps 2-3: "):
        run(tmp_path / "whole")
    calls = []

    def terminated_in_step_2(prompts, completions, answer, **columns):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return reversal_reward(prompts, completions, answer, **columns)

    terminated_in_step_2.__name__ = "reversal_reward"
    with pytest.raises(TrainingInterrupted, match="SIGTERM at step 2"):
        run(tmp_path / "term", reward_funcs=[terminated_in_step_2])
    with pytest.raises(NonFiniteStepsError, match=r"steps 2-3: "):
        run(tmp_path / "term", resume=True)

    assert run(tmp_path / "extended", max_steps=2).nonfinite.in_a_row == 1  # finished, checkpoint-2 saved
    with pytest.raises(NonFiniteStepsError, match=r"steps 2-3: "):
        run(tmp_path / "extended", resume=True)


def test_a_resume_with_other_reward_functions_is_refused_listing_both(tmp_path):
    """What a run scores may not change on resume: other reward functions (by name) are refused naming
    reward_funcs with the old and the new ones (an outside audit, 2026-12: accepted silently); a checkpoint saved
    before the names were recorded cannot be checked and is accepted."""

    def constant_reward(prompts, completions, **columns):
        return [1.0] * len(completions)

    out = tmp_path / "run"
    make_trainer(small_config(tmp_path, max_steps=1, save_steps=1)).train()
    assert torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=False)["reward_funcs"] == [
        "reversal_reward"
    ]  # fmt: skip
    for funcs, new in (([constant_reward], "'constant_reward'"), ([reversal_reward, constant_reward],
                                                                  "'reversal_reward', 'constant_reward'")):  # fmt: skip
        trainer = make_trainer(small_config(tmp_path, max_steps=2), reward_funcs=funcs)
        with pytest.raises(ValueError, match=rf"reward_funcs: the checkpoint's run was scored by \['reversal_reward'\] "
                                             rf"and this run by \[{new}\]"):  # fmt: skip
            trainer.train(resume_from_checkpoint=True)
        assert trainer.global_step == 0  # refused before anything was loaded
    state = torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    del state["reward_funcs"]  # as an older checkpoint
    torch.save(state, out / "checkpoint-1" / "trainer_state.pt")
    make_trainer(small_config(tmp_path, max_steps=2), reward_funcs=[constant_reward]).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_checkpoint_names_the_file_and_the_previous_one(tmp_path, damage):
    """A trainer_state.pt cut short or empty (a disk fault, a copy cut short) is an error naming the file and the
    --resume of the newest other checkpoint, which resumes (an outside audit, 2026-12: torch's error alone)."""
    out = tmp_path / "run"
    make_trainer(small_config(tmp_path, max_steps=4, save_steps=2)).train()
    damaged = out / "checkpoint-4" / "trainer_state.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2] if damage == "truncated" else b"")
    config = small_config(tmp_path, max_steps=4)
    with pytest.raises(CheckpointReadError, match=rf"cannot read {damaged} \(.*\): the checkpoint is damaged or "
                                                  rf"incomplete .*--resume {out / 'checkpoint-2'}$"):  # fmt: skip
        make_trainer(config).train(resume_from_checkpoint=True)
    os.replace(out / "checkpoint-2", tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointReadError, match=rf"incomplete .*; {out} holds no other checkpoint to resume from"):
        make_trainer(config).train(resume_from_checkpoint=True)
    os.replace(tmp_path / "checkpoint-2", out / "checkpoint-2")
    make_trainer(config).train(resume_from_checkpoint=str(out / "checkpoint-2"))  # the way out it names


# ---------------------------------------------------------------------------------------------------------------
# the output folder: one run at a time, no silent overwrite
# ---------------------------------------------------------------------------------------------------------------


def test_a_second_run_into_the_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    out = tmp_path / "run"
    make_trainer(small_config(tmp_path, max_steps=2, save_steps=1)).train()
    (out / "notes.txt").write_text("the user's own file\n")
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(OutputFolderError, match=r"holds the outputs of a previous run \(checkpoint-1, checkpoint-2, "
                                                r"final_model, metrics\.jsonl\).*--resume.*--overwrite"):  # fmt: skip
        make_trainer(small_config(tmp_path, max_steps=3)).train()
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoint-2").is_dir()

    make_trainer(small_config(tmp_path, max_steps=3, save_steps=1)).train(resume_from_checkpoint=True)
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]

    make_trainer(small_config(tmp_path, max_steps=1, overwrite_output_dir=True)).train()
    assert sorted(p.name for p in out.iterdir()) == ["final_model", "metrics.jsonl", "notes.txt"]  # no checkpoints
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1]


def test_a_run_holding_the_folder_blocks_another_and_a_dead_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = RunFolderLock(out)
    holder.acquire()  # another run, alive (this process, through another open file)
    try:
        with pytest.raises(OutputFolderError, match=rf"another run \(pid {os.getpid()} on .*\) is writing to"):
            make_trainer(small_config(tmp_path, max_steps=1)).train()
    finally:
        holder.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(f"pid {int(dead.stdout)} on {socket.gethostname()}\n")  # a run killed with -9 left it
    with pytest.warns(UserWarning, match="taking over the lock of a run that died"):
        make_trainer(small_config(tmp_path, max_steps=1)).train()
    assert not (out / LOCK_NAME).exists()  # released at the end


def test_cli_reports_a_used_folder_in_one_line_before_loading_the_model(cli_run, tmp_path, capsys):
    run_file, _ = cli_run
    args = ["train", "--config", str(run_file), "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]
    assert cli_main(args) == 0
    capsys.readouterr()
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("grpo-ext: error: ") and err.count("\n") == 1  # before the model loads: one line only
    assert "holds the outputs of a previous run" in err
    assert cli_main([*args, "--overwrite", "--resume"]) == 1
    assert "give one of them" in capsys.readouterr().err
    assert cli_main([*args, "--overwrite"]) == 0
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text())["step"] == 1
