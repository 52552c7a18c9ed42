"""`search`: one sweep, from the user's `SearchOptions` to the best run.

It checks everything a user can get wrong before anything is written (each refusal is one
`UserError` line), adds to the options what it derives from them (the output folder, the
directions, the objective's name, each trial's resources, the home: the one `SearchOptions` a
backend reads) and builds the `SweepJob` every trial needs, then hands a `SweepLoop` over a
`TrialRunner` to the backend's searcher and returns the best run(s). Searchers decide what to
try: an `AskTellSearcher` under the loop, a `Driver` (Ray, W&B with a server) where its trials
start; counting, leases and records are the ledger's.
"""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpsweep import devices, runs
from hpsweep.errors import UserError
from hpsweep.search import stopping
from hpsweep.search.backends import (
    Backend,
    Driver,
    Searcher,
    backend_class,
    get_backend,
    transformers_keywords,
)
from hpsweep.search.checks import (
    STUDY_FILE,
    check_counts,
    check_one_study,
    check_output_dir,
    check_space_against_args,
    normalise_directions,
)
from hpsweep.search.job import (
    SweepJob,
    push_to_hub_callbacks,
    report_to_callbacks,
    trainer_parts,
    trial_arguments,
)
from hpsweep.search.objective import describe_objective
from hpsweep.search.options import (
    DEFAULT_STUDY_NAME,
    Objective,
    SearchOptions,
    given_optional,
)
from hpsweep.search.space import validate_space
from hpsweep.search.sweep_loop import SweepLoop
from hpsweep.search.torchrun import launched_rank, search_launched
from hpsweep.search.trial_runner import TrialRunner
from hpsweep.search.warm_start import give_backend


def search(trainer: Any, options: SearchOptions) -> Any:
    """Validate, run the backend, and return the best run(s); see `Trainer.hyperparameter_search`
    and `hpsweep.run`, which build the ``options``."""
    devices.note_start()
    options = adopt_directions(options)
    rank = launched_rank(trainer.args)
    if rank is None:
        best = sweep_request(trainer, options)
    else:  # torchrun's processes: one sweep, each trial trained by all
        best = search_launched(
            rank, trainer, options, functools.partial(sweep_request, trainer, options)
        )
    if isinstance(best, runs.BestRun):
        trainer._hold_best_model(best)  # evaluate / predict / save_model use the best trial's model
    return best


def sweep_request(
    trainer: Any,
    options: SearchOptions,
    make_runner: Callable[[SweepJob, SearchOptions], Any] | None = None,
) -> Any:
    """Check ``options``, run their sweep here and return the best run(s); ``make_runner`` makes
    the `TrialRunner` that trains each trial."""
    options, note = adopt_library_keywords(options)
    settings, job, chosen = prepare(trainer, options)
    if note:  # after the line naming the objective, which comes first
        print(f"hpsweep: {note}", file=sys.stderr)
    return run_sweep(chosen, job, settings, make_runner=make_runner)


def adopt_directions(options: SearchOptions) -> SearchOptions:
    """``directions=[...]``, the keyword Optuna's ``create_study`` takes and transformers' docs
    show for a multi-objective search, is ``direction=[...]``."""
    if "directions" not in options.options:
        return options
    left = {name: value for name, value in options.options.items() if name != "directions"}
    directions = options.options["directions"]
    if directions is None:
        return replace(options, options=left)
    given = normalise_directions(options.direction)
    if given != ["minimize"] and given != normalise_directions(directions):
        raise UserError(
            f"direction={options.direction!r} and directions={directions!r} disagree; give one of them"
        )
    return replace(options, direction=directions, options=left)


