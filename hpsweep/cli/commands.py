"""The ``hpsweep`` command line: ``run``, ``show``, ``report``, ``push``, ``dashboard``.

Exit codes: 0 done; 2 a user error, printed as one line with no traceback; 1 an internal
failure; 130 after Ctrl-C, once running trials are recorded as stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from hpsweep.errors import UserError
from hpsweep.search.options import SearchOptions

#: What a search flag not given stands for: `SearchOptions`' defaults.
DEFAULTS = SearchOptions()

#: Optuna's storage URL when ``--storage`` is not given. A Kubernetes Secret can fill it, so the
#: database password stays off the command line, where ``ps`` and the pod's spec would show it.
STORAGE_ENV = "HPSWEEP_STORAGE"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other user error
        raise UserError(f"{message}; see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpsweep", description="Hyperparameter search over PyTorch training.")
    parser.add_argument("--version", action="version", version=f"hpsweep {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run(sub)
    _add_show(sub)
    _add_report(sub)
    _add_push(sub)
    _add_dashboard(sub)
    return parser


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="run the sweep a space file describes")
    run.add_argument(
        "space_file", help="a .py file defining model_init, args, space, train_dataset, ..."
    )
    _add_search_options(run.add_argument_group("the search"))
    _add_stopping_options(run.add_argument_group("stopping early"))
    _add_device_options(run.add_argument_group("where trials run"))
    _add_arguments_options(run.add_argument_group("training arguments"))
    _add_tracking_options(run.add_argument_group("tracking and publishing"))
    run.set_defaults(func=cmd_run)


def _add_search_options(group: Any) -> None:
    group.add_argument(
        "--backend",
        default=DEFAULTS.backend,
        help=f"optuna, ray or wandb (default {DEFAULTS.backend})",
    )
    group.add_argument(
        "--n-trials",
        type=int,
        default=DEFAULTS.n_trials,
        help=f"trials the study should hold when done (default {DEFAULTS.n_trials})",
    )
    group.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    group.add_argument(
        "--output-dir",
        help="the sweep's home: where runs, best/ and the study go, a folder or s3://bucket/prefix "
        "/ gs://bucket/prefix (default: args.output_dir)",
    )
    group.add_argument("--study-name", help="study name (default: the space file's name)")
    group.add_argument(
        "--storage",
        help="optuna: a journal file's path (default: $HPSWEEP_STORAGE, else "
        "OUTPUT_DIR/study.journal), sqlite:///FILE, "
        "postgresql://USER@HOST/DB (password from the URL or PGPASSWORD), mysql+pymysql://..., "
        "or grpc://HOST:PORT (Optuna's storage proxy); "
        "ray: where Tune keeps its experiment (a path or s3://...)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="accepted for compatibility: the same command always continues its sweep",
    )
    group.add_argument(
        "--sampler", help="optuna: tpe, random, cmaes, gp, grid, nsga2; wandb: random, grid, bayes"
    )
    group.add_argument(
        "--pruner", help="optuna: median, hyperband, sha, none; wandb: hyperband, none"
    )
    group.add_argument("--scheduler", help="ray: fifo, asha, hyperband, pbt")
    group.add_argument("--seed", type=int, help="seed for the sampler")
    group.add_argument(
        "--max-failed-trials",
        type=int,
        default=DEFAULTS.max_failed_trials,
        help="end the sweep after this many failed trials in one run "
        f"(default {DEFAULTS.max_failed_trials})",
    )
    group.add_argument(
        "--warm-start",
        metavar="HOME",
        help="begin from an earlier sweep's finished trials (its folder or s3://... / gs://..., "
        "any backend), given to the backend as evaluated; they do not count towards --n-trials",
    )
    group.add_argument(
        "--warm-start-best",
        type=int,
        metavar="K",
        help="with --warm-start: train the earlier sweep's K best configs again first (they count)",
    )


def _add_stopping_options(group: Any) -> None:
    group.add_argument(
        "--stop-when",
        metavar="RULE",
        help="end the sweep before --n-trials when more trials will not help: plateau[:N[:TOL]] "
        "(no gain over the best by more than TOL in the last N trials; default 10, 0), "
        "target:VALUE (the objective reached), regret (the room for improvement below the "
        "objective's noise or 0.15 of its early size); none: go on past a stop recorded earlier",
    )


def _add_device_options(group: Any) -> None:
    group.add_argument(
        "--n-jobs",
        type=int,
        default=DEFAULTS.n_jobs,
        help=f"trials run in parallel (processes; default {DEFAULTS.n_jobs})",
    )
    group.add_argument(
        "--address", help="ray: an existing cluster (auto, HOST:PORT or ray://HOST:10001)"
    )
    group.add_argument(
        "--resources-per-trial",
        type=_resources,
        help="what each trial gets, on every backend: cpu=N threads, gpu=F GPUs (0.5: two trials "
        "share one; default: 1 per process where CUDA sees a GPU, else 0)",
    )
    group.add_argument(
        "--processes-per-trial",
        type=int,
        default=DEFAULTS.processes_per_trial,
        metavar="N",
        help="train each trial data-parallel over N processes (NCCL on GPUs, gloo on CPU); "
        "the effective batch is per_device_train_batch_size x N",
    )


def _add_arguments_options(group: Any) -> None:
    group.add_argument("--config", help="a YAML or JSON file of TrainingArguments")
    group.add_argument(
        "--set",
        dest="set_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one TrainingArguments field (repeatable)",
    )


def _add_tracking_options(group: Any) -> None:
    group.add_argument(
        "--mlflow",
        nargs="?",
        const="",
        metavar="TRACKING_URI",
        help="track the sweep in MLflow (default URI: $MLFLOW_TRACKING_URI, else MLflow's local default)",
    )
    group.add_argument(
        "--mlflow-fatal", action="store_true", help="stop the sweep when MLflow tracking fails"
    )
    group.add_argument(
        "--mlflow-log-best",
        action="store_true",
        help="upload best/ as an artifact of the MLflow run",
    )
    group.add_argument(
        "--push-to-hub", metavar="REPO_ID", help="push the best run to this Hugging Face Hub repo"
    )
    group.add_argument("--hub-private", action="store_true", help="create the Hub repo as private")
    group.add_argument(
        "--hub-revision", metavar="BRANCH", help="push to this branch of the Hub repo"
    )


def _add_show(sub: Any) -> None:
    show = sub.add_parser("show", help="the trials of a sweep as a table")
    show.add_argument("dir", help="the sweep's home: its output folder, or s3://... / gs://...")
    show.add_argument("--json", action="store_true", help="print the trials as JSON")
    show.set_defaults(func=cmd_show)


def _add_report(sub: Any) -> None:
    report = sub.add_parser("report", help="an HTML page with plots of the sweep (DIR/report.html)")
    report.add_argument("dir", help="the sweep's home: its output folder, or s3://... / gs://...")
    report.add_argument("--output", help="where to write the page (default: DIR/report.html)")
    report.set_defaults(func=cmd_report)


def _add_push(sub: Any) -> None:
    push = sub.add_parser(
        "push", help="push the best run, with a model card, to the Hugging Face Hub"
    )
    push.add_argument("dir", help="the sweep's home: its output folder, or s3://... / gs://...")
    push.add_argument(
        "--repo-id",
        required=True,
        help="USER/NAME or ORG/NAME (the token: `hf auth login` or HF_TOKEN)",
    )
    push.add_argument("--private", action="store_true", help="create the repo as private")
    push.add_argument(
        "--revision", metavar="BRANCH", help="push to this branch (created if needed)"
    )
    push.set_defaults(func=cmd_push)


def _add_dashboard(sub: Any) -> None:
    dashboard = sub.add_parser(
        "dashboard",
        help="serve optuna-dashboard on a sweep's study, live (pip install 'hpsweep[dashboard]')",
    )
    dashboard.add_argument(
        "dir", help="the sweep's home: its output folder, or s3://... / gs://... (with --storage)"
    )
    dashboard.add_argument(
        "--storage",
        help="the study's database, for a sweep run with --storage (default: $HPSWEEP_STORAGE, "
        "else DIR/study.journal)",
    )
    dashboard.add_argument(
        "--study-name", help="the study (default: the one DIR/.study names, or the one kept at DIR)"
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only; the dashboard has "
        "no login, and its buttons change the study)",
    )
    dashboard.add_argument("--port", type=int, default=8080, help="the port (default 8080)")
    dashboard.set_defaults(func=cmd_dashboard)


def _resources(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = float(value)  # cpu, gpu, or a custom Ray resource
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not name=number, e.g. cpu=1,gpu=0.5"
            ) from None
    return out


def cmd_run(ns: argparse.Namespace) -> int:
    from hpsweep.cli import startup_heap
    from hpsweep.devices.threads import note_start

    note_start()  # the first trial's threads are decided over the command's start-up
    # see hpsweep.cli.startup_heap
    with startup_heap.collector_off(process_ends=getattr(ns, "process_ends", False)):
        startup_heap.import_libraries()
        from hpsweep.api import run_options

        startup_heap.freeze_libraries()

        options = search_options(ns)
        # the freeze comes last: after MLflow's imports
        freeze = startup_heap.FreezeAtSweepBegin()
        options = replace(options, sweep_callbacks=(*options.sweep_callbacks, freeze))
        best = run_options(
            ns.space_file,
            options,
            output_dir=ns.output_dir,
            config=ns.config,
            set_args=ns.set_args,
        )
        _print_best(best)
    return 0


def search_options(ns: argparse.Namespace) -> SearchOptions:
    """The search ``hpsweep run``'s flags ask for: each flag is the option of its name, and one
    not given keeps its default (``--study-name``'s: the space file's name); ``--storage`` falls
    back to ``$HPSWEEP_STORAGE``; ``--mlflow`` and ``--push-to-hub`` are sweep callbacks."""
    flags = {name: getattr(ns, name) for name in SearchOptions.asked() if hasattr(ns, name)}
    flags["storage"] = _storage(ns)
    return SearchOptions(
        **{name: value for name, value in flags.items() if value is not None},
        sweep_callbacks=_sweep_callbacks(ns),
    )


def _storage(ns: argparse.Namespace) -> str | None:
    """``--storage``, else (on Optuna, whose storage is the study's database) ``$HPSWEEP_STORAGE``,
    marked as the variable's so that a message about it names the variable. Other backends read
    ``--storage`` as something else (Ray: Tune's files), so not the variable."""
    if ns.storage is not None or ns.backend != "optuna":
        return ns.storage
    url = os.environ.get(STORAGE_ENV)
    if not url:
        return None
    from hpsweep.search.backends._optuna._storages import StorageFromEnv

    return StorageFromEnv(url, STORAGE_ENV)


def _sweep_callbacks(ns: argparse.Namespace) -> list[Any]:
    callbacks: list[Any] = []
    if ns.mlflow is not None:
        from hpsweep.integrations.mlflow import MLflowTracker

        callbacks.append(
            MLflowTracker(
                ns.mlflow or None, fatal=ns.mlflow_fatal, log_best_checkpoint=ns.mlflow_log_best
            )
        )
    if ns.push_to_hub:
        from hpsweep.integrations.hub import PushBestAtEnd

        callbacks.append(
            PushBestAtEnd(ns.push_to_hub, private=ns.hub_private, revision=ns.hub_revision)
        )
    return callbacks


@contextlib.contextmanager
def sweep_folder(spec: str, *, checkpoints: bool = False) -> Iterator[tuple[Path, Any]]:
    """The sweep's home as a local folder, and the home: a path is the folder itself; an
    object-store URL's records and best_run.json (and best/) are downloaded to a temporary one."""
    from hpsweep import runs

    home = runs.open_home(spec)
    if not home.remote:
        yield (Path(spec) if "://" not in spec else home.local), home
        return
    with tempfile.TemporaryDirectory(prefix="hpsweep-home-") as tmp:
        yield home.snapshot(Path(tmp), checkpoints=checkpoints), home


def cmd_report(ns: argparse.Namespace) -> int:
    from hpsweep.integrations.html_report import REPORT_FILE, write_report

    with sweep_folder(ns.dir) as (folder, home):
        if not home.remote:
            print(write_report(folder, Path(ns.output) if ns.output else None))
            return 0
        page = write_report(folder, Path(ns.output) if ns.output else None, name=home.url)
        print(page if ns.output else home.upload_file(page, REPORT_FILE))
    return 0


def cmd_push(ns: argparse.Namespace) -> int:
    from hpsweep.integrations.hub import push_best

    with sweep_folder(ns.dir, checkpoints=True) as (folder, _):
        print(push_best(folder, ns.repo_id, private=ns.private, revision=ns.revision))
    return 0


def cmd_dashboard(ns: argparse.Namespace) -> int:
    from hpsweep.search.backends._optuna._dashboard import serve_dashboard

    storage = ns.storage or os.environ.get(STORAGE_ENV) or None
    if storage and not ns.storage:
        from hpsweep.search.backends._optuna._storages import StorageFromEnv

        storage = StorageFromEnv(storage, STORAGE_ENV)
    try:
        serve_dashboard(
            ns.dir, storage=storage, study_name=ns.study_name, host=ns.host, port=ns.port
        )
    except KeyboardInterrupt:
        return 130  # the server stopped as asked; nothing to say
    return 0


def _print_best(best: Any) -> None:
    from rich.console import Console

    console = Console()
    for b in best if isinstance(best, list) else [best]:
        name = b.run_summary.get("objective_name", "objective")
        console.print(
            f"[bold green]best[/] {Path(b.run_dir).name}: {name}={b.objective}  "
            f"params={json.dumps(b.hyperparameters)}  checkpoint={b.checkpoint}",
            highlight=False,
            soft_wrap=True,
        )  # one line, as a script reading it expects, in a pipe too


def cmd_show(ns: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hpsweep import runs
    from hpsweep.search.stopping import last_line
    from hpsweep.search.warm_start import read_taken

    with sweep_folder(ns.dir) as (folder, home):
        records = runs.read_trials(folder)
        best = runs.read_best(folder)
        taken = read_taken(folder)  # --warm-start's trials: shown marked, after the sweep's own
        stopped = last_line(folder, records)
    name = home.url if home.remote else Path(ns.dir)
    if not records:
        raise UserError(
            f"{name}: no trials found (no run-*/trial.json); give the --output-dir of a sweep"
        )
    best_ids = {b.run_id for b in (best if isinstance(best, list) else [best] if best else [])}
    if ns.json:
        warm = [{**t, "warm_start": taken["home"]} for t in (taken or {}).get("trials", [])]
        print(
            json.dumps(
                [{**asdict(r), "best": r.id in best_ids} for r in records] + warm,
                indent=2,
                default=str,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{name}: {len(records)} trials")
    for column in ("#", "run", "state", records[0].objective_name, "params", "time"):
        table.add_column(column, justify="right" if column in ("#", "time") else "left")
    for r in records:
        mark = " [bold green]★[/]" if r.id in best_ids else ""
        objective = (
            ""
            if r.objective is None
            else json.dumps(r.objective)
            if isinstance(r.objective, list)
            else f"{r.objective:.6g}"
        )
        table.add_row(
            str(r.number),
            Path(r.run_dir).name + mark,
            r.state,
            objective,
            _params_text(r.params),
            f"{r.duration_s:.1f}s" if r.duration_s is not None else "",
        )
    for w in (taken or {}).get("trials", []):
        table.add_row(
            f"w{w['number']}",
            "warm start",
            w["state"],
            "" if w["value"] is None else json.dumps(w["value"]),
            _params_text(w["params"]),
            "",
        )
    if taken:
        table.caption = f"w<N>: trial N of {taken['home']}, given as evaluated (--warm-start)"
    Console().print(table)
    if stopped:
        print(stopped)
    return 0


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command ``argv``; None is this process's own command line (the ``hpsweep`` script,
    ``python -m hpsweep.cli``), whose process ends with the command."""
    if argv is None:
        # This process owns its W&B service. One named by the shell's process (a notebook that
        # ran wandb) outlives a crash of this sweep holding its trials' runs, and the command
        # run again could not resume them ("run ID ... is in use").
        os.environ.pop("WANDB_SERVICE", None)
    try:
        ns = build_parser().parse_args(argv)
        ns.process_ends = argv is None
        return ns.func(ns)
    except UserError as exc:
        print(f"hpsweep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(
            "hpsweep: interrupted; finished trials are saved and running ones recorded as stopped "
            "(run the same command again to continue)",
            file=sys.stderr,
        )
        return 128 + getattr(exc, "signum", 2)


def _version() -> str:
    from hpsweep import __version__

    return __version__
