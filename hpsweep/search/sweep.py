"""`search`: one sweep, from the user's keywords to the best run.

It checks everything a user can get wrong before anything is written (each refusal is one
`UserError` line), builds the `SearchSettings` a backend reads and the `SweepJob` every trial
needs, then hands a `TrialLoop` over a `TrialRunner` to the chosen backend and returns the best
run(s). Backends decide what to try: ask/tell backends under the loop, executor backends (Ray,
W&B with a server) where their trials start; counting, leases and records are the ledger's.
"""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsweep import devices, runs
from hpsweep.errors import UserError
from hpsweep.search.backends import Backend, SearchSettings, get_backend, transformers_keywords
from hpsweep.search.checks import (
    STUDY_FILE,
    check_counts,
    check_one_study,
    check_output_dir,
    check_space_against_args,
    normalise_directions,
)
from hpsweep.search.job import (
    Objective,
    SweepCallback,
    SweepJob,
    push_to_hub_callbacks,
    report_to_callbacks,
    trainer_parts,
    trial_arguments,
)
from hpsweep.search.launched import launched_rank, search_launched
from hpsweep.search.objective import describe_objective
from hpsweep.search.space import validate_space
from hpsweep.search.trial_runner import TrialRunner


@dataclass
class SearchRequest:
    """The keywords `search` was called with, as given (see `Trainer.hyperparameter_search`)."""

    space: Mapping[str, Any] | None
    hp_space: Callable | None
    n_trials: int | None
    direction: str | Sequence[str]
    objective: Objective | None
    backend: str
    hp_name: Callable | None = None
    timeout: float | None = None
    n_jobs: int = 1
    study_name: str = "hpsweep"
    storage: Any = None  # a path, a URL, or an optuna BaseStorage (the Python API)
    resume: bool = False
    sampler: str | None = None
    pruner: str | None = None
    scheduler: str | None = None
    seed: int | None = None
    address: str | None = None
    resources_per_trial: Mapping[str, float] | None = None
    max_failed_trials: int = 5
    processes_per_trial: int = 1
    sweep_callbacks: Sequence[SweepCallback] = ()
    #: Backend options, and the keywords transformers hands a backend's library.
    options: dict[str, Any] = field(default_factory=dict)

    def given(self) -> frozenset[str]:
        """The optional settings given explicitly (a backend refuses those it does not read)."""
        named = ("storage", "address", "resources_per_trial")
        return frozenset(name for name in named if getattr(self, name) is not None)

    def settings(
        self,
        *,
        output_dir: Path,
        space: Mapping[str, Any] | None,
        directions: list[str],
        objective_name: str,
        resources_per_trial: dict[str, float],
    ) -> SearchSettings:
        """What a backend reads, once the request has been checked."""
        return SearchSettings(
            output_dir=output_dir,
            space=dict(space) if space else None,
            hp_space=self.hp_space,
            directions=directions,
            objective_name=objective_name,
            n_trials=self.n_trials,
            timeout=self.timeout,
            n_jobs=self.n_jobs,
            study_name=self.study_name,
            storage=self.storage,
            resume=self.resume,
            sampler=self.sampler,
            pruner=self.pruner,
            scheduler=self.scheduler,
            seed=self.seed,
            address=self.address,
            resources_per_trial=resources_per_trial,
            options=self.options,
            backend=self.backend,
            max_failed_trials=self.max_failed_trials,
            processes_per_trial=self.processes_per_trial,
            given=self.given(),
        )