def adopt_library_keywords(options: SearchOptions) -> tuple[SearchOptions, str | None]:
    """Read what transformers hands the backend's library (``tune.run``'s keywords, W&B's
    ``project`` and ``metric``) as hpsweep's own options; what hpsweep's keywords say explicitly
    wins. Returns the options, and a note on those that change nothing, for after the
    objective's line."""
    if not options.options:
        return options, None
    left, theirs, note = transformers_keywords(options.backend, dict(options.options))
    unset = {
        "sampler": options.sampler is None,
        "storage": options.storage is None,
        "timeout": options.timeout is None,
        "n_jobs": options.n_jobs == 1,
        "max_failed_trials": True,
        "study_name": options.study_name is None,
    }
    changes = {name: theirs[name] for name, free in unset.items() if free and name in theirs}
    if "objective" in theirs:
        changes["objective"] = metric_as_objective(theirs["objective"], options.objective)
    return replace(options, options=left, **changes), note


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


def prepare(trainer: Any, options: SearchOptions) -> tuple[SearchOptions, SweepJob, Backend]:
    """Every check that needs no trial, in the order a user fixes them; nothing is written.
    Returns the options with what the sweep derived, the job and the backend."""
    settings, objective, takes_trial, note = checked_options(trainer, options)
    settings = adopt_native_options(settings, trainer.args, takes_trial)
    chosen = get_backend(settings.backend, settings)
    chosen.check_study()
    taken = give_backend(chosen, settings)  # --warm-start: read, checked and handed over
    job = job_for(trainer, settings, objective, takes_trial)
    job.sweep_callbacks[:0] = taken
    if note:
        print(f"hpsweep: {note}", file=sys.stderr)
    return settings, job, chosen


def checked_options(
    trainer: Any, options: SearchOptions
) -> tuple[SearchOptions, Objective, bool, str | None]:
    """The checks before the backend's: ``options`` with what the sweep derives from them, the
    objective, whether ``model_init`` takes the trial, and the placement's note."""
    from hpsweep.search.objective import resolve_objective
    from hpsweep.train.model_init import model_init_arity

    directions = normalise_directions(options.direction)
    check_counts(
        n_trials=options.n_trials,
        timeout=options.timeout,
        n_jobs=options.n_jobs,
        max_failed_trials=options.max_failed_trials,
        processes_per_trial=options.processes_per_trial,
    )
    refuse_combinations(trainer.args, options)
    stopping.check_stop_when(options.stop_when, directions)
    # A request this machine's devices cannot meet is one line, before anything is written.
    placement = devices.plan(
        n_jobs=options.n_jobs,
        resources=options.resources_per_trial,
        processes_per_trial=options.processes_per_trial,
        gpus=devices.visible_gpus(),
        cores=devices.usable_cores(),
        local=options.address is None,
    )
    devices.check_fork_safe(placement)
    takes_trial = model_init_arity(trainer.model_init) == 1
    space = checked_space(options, trainer.args, takes_trial)
    # Hugging Face's default objective when none is given; the sweep says which it optimises
    objective = resolve_objective(options.objective, directions, trainer.compute_metrics)
    check_objective(objective, directions)
    if trainer.eval_dataset is None:
        raise UserError("a search evaluates every trial: give an eval_dataset")
    # A URL is checked here (store, bucket, credentials); its runs are written to a staging folder.
    home = runs.open_home(trainer.args.output_dir)
    # Absolute, so trials that run in another working directory (Ray workers) write here too.
    output_dir = check_output_dir(home.local)
    study_name = options.study_name or DEFAULT_STUDY_NAME
    check_one_study(output_dir, study_name)
    derived = replace(
        options,
        space=space,
        study_name=study_name,
        output_dir=output_dir,
        directions=directions,
        objective_name=objective if isinstance(objective, str) else "objective",
        resources_per_trial=placement.resources,
        given=given_optional(options),
        home=home,
    )
    return derived, objective, takes_trial, placement.note


def adopt_native_options(settings: SearchOptions, args: Any, takes_trial: bool) -> SearchOptions:
    """The options an ``hp_space`` in the backend library's own form stands for (a W&B sweep
    config: its space, method and stopping), adopted before the backend is made; a space it
    holds is checked as a space given is."""
    native = backend_class(settings.backend).native_options(settings)
    if native.get("space") is not None:
        native["space"] = validate_space(native["space"])
        check_space_against_args(native["space"], args, takes_trial)
    return replace(settings, **native) if native else settings


