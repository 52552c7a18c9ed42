"""What to try, in Ray Tune's terms: the space as Tune domains, Tune's search algorithms and
schedulers, transformers' ``tune.run`` keywords. Both search algorithms stop suggesting at
``--timeout``; hpsweep's TPE tells Optuna a trial without a result as FAIL (which TPE ignores)
and starts from the results of the trials earlier rounds completed.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

from ray import tune
from ray.tune.search import Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.optuna import OptunaSearch
from ray.tune.search.sample import Domain

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.backends._ray._trial import FAILED_KEY, METRIC, USER_ERROR_KEY
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Categorical, Distribution, Float, Int
from hpsweep.search.warm_start import WarmStart
from hpsweep.train.arguments import FIELD_NAMES


def tune_domain(dist: Distribution) -> Any:
    """A distribution as a Tune domain (same bounds, both included)."""
    if isinstance(dist, Float):
        if dist.log:
            return tune.loguniform(dist.low, dist.high)
        if dist.step is not None:  # Tune quantises to multiples of q; off-grid bounds need a choice
            aligned = abs(dist.low / dist.step - round(dist.low / dist.step)) < 1e-9
            return (
                tune.quniform(dist.low, dist.high, dist.step)
                if aligned
                else tune.choice(dist.grid())
            )
        return tune.uniform(dist.low, dist.high)
    if isinstance(dist, Int):
        if dist.log:
            return tune.lograndint(dist.low, dist.high + 1)
        if dist.step == 1:
            return tune.randint(dist.low, dist.high + 1)
        return (
            tune.qrandint(dist.low, dist.high, dist.step)
            if dist.low % dist.step == 0
            else tune.choice(dist.grid())
        )
    assert isinstance(dist, Categorical)
    return tune.choice(list(dist.choices))


def tune_space(space: dict[str, Distribution]) -> dict[str, Any]:
    return {name: tune_domain(dist) for name, dist in space.items()}


def native_space(hp_space: Callable[[Any], Any] | None) -> dict[str, Any] | None:
    """``hp_space(None)`` when it is a dict of Tune domains (as Hugging Face calls a Ray
    ``hp_space``), else None: the function is define-by-run."""
    if hp_space is None:
        return None
    try:
        space = hp_space(None)
    except Exception:  # define-by-run: it calls trial.suggest_*
        return None
    if not isinstance(space, dict) or not any(_is_domain(v) for v in space.values()):
        return None
    return dict(space)


def _is_domain(value: Any) -> bool:
    return isinstance(value, Domain) or (isinstance(value, dict) and set(value) == {"grid_search"})


def search_algorithm(
    settings: SearchOptions,
    sampler: str,
    param_space: dict[str, Any],
    define_by_run: bool,
    records: list[runs.TrialRecord],
    deadline: float | None,
    *,
    explicit_metric: bool = False,
    warm: WarmStart | None = None,
) -> Any:
    """A round's search algorithm: random, or TPE started from the sweep's ``records`` and
    ``warm`` (`seeded_storage`), seeded past them so that a later round draws other params.
    ``explicit_metric``: the round's config names no metric (a user's scheduler has its own), so
    TPE is told the objective itself."""
    s = settings
    seed = None if s.seed is None else s.seed + len(records)
    if sampler == "random":
        # Tune ignores max_concurrent_trials for a variant generator it did not make
        return VariantGenerator(deadline, random_state=seed, max_concurrent=s.n_jobs)
    import optuna

    from hpsweep.search.backends._optuna._backend import OptunaTrial

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space: Callable[[Any], None] | None = None
    storage = None
    if define_by_run:
        hp_space, multi = s.hp_space, s.multi_objective
        assert hp_space is not None

        def sample(ot_trial: Any) -> None:  # sampled on the driver, replayed on the worker
            hp_space(OptunaTrial(ot_trial, multi))

        space = sample
    elif not s.multi_objective:  # a define-by-run space has no distributions to add trials with
        storage = seeded_storage(param_space, s.directions[0], records, warm)
    metrics: Any = (
        None if not s.multi_objective else [f"{METRIC}_{i}" for i in range(len(s.directions))]
    )
    modes: Any = None if not s.multi_objective else [mode(d) for d in s.directions]
    if explicit_metric and not s.multi_objective:
        metrics, modes = METRIC, mode(s.directions[0])
    return _OptunaSearch(
        deadline,
        space=space,
        metric=metrics,
        mode=modes,
        sampler=optuna.samplers.TPESampler(seed=seed),
        storage=storage,
        study_name=SEEDED_STUDY if storage is not None else None,
    )


def scheduler(
    settings: SearchOptions, name: str, param_space: dict[str, Any], budget: int | None
) -> Any:
    """Tune's scheduler ``name``; ``budget``: the evaluations of a full trial, when known."""
    from ray.tune.schedulers import (
        ASHAScheduler,
        FIFOScheduler,
        HyperBandScheduler,
        PopulationBasedTraining,
    )

    opts = settings.options
    eta = opts.get("reduction_factor", 3)
    if name == "asha":
        # rungs at 1, eta, eta^2, ...; max_t past the budget, so no trial is cut at its end
        return ASHAScheduler(
            time_attr="training_iteration",
            grace_period=1,
            reduction_factor=eta,
            max_t=(budget or 10_000) + 1,
        )
    if name == "hyperband":
        return HyperBandScheduler(
            time_attr="training_iteration", max_t=budget or 81, reduction_factor=eta
        )
    if name == "pbt":
        # A checkpoint only loads into the same model: mutate training arguments, keep model params.
        mutations = {
            n: d for n, d in param_space.items() if n in FIELD_NAMES and isinstance(d, Domain)
        }
        if not mutations:
            raise UserError(
                "--scheduler pbt mutates TrainingArguments fields (learning_rate, weight_decay, ...) "
                "and the space has none; add one to the space or use --scheduler asha"
            )
        # require_attrs: a trial the ledger had no place for ends without any result.
        return PopulationBasedTraining(
            time_attr="training_iteration",
            require_attrs=False,
            perturbation_interval=opts.get("perturbation_interval", 1),
            hyperparam_mutations=mutations,
        )
    return FIFOScheduler()


