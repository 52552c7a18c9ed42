"""Inputs that used to crash, half-write or mislead a sweep: each is one line and exit 2 with
nothing written, or does what a user means (docs/cli.md and
docs/guarantees.md)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from support import hpsweep_cli, write_space

from hpsweep import runs


def assert_one_line(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpsweep: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize(
    "case, needles",
    [
        ("output-dir-is-a-file", ["is a file", "give a folder"]),
        ("output-dir-under-a-file", ["is under the file", "give a folder"]),
        ("config-is-a-folder", ["is a folder", "YAML or JSON file"]),
        ("timeout-nan", ["--timeout nan", "positive number"]),
        ("hp-name-raises", ["hp_name(trial) raised ZeroDivisionError", "fix hp_name"]),
        ("sys-exit-in-space-file", ["raised SystemExit", "__main__"]),
        ("keyboard-interrupt-in-space-file", ["raised KeyboardInterrupt"]),
        ("compute-metrics-returns-a-list", ["compute_metrics returned list", "return a dict"]),
        ("empty-train-dataset", ["train_dataset is empty"]),
        (
            "streamed-train-dataset",
            ["train_dataset is an IterableDataset", "without streaming=True"],
        ),
        ("max-failed-trials-zero", ["--max-failed-trials 0"]),
        ("address-on-optuna", ["--address", "does not use it", "--backend ray"]),
        ("unknown-option", ["unknown optuna option(s) colour"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, case: str, needles: list[str]
) -> None:
    extra, argv = "", []
    out = tmp_path / "out"
    if case == "output-dir-is-a-file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f"
    elif case == "output-dir-under-a-file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "sub"
    elif case == "config-is-a-folder":
        argv = ["--config", str(tmp_path)]
    elif case == "timeout-nan":
        argv = ["--timeout", "nan"]
    elif case == "hp-name-raises":
        extra = "def hp_name(trial):\n    return str(1 / 0)\n"
    elif case == "sys-exit-in-space-file":
        extra = "import sys\nsys.exit()\n"
    elif case == "keyboard-interrupt-in-space-file":
        extra = "raise KeyboardInterrupt\n"
    elif case == "compute-metrics-returns-a-list":
        extra = "def compute_metrics(p):\n    return [0.5]\nobjective = 'eval_loss'\ndirection = 'minimize'\n"
    elif case == "empty-train-dataset":
        extra = "def train_dataset():\n    return _data(0, 1)\n"
    # as datasets' load_dataset(..., streaming=True) gives it
    elif case == "streamed-train-dataset":
        extra = (
            "class Stream(torch.utils.data.IterableDataset):\n"
            "    def __iter__(self):\n        yield from _data(32, 1)\n\n"
            "def train_dataset():\n    return Stream()\n"
        )
    elif case == "max-failed-trials-zero":
        argv = ["--max-failed-trials", "0"]
    elif case == "address-on-optuna":
        argv = ["--address", "127.0.0.1:6379"]
    space = write_space(tmp_path, extra=extra, output_dir=str(out))
    if case == "unknown-option":  # through the API, as keyword options reach the backend
        import hpsweep

        with pytest.raises(hpsweep.errors.UserError, match="unknown optuna option"):
            hpsweep.run(space, n_trials=1, colour="blue")
        assert not out.exists()
        return
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_one_line(hpsweep_cli("run", space, "--n-trials", "2", *argv, cwd=tmp_path), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written


def test_long_and_reserved_hp_names_get_their_own_folders(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        extra="""
def hp_name(trial):
    return ["study.journal", "study.db", "best_run.json", "x" * 150 + str(trial.number), "x" * 150 + "9"][trial.number]
""",
    )
    hpsweep_cli("run", space, "--n-trials", "5", "--sampler", "random", check=True)
    out = tmp_path / "out"
    records = runs.read_trials(out)
    assert len({r.run_dir for r in records}) == 5
    assert (out / "study.journal").is_file() and (out / "run-study.journal").is_dir()
    # 0.1's study file stays free
    assert not (out / "study.db").exists() and (out / "run-study.db").is_dir()
    assert runs.read_best(out).run_dir in {r.run_dir for r in records}
    assert all(len(Path(r.run_dir).name) <= 100 for r in records)


def test_a_study_created_to_maximize_is_not_rerun_to_minimize(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    flipped = write_space(tmp_path, name="space.py", direction="minimize", objective="eval_loss")
    assert_one_line(
        hpsweep_cli("run", flipped, "--n-trials", "2"), "was created to maximize", "--study-name"
    )


def test_a_rerun_with_the_same_seed_continues_the_sampler(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    hpsweep_cli("run", space, "--n-trials", "2", "--seed", "3", check=True)
    hpsweep_cli("run", space, "--n-trials", "4", "--seed", "3", check=True)
    params = [tuple(sorted(r.params.items())) for r in runs.read_trials(tmp_path / "out")]
    assert len(set(params)) == 4, params


def test_checkpoints_and_best_are_readable_by_other_users(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    out = tmp_path / "out"
    for path in [
        out / "best",
        out / "best" / "model.safetensors",
        *runs.checkpoints(out / "run-0"),
    ]:
        assert path.stat().st_mode & stat.S_IROTH, oct(path.stat().st_mode)


def test_a_second_study_in_one_folder_is_refused_and_the_first_is_kept(tmp_path: Path) -> None:
    """The study name defaults to the space file's name: another space file sent to the same
    --output-dir would number its trials from 0 into the first sweep's run folders."""
    first, second = write_space(tmp_path, name="first.py"), write_space(tmp_path, name="second.py")
    out = tmp_path / "out"
    hpsweep_cli("run", first, "--n-trials", "2", "--output-dir", out, check=True)
    before = {r.id: r.finished_at for r in runs.read_trials(out)}
    assert_one_line(
        hpsweep_cli("run", second, "--n-trials", "3", "--output-dir", out),
        "holds the sweep of study 'first', not 'second'",
        "--study-name first",
    )
    assert {r.id: r.finished_at for r in runs.read_trials(out)} == before
    # naming the folder's study continues it
    hpsweep_cli(
        "run", second, "--n-trials", "3", "--output-dir", out, "--study-name", "first", check=True
    )
    after = runs.read_trials(out)
    assert len(after) == 3 and {r.id: r.finished_at for r in after if r.id in before} == before
