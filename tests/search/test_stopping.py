"""``--stop-when``: a sweep that stops by itself, on one decision for every worker and machine
(docs/stopping.md). Real sweeps of the tiny model, a real Optuna study for the regret rule, a
real PostgreSQL study shared by two machines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optuna
import pytest
from support import hpsweep_cli, offline_wandb_env, write_space
from support.machines import Machine, sweep_args

from hpsweep import runs
from hpsweep.cli import main
from hpsweep.search.stopping import STATE_FILE, STUDY_ATTR, Finished, Regret

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

#: One config only: every trial trains the same seeded model, so no trial gains on the first.
SAME_EVERY_TIME = '{"hidden": hpsweep.Categorical([16])}'


def finished(out: Path) -> list[runs.TrialRecord]:
    return [r for r in runs.read_trials(out) if r.state in ("complete", "pruned")]


def decision(out: Path) -> dict:
    return json.loads((out / STATE_FILE).read_text())["stopped"]


@pytest.mark.parametrize(
    "spec", ["plateu", "target:", "target:high", "plateau:0", "plateau:5:-1", "regret:3"]
)
def test_a_bad_rule_is_one_line_with_the_fix_and_nothing_is_written(tmp_path, capsys, spec):
    space = write_space(tmp_path, epochs=1)
    out = tmp_path / "out"
    assert main(["run", str(space), "--output-dir", str(out), f"--stop-when={spec}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and spec in err[0] and "give plateau" in err[0], err
    assert not out.exists()


def test_a_sweep_of_several_objectives_is_refused_a_rule(tmp_path, capsys):
    space = write_space(
        tmp_path,
        epochs=1,
        objective="eval_loss",
        direction=["minimize", "maximize"],
    )
    out = tmp_path / "out"
    assert main(["run", str(space), "--output-dir", str(out), "--stop-when", "plateau"]) == 2
    assert "2 objectives" in capsys.readouterr().err
    assert not out.exists()


def test_target_stops_the_sweep_and_the_same_command_does_not_start_it_again(tmp_path):
    space = write_space(tmp_path, epochs=1)
    out = tmp_path / "out"
    command = ("run", space, "--output-dir", out, "--n-trials", "8", "--seed", "0")
    proc = hpsweep_cli(*command, "--stop-when", "target:0.2", check=True)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hpsweep: stopped by target:0.2 after 1 trials"), proc.stderr
    assert "1 of --n-trials 8 ran, saving 7 trials" in last
    assert len(finished(out)) == 1 and decision(out)["after"] == 1

    again = hpsweep_cli(*command, "--stop-when", "target:0.2", check=True)
    assert again.stderr.strip().splitlines()[-1] == last  # done at once, the same last line
    assert len(runs.read_trials(out)) == 1

    # more trials asked: the sweep goes on, and the rule judges only the trials after that point
    more = hpsweep_cli(
        "run", space, "--output-dir", out, "--n-trials", "9", "--seed", "0",
        "--stop-when", "target:0.2", check=True,
    )  # fmt: skip
    assert "stopped by target:0.2 after 2 trials" in more.stderr
    assert len(finished(out)) == 2


def test_plateau_stops_two_workers_on_one_decision(tmp_path):
    space = write_space(tmp_path, epochs=1, space=SAME_EVERY_TIME)
    out = tmp_path / "out"
    proc = hpsweep_cli(
        "run", space, "--output-dir", out, "--n-trials", "12", "--n-jobs", "2",
        "--stop-when", "plateau:3", check=True,
    )  # fmt: skip
    stopped = decision(out)
    done = finished(out)
    # the decision after 4 trials (1, then 3 without gain), or 5 when the two workers' trials
    # ended together; the other worker's trial then running finishes and counts
    assert stopped["after"] in (4, 5) and stopped["rule"] == "plateau:3:0"
    assert len(done) - stopped["after"] in (0, 1) and len(done) == len(runs.read_trials(out))
    assert all(r.started_at <= stopped["at"] for r in done), "a trial began after the decision"
    assert f"{len(done)} of --n-trials 12 ran, saving {12 - len(done)}" in proc.stderr


def study_trials(maker, n: int, seed: int) -> list[Finished]:
    """``n`` trials of a real Optuna study maximising ``maker``'s function of (x, y)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=maker(seed=seed))
    rng = np.random.default_rng(seed)
    study.optimize(
        lambda t: TASKS[maker](t.suggest_float("x", 0, 1), t.suggest_float("y", 0, 1), rng),
        n_trials=n,
    )
    return [Finished(t.params, t.value) for t in study.trials]


TASKS = {
    # a smooth bowl that TPE closes in on, observed with noise
    optuna.samplers.TPESampler: lambda x, y, rng: (
        1 - (x - 0.3) ** 2 - (y - 0.6) ** 2 + rng.normal(0, 0.01)
    ),
    # a slope random search keeps climbing
    optuna.samplers.RandomSampler: lambda x, y, rng: x + y + rng.normal(0, 0.01),
}
SPACE = {"x": {"low": 0.0, "high": 1.0}, "y": {"low": 0.0, "high": 1.0}}


def first_stop(trials: list[Finished]) -> int | None:
    """How many trials the regret rule lets run: judged at every tenth trial from its 20th."""
    rule = Regret()
    return next(
        (n for n in range(20, len(trials) + 1, 10) if rule.decide(trials[:n], True, 0, SPACE)),
        None,
    )


def test_regret_stops_a_sweep_that_closed_in_and_not_one_that_still_improves():
    assert first_stop(study_trials(optuna.samplers.TPESampler, 40, seed=0)) is not None
    assert first_stop(study_trials(optuna.samplers.RandomSampler, 60, seed=0)) is None


def test_a_wandb_offline_sweep_stops_at_its_target(tmp_path):
    env = offline_wandb_env(tmp_path)  # no login, no server, nothing outside the test
    space = write_space(tmp_path, epochs=1)
    out = tmp_path / "out"
    proc = hpsweep_cli(
        "run", space, "--backend", "wandb", "--output-dir", out, "--n-trials", "6",
        "--stop-when", "target:0.2", env=env, check=True,
    )  # fmt: skip
    assert "stopped by target:0.2 after 1 trials" in proc.stderr
    assert len(finished(out)) == len(runs.read_trials(out)) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_machines_stop_on_the_study_decision_with_exact_counts(pg, tmp_path):
    url = pg.create_database("stopping")
    space = write_space(tmp_path, epochs=1, space=SAME_EVERY_TIME)
    home = tmp_path / "home"
    args = [*sweep_args(space, url, "stop", home, 12), "--stop-when", "plateau:3"]
    machines = [Machine(tmp_path, f"m{i}", *args) for i in range(2)]
    outputs = []
    for machine in machines:
        code, output = machine.finish()
        assert code == 0, output
        outputs.append(output)

    study = optuna.load_study(study_name="stop", storage=url)
    stopped = study.user_attrs[STUDY_ATTR]["stopped"]  # what the dashboard shows too
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    # the other machine's trial then running finishes and counts
    assert stopped["after"] in (4, 5) and len(complete) - stopped["after"] in (0, 1)
    assert {t.state.name for t in study.trials} <= {"COMPLETE", "FAIL"}  # FAIL: closed unneeded
    assert len(finished(home)) == len(complete)
    for output in outputs:
        assert f"stopped by plateau:3:0 after {stopped['after']} trials" in output, output