def search(
    trainer: Any,
    *,
    space: Mapping[str, Any] | None,
    hp_space: Callable | None,
    n_trials: int | None,
    direction: str | Sequence[str],
    objective: Objective | None,
    backend: str,
    hp_name: Callable | None = None,
    timeout: float | None = None,
    n_jobs: int = 1,
    study_name: str = "hpsweep",
    storage: Any = None,
    resume: bool = False,
    sampler: str | None = None,
    pruner: str | None = None,
    scheduler: str | None = None,
    seed: int | None = None,
    address: str | None = None,
    resources_per_trial: Mapping[str, float] | None = None,
    max_failed_trials: int = 5,
    processes_per_trial: int = 1,
    sweep_callbacks: Sequence[SweepCallback] = (),
    show_progress: bool = True,
    **options: Any,
) -> Any:
    """Validate, run the backend, and return the best run(s); see `Trainer.hyperparameter_search`.

    ``resume`` is accepted for compatibility: the same command always continues its sweep.
    """
    devices.note_start()
    request = SearchRequest(
        space=space,
        hp_space=hp_space,
        n_trials=n_trials,
        direction=direction,
        objective=objective,
        backend=backend,
        hp_name=hp_name,
        timeout=timeout,
        n_jobs=n_jobs,
        study_name=study_name,
        storage=storage,
        resume=resume,
        sampler=sampler,
        pruner=pruner,
        scheduler=scheduler,
        seed=seed,
        address=address,
        resources_per_trial=resources_per_trial,
        max_failed_trials=max_failed_trials,
        processes_per_trial=processes_per_trial,
        sweep_callbacks=sweep_callbacks,
        options=options,
    )
    adopt_directions(request)
    rank = launched_rank(trainer.args)
    if rank is None:
        best = sweep_request(trainer, request, show_progress)
    else:  # torchrun's processes: one sweep, each trial trained by all
        best = search_launched(
            rank,
            trainer,
            request,
            functools.partial(sweep_request, trainer, request, show_progress),
        )
    if isinstance(best, runs.BestRun):
        trainer._hold_best_model(best)  # evaluate / predict / save_model use the best trial's model
    return best


def sweep_request(
    trainer: Any,
    request: SearchRequest,
    show_progress: bool,
    make_runner: Callable[[SweepJob, SearchSettings], Any] | None = None,
) -> Any:
    """Check ``request``, run its sweep here and return the best run(s); ``make_runner`` makes
    the `TrialRunner` that trains each trial."""
    note = adopt_library_keywords(request)
    settings, job, chosen = prepare(trainer, request)
    if note:  # after the line naming the objective, which comes first
        print(f"hpsweep: {note}", file=sys.stderr)
    return run_sweep(chosen, job, settings, show_progress=show_progress, make_runner=make_runner)


def adopt_directions(request: SearchRequest) -> None:
    """``directions=[...]``, the keyword Optuna's ``create_study`` takes and transformers' docs
    show for a multi-objective search, is ``direction=[...]``."""
    directions = request.options.pop("directions", None)
    if directions is None:
        return
    given = normalise_directions(request.direction)
    if given != ["minimize"] and given != normalise_directions(directions):
        raise UserError(
            f"direction={request.direction!r} and directions={directions!r} disagree; give one of them"
        )
    request.direction = directions


def adopt_library_keywords(request: SearchRequest) -> str | None:
    """Read what transformers hands the backend's library (``tune.run``'s keywords, W&B's
    ``project`` and ``metric``) as hpsweep's own settings; what hpsweep's keywords say explicitly
    wins. Returns a note on those that change nothing, for after the objective's line."""
    if not request.options:
        return None
    request.options, theirs, note = transformers_keywords(request.backend, request.options)
    for name in ("sampler", "storage", "timeout"):
        if getattr(request, name) is None and name in theirs:
            setattr(request, name, theirs[name])
    if request.n_jobs == 1:
        request.n_jobs = theirs.get("n_jobs", request.n_jobs)
    request.max_failed_trials = theirs.get("max_failed_trials", request.max_failed_trials)
    if request.study_name == "hpsweep":
        request.study_name = theirs.get("study_name", request.study_name)
    if "objective" in theirs:
        request.objective = metric_as_objective(theirs["objective"], request.objective)
    return note


def metric_as_objective(metric: str, objective: Objective | None) -> Objective | None:
    """The objective a library's ``metric=`` names (W&B's ``eval/accuracy`` is hpsweep's
    ``eval_accuracy``); one that disagrees with the objective given is refused."""
    if metric == "objective":  # the name the objective itself is reported under
        return objective
    name = metric.replace("/", "_", 1) if metric.startswith("eval/") else metric
    if objective is None or objective == name:
        return name
    raise UserError(
        f"metric={metric!r} and the objective {describe_objective(objective)} disagree: a sweep "
        "optimises one objective; drop metric= or the objective"
    )


