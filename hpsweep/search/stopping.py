"""Stopping rules: ``--stop-when plateau|target:VALUE|regret`` ends a sweep before ``--n-trials``
once more trials will not help, and the decision the sweep's ledger records.

A rule is a pure function of the finished trials (their params and objective, in the order they
finished), so every worker of every machine that judges the same trials reaches the same answer.
It is judged where a trial is claimed (`hpsweep.search.ledger.FolderSession.claim_new` for one
folder, `hpsweep.search.backends._optuna._study_ledger.StudyLedger.next_trial` for a study that
machines share), only when a trial finished since the last judgement, and only for a new trial:
a trial that runs again always runs. Once a rule fires its decision is recorded (`StopState`, in
``DIR/stopping.json`` or in the study), every later claim in every process answers
`hpsweep.search.ledger_base.Verdict.DONE`, and the trials already running finish and count.

The same command run again is done at once, with the same last line; a larger ``--n-trials``
(or ``--stop-when none``) goes on, and the rule then judges only the trials that finish after
that point (`StopState.since`).

    >>> parse_stop_when("plateau:15:0.001")
    Plateau(n=15, tol=0.001)
    >>> parse_stop_when("target:0.9").decide([Finished({}, 0.8), Finished({}, 0.95)], True)
    'target: objective 0.95 reached 0.9'
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpsweep import runs
from hpsweep.errors import UserError

#: What a command writes in its sweep folder: the rule its processes judge (`RuleFile`).
RULE_FILE = ".stop-when.json"
#: The sweep's stopping record in its folder (`StopState`); a study that machines share keeps it
#: as its user attribute `STUDY_ATTR`.
STATE_FILE = "stopping.json"
STUDY_ATTR = "hpsweep_stopping"
#: The rules, as ``--stop-when`` names them.
RULES = ("plateau[:N[:TOL]]", "target:VALUE", "regret", "none")
USAGE = "give plateau, plateau:N, plateau:N:TOL, target:VALUE, regret or none"


@dataclass(frozen=True)
class Finished:
    """A finished trial as a rule sees it: its params, its objective (None: pruned) and how long
    it ran (seconds; None when unknown)."""

    params: Mapping[str, Any]
    objective: float | None
    duration_s: float | None = None


class StopRule(Protocol):
    """A stopping rule: `decide` says why the sweep should stop now, or None."""

    #: Fewer trials than this, finished since the rule began judging, and it says nothing.
    least: int

    @property
    def spec(self) -> str:
        """The rule as ``--stop-when`` writes it."""

    def decide(
        self,
        trials: Sequence[Finished],
        maximize: bool,
        since: int = 0,
        space: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Why the sweep should stop after ``trials`` (in finishing order), or None. Only the
        trials from ``since`` on count as new; ``space`` is the sweep's space when it has one."""


@dataclass(frozen=True)
class Plateau:
    """Stop when none of the last ``n`` finished trials beat the best before them by more than
    ``tol`` (in the objective's units).

    The default 10 is Optuna's TPE start-up (its first 10 trials are random): a sampler that
    has learned something and still gains nothing over as many trials as it needed to start
    is unlikely to gain soon. ``tol`` 0: any gain counts."""

    n: int = 10
    tol: float = 0.0

    @property
    def least(self) -> int:
        return self.n

    @property
    def spec(self) -> str:
        return f"plateau:{self.n}:{self.tol:g}"

    def decide(
        self,
        trials: Sequence[Finished],
        maximize: bool,
        since: int = 0,
        space: Mapping[str, Any] | None = None,
    ) -> str | None:
        if len(trials) - since < self.n or len(trials) <= self.n:
            return None
        before = _best(trials[: -self.n], maximize)
        if before is None:
            return None
        window = _best(trials[-self.n :], maximize)
        gain = -math.inf if window is None else (window - before) * (1 if maximize else -1)
        if gain > self.tol:
            return None
        return f"plateau: no gain over the best ({before:.6g}) by more than {self.tol:g} in the last {self.n} trials"


