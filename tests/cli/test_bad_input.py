"""Every mistake a user can make gets one line naming the problem and the fix, exit code 2, no
traceback, and nothing half-written on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import hpsweep_cli, write_space

from hpsweep import runs

NO_TRIAL_INIT = """
def model_init():
    return Net()
"""


def assert_user_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and lines[0].startswith("hpsweep: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


CASES = {
    "unknown parameter with a did-you-mean": (
        dict(space='{"learning_rte": hpsweep.Float(1e-3, 1e-1)}', model_init=NO_TRIAL_INIT),
        [
            "'learning_rte' is not a TrainingArguments field",
            "did you mean 'learning_rate'",
            "model_init(trial)",
        ],
    ),
    "low > high": (
        dict(space='{"learning_rate": hpsweep.Float(0.1, 0.001)}'),
        ["low (0.1) > high (0.001)", "swap"],
    ),
    "log range through zero": (
        dict(space='{"learning_rate": hpsweep.Float(0.0, 0.1, log=True)}'),
        ["low > 0"],
    ),
    "an empty categorical": (
        dict(space='{"hidden": hpsweep.Categorical([])}'),
        ["at least one choice"],
    ),
    "a bound invalid for its field": (
        dict(space='{"per_device_train_batch_size": hpsweep.Int(0, 8)}'),
        ["per_device_train_batch_size=0", "must be > 0"],
    ),
    "model_init returns None": (
        dict(model_init="def model_init(trial):\n    Net()\n"),
        ["model_init returned None", "return"],
    ),
    "model_init with two arguments": (
        dict(model_init="def model_init(a, b):\n    return Net()\n"),
        ["model_init takes 2 arguments"],
    ),
    "a metric that does not exist": (
        dict(objective="eval_acuracy"),
        ["'eval_acuracy' is not among", "did you mean 'eval_accuracy'"],
    ),
    "a bad direction": (dict(direction="maximise"), ["'maximise'", "'minimize' or 'maximize'"]),
    "a bad value in args": (
        dict(extra_args=', lr_scheduler_type="cosin"'),
        ["cosin", "did you mean 'cosine'"],
    ),
    "hp_space that raises": (
        dict(
            space="None",
            extra="""
        def hp_space(trial):
            return {"learning_rate": trial.suggest_float("learning_rate", 0.1, 0.01)}
        """,
        ),
        ["hp_space(trial) raised ValueError", "fix hp_space"],
    ),
    "an error inside the space file": (
        dict(extra="raise ValueError('no data here')"),
        ["raised ValueError: no data here"],
    ),
    # accelerate would take it and quietly train in fp32 (no GPU here): not the run that was asked for
    "fp16 without a GPU": (
        dict(extra_args=", fp16=True"),
        ["mixed_precision='fp16'", "needs a CUDA GPU", "bf16=True"],
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_space_file(tmp_path: Path, case: str) -> None:
    kwargs, needles = CASES[case]
    space = write_space(tmp_path, **kwargs)
    assert_user_error(hpsweep_cli("run", space, "--n-trials", "2"), *needles)
    assert not (tmp_path / "out").exists()


def test_missing_space_file(tmp_path: Path) -> None:
    assert_user_error(hpsweep_cli("run", tmp_path / "nope.py"), "nope.py: no such space file")


def test_space_file_with_a_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import hpsweep\nspace = {\n")
    assert_user_error(hpsweep_cli("run", path), "broken.py:2", "syntax error")


def test_space_file_missing_a_required_name(tmp_path: Path) -> None:
    path = tmp_path / "partial.py"
    path.write_text("import hpsweep\nargs = hpsweep.TrainingArguments()\nmodel_int = None\n")
    assert_user_error(
        hpsweep_cli("run", path), "defines no 'model_init'", "did you mean 'model_int'"
    )


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["--set", "learnig_rate=0.1"],
            ["'learnig_rate' is not a TrainingArguments field", "did you mean 'learning_rate'"],
        ),
        (["--set", "num_train_epochs=abc"], ["num_train_epochs='abc' is not a valid float"]),
        (["--set", "oops"], ["write it as key=value"]),
        (["--config", "missing.yaml"], ["missing.yaml: no such file"]),
        (["--backend", "sigopt"], ["'sigopt' is not one of optuna, ray, wandb"]),
        (["--sampler", "annealing"], ["'annealing' is not one of tpe, random"]),
        (["--pruner", "wilcoxon"], ["'wilcoxon' is not one of median"]),
        (["--scheduler", "asha"], ["the optuna backend has no schedulers"]),
        (["--n-trials", "0"], ["--n-trials 0: give a whole number of at least 1"]),
        (["--n-trials", "many"], ["invalid int value: 'many'"]),
        (["--sampler", "grid"], ["has no step", "Float(..., step=...)"]),
        (
            ["--storage", "sqlite:////nonexistent-dir/x/study.db"],
            ["cannot be opened", "check the URL"],
        ),
        (
            ["--storage", "/proc/hpsweep/study.journal"],
            ["study's journal /proc/hpsweep/study.journal cannot be written", "writable folder"],
        ),
    ],
)
def test_bad_command_line(
    tmp_path: Path, space_file: Path, argv: list[str], needles: list[str]
) -> None:
    assert_user_error(hpsweep_cli("run", space_file, *argv, cwd=tmp_path), *needles)
    assert not (tmp_path / "out").exists()


def test_broken_config_file(tmp_path: Path, space_file: Path) -> None:
    config = tmp_path / "args.yaml"
    config.write_text("learning_rate: [1\nseed: 3\n")
    assert_user_error(
        hpsweep_cli("run", space_file, "--config", config), "args.yaml:", "not valid YAML"
    )
    config.write_text("learning_rat: 0.1\n")
    assert_user_error(
        hpsweep_cli("run", space_file, "--config", config), "did you mean 'learning_rate'"
    )


def test_show_on_a_folder_without_trials(tmp_path: Path) -> None:
    assert_user_error(hpsweep_cli("show", tmp_path), "no trials found")


def test_an_existing_sweep_is_kept_when_a_later_run_is_refused(
    tmp_path: Path, space_file: Path
) -> None:
    hpsweep_cli("run", space_file, "--n-trials", "1", check=True)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*"))
    assert_user_error(
        hpsweep_cli("run", space_file, "--n-trials", "2", "--set", "seed=x"), "seed='x'"
    )
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*")) == before


def test_a_changed_space_on_an_existing_study(tmp_path: Path) -> None:
    hpsweep_cli("run", write_space(tmp_path), "--n-trials", "1", check=True)
    changed = write_space(
        tmp_path,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), '
        '"hidden": hpsweep.Categorical([8, 32])}',
    )
    assert_user_error(
        hpsweep_cli("run", changed, "--n-trials", "2"), "space['hidden']", "another --study-name"
    )
    assert [r.state for r in runs.read_trials(tmp_path / "out")] == ["complete"]


@pytest.mark.parametrize("held", [[], ["notes.txt"]], ids=["empty", "with a file"])
def test_a_refusal_keeps_the_output_folder_that_was_there(
    tmp_path: Path, space_file: Path, held: list[str]
) -> None:
    """The storage is refused once the sweep's folder is open: what the command made there goes,
    the folder the user made stays as it was."""
    out = tmp_path / "out"
    out.mkdir()
    for name in held:
        (out / name).write_text("mine\n")
    proc = hpsweep_cli(
        "run", space_file, "--storage", "sqlite:////nonexistent-dir/x/study.db", cwd=tmp_path
    )
    assert_user_error(proc, "cannot be opened")
    assert sorted(p.name for p in out.iterdir()) == held