def job_for(
    trainer: Any, settings: SearchOptions, objective: Objective, takes_trial: bool
) -> SweepJob:
    """What every trial of the sweep needs, taken from the trainer the search was called on."""
    return SweepJob(
        **trainer_parts(trainer),
        args=trial_arguments(trainer.args, settings.output_dir),
        objective=objective,
        directions=settings.directions,
        hp_space=settings.hp_space,
        hp_name=settings.hp_name,
        sweep_callbacks=[
            *settings.sweep_callbacks,
            *report_to_callbacks(trainer.args.report_to, settings.sweep_callbacks),
            *push_to_hub_callbacks(trainer.args, settings.sweep_callbacks),
        ],
        model_takes_trial=takes_trial,
        processes_per_trial=settings.processes_per_trial,
        home=settings.home if settings.home.remote else None,
    )


def refuse_combinations(args: Any, options: SearchOptions) -> None:
    """Settings that work alone but not together."""
    if options.processes_per_trial > 1 and args.auto_find_batch_size:
        raise UserError(
            "auto_find_batch_size with --processes-per-trial: a process that runs out of memory cannot "
            "restart the others; set per_device_train_batch_size to a size that fits instead"
        )
    if options.processes_per_trial > 1 and args.train_sampling_strategy == "group_by_length":
        raise UserError(
            "train_sampling_strategy='group_by_length' with --processes-per-trial: the processes' "
            "shares of a grouped order are not drawn per epoch yet; use 'random' or one process per trial"
        )
    if options.scheduler == "pbt" and args.save_only_model:
        raise UserError(
            "--scheduler pbt goes on from other trials' checkpoints, and save_only_model=True writes the "
            "model alone, nothing to train on from; set save_only_model=False"
        )


def checked_space(options: SearchOptions, args: Any, takes_trial: bool) -> dict[str, Any] | None:
    """The space, validated against the arguments; None for a define-by-run ``hp_space``."""
    if (options.space is None) == (options.hp_space is None):
        raise UserError("give exactly one of space={...} or hp_space=function")
    if options.space is None:
        return None
    space = validate_space(options.space)
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
    settings: SearchOptions,
    *,
    make_runner: Callable[[SweepJob, SearchOptions], Any] | None = None,
) -> Any:
    """Run the backend over the sweep's folder, with its progress and sweep callbacks around it;
    returns the best run(s). A refusal before any trial leaves no folder behind."""
    # before the folder: a runner may refuse the settings
    runner = (make_runner or _trial_runner)(job, settings)
    output_dir = settings.output_dir
    made = open_output_dir(output_dir, settings.study_name)
    stopping.begin(output_dir, settings.stop_when, settings.directions, settings.space)
    progress = None
    if settings.show_progress:
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
        run_searcher(chosen.searcher(), SweepLoop(runner, settings, chosen.ledger()))
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
    stopped = stopping.last_line(output_dir, records) if finished else None
    if stopped:
        print(stopped, file=sys.stderr)
    if best is None:
        states = sorted({r.state for r in records})
        raise UserError(
            f"no trial completed ({len(records)} trials: {', '.join(states) or 'none ran'}); "
            f"see the trial.json and error.log files in {output_dir}"
        )
    return best


def _trial_runner(job: SweepJob, settings: SearchOptions) -> TrialRunner:
    return TrialRunner(job, settings.backend)


def run_searcher(searcher: Searcher, loop: SweepLoop) -> None:
    """The sweep's trials, tried by ``searcher``: a `Driver` drives them itself, handed the
    loop; an `AskTellSearcher` is asked and told by the loop."""
    if isinstance(searcher, Driver):
        searcher.drive(loop)
    else:
        loop.run(searcher)


def settle_home(job: SweepJob) -> None:
    """The home's best run made right (two machines may have finished at once; a Pareto front
    may lack a trial whose process died as it was promoted) and, from an object store, brought
    here, with this machine's top records (a stopping rule's decision) sent there; a failure
    leaves this machine's best, with one line saying so."""
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
