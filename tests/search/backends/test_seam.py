"""Add a backend: the walk-through of docs/architecture.md ("Add a backend"), as code that runs.

A random search is written here against the typed bases (`AskTellSearcher` for what to try,
`Backend` for the options it takes), registered for the test, and run as a user runs any
backend: a real tiny sweep through ``Trainer.hyperparameter_search``, stopped mid-trial and run
again. Everything a user looks at afterwards (the records, the count, ``best/``, the stopped
trial resumed from its checkpoint) comes from the search layer, not from the 30 lines below.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.tiny_model import FourClassNet, four_class_rows

import hpsweep
from hpsweep import runs
from hpsweep.runs import TrialRecord
from hpsweep.search.backends import (
    BACKENDS,
    AskTellSearcher,
    Backend,
    ObjectiveValue,
    Searcher,
    SearchOptions,
    TrialEnd,
    register_backend,
)
from hpsweep.search.space import Distribution, Float
from hpsweep.trial import Trial

# --- the backend: what to try (the searcher) and the options it takes (the backend) -------------


def draw(dist: Distribution, rng: random.Random) -> object:
    """One value of ``dist``: log-uniform or uniform for a continuous float, else a grid point."""
    if isinstance(dist, Float) and dist.step is None:
        if dist.log:
            return math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))
        return rng.uniform(dist.low, dist.high)
    return rng.choice(dist.grid())


class RandomSearch(AskTellSearcher[Trial]):
    """Draws each new trial's params at random, seeded by its number. It numbers nothing itself,
    so the ledger does (``ask_numbered``); ``ask`` is asked only for a trial that runs again."""

    def __init__(self, settings: SearchOptions) -> None:
        assert settings.space is not None  # RandomBackend refused a define-by-run hp_space
        self.space, self.seed = settings.space, settings.seed or 0
        #: what this searcher was asked and told, for the test to read
        self.calls: list[tuple[str, int, TrialEnd | None]] = []

    def ask_numbered(self, number: int) -> Trial:
        rng = random.Random(self.seed * 100_003 + number)
        self.calls.append(("asked", number, None))
        return Trial(number, {name: draw(dist, rng) for name, dist in self.space.items()})

    def ask(self, again: TrialRecord | None = None) -> Trial | None:
        assert again is not None, "new trials are asked by number"
        self.calls.append(("asked again", again.number, None))
        return Trial(again.number, again.params, id=again.id)

    def tell(self, trial: Trial, end: TrialEnd, value: ObjectiveValue | None = None) -> None:
        self.calls.append(("told", trial.number, end))


class RandomBackend(Backend):
    """``--backend random``: the checks of the options are `Backend`'s; what to try is
    `RandomSearch`'s."""

    name = "random"
    samplers = ("random",)
    reads = frozenset({"resources_per_trial"})
    parallel = False  # one process; a searcher that learns nothing could take --n-jobs too
    made: list[RandomSearch] = []  # the searchers the test's sweeps used

    def searcher(self) -> Searcher:
        searcher = RandomSearch(self.settings)
        RandomBackend.made.append(searcher)
        return searcher


@pytest.fixture
def random_backend() -> Iterator[list[RandomSearch]]:
    """``backend="random"`` in this test; the searchers its sweeps made."""
    register_backend("random", RandomBackend)
    RandomBackend.made.clear()
    try:
        yield RandomBackend.made
    finally:
        del BACKENDS["random"]


# --- a user's session with it --------------------------------------------------------------------


SPACE = {
    "learning_rate": hpsweep.Float(1e-3, 1e-1, log=True),
    "weight_decay": hpsweep.Categorical([0.0, 0.01]),
}


class StopAtTrial1sFirstCheckpoint(hpsweep.TrainerCallback):
    """Ctrl-C once trial 1 has written its first checkpoint, as a user stops a sweep."""

    def __init__(self) -> None:
        self.fired = False

    def on_save(self, args, state, control, **kwargs) -> None:
        if Path(args.output_dir).name == "run-1" and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def sweep(out: Path, stop: StopAtTrial1sFirstCheckpoint) -> hpsweep.BestRun:
    trainer = hpsweep.Trainer(
        model_init=FourClassNet,
        args=hpsweep.TrainingArguments(
            output_dir=str(out),
            num_train_epochs=2,
            per_device_train_batch_size=32,
            disable_progress=True,
        ),
        train_dataset=four_class_rows(64, 1),
        eval_dataset=four_class_rows(32, 2),
        callbacks=[stop],
    )
    return trainer.hyperparameter_search(
        space=SPACE, n_trials=3, backend="random", sampler="random", seed=1, show_progress=False
    )


def test_a_backend_written_against_the_bases_runs_a_sweep_stopped_and_run_again(
    tmp_path: Path, random_backend: list[RandomSearch]
) -> None:
    out, stop = tmp_path / "out", StopAtTrial1sFirstCheckpoint()
    with pytest.raises(KeyboardInterrupt):
        sweep(out, stop)
    first = {r.number: r for r in runs.read_trials(out)}
    assert {n: r.state for n, r in first.items()} == {0: "complete", 1: "stopped"}
    assert runs.latest_checkpoint(Path(first[1].run_dir)) is not None

    best = sweep(out, stop)  # the same call again: the sweep goes on where it stopped
    records = {r.number: r for r in runs.read_trials(out)}
    assert {n: r.state for n, r in records.items()} == {n: "complete" for n in range(3)}
    assert all(r.backend == "random" and len(r.history) == 2 for r in records.values())
    # the stopped trial ran again as itself, from its checkpoint, asked again of the searcher
    again = records[1]
    assert (again.params, again.run_dir, again.attempts) == (first[1].params, first[1].run_dir, 2)
    assert again.resumed_from is not None and "checkpoint-" in again.resumed_from
    before, after = random_backend
    assert before.calls == [
        ("asked", 0, None),
        ("told", 0, TrialEnd.COMPLETE),
        ("asked", 1, None),
        ("told", 1, TrialEnd.STOPPED),
    ]
    assert after.calls == [
        ("asked again", 1, None),
        ("told", 1, TrialEnd.COMPLETE),
        ("asked", 2, None),
        ("told", 2, TrialEnd.COMPLETE),
    ]
    # counted once each, and the best of the three is the sweep's best/
    top = min(records.values(), key=lambda r: r.objective)
    assert (best.run_id, best.objective, best.hyperparameters) == (
        top.id,
        top.objective,
        top.params,
    )
    assert (out / "best" / "model.safetensors").exists()


def test_a_backend_name_is_registered_once_and_a_backend_must_say_what_searches() -> None:
    with pytest.raises(ValueError, match="'optuna'.*taken"):
        register_backend("optuna", RandomBackend)
    with pytest.raises(TypeError, match="subclasses Backend"):
        register_backend("random", RandomSearch)  # type: ignore[arg-type]

    class NoSearcher(Backend):  # neither a searcher itself nor overriding searcher()
        name = "none"

    with pytest.raises(TypeError, match="neither an AskTellSearcher nor a Driver"):
        NoSearcher(SearchOptions()).searcher()
