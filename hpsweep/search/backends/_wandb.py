"""The W&B Sweeps backend: W&B's own search (grid, random, bayes) and hyperband stopping.

With a W&B login (``WANDB_API_KEY`` or ``wandb login``) and ``WANDB_MODE`` not ``offline`` or
``disabled``, the sweep runs the way W&B users know it: ``wandb.sweep`` creates it on the
server and ``wandb.agent`` runs ``--n-trials`` runs, the server proposing params and stopping
runs (a `Driver`: each run takes its lease and number from the sweep's ledger, though the
server cannot run a cut-short run again). Without a server the same sweep runs locally on
``sweeps``, the open-source engine W&B's local controller uses (an `AskTellSearcher`): it
proposes the next params from the finished runs on disk and decides hyperband stops, and every
trial is an offline W&B run under ``DIR/wandb/`` that ``wandb sync DIR/wandb/offline-run-*``
uploads later. hpsweep adds no search logic of its own.

    $ WANDB_MODE=offline hpsweep run space.py --backend wandb --sampler bayes --pruner hyperband

Samplers: bayes (default), random, grid. Pruners: none (default, as in W&B), hyperband
(``early_terminate: {type: hyperband, min_iter: 1, eta: 3}``; change them with the
``hyperband_min_iter`` / ``hyperband_eta`` options). ``DIR/wandb_sweep.json`` keeps the sweep
config (and the server's sweep id), so the same command continues the same sweep.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import secrets
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import wandb

# sweeps 0.3 still spells pydantic-v1 config keys; pydantic warns on import
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sweeps

from hpsweep import runs
from hpsweep.errors import TrialFailed, TrialPruned, UserError
from hpsweep.search.ask_tell import AskTellSearcher, ObjectiveValue, TrialEnd
from hpsweep.search.backends._base import Backend, Driver, Searcher, TrialFunction
from hpsweep.search.ledger import FolderSession, Ledger
from hpsweep.search.ledger_base import Claim, Verdict
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Categorical, Distribution, Float, Int
from hpsweep.search.sweep_loop import WAIT_S, SweepLoop
from hpsweep.search.warm_start import WarmStart, whole_trials_only
from hpsweep.trial import Trial, training_step

SWEEP_FILE = "wandb_sweep.json"
OPTIONS = (
    "hyperband_min_iter",
    "hyperband_eta",
    "entity",
    "sweep_id",
    "name",
)  # name: the sweep's, as transformers'
#: trial.json state -> the W&B run state the sweeps engine reasons about. W&B's controller marks
#: early-terminated runs ``stopped`` and keeps their history, so bayes learns from pruned runs too.
RUN_STATES = {
    "complete": "finished",
    "pruned": "finished",
    "failed": "failed",
    "running": "crashed",
    "stopped": "crashed",
}
#: How a local trial's offline W&B run exits, by how it ended (1: any other end).
EXIT_CODES = {TrialEnd.COMPLETE: 0, TrialEnd.PRUNED: 0, TrialEnd.STOPPED: 130}


class WandbTrial(Trial):
    """A trial that is one W&B run: each evaluation is a ``run.log`` row at its training step.

    ``stopper`` (local mode) is asked after each report whether hyperband stops the trial;
    online, the W&B server stops runs itself.
    """

    backend = "wandb"
    reads_checkpoints = False  # a row of metrics; the run's checkpoints stay in its folder

    def __init__(
        self,
        number: int,
        params: Mapping[str, Any],
        *,
        run: Any,
        metric: str,
        history: Sequence[Mapping[str, float]] = (),
        stopper: Callable[[WandbTrial], bool] | None = None,
    ) -> None:
        super().__init__(number, params)
        self.run = run
        self.metric = metric
        self.history: list[dict[str, float]] = [dict(h) for h in history]
        self._stopper = stopper

    def report(
        self, step: int, metrics: Mapping[str, float], objective: Any, checkpoint: str | None = None
    ) -> None:
        row = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        if objective is not None:
            row[self.metric] = float(objective)
            self.history.append({self.metric: float(objective)})
        self.run.log(row, step=training_step(step, metrics))

    def should_prune(self) -> bool:
        return self._stopper is not None and self._stopper(self)


# --- the space as a W&B sweep config -------------------------------------------------------------------


def sweep_config(settings: SearchOptions) -> dict[str, Any]:
    """The W&B sweep config for ``settings``: method, metric, parameters and early_terminate.

    >>> sweep_config(SearchOptions(space={"lr": Float(1e-4, 1e-1, log=True)}))["parameters"]
    {'lr': {'distribution': 'log_uniform_values', 'min': 0.0001, 'max': 0.1}}
    """
    method = settings.sampler or "bayes"
    assert settings.space is not None
    parameters = {
        name: _parameter(name, dist, grid=method == "grid") for name, dist in settings.space.items()
    }
    config: dict[str, Any] = {
        "method": method,
        "metric": {"name": settings.objective_name, "goal": settings.directions[0]},
        "parameters": parameters,
    }
    if (settings.pruner or "none") == "hyperband":
        config["early_terminate"] = {
            "type": "hyperband",
            "min_iter": int(settings.options.get("hyperband_min_iter", 1)),
            "eta": int(settings.options.get("hyperband_eta", 3)),
        }
    return config


def _sweep_config_of(hp_space: Callable[..., Any]) -> dict[str, Any] | None:
    """The W&B sweep config ``hp_space(None)`` returns (Hugging Face's W&B convention), or None."""
    try:
        config = hp_space(None)
    except Exception:  # a define-by-run function that needs a trial: not a sweep config
        return None
    return (
        dict(config)
        if isinstance(config, Mapping) and isinstance(config.get("parameters"), Mapping)
        else None
    )


def space_from_sweep_config(config: Mapping[str, Any]) -> dict[str, Distribution]:
    """A W&B sweep config's ``parameters`` as an hpsweep space (the inverse of `_parameter`).

    >>> space_from_sweep_config({"parameters": {"lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 0.1}}})
    {'lr': Float(low=0.0001, high=0.1, log=True, step=None)}
    """
    space: dict[str, Distribution] = {}
    for name, spec in config["parameters"].items():
        kind = spec.get("distribution")
        low, high = spec.get("min"), spec.get("max")
        if "values" in spec or kind == "categorical":
            space[name] = Categorical(list(spec["values"]))
        elif "value" in spec:
            space[name] = Categorical([spec["value"]])
        elif kind == "int_uniform" or (
            kind is None and isinstance(low, int) and isinstance(high, int)
        ):
            space[name] = Int(int(low), int(high))
        elif kind in ("uniform", None):
            space[name] = Float(float(low), float(high))
        elif kind == "log_uniform_values":
            space[name] = Float(float(low), float(high), log=True)
        elif kind == "q_uniform":
            space[name] = Float(float(low), float(high), step=float(spec.get("q", 1)))
        elif kind == "q_log_uniform_values" and spec.get("q", 1) == 1:
            space[name] = Int(int(low), int(high), log=True)
        else:
            raise UserError(
                f"hp_space parameter {name!r}: the W&B distribution {kind!r} has no hpsweep equivalent; "
                "use values, uniform, int_uniform, log_uniform_values or q_uniform"
            )
    return space


def _parameter(name: str, dist: Distribution, *, grid: bool) -> dict[str, Any]:
    if grid or isinstance(dist, Categorical):
        # A grid lists every value: W&B's own q_uniform grid (np.arange) would drop the upper bound.
        return {"values": dist.grid()}
    if isinstance(dist, Int):
        if dist.log:
            return {
                "distribution": "q_log_uniform_values",
                "min": dist.low,
                "max": dist.high,
                "q": 1,
            }
        if dist.step == 1:
            return {"distribution": "int_uniform", "min": dist.low, "max": dist.high}
    elif dist.step is None:
        kind = "log_uniform_values" if dist.log else "uniform"
        return {"distribution": kind, "min": float(dist.low), "max": float(dist.high)}
    # q_uniform rounds to multiples of q, so it keeps Float/Int(step=...) exact only when both
    # bounds are multiples of the step; otherwise list the values.
    if _multiple(dist.low, dist.step) and _multiple(dist.high, dist.step):
        return {"distribution": "q_uniform", "min": dist.low, "max": dist.high, "q": dist.step}
    return {"values": dist.grid()}


def _multiple(value: float, step: float) -> bool:
    return abs(value / step - round(value / step)) < 1e-9


def _plain(value: Any) -> Any:
    """A sweeps suggestion (numpy scalars, q_uniform's float noise) as a plain JSON value."""
    if isinstance(value, np.generic):
        value = value.item()
    return round(value, 12) if isinstance(value, float) else value


# --- the backend ------------------------------------------------------------------------------------


class WandbBackend(Backend, AskTellSearcher["WandbTrial"]):
    """Search with W&B Sweeps: online, the W&B server through its agent (`_Agent`, a `Driver`);
    offline, the ``sweeps`` engine locally, which this backend asks and tells itself."""

    name = "wandb"
    samplers = ("bayes", "random", "grid")
    pruners = ("hyperband", "none")
    reads = frozenset({"resources_per_trial"})
    option_names = OPTIONS
    parallel = False  # the engine proposes from the finished runs: one trial at a time
    #: ``--warm-start``'s trials, as the runs the engine learns from beside the sweep's own.
    _warm_runs: Sequence[sweeps.SweepRun] = ()

    @staticmethod
    def transformers_keywords(
        options: dict[str, Any],
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """transformers' W&B users name the project (here: the study's name, which is the sweep's
        W&B project) and the metric the sweep optimises (``eval/accuracy``: the objective
        ``eval_accuracy``)."""
        left = dict(options)
        project, metric = left.pop("project", None), left.pop("metric", None)
        theirs: dict[str, Any] = {"study_name": str(project)} if project else {}
        if metric is not None:
            theirs["objective"] = str(metric)
        return left, theirs, None

    @staticmethod
    def native_options(settings: SearchOptions) -> dict[str, Any]:
        """A W&B sweep config, as Hugging Face users write ``hp_space``: its parameters are the
        space, its method the sampler and its ``early_terminate`` hyperband, unless given."""
        native = _sweep_config_of(settings.hp_space) if settings.hp_space is not None else None
        if native is None:
            return {}
        stops = "early_terminate" in native and settings.pruner is None
        return {
            "space": space_from_sweep_config(native),
            "hp_space": None,
            "sampler": settings.sampler or native.get("method"),
            "pruner": "hyperband" if stops else settings.pruner,
        }

    def __init__(self, settings: SearchOptions) -> None:
        super().__init__(settings)
        if settings.hp_space is not None or settings.space is None:
            raise UserError(
                "the wandb backend needs a `space` dict (a W&B sweep config is fixed before the runs); "
                "declare the parameters in `space` or use --backend optuna for hp_space"
            )
        if settings.multi_objective:
            raise UserError(
                "W&B sweeps optimise one metric; give one direction, or use --backend optuna"
            )
        # grid on a Float without step raises its UserError here
        self.config = sweep_config(settings)
        if settings.options.get("name"):
            self.config["name"] = str(settings.options["name"])
        self.metric = settings.objective_name
        self.online = _logged_in() and os.environ.get("WANDB_MODE", "online") not in (
            "offline",
            "disabled",
            "dryrun",
        )
        self._histories: dict[
            str, list[dict[str, float]]
        ] = {}  # objective per evaluation, for callable objectives

    def searcher(self) -> Searcher:
        """With a W&B login, the server's agent; without, this backend (the ``sweeps`` engine)."""
        return _Agent(self) if self.online else self

    # --- shared pieces --------------------------------------------------------------------------------

    def _load_sweep_file(self) -> dict[str, Any]:
        """The sweep this folder already holds; a different one is an error rather than a mix-up."""
        path = self.settings.output_dir / SWEEP_FILE
        saved = runs.read_json(path) if path.exists() else {}
        wanted = self.settings.options.get("sweep_id")
        if wanted and not self.online and wanted != saved.get("sweep_id", wanted):
            raise UserError(
                f"sweep_id={wanted!r}: {self.settings.output_dir} holds sweep {saved['sweep_id']!r}; "
                "give its id, or no sweep_id (the folder's sweep continues)"
            )
        if saved and saved.get("config") != self.config:
            raise UserError(
                f"{self.settings.output_dir} holds another W&B sweep (see {SWEEP_FILE}: other space, "
                "sampler, pruner or objective); use another --output-dir or the same settings"
            )
        if not self.online:  # a local sweep's id names the folder's sweep, as a server's id would
            saved.setdefault("sweep_id", wanted or f"local-{secrets.token_hex(4)}")
        runs.write_json(path, {**saved, "config": self.config})
        return saved

    def _records(self) -> list[runs.TrialRecord]:
        return runs.read_trials(self.settings.output_dir)

    @staticmethod
    def _init_settings() -> wandb.Settings:
        # No console capture, no system-metrics sampler, no git/code/requirements scans: a trial
        # is a short run, and those would add threads, files and output to every one of them.
        return wandb.Settings(
            console="off",
            x_disable_stats=True,
            silent=True,
            save_code=False,
            disable_git=True,
            x_save_requirements=False,
        )

    # --- local: the sweeps engine on the runs on disk -----------------------------------------------

    def open(self, worker: int = 0) -> None:
        """The folder's sweep file checked and written, before the first trial."""
        self._load_sweep_file()

    def ask(self, again: runs.TrialRecord | None = None) -> WandbTrial | None:
        """A trial cut short, again from its latest checkpoint: its number, params and history.
        A new trial is asked with the number the ledger gives it (`ask_numbered`)."""
        if again is None:
            raise NotImplementedError("a new W&B trial takes the ledger's number: ask_numbered()")
        history = _checkpoint_history(runs.latest_checkpoint(Path(again.run_dir)), self.metric)
        return self._offline_trial(again.number, again.params, history, self._finished())

    def ask_numbered(self, number: int) -> WandbTrial | None:
        """A new trial numbered ``number`` (`hpsweep.search.ledger_base.LedgerNumbered`: the
        engine numbers nothing, so the ledger does, under its lock): the params the engine
        proposes from the finished runs, drawn from ``--seed`` + ``number``; None once a grid is
        done."""
        s = self.settings
        finished = self._finished()
        if s.seed is not None:  # the engine samples with `random` and numpy
            random.seed(s.seed + number)
            np.random.seed((s.seed + number) % 2**32)
        suggestion = sweeps.next_run(self.config, finished)
        if suggestion is None:  # a grid that is done
            return None
        params = {k: _plain(v["value"]) for k, v in suggestion.config.items()}
        return self._offline_trial(number, params, [], finished)

    def _finished(self) -> list[sweeps.SweepRun]:
        own = [self._as_sweep_run(r) for r in self._records() if r.backend == "wandb"]
        return [*self._warm_runs, *own]

    def _offline_trial(
        self,
        number: int,
        params: dict[str, Any],
        history: list[dict[str, float]],
        finished: list[sweeps.SweepRun],
    ) -> WandbTrial:
        """The trial as an offline W&B run (``DIR/wandb/``), with hyperband's stopper if any."""
        s = self.settings
        mode = "disabled" if os.environ.get("WANDB_MODE") == "disabled" else "offline"
        run = wandb.init(
            mode=mode,
            dir=str(s.output_dir),
            project=s.study_name,
            entity=s.options.get("entity"),  # where `wandb sync` uploads the run
            group=s.study_name,
            name=f"run-{number}",
            config=params,
            reinit="finish_previous",
            settings=self._init_settings(),
        )
        stopper = self._hyperband_stopper(finished) if "early_terminate" in self.config else None
        return WandbTrial(
            number, params, run=run, metric=self.metric, history=history, stopper=stopper
        )

    def tell(self, trial: WandbTrial, end: TrialEnd, value: ObjectiveValue | None = None) -> None:
        self._histories[trial.id] = trial.history
        if end is TrialEnd.PRUNED:
            # W&B has no pruned state; a tag keeps it findable
            trial.run.tags = (*trial.run.tags, "pruned")
        elif end is TrialEnd.COMPLETE:
            trial.run.summary[self.metric] = value
        trial.run.finish(exit_code=EXIT_CODES.get(end, 1))

    def _call(self, trial_fn: TrialFunction, trial: WandbTrial) -> TrialEnd:
        """Online: train ``trial`` in the agent's thread; returns how it ended, the run's summary set."""
        try:
            objective = trial_fn(trial)
        except TrialPruned:
            trial.run.tags = (*trial.run.tags, "pruned")
            return TrialEnd.PRUNED
        except TrialFailed:
            return TrialEnd.FAILED
        trial.run.summary[self.metric] = objective
        return TrialEnd.COMPLETE

    def _as_sweep_run(self, record: runs.TrialRecord) -> sweeps.SweepRun:
        """A trial on disk as the engine sees a W&B run: config, state, metric history, summary."""
        history = self._histories.get(record.id) or [
            {self.metric: h[self.metric]} for h in record.history if self.metric in h
        ]
        summary = (
            {self.metric: record.objective} if isinstance(record.objective, (int, float)) else {}
        )
        return _sweep_run(
            record.id,
            RUN_STATES.get(record.state, "crashed"),
            record.params,
            history,
            summary,
            stopped=record.state == "pruned",
        )

    def _hyperband_stopper(self, finished: list[sweeps.SweepRun]) -> Callable[[WandbTrial], bool]:
        def stop(trial: WandbTrial) -> bool:
            current = _sweep_run(trial.id, "running", trial.params, trial.history)
            return any(
                r.name == trial.id for r in sweeps.stop_runs(self.config, [*finished, current])
            )

        return stop

    def warm_start(self, warm: WarmStart) -> None:
        """Offline, the engine proposes from the runs it is given: the earlier trials are given
        as finished runs beside the sweep's own (``warm-<number>``). It takes whole trials only
        (a param the new space adds would be a hole in its model), and it has no queue for
        ``--warm-start-best``; a W&B server takes no runs from elsewhere."""
        if self.online:
            raise UserError(
                "--warm-start: a sweep on the W&B server takes no earlier runs; run it offline "
                "(WANDB_MODE=offline) or use --backend optuna"
            )
        whole_trials_only(warm, self.name)
        self._warm_runs = [
            _sweep_run(
                f"warm-{t.number}",
                "finished",
                t.params,
                [{self.metric: v} for _, v in sorted(t.intermediate.items())],
                {self.metric: t.value} if t.value is not None else None,
                stopped=t.state == "pruned",
            )
            for t in warm.trials
        ]


# --- online: wandb.sweep + wandb.agent (not testable without a W&B server) ------------------------


class _Agent(Driver):
    """W&B's agent, run one trial at a time in this process. The server hands out the params and
    stops runs; each trial takes its lease and number from the sweep's ledger before the agent
    starts it, as the search layer's loop does, so the ledger counts, numbers and reaps the
    agent's trials as any other. The server cannot run a cut-short trial again: trials waiting
    to run again hold no place in the count here."""

    def __init__(self, backend: WandbBackend) -> None:
        self.backend = backend
        self.settings = backend.settings
        self.errors: list[BaseException] = []
        self.interrupted = threading.Event()

    def drive(self, loop: SweepLoop) -> None:
        """The folder's sweep (or ``sweep_id``'s, or a new one on the server), its runs trained
        here, placed as the loop places its trials."""
        saved = self.backend._load_sweep_file()
        ledger = loop.ledger
        assert isinstance(ledger, Ledger), "W&B's ledger is the output folder's (Backend.ledger)"
        with loop.placed():
            sweep_id = self.settings.options.get("sweep_id") or saved.get("sweep_id")
            self._run(sweep_id or self._create_sweep(), loop.runner, ledger)

    def _create_sweep(self) -> str:
        """A new sweep on the server, its id kept in the folder's sweep file."""
        s = self.settings
        sweep_id = wandb.sweep(
            self.backend.config, project=s.study_name, entity=s.options.get("entity")
        )
        path = s.output_dir / SWEEP_FILE
        runs.write_json(path, {**runs.read_json(path), "sweep_id": sweep_id})
        return sweep_id

    def _run(self, sweep_id: str, trial_fn: TrialFunction, ledger: Ledger) -> None:
        """One agent per trial, so n_trials, --timeout and errors are checked between runs."""
        s = self.settings
        started = time.monotonic()
        with self._ctrl_c_remembered():
            while (
                (s.timeout is None or time.monotonic() - started < s.timeout)
                and not self.errors
                and not self.interrupted.is_set()
            ):
                claimed = ledger.take_trial(_new_trial, _its_place)
                if claimed is Verdict.DONE:
                    break
                if isinstance(claimed, Verdict):
                    time.sleep(WAIT_S)  # other commands' trials run; one may fail
                    continue
                try:
                    wandb.agent(
                        sweep_id,
                        function=functools.partial(
                            self._one_trial, trial_fn, ledger, claimed.trial.number
                        ),
                        count=1,
                        project=s.study_name,
                        entity=s.options.get("entity"),
                    )
                finally:
                    claimed.claim.lease.release()
        if self.errors:
            raise self.errors[0]
        if self.interrupted.is_set():
            raise KeyboardInterrupt

    def _one_trial(self, trial_fn: TrialFunction, ledger: Ledger, number: int) -> None:
        """The agent calls this in its own thread, with the server's params, for the trial
        numbered ``number`` that the ledger's claim made room for."""
        backend = self.backend
        run = wandb.init(dir=str(self.settings.output_dir), settings=backend._init_settings())
        run.name = f"run-{number}"
        params = {name: _plain(run.config[name]) for name in backend.config["parameters"]}
        trial = WandbTrial(number, params, run=run, metric=backend.metric)
        try:
            end = backend._call(trial_fn, trial)
        except UserError as exc:
            self.errors.append(exc)
            raise
        run.finish(exit_code=1 if end is TrialEnd.FAILED else 0)
        if getattr(threading.current_thread(), "_terminated", False):
            # The agent stops a run by raising inside its thread (the server's hyperband or
            # Ctrl-C): TrialRunner saw an exception, so record what it really was.
            with ledger.locked() as session:
                session.restate(trial.id, "stopped" if self.interrupted.is_set() else "pruned")

    @contextlib.contextmanager
    def _ctrl_c_remembered(self) -> Iterator[None]:
        """The agent swallows Ctrl-C: remember it, to stop after the trial."""

        def on_sigint(signum: int, frame: Any) -> None:
            self.interrupted.set()
            signal.default_int_handler(signum, frame)

        if threading.current_thread() is not threading.main_thread():  # signal() works only there
            yield
            return
        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _new_trial(session: FolderSession) -> Claim | Verdict:
    """What W&B's agent claims: a new trial, numbered by the ledger. The server cannot run a
    cut-short trial again, so trials waiting to run again hold no place."""
    return session.claim_new(waiting_run_again=False, numbered=True)


def _its_place(claim: Claim) -> Trial:
    """The agent's next trial as its claim's lease names it, by its number: the agent makes the
    trial itself, in its own thread, once the server has given its params (`_Agent._one_trial`)."""
    assert claim.number is not None
    return Trial(claim.number)


def _sweep_run(
    name: str,
    state: str,
    params: Mapping[str, Any],
    history: list[dict[str, float]],
    summary: Mapping[str, float] | None = None,
    *,
    stopped: bool = False,
) -> sweeps.SweepRun:
    # The W&B API's field names (sampledHistory, summaryMetrics): sweeps 0.2 accepts only these,
    # 0.3 both; the plain names would be silently dropped by 0.2.
    return sweeps.SweepRun(
        name=name,
        state=state,
        config={k: {"value": v} for k, v in params.items()},
        sampledHistory=history,
        summaryMetrics=dict(summary or {}),
        stopped=stopped,
    )


def _logged_in() -> bool:
    """Whether a W&B API key is configured (environment or ``wandb login``'s netrc entry)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return (
            read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
            is not None
        )
    except Exception:  # an unreadable netrc, or another wandb version's layout: no login to use
        return False


def _checkpoint_history(checkpoint: Path | None, metric: str) -> list[dict[str, float]]:
    """The objective per evaluation up to ``checkpoint``, so hyperband sees a resumed trial whole."""
    if checkpoint is None:
        return []
    state = runs.read_json(checkpoint / "trainer_state.json")
    return [{metric: h[metric]} for h in state.get("log_history", []) if metric in h]