class VariantGenerator(BasicVariantGenerator):
    """Tune's random search, which stops suggesting at the deadline."""

    def __init__(self, deadline: float | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline

    def next_trial(self) -> Any:
        if self.deadline is not None and time.time() >= self.deadline:
            self.set_finished()
            return None
        return super().next_trial()


class _OptunaSearch(OptunaSearch):
    """Tune's `OptunaSearch`, stopping at the deadline, told a trial without a result (failed, or
    the ledger had enough) as FAIL rather than its stand-in objective."""

    def __init__(self, deadline: float | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self.deadline is not None and time.time() >= self.deadline:
            return Searcher.FINISHED  # type: ignore[return-value]
        return super().suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        if _has_result(result, self.metric):
            super().on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        has = _has_result(result, self.metric)
        super().on_trial_complete(trial_id, result if has else None, error=error or not has)


def _has_result(result: dict[str, Any] | None, metric: str | list[str] | None) -> bool:
    metrics = metric if isinstance(metric, list) else [metric]
    return (
        bool(result)
        and FAILED_KEY not in result
        and USER_ERROR_KEY not in result
        and all(m in result for m in metrics)
    )  # type: ignore[operator]


#: The in-memory study a round's TPE loads, holding the trials it starts from.
SEEDED_STUDY = "hpsweep-round"


def seeded_storage(
    param_space: dict[str, Any],
    direction: str,
    records: list[runs.TrialRecord],
    warm: WarmStart | None,
) -> Any:
    """An Optuna in-memory storage for a round's TPE (Tune's `OptunaSearch` loads its study
    `SEEDED_STUDY`), holding what the round starts from: the sweep's complete trials, and the
    ``--warm-start`` trials with the params they have (Optuna samples a param the space added);
    before the sweep's first trial, also the warm start's best configs, queued to train first.
    None when there is nothing to hold. Optuna's ``add_trial`` takes any subset of the params,
    where Tune's ``points_to_evaluate`` takes whole configs only."""
    import optuna

    try:
        dists = OptunaSearch.convert_search_space(param_space)
    except (ValueError, TypeError):
        return None
    given = [
        _finished_trial(r.params, r.objective, "complete", {}, dists)
        for r in records
        if r.state == "complete" and isinstance(r.objective, (int, float))
    ]
    if warm is not None:
        given += [
            _finished_trial(t.params, t.value, t.state, t.intermediate, dists) for t in warm.trials
        ]
    trials = [t for t in given if t is not None]
    queued = warm.best if warm is not None and not records else ()
    if not trials and not queued:
        return None
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name=SEEDED_STUDY, direction=direction)
    study.add_trials(trials)
    for params in queued:
        study.enqueue_trial(params, skip_if_exists=False)
    return storage


def _finished_trial(
    params: dict[str, Any],
    value: Any,
    state: str,
    intermediate: dict[int, float],
    dists: dict[str, Any],
) -> Any:
    """A finished trial as Optuna adds it, over the params the space has; None where a value
    lies outside the space (as Optuna checks it)."""
    import optuna
    from optuna.trial import TrialState

    point = {n: v for n, v in params.items() if n in dists}
    complete = state == "complete"
    try:
        return optuna.trial.create_trial(
            state=TrialState.COMPLETE if complete else TrialState.PRUNED,
            params=point,
            distributions={n: dists[n] for n in point},
            value=float(value) if complete else None,
            intermediate_values=intermediate,
        )
    except (ValueError, TypeError):
        return None


def mode(direction: str) -> str:
    return "max" if direction == "maximize" else "min"


#: ``tune.run`` keywords for Tune's own output and bookkeeping, which hpsweep keeps itself (logs,
#: trial names, failure handling, the metric its best trial is read by): ignored, with a note.
TUNE_BOOKKEEPING = (
    "log_to_file",
    "verbose",
    "trial_name_creator",
    "trial_dirname_creator",
    "raise_on_failed_trial",
    "metric",
    "mode",
)


def tune_run_keywords(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The ``tune.run`` keywords Hugging Face's Ray users pass: (the options left for the backend,
    with the checkpoint keywords folded into ``checkpoint_config``; the hpsweep settings others
    stand for; a note naming the `TUNE_BOOKKEEPING` ones given)."""
    import datetime

    left, settings = dict(options), {}
    for tune_name, ours in (
        ("search_alg", "sampler"),
        ("local_dir", "storage"),
        ("storage_path", "storage"),
        ("time_budget_s", "timeout"),
        ("max_concurrent_trials", "n_jobs"),
    ):
        value = left.pop(tune_name, None)
        if value is not None:
            settings[ours] = value
    if isinstance(settings.get("timeout"), datetime.timedelta):
        settings["timeout"] = settings["timeout"].total_seconds()
    if left.pop("fail_fast", False):
        settings["max_failed_trials"] = 1
    checkpoints = checkpoint_keywords(left)
    if checkpoints:
        left["checkpoint_config"] = checkpoints
    ignored = [name for name in TUNE_BOOKKEEPING if name in left]
    for name in ignored:
        del left[name]
    if not ignored:
        return left, settings, None
    note = (
        f"{', '.join(ignored)}: Tune's own output and bookkeeping, which hpsweep keeps itself (its "
        "logs and progress, trial folders named by hp_name, the objective it was given); ignored"
    )
    return left, settings, note


def checkpoint_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_config`` and ``tune.run``'s ``keep_checkpoints_num`` / ``checkpoint_score_attr``
    (``min-``: lower is better), taken out of ``options`` as ``{"num_to_keep", "score_attribute",
    "score_order"}`` (empty when none is given). Tune's checkpoint frequency is refused: a trial
    saves where its arguments say."""
    config = options.pop("checkpoint_config", None)
    kept = {
        "num_to_keep": getattr(config, "num_to_keep", None),
        "score_attribute": getattr(config, "checkpoint_score_attribute", None),
        "score_order": getattr(config, "checkpoint_score_order", "max"),
    }
    frequency = options.pop("checkpoint_freq", 0) or getattr(config, "checkpoint_frequency", 0)
    if (
        frequency
        or options.pop("checkpoint_at_end", False)
        or getattr(config, "checkpoint_at_end", False)
    ):
        raise UserError(
            "checkpoint frequency / checkpoint_at_end: a trial saves where its TrainingArguments say; "
            "set save_strategy (and save_steps) instead"
        )
    if options.get("keep_checkpoints_num") is not None:
        kept["num_to_keep"] = int(options.pop("keep_checkpoints_num"))
    options.pop("keep_checkpoints_num", None)
    attr = options.pop("checkpoint_score_attr", None)
    if attr:
        low = attr.startswith("min-")
        kept.update(score_attribute=attr[4:] if low else attr, score_order="min" if low else "max")
    given = config is not None or kept["num_to_keep"] is not None or kept["score_attribute"]
    return kept if given else {}


def own_metric(obj: Any) -> tuple[str, str] | None:
    """The metric and mode a user's scheduler or search algorithm was made with
    (``PopulationBasedTraining(metric="eval_acc", mode="max")``), or None: it takes the objective."""
    metric = getattr(obj, "metric", None)
    # Private: a scheduler exposes its metric but not its mode.
    mode_ = getattr(obj, "mode", None) or getattr(obj, "_mode", None)
    return (metric, mode_ or "max") if isinstance(metric, str) and metric else None


def is_tune_object(what: str, value: Any) -> bool:
    """Whether ``value`` is Tune's own scheduler (``what="scheduler"``) or search algorithm."""
    from ray.tune.schedulers import TrialScheduler
    from ray.tune.search import SearchAlgorithm

    kinds: dict[str, Any] = {"scheduler": TrialScheduler, "sampler": (Searcher, SearchAlgorithm)}
    return what in kinds and isinstance(value, kinds[what])


def scheduler_kind(scheduler_object: Any) -> str:
    """A user's scheduler by what it does: "pbt" for population-based training, else its class
    name. A PBT that mutates more than training arguments is refused: a checkpoint it restores
    loads only into the model it came from."""
    from ray.tune.schedulers import PopulationBasedTraining

    if not isinstance(scheduler_object, PopulationBasedTraining):
        return type(scheduler_object).__name__
    # Private: PBT (and PB2) do not expose what they mutate.
    mutated = (
        getattr(scheduler_object, "_hyperparam_mutations", None)
        or getattr(scheduler_object, "_hyperparam_bounds", None)
        or {}
    )
    others = sorted(set(mutated) - set(FIELD_NAMES))
    if others:
        raise UserError(
            f"{type(scheduler_object).__name__} mutates {', '.join(others)}, which no TrainingArguments "
            "field holds: a trial it restores from another's checkpoint keeps that trial's model; mutate "
            "training arguments only (learning_rate, weight_decay, ...)"
        )
    return "pbt"


def fresh_copy(obj: Any) -> Any:
    """A round's copy of a user's scheduler or search algorithm: Tune's keep per-trial state."""
    copied = copy.deepcopy(obj)
    if hasattr(copied, "_require_attrs"):
        # Private, PBT's: set only at construction; a trial the ledger had no place for ends
        # without any result, which PBT must accept, as under --scheduler pbt.
        copied._require_attrs = False
    return copied


def worst_of(metric: tuple[str, str] | None) -> dict[str, float]:
    """What a trial without a result reports for a user's object's own metric (ranked last)."""
    return {} if metric is None else {metric[0]: -math.inf if metric[1] == "max" else math.inf}


def check_warm_start(warm: WarmStart, settings: SearchOptions, sampler: str) -> None:
    """Refuse, in one line, a ``--warm-start`` that the round's search cannot take: random
    search, a search algorithm of the user's own, or a multi-objective search (Tune's
    `OptunaSearch` is given earlier trials for one objective: `seeded_storage`)."""
    if sampler != "tpe" or settings.multi_objective:
        why = f"--sampler {sampler}" if sampler != "tpe" else "a multi-objective search"
        raise UserError(
            f"--warm-start: on the ray backend only Optuna's TPE (--sampler tpe) with one "
            f"objective takes earlier trials, not {why}; use --sampler tpe or drop --warm-start"
        )