def prepare(trainer: Any, request: SearchRequest) -> tuple[SearchSettings, SweepJob, Backend]:
    """Every check that needs no trial, in the order a user fixes them; nothing is written."""
    from hpsweep.search.objective import resolve_objective
    from hpsweep.train.model_init import model_init_arity

    directions = normalise_directions(request.direction)
    check_counts(
        n_trials=request.n_trials,
        timeout=request.timeout,
        n_jobs=request.n_jobs,
        max_failed_trials=request.max_failed_trials,
        processes_per_trial=request.processes_per_trial,
    )
    refuse_combinations(trainer.args, request)
    # A request this machine's devices cannot meet is one line, before anything is written.
    placement = devices.plan(
        n_jobs=request.n_jobs,
        resources=request.resources_per_trial,
        processes_per_trial=request.processes_per_trial,
        gpus=devices.visible_gpus(),
        cores=devices.usable_cores(),
        local=request.address is None,
    )
    devices.check_fork_safe(placement)
    takes_trial = model_init_arity(trainer.model_init) == 1
    space = checked_space(request, trainer.args, takes_trial)
    # Hugging Face's default objective when none is given; the sweep says which it optimises
    objective = resolve_objective(request.objective, directions, trainer.compute_metrics)
    check_objective(objective, directions)
    if trainer.eval_dataset is None:
        raise UserError("a search evaluates every trial: give an eval_dataset")

    # A URL is checked here (store, bucket, credentials); its runs are written to a staging folder.
    home = runs.open_home(trainer.args.output_dir)
    # Absolute, so trials that run in another working directory (Ray workers) write here too.
    output_dir = check_output_dir(home.local)
    check_one_study(output_dir, request.study_name)
    settings = request.settings(
        output_dir=output_dir,
        space=space,
        directions=directions,
        objective_name=objective if isinstance(objective, str) else "objective",
        resources_per_trial=placement.resources,
    )
    settings.home = home
    chosen = get_backend(request.backend, settings)
    chosen.check_study()
    hp_space = request.hp_space
    if space is None and settings.space is not None:  # the backend read a native hp_space
        space, hp_space = validate_space(settings.space), settings.hp_space  # a W&B sweep config
        check_space_against_args(space, trainer.args, takes_trial)
    job = job_for(trainer, request, objective, directions, hp_space, takes_trial, output_dir)
    job.home = home if home.remote else None
    if placement.note:
        print(f"hpsweep: {placement.note}", file=sys.stderr)
    return settings, job, chosen


def job_for(
    trainer: Any,
    request: SearchRequest,
    objective: Objective,
    directions: list[str],
    hp_space: Callable | None,
    takes_trial: bool,
    output_dir: Path,
) -> SweepJob:
    """What every trial of the sweep needs, taken from the trainer the search was called on."""
    return SweepJob(
        **trainer_parts(trainer),
        args=trial_arguments(trainer.args, output_dir),
        objective=objective,
        directions=directions,
        hp_space=hp_space,
        hp_name=request.hp_name,
        sweep_callbacks=[
            *request.sweep_callbacks,
            *report_to_callbacks(trainer.args.report_to, request.sweep_callbacks),
            *push_to_hub_callbacks(trainer.args, request.sweep_callbacks),
        ],
        model_takes_trial=takes_trial,
        processes_per_trial=request.processes_per_trial,
    )


def refuse_combinations(args: Any, request: SearchRequest) -> None:
    """Settings that work alone but not together."""
    if request.processes_per_trial > 1 and args.auto_find_batch_size:
        raise UserError(
            "auto_find_batch_size with --processes-per-trial: a process that runs out of memory cannot "
            "restart the others; set per_device_train_batch_size to a size that fits instead"
        )
    if request.processes_per_trial > 1 and args.train_sampling_strategy == "group_by_length":
        raise UserError(
            "train_sampling_strategy='group_by_length' with --processes-per-trial: the processes' "
            "shares of a grouped order are not drawn per epoch yet; use 'random' or one process per trial"
        )
    if request.scheduler == "pbt" and args.save_only_model:
        raise UserError(
            "--scheduler pbt goes on from other trials' checkpoints, and save_only_model=True writes the "
            "model alone, nothing to train on from; set save_only_model=False"
        )


def checked_space(request: SearchRequest, args: Any, takes_trial: bool) -> dict[str, Any] | None:
    """The space, validated against the arguments; None for a define-by-run ``hp_space``."""
    if (request.space is None) == (request.hp_space is None):
        raise UserError("give exactly one of space={...} or hp_space=function")
    if request.space is None:
        return None
    space = validate_space(request.space)
    check_space_against_args(space, args, takes_trial)
    return space


