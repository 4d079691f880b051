"""``grpo-ext train``'s errors: one line on stderr naming the file, line or field and what to do; exit status 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo_ext.trainer.cli import main as cli_main
from trainer_utils import write_cli_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    write_cli_inputs(folder, max_steps=1)
    return folder


def run_with(inputs, tmp_path, capsys, run_text: str, *extra: str) -> str:
    """``grpo-ext train`` on a run file holding ``run_text``; asserts one error line, returns it."""
    run_file = tmp_path / "bad.yaml"
    run_file.write_text(run_text)
    capsys.readouterr()
    assert cli_main(["train", "--config", str(run_file), "--output_dir", str(tmp_path / "out"), *extra]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo-ext")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("grpo-ext: error: ") and lines[0].endswith("(--debug shows the traceback)")
    return lines[0]


def good_run(inputs, *without: str) -> str:
    """The fixture's run file, less the lines of the keys ``without`` (given again by the test: a repeated key is an
    error of its own)."""
    lines = (inputs / "run.yaml").read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.split(":", 1)[0] not in without)


def test_a_run_file_that_is_a_list_or_a_scalar(inputs, tmp_path, capsys):
    assert "bad.yaml: a run file is a mapping of options" in run_with(inputs, tmp_path, capsys, "- a\n- b\n")
    assert "got a list" in run_with(inputs, tmp_path, capsys, "- a\n- b\n")
    assert "got a str" in run_with(inputs, tmp_path, capsys, "just text\n")


def test_yaml_syntax_error_names_file_line_and_column(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "learning_rate: [1e-3\nseed: 1\n")
    assert "bad.yaml:" in line and "not valid YAML" in line
    assert run_with(inputs, tmp_path, capsys, "a: b\n  c: d\n").split("bad.yaml:")[1].startswith("2:")


def test_missing_run_file(inputs, tmp_path, capsys):
    capsys.readouterr()
    assert cli_main(["train", "--config", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: no such run file (--config)" in capsys.readouterr().err


def test_garbled_jsonl_line_names_file_and_line(inputs, tmp_path, capsys):
    data = (inputs / "data.jsonl").read_text().splitlines()
    data[6] = data[6][:-3]  # a line cut short
    (tmp_path / "data.jsonl").write_text("\n".join(data) + "\n")
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--dataset", str(tmp_path / "data.jsonl"))
    assert f"{tmp_path / 'data.jsonl'}:7: not a JSON line" in line
    (tmp_path / "data.jsonl").write_text('{"question": "no prompt"}\n')
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--dataset", str(tmp_path / "data.jsonl"))
    assert "data.jsonl:1: every row needs a 'prompt' string" in line


def test_missing_model_folder_is_named_not_a_repo_id(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--model_name_or_path", str(tmp_path / "no-model"))
    assert f"model_name_or_path: no model folder {tmp_path / 'no-model'}" in line and "Repo id" not in line


def test_unknown_key_names_the_closest_field(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "learning_rat: 0.1\n")
    assert "the run config has no field 'learning_rat' (did you mean 'learning_rate'?)" in line
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "datset: x\n")
    assert "(did you mean 'dataset'?)" in line


def test_a_string_boolean_is_refused(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + 'bf16: "false"\n')
    assert "GRPOConfig.bf16 must be a boolean (true or false) or null (None), got 'false' (str)" in line


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return None", "reward function broken returned None"),
        ("return (1.0 for _ in completions)", "reward function broken returned generator"),
        ("return [1.0] * (len(completions) - 1)", "reward function broken returned 7 values for 8 completions"),
        # not only the exception's message: the function and the exception's type too
        ("raise RuntimeError('reward server unreachable')",
         "error: reward function 'broken' raised RuntimeError: reward server unreachable (--debug"),
        ("return [1.0] + [10**400] * (len(completions) - 1)",  # an int beyond float64
         "reward function broken returned 1000000000000000000000000000000000000000... for row 1"),
    ],
    ids=["None", "generator", "short", "raises", "int beyond float"],
)  # fmt: skip
def test_a_reward_returning_the_wrong_thing_is_named(inputs, tmp_path, capsys, monkeypatch, body, message):
    module = f"rewards_{tmp_path.name}"  # a module of its own per case (imports are cached)
    (tmp_path / f"{module}.py").write_text(f"def broken(prompts, completions, **columns):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = run_with(inputs, tmp_path, capsys, good_run(inputs, "reward_funcs") + f"reward_funcs: {module}:broken\n")
    assert message in line


def test_a_reward_that_cannot_be_imported_is_named(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs, "reward_funcs") + "reward_funcs: no_such_module:f\n")
    assert "reward_funcs: cannot import 'no_such_module'" in line


REWARD = "a reward (a built-in name or package.module:function)"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("5", f"reward_funcs must be {REWARD} or a list of them, got 5 (int)"),
        ("[graded_answer, 5]", f"reward_funcs[1] must be {REWARD}, got 5 (int)"),
        ("{graded_answer: 1}", f"reward_funcs must be {REWARD} or a list of them, got {{'graded_answer': 1}} (dict)"),
        ("[]", "reward_funcs is empty: give at least one reward"),
        ("null", "the run config lacks reward_funcs (give it in the run file or as --key value)"),
    ],
    ids=["int", "int in a list", "mapping", "empty list", "null"],
)  # fmt: skip
def test_reward_funcs_of_the_wrong_type_is_named(inputs, tmp_path, capsys, value, message):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs, "reward_funcs") + f"reward_funcs: {value}\n")
    assert message in line


def test_a_missing_gguf_file_is_named(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "gguf_file: missing.gguf\n")
    assert f"gguf_file: no GGUF file {inputs / 'model' / 'missing.gguf'}" in line
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "gguf_file: 3\n")
    assert "gguf_file must be a file name (in the model_name_or_path folder) or a path, got 3 (int)" in line


def test_a_prompt_that_is_neither_text_nor_messages_is_named(inputs, tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"prompt": [{"role": "user", "content": "12>"}]}\n{"prompt": [1, 2]}\n')
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--dataset", str(tmp_path / "data.jsonl"))
    assert "data.jsonl:2: every row needs a 'prompt' string or list of messages" in line


def test_a_prompt_that_gives_no_tokens_is_named_by_file_and_line(inputs, tmp_path, capsys):
    rows = (inputs / "data.jsonl").read_text().splitlines()
    rows[2] = rows[2].replace('"prompt": "', '"prompt": "", "was": "')  # row 2, an empty prompt
    (tmp_path / "data.jsonl").write_text("\n" + "\n".join(rows) + "\n")  # a blank first line: row 2 is on line 4
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--dataset", str(tmp_path / "data.jsonl"))
    assert f"{tmp_path / 'data.jsonl'}:4: train_dataset row 2: its prompt '' gives no tokens" in line
    (tmp_path / "held_out.jsonl").write_text('{"prompt": "12>", "answer": "21"}\n{"prompt": "", "answer": ""}\n')
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + f"eval_dataset: {tmp_path / 'held_out.jsonl'}\n")
    assert f"{tmp_path / 'held_out.jsonl'}:2: eval_dataset row 1: its prompt '' gives no tokens" in line


def test_a_repeated_key_names_both_lines(inputs, tmp_path, capsys):
    lines = good_run(inputs).splitlines()
    first, end = next(n for n, line in enumerate(lines, 1) if line.startswith("learning_rate:")), len(lines)
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "learning_rate: 0.5\n")
    assert (f"bad.yaml:{end + 1}:1: not valid YAML (duplicate key 'learning_rate': first on line {first}, again on "
            f"line {end + 1})") in line  # fmt: skip
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + "lora:\n  r: 4\n  lora_alpha: 8\n  r: 8\n")
    assert f"bad.yaml:{end + 4}:3: not valid YAML (duplicate key 'r': first on line {end + 2}, again on line " in line
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--lora", "{r: 4, r: 8}")
    assert "--lora '{r: 4, r: 8}': not a valid value (duplicate key 'r': first on line 1, again on line 1)" in line


def test_a_missing_eval_dataset_is_named(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + f"eval_dataset: {tmp_path / 'nope.jsonl'}\n")
    assert f"eval_dataset: no such file {tmp_path / 'nope.jsonl'}" in line


def test_a_missing_model_name_or_path_is_named(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs, "model_name_or_path") + "model_name_or_path: null\n")
    assert "the run config lacks model_name_or_path (give it in the run file or as --key value)" in line


def test_a_missing_reward_file_is_named(inputs, tmp_path, capsys):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs, "reward_funcs") + "reward_funcs: nowhere/rewards.py:f\n")
    assert "reward_funcs: no file nowhere/rewards.py for 'nowhere/rewards.py:f'" in line
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    run_text = good_run(inputs, "reward_funcs") + f"reward_funcs: {tmp_path / 'broken.py'}:f\n"
    line = run_with(inputs, tmp_path, capsys, run_text)
    assert "failed (RuntimeError: boom)" in line


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("5", "lora must be a mapping of peft.LoraConfig fields (e.g. {r: 16, lora_alpha: 32}), got 5 (int)"),
        ("{rank: 4}", "lora: "),
    ],
    ids=["not a mapping", "unknown field"],
)
def test_a_bad_lora_mapping_is_named(inputs, tmp_path, capsys, value, message):
    line = run_with(inputs, tmp_path, capsys, good_run(inputs) + f"lora: {value}\n")
    assert message in line
    if value.startswith("{"):
        assert "rank" in line


def test_an_abbreviated_flag_is_not_taken_for_overwrite(inputs, tmp_path, capsys):
    """argparse would read --over as --overwrite, which deletes a run's outputs (an outside audit, 2026-11-29)."""
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), "--over", "true")
    assert "the run config has no field 'over'" in line  # an unknown key, not --overwrite