@dataclass(frozen=True)
class Target:
    """Stop once a trial's objective reaches ``value`` (at least it when maximising, at most it
    when minimising)."""

    value: float
    least: int = 1

    @property
    def spec(self) -> str:
        return f"target:{self.value:g}"

    def decide(
        self,
        trials: Sequence[Finished],
        maximize: bool,
        since: int = 0,
        space: Mapping[str, Any] | None = None,
    ) -> str | None:
        best = _best(trials[since:], maximize)
        if best is None or (best < self.value if maximize else best > self.value):
            return None
        return f"target: objective {best:.6g} reached {self.value:g}"


@dataclass(frozen=True)
class Regret:
    """Stop when the estimated room for improvement is below the objective's noise, or has shrunk
    to ``ratio`` of what it was just after the sampler's random start-up: the regret bound of
    Makarova et al. (2022, "Automatic termination for hyperparameter optimization"), the most
    any point of the space may beat the best trials by with high probability under a Gaussian
    process fitted to them (`regret_bound`).

    The paper stops when the bound falls below the objective's statistical error, which it
    takes from cross-validation scores; a sweep's records have one score per trial, so the
    threshold is estimated two ways, and the first met stops. The noise the fit sees (judged
    once ``least`` trials are complete, on the better half of them, at least ``least``, as
    Optuna's terminator fits its own) decides on a smooth noisy objective, where the bound
    shrinks to the noise and no further. ``ratio`` times the median of the bounds of the sweep's
    first trials (`early_bound`), as Optuna's ``MedianErrorEvaluator`` (Ishibashi et al., 2023)
    sets its threshold when no cross-validation scores are at hand, decides on a coarse one (an
    accuracy on a few hundred examples), whose noise the fit cannot tell from its steps; it is
    in the objective's units whatever they are and asks only that the search closed in.
    ``ratio`` 0.15 was chosen on sweeps of tasks other than the benchmark's (docs/stopping.md).

    Judged from ``least`` finished trials on, every trial up to 40, then every ``n // 20``, on
    at most the ``cap`` best trials: the fit's cost stays bounded per trial however long the
    sweep runs, and every worker judges at the same counts."""

    least: int = 20
    cap: int = 200
    ratio: float = 0.15

    @property
    def spec(self) -> str:
        return "regret"

    def decide(
        self,
        trials: Sequence[Finished],
        maximize: bool,
        since: int = 0,
        space: Mapping[str, Any] | None = None,
    ) -> str | None:
        done = [t for t in trials if t.objective is not None]
        if len(trials) - since < self.least or len(done) < 2:
            return None
        if len(trials) % max(1, len(trials) // 20) != 0:
            return None
        if len(done) >= self.least:
            bound, noise = _bound(trials, maximize, space, self.cap, fewest=self.least)
            if bound <= noise:
                return f"regret: the room for improvement ({bound:.3g}) fell below the objective's noise ({noise:.3g})"
        early = early_bound(trials, maximize, space, self.least)
        bound, _ = _bound(trials, maximize, space, self.cap)
        if bound >= self.ratio * early or not math.isfinite(early):
            return None
        return (
            f"regret: the room for improvement ({bound:.3g}) fell below {self.ratio:g} of its "
            f"median over the first {self.least} trials ({early:.3g})"
        )


#: The early bounds' median of each sweep this process judged, by its first trials.
_EARLY: dict[str, float] = {}


def early_bound(
    trials: Sequence[Finished], maximize: bool, space: Mapping[str, Any] | None, least: int
) -> float:
    """The median regret bound of the first trials: of each prefix from Optuna's TPE start-up
    (10 random trials) to ``least`` trials, the room the search saw before it had modelled
    much; a prefix with fewer than two complete trials has no bound, and none at all gives
    infinity (the rule then never fires). Computed once per sweep and process (a pure function
    of those trials)."""
    first = trials[:least]
    key = json.dumps([[dict(t.params), t.objective] for t in first], default=repr, sort_keys=True)
    key += json.dumps([maximize, space], default=repr, sort_keys=True)
    if key not in _EARLY:
        bounds = [_bound(first[:n], maximize, space)[0] for n in range(min(10, least), least + 1)]
        finite = [b for b in bounds if math.isfinite(b)]
        _EARLY[key] = float(np.median(finite)) if finite else math.inf
    return _EARLY[key]


def _bound(
    trials: Sequence[Finished],
    maximize: bool,
    space: Mapping[str, Any] | None,
    cap: int = 200,
    fewest: int = 10,
) -> tuple[float, float]:
    """`regret_bound` of the complete ``trials``; infinite room when fewer than two are."""
    done = [t for t in trials if t.objective is not None]
    if len(done) < 2:
        return math.inf, 0.0
    x = encode([t.params for t in done], space)
    y = np.array([t.objective for t in done], dtype=float) * (1 if maximize else -1)
    return regret_bound(x, y, top=cap, fewest=fewest, seed=len(trials))


def parse_stop_when(text: str | None) -> StopRule | None:
    """The rule ``--stop-when TEXT`` names; None for none. A bad spec is one `UserError` line."""
    if text is None or text.strip().lower() == "none":
        return None
    name, _, rest = text.strip().partition(":")
    args = rest.split(":") if rest else []
    try:
        if name == "plateau" and len(args) <= 2:
            rule: StopRule = Plateau(*_plateau_args(args))
        elif name == "target" and len(args) == 1:
            rule = Target(_finite(args[0]))
        elif name == "regret" and not args:
            rule = Regret()
        else:
            raise ValueError
    except ValueError:
        raise UserError(f"--stop-when {text!r} is not a stopping rule; {USAGE}") from None
    return rule


def _plateau_args(args: list[str]) -> tuple[Any, ...]:
    n = int(args[0]) if args else Plateau.n
    tol = _finite(args[1]) if len(args) > 1 else Plateau.tol
    if n < 1 or tol < 0:
        raise ValueError
    return n, tol


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def check_stop_when(text: str | None, directions: Sequence[str]) -> None:
    """Refuse, before anything is written, a rule the sweep cannot judge: a bad spec, or any
    rule on several objectives (a Pareto front has no one best to plateau, reach or bound)."""
    rule = parse_stop_when(text)
    if rule is not None and len(directions) > 1:
        raise UserError(
            f"--stop-when {text}: a sweep with {len(directions)} objectives has no single best to "
            "judge; drop --stop-when or optimise one objective"
        )


def _best(trials: Sequence[Finished], maximize: bool) -> float | None:
    values = [t.objective for t in trials if t.objective is not None]
    if not values:
        return None
    return max(values) if maximize else min(values)


# --- the regret bound ----------------------------------------------------------------------------


def encode(params: Sequence[Mapping[str, Any]], space: Mapping[str, Any] | None) -> np.ndarray:
    """The trials' params as points of the unit cube: a number scaled to its range in the
    space (on a log scale where the space says so), or the range the trials span without one;
    a choice one-hot. Params not in every trial are left out."""
    names = sorted(set.intersection(*(set(p) for p in params))) if params else []
    columns = []
    for name in names:
        values = [p[name] for p in params]
        bounds = (space or {}).get(name)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and (
            bounds is None or "low" in bounds
        ):
            columns.append(_scaled(np.array(values, dtype=float), bounds))
        else:
            choices = sorted({repr(v) for v in values})
            columns.extend(np.array([repr(v) == c for v in values], float) for c in choices)
    if not columns:
        return np.zeros((len(params), 1))
    return np.column_stack(columns)


def _scaled(values: np.ndarray, bounds: Mapping[str, Any] | None) -> np.ndarray:
    low, high = (values.min(), values.max()) if bounds is None else (bounds["low"], bounds["high"])
    if bounds is not None and bounds.get("log"):
        values, low, high = np.log(values), math.log(low), math.log(high)
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


def regret_bound(
    x: np.ndarray,
    y: np.ndarray,
    *,
    top: int = 200,
    fewest: int = 10,
    seed: int = 0,
    samples: int = 1024,
) -> tuple[float, float]:
    """The regret bound and the noise, in the objective's units, of maximising ``y`` at the
    unit-cube points ``x``.

    A Gaussian process (scikit-learn's: a Matern 5/2 kernel per dimension plus a white-noise
    kernel, its hyperparameters fitted by maximum likelihood) is fitted to the better half of the
    trials (at least ``fewest``, at most ``top``): the region the bound is about; 10 leaves out
    more of the configs that did not train at all, whose cliffs force short length scales and
    leave the whole space uncertain. The bound is the highest upper confidence bound over the space (random
    points and the trials) less the highest lower confidence bound over the trials, of the
    latent function (the noise apart), with beta as Optuna's terminator takes it. The noise is
    the fitted white-noise level's standard deviation, as the same confidence band (2 sqrt(beta)
    of it): the width within which one more evaluation of the best trial could land. Seeded:
    every worker computes the same numbers."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    keep = np.argsort(-y)[: min(len(y), top, max(fewest, len(y) // 2))]
    x, y = x[keep], y[keep]
    if not y.std() > 0:
        return 0.0, 0.0  # the best trials all tie (an objective at its ceiling): no room left
    scale = float(y.std())
    ys = (y - y.mean()) / scale
    dims = x.shape[1]
    signal = ConstantKernel(1.0, (1e-2, 1e2)) * Matern(np.ones(dims), (1e-2, 1e2), nu=2.5)
    kernel = signal + WhiteKernel(1e-2, (1e-6, 1.0))
    with warnings.catch_warnings():
        # a bound reached is an answer here (no noise at all: a deterministic objective)
        warnings.simplefilter("ignore", ConvergenceWarning)
        fitted = GaussianProcessRegressor(kernel, random_state=seed, n_restarts_optimizer=1)
        fitted.fit(x, ys)
    noise = float(fitted.kernel_.k2.noise_level)
    latent = GaussianProcessRegressor(fitted.kernel_.k1, alpha=noise, optimizer=None).fit(x, ys)
    beta = 2 * math.log(dims * len(ys) ** 2 * math.pi**2 / 6 / 0.1) / 5
    points = np.vstack([x, np.random.default_rng(seed).random((samples, dims))])
    mean, std = latent.predict(points, return_std=True)
    upper = float(np.max(mean + math.sqrt(beta) * std))
    mean, std = latent.predict(x, return_std=True)
    lower = float(np.max(mean - math.sqrt(beta) * std))
    return (upper - lower) * scale, 2 * math.sqrt(beta * noise) * scale


# --- what a sweep's processes read and record ----------------------------------------------------


@dataclass(frozen=True)
class RuleFile:
    """What a command asks of its sweep's stopping, written in its folder (`RULE_FILE`) before its
    first trial, so every process of the command (``--n-jobs`` workers, Ray's workers, W&B's
    agent) judges the same rule.

    ``rule``: the ``--stop-when`` spec; ``given``: whether ``--stop-when`` was given at all
    (``none`` given goes on past a recorded stop; not given keeps it); ``maximize``, ``space``:
    what the rule needs of the sweep."""

    rule: str | None = None
    given: bool = False
    maximize: bool = False
    space: Mapping[str, Any] | None = None

    @classmethod
    def read(cls, folder: Path) -> RuleFile:
        try:
            data = runs.read_json(folder / RULE_FILE)
        except (OSError, ValueError):
            return cls()
        return cls(**{k: v for k, v in (data or {}).items() if k in cls.__dataclass_fields__})

    def write(self, folder: Path) -> None:
        runs.write_json(folder / RULE_FILE, asdict(self))


@dataclass(frozen=True)
class StopState:
    """A sweep's stopping record: ``stopped`` (the decision: the rule, why, after how many finished
    trials, and ``--n-trials`` then), and ``since``: the finished trials when the rule last began
    judging (0, or where a larger ``--n-trials`` went on past a decision)."""

    since: int = 0
    stopped: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> StopState:
        if not isinstance(data, Mapping):
            return cls()
        return cls(since=int(data.get("since", 0)), stopped=data.get("stopped"))


def read_state(folder: Path) -> StopState:
    """The stopping record in ``folder`` (none yet: nothing decided)."""
    try:
        return StopState.from_dict(runs.read_json(folder / STATE_FILE))
    except (OSError, ValueError):
        return StopState()


def write_state(folder: Path, state: StopState) -> None:
    runs.write_json(folder / STATE_FILE, asdict(state))


class StopJudge:
    """One process's judge of its sweep's rule, for either home of the ledger: the home reads and
    writes the `StopState` and lists the finished trials; the judge decides.

    Args:
        folder: the sweep's folder on this machine (its `RULE_FILE`, read at the first judgement:
            the command writes it before its first claim).
        n_trials: this process's ``--n-trials`` (None: no limit).
    """

    def __init__(self, folder: Path, n_trials: int | None) -> None:
        self.folder = folder
        self.n_trials = n_trials
        self.asked: RuleFile | None = None
        self.rule: StopRule | None = None
        self._judged = -1  # the finished trials at the last judgement

    def stopped(
        self,
        load: Callable[[], StopState],
        save: Callable[[StopState], None],
        finished: Callable[[], int],
        trials: Callable[[], Sequence[Finished]],
    ) -> bool:
        """Whether the sweep is stopped: a decision is recorded that this command does not go on
        past, or the rule fires now (``finished`` counts the finished trials, ``trials`` lists
        them, asked only when one finished since the last judgement). Call it where the home
        would claim a new trial."""
        if self.asked is None:
            self.asked = RuleFile.read(self.folder)
            self.rule = parse_stop_when(self.asked.rule) if self.asked.rule else None
        state = load()
        if state.stopped is not None:
            if not self._goes_on(self.asked, state.stopped):
                return True
            state = StopState(since=finished())
            save(state)
        if self.rule is None:
            return False
        count = finished()
        if count == self._judged:
            return False
        self._judged = count
        reason = self.rule.decide(trials(), self.asked.maximize, state.since, self.asked.space)
        if reason is None:
            return False
        decision = {
            "rule": self.rule.spec,
            "reason": reason,
            "after": count,
            "n_trials": self.n_trials,
            "at": time.time(),
        }
        save(StopState(since=state.since, stopped=decision))
        return True

    def _goes_on(self, asked: RuleFile, stopped: Mapping[str, Any]) -> bool:
        """A decision this command goes on past: ``--stop-when none``, or more trials asked."""
        if asked.given and asked.rule is None:
            return True
        recorded = stopped.get("n_trials")
        return self.n_trials is None or (recorded is not None and self.n_trials > recorded)


def begin(
    folder: Path,
    text: str | None,
    directions: Sequence[str],
    space: Mapping[str, Any] | None,
) -> None:
    """Write this command's rule in its sweep folder (`RuleFile`), before its first claim."""
    rule = parse_stop_when(text)
    described = runs_space(space)
    RuleFile(
        rule=rule.spec if rule is not None else None,
        given=text is not None,
        maximize=directions[0] == "maximize",
        space=described,
    ).write(folder)