def check_objective(objective: Objective, directions: list[str]) -> None:
    if len(directions) > 1 and isinstance(objective, str):
        raise UserError(
            f"{len(directions)} directions need an objective function returning {len(directions)} values"
        )
    if isinstance(objective, str) and not objective.startswith("eval_"):
        raise UserError(
            f"objective {objective!r}: evaluation metrics are named eval_*; did you mean 'eval_{objective}'?"
        )


def run_sweep(
    chosen: Backend,
    job: SweepJob,
    settings: SearchSettings,
    *,
    show_progress: bool,
    make_runner: Callable[[SweepJob, SearchSettings], Any] | None = None,
) -> Any:
    """Run the backend over the sweep's folder, with its progress and sweep callbacks around it;
    returns the best run(s). A refusal before any trial leaves no folder behind."""
    from hpsweep.search.loop import TrialLoop

    # before the folder: a runner may refuse the settings
    runner = (make_runner or _trial_runner)(job, settings)
    output_dir = settings.output_dir
    made = open_output_dir(output_dir, settings.study_name)
    progress = None
    if show_progress:
        from hpsweep.search.progress import SweepProgress

        progress = SweepProgress(
            output_dir,
            n_trials=settings.n_trials,
            timeout=settings.timeout,
            directions=settings.directions,
            objective_name=job.objective_name,
            counts=chosen.progress_counts(),
        )
    finished = False
    records: list[runs.TrialRecord] = []
    best = None
    try:
        for sc in job.sweep_callbacks:
            sc.on_sweep_begin(settings)
        if progress:
            progress.start()
        chosen.run(TrialLoop(runner, settings, chosen.ledger()))
        finished = True
    except UserError:
        if not runs.read_trials(output_dir):
            made.remove()
        raise
    finally:
        if progress:
            progress.stop()
        if finished:
            settle_home(job)
        if output_dir.exists():
            records = runs.read_trials(output_dir)
            best = runs.read_best(output_dir)
            # interrupted: Ctrl-C or an error; pushers skip, trackers close
            for sc in job.sweep_callbacks:
                sc.on_sweep_end(best, records, interrupted=not finished)
    if best is None:
        states = sorted({r.state for r in records})
        raise UserError(
            f"no trial completed ({len(records)} trials: {', '.join(states) or 'none ran'}); "
            f"see the trial.json and error.log files in {output_dir}"
        )
    return best


def _trial_runner(job: SweepJob, settings: SearchSettings) -> TrialRunner:
    return TrialRunner(job, settings.backend)


def settle_home(job: SweepJob) -> None:
    """The home's best run made right (two machines may have finished at once; a Pareto front
    may lack a trial whose process died as it was promoted) and, from an object store, brought
    here; a failure leaves this machine's best, with one line saying so."""
    home = job.runs_home
    try:
        home.settle()
    except Exception as exc:
        print(
            f"hpsweep: warning: could not read the best run at {home.url} ({type(exc).__name__}); "
            "this machine's best is returned, and the next command to finish puts the study's best there",
            file=sys.stderr,
        )


@dataclass(frozen=True)
class MadeHere:
    """What `open_output_dir` found before it wrote anything, so that a refusal takes back only
    what this command made: the first folder it created, or the entries it added to a folder
    that was there already (empty or not), which stays."""

    output_dir: Path
    #: the outermost folder this command created (the output folder or one above it), if any
    created: Path | None
    #: the output folder's entries before, when it existed
    entries: frozenset[str]

    def remove(self) -> None:
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for path in self.output_dir.iterdir():
            if path.name not in self.entries:
                remove_path(path)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def open_output_dir(output_dir: Path, study_name: str) -> MadeHere:
    """Create the sweep's folder (or finish what a crash left half-swapped in it) and name its
    study there; returns what was there before."""
    missing = [p for p in (output_dir, *output_dir.parents) if not p.exists()]
    made = MadeHere(
        output_dir,
        created=missing[-1] if missing else None,
        entries=frozenset(p.name for p in output_dir.iterdir()) if not missing else frozenset(),
    )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--output-dir {output_dir}: cannot create it ({exc.strerror}); give a writable folder"
        ) from None
    runs.recover_interrupted_swaps(output_dir)
    runs.write_text(output_dir / STUDY_FILE, study_name + "\n")  # checked by check_one_study
    return made
