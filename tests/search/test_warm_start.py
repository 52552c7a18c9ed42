"""Warm start (docs/warm-start.md): a sweep begins from an earlier sweep's finished trials, given
to its search as evaluated ones, on a changed space and from another backend; bad warm-start
inputs are one line, exit 2, nothing written. One earlier sweep (5 trials) serves every test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import hpsweep_cli, load_sweep_study, offline_wandb_env, write_space

from hpsweep import runs
from hpsweep.cli.commands import main
from hpsweep.search.warm_start import WARM_ATTR, WARM_NUMBER

EARLIER_SPACE = (
    '{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8),'
    ' "warmup_ratio": hpsweep.Float(0.0, 0.2)}'
)
#: warmup_ratio removed, the learning rate's range narrowed, weight_decay new
CHANGED_SPACE = (
    '{"learning_rate": hpsweep.Float(1e-3, 2e-2, log=True), "hidden": hpsweep.Int(8, 32, step=8),'
    ' "weight_decay": hpsweep.Float(0.0, 0.1)}'
)
NARROWED = 2e-2


@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The home of an earlier Optuna sweep: 5 seeded random trials of one epoch."""
    folder = tmp_path_factory.mktemp("earlier")
    space = write_space(folder, name="earlier.py", epochs=1, space=EARLIER_SPACE)
    hpsweep_cli("run", space, "--n-trials", 5, "--sampler", "random", "--seed", 0, check=True)
    return folder / "out"


def test_changed_space_takes_what_fits_once_and_counts_only_new_trials(
    earlier: Path, tmp_path: Path
) -> None:
    records = runs.read_trials(earlier)
    fits = [r for r in records if r.params["learning_rate"] <= NARROWED]
    assert 0 < len(fits) < len(records)  # the seeded sweep has trials on both sides
    space = write_space(tmp_path, epochs=1, space=CHANGED_SPACE)
    out = tmp_path / "out"

    proc = hpsweep_cli("run", space, "--n-trials", 2, "--warm-start", earlier, check=True)
    assert (
        f"hpsweep: warm start: {len(fits)} of 5 trials of {earlier}; {5 - len(fits)} outside "
        "the new space; weight_decay sampled fresh"
    ) in proc.stderr.splitlines()
    warm = [t for t in load_sweep_study(out).trials if WARM_ATTR in t.user_attrs]
    assert sorted(t.user_attrs[WARM_NUMBER] for t in warm) == [r.number for r in fits]
    earlier_by_number = {r.number: r for r in records}
    for t in warm:
        was = earlier_by_number[t.user_attrs[WARM_NUMBER]]
        assert t.user_attrs[WARM_ATTR] == str(earlier)
        # warmup_ratio dropped, weight_decay (new) absent: the sampler draws it fresh
        assert t.params == {k: was.params[k] for k in ("learning_rate", "hidden")}
        assert t.value == was.objective
        assert t.intermediate_values == {}  # a pruner would compare new curves with these
    new = runs.read_trials(out)
    assert [r.state for r in new] == ["complete", "complete"]  # --n-trials counts new ones only
    assert sorted(p.name for p in out.glob("run-*")) == sorted(Path(r.run_dir).name for r in new)
    assert all(set(r.params) == {"learning_rate", "hidden", "weight_decay"} for r in new)

    # the same command again, for one more trial: nothing is added twice
    hpsweep_cli("run", space, "--n-trials", 3, "--warm-start", earlier, check=True)
    study = load_sweep_study(out)
    assert len([t for t in study.trials if WARM_ATTR in t.user_attrs]) == len(fits)
    assert len(runs.read_trials(out)) == 3
    shown = json.loads(hpsweep_cli("show", out, "--json", check=True).stdout)
    assert [row["number"] for row in shown if "warm_start" in row] == [r.number for r in fits]
    assert len([row for row in shown if "warm_start" not in row]) == 3


def test_best_configs_train_first_and_count(earlier: Path, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1, space=CHANGED_SPACE)
    out = tmp_path / "out"
    hpsweep_cli(
        "run", space, "--n-trials", 1, "--warm-start", earlier, "--warm-start-best", 1, check=True
    )
    fits = [r for r in runs.read_trials(earlier) if r.params["learning_rate"] <= NARROWED]
    best = max(fits, key=lambda r: r.objective)
    (trained,) = runs.read_trials(out)
    assert {k: trained.params[k] for k in ("learning_rate", "hidden")} == {
        k: best.params[k] for k in ("learning_rate", "hidden")
    }


@pytest.fixture
def wandb_offline(tmp_path: Path) -> dict[str, str]:
    return offline_wandb_env(tmp_path)


def test_an_optuna_sweep_warm_starts_a_wandb_one(
    earlier: Path, tmp_path: Path, wandb_offline: dict[str, str]
) -> None:
    space = write_space(
        tmp_path,
        epochs=1,
        space='{"learning_rate": hpsweep.Float(1e-3, 2e-2, log=True), '
        '"hidden": hpsweep.Int(8, 32, step=8)}',
    )
    out = tmp_path / "out"
    argv = ["run", space, "--backend", "wandb", "--n-trials", 2, "--warm-start", earlier]
    proc = hpsweep_cli(*argv, env=wandb_offline, check=True)
    fits = [r for r in runs.read_trials(earlier) if r.params["learning_rate"] <= NARROWED]
    assert f"warm start: {len(fits)} of 5 trials of {earlier}" in proc.stderr
    assert [r.backend for r in runs.read_trials(out)] == ["wandb", "wandb"]
    shown = hpsweep_cli("show", out, check=True).stdout
    assert "warm start" in shown and "(--warm-start)" in shown
    report = hpsweep_cli("report", out, check=True)
    assert f"Warm start: {len(fits)} trials of {earlier}" in Path(report.stdout.strip()).read_text()


@pytest.mark.parametrize(
    "case, needles",
    [
        ("missing-home", ["--warm-start", "no such folder"]),
        ("other-objective", ["optimised eval_accuracy (maximize)", "same objective"]),
        ("nothing-fits", ["none of its 5 finished trials fits the new space"]),
        ("best-without-home", ["--warm-start-best 2 needs --warm-start"]),
        ("wandb-new-param", ["wandb backend", "none has weight_decay"]),
        ("ray-random", ["on the ray backend only Optuna's TPE", "not --sampler random"]),
    ],
)
def test_bad_warm_start_is_one_line_and_writes_nothing(
    earlier: Path,
    tmp_path: Path,
    wandb_offline: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: str,
    needles: list[str],
) -> None:
    for name, value in wandb_offline.items():
        monkeypatch.setenv(name, value)
    settings: dict[str, object] = {"epochs": 1, "space": CHANGED_SPACE}
    argv: list[object] = ["--warm-start", earlier]
    if case == "missing-home":
        argv = ["--warm-start", tmp_path / "nowhere"]
    elif case == "other-objective":
        settings.update(objective="eval_loss", direction="minimize")
    elif case == "nothing-fits":
        settings["space"] = '{"learning_rate": hpsweep.Float(0.5, 0.9)}'
    elif case == "best-without-home":
        argv = ["--warm-start-best", 2]
    elif case == "wandb-new-param":
        argv += ["--backend", "wandb"]
    elif case == "ray-random":
        argv += ["--backend", "ray", "--sampler", "random"]
    space = write_space(tmp_path, **settings)  # type: ignore[arg-type]
    assert main(["run", str(space), "--n-trials", "1", *map(str, argv)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("hpsweep: error: "), errors
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