def runs_space(space: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The space's numeric ranges as the rule reads them (`encode`); None without a space."""
    if space is None:
        return None
    from hpsweep.search.space import space_to_json

    return {
        name: {k: v for k, v in dist.items() if k in ("low", "high", "log", "choices")}
        for name, dist in space_to_json(space).items()
    }


# --- the last line ---------------------------------------------------------------------------------


def last_line(folder: Path, records: Sequence[runs.TrialRecord]) -> str | None:
    """What the sweep's last line says when a rule stopped it: the rule, why, after how many
    trials, and the trials and trial time it saved against ``--n-trials`` (the mean finished
    trial's time for each trial not run); None when no rule stopped it."""
    stopped = read_state(folder).stopped
    if stopped is None:
        return None
    finished = [r for r in records if r.state in ("complete", "pruned")]
    n_trials = stopped.get("n_trials")
    line = f"hpsweep: stopped by {stopped['rule']} after {stopped['after']} trials ({stopped['reason']})"
    if n_trials is None:
        return line
    saved = max(0, n_trials - len(finished))
    times = [r.duration_s for r in finished if r.duration_s is not None]
    mean = sum(times) / len(times) if times else 0.0
    return (
        f"{line}; {len(finished)} of --n-trials {n_trials} ran, saving {saved} trials and "
        f"~{_duration(saved * mean)} of trial time"
    )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