@pytest.mark.parametrize(("flags", "message"), [(["--learning_rate"], "--learning_rate needs a value"),
                                                (["--seed", "1", "--max_steps"], "--max_steps needs a value"),
                                                (["seed", "1"], "expected --key value, got 'seed'")])
def test_a_bad_override_is_one_error_line(inputs, tmp_path, capsys, flags, message):
    """An override without its value is the CLI's one-line error with status 1, as every other bad input (an outside
    audit, 2026-11-29: it was a bare SystemExit's text)."""
    line = run_with(inputs, tmp_path, capsys, good_run(inputs), *flags)
    assert line.startswith("grpo-ext: error: ") and message in line


def test_fsdp_false_overrides_a_run_file(inputs, tmp_path, capsys, monkeypatch):
    """``--fsdp`` alone turns FSDP2 on; ``--fsdp false`` turns off a run file's ``fsdp: true`` (an outside audit,
    2026-11-29: "expected --key value, got 'false'")."""
    from grpo_ext.trainer import cli

    seen = []
    monkeypatch.setattr(cli, "train_from_options", lambda options, resume=None: seen.append(options["fsdp"]))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(good_run(inputs) + "fsdp: true\n")
    for flag, expected in (([], True), (["--fsdp", "false"], False), (["--fsdp"], True), (["--fsdp=false"], False)):
        assert cli_main(["train", "--config", str(run_file), *flag]) == 0
        assert seen.pop() is expected, flag
    with pytest.raises(SystemExit):  # argparse's usage error, naming the flag
        cli_main(["train", "--config", str(run_file), "--fsdp", "maybe"])
    assert "argument --fsdp: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_run_file_paths_may_start_with_home(inputs, tmp_path, capsys, monkeypatch):
    """``~/...`` in a run file's model, dataset and output paths is the home folder, as a shell would read it (an
    outside audit, 2026-11-29: the model was looked up as a Hub repo id, the output written to a folder named ~)."""
    monkeypatch.setenv("HOME", str(inputs))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(good_run(inputs, "model_name_or_path", "dataset", "output_dir") +
                        "model_name_or_path: ~/model\ndataset: ~/data.jsonl\noutput_dir: ~/home-run\n")  # fmt: skip
    assert cli_main(["train", "--config", str(run_file)]) == 0
    assert (inputs / "home-run" / "final_model").is_dir()


def test_python_m_grpo_ext_is_the_grpo_ext_command(tmp_path):
    ran = subprocess.run([sys.executable, "-m", "grpo_ext", "train", "--config", str(tmp_path / "none.yaml")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert ran.returncode == 1
    assert ran.stderr.startswith("grpo-ext: error:") and "none.yaml" in ran.stderr
    helped = subprocess.run([sys.executable, "-m", "grpo_ext", "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: grpo-ext ") and "demo" in helped.stdout
