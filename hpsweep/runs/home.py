"""The sweep's home (``--output-dir``): a local folder, or an object-store URL every machine names.

    home = open_home("s3://bucket/sweep")    # or "gs://bucket/sweep", or a local path
    home.local                               # where this machine's training writes
    home.upload_checkpoint(run_dir, ckpt)    # after the checkpoint is whole on local disk
    home.promote_best(record)                # best/ and best_run.json at the home

A local path is the home itself: `Home` adds nothing to what `hpsweep.runs` writes there. An
object-store URL gets a `RemoteHome`: training writes to a staging folder on this machine (stable
per URL, so a rerun here continues), and the home receives, as they are made:

- each checkpoint, once whole on disk: its files, then a ``.complete`` marker last, so a reader
  (another machine resuming the trial, `pull_run`) trusts only checkpoints with the marker;
  checkpoints rotated away locally (``save_total_limit``) are removed there too, marker first;
- ``trial.json`` (when the trial starts and when it ends) and ``error.log``, with ``run_dir`` naming
  the run at the home (``s3://bucket/sweep/run-3``);
- ``best/`` and ``best_run.json`` when a trial beats the home's current best (compared with the
  home's ``best_run.json``, whichever machine wrote it): ``best/``'s files first (the model's
  files of the trial's checkpoint, not its training state), its README.md, then ``best_run.json``.

Two machines that finish at once may both find their trial better than the home's best and both
write; the last ``best_run.json`` written wins, and ``best/`` may hold files of both for a moment.
So each command ends with `RemoteHome.settle`: it reads every ``trial.json`` at the home and, when
``best_run.json`` does not hold the best of them, copies the model's files of that trial's
uploaded checkpoint into ``best/`` (a copy inside the store) and rewrites ``best_run.json``.
Whichever command ends last leaves the study's best there.

Built on fsspec (s3fs for ``s3://``, gcsfs for ``gs://``), not on pyarrow's filesystems or Optuna's
artifact stores: fsspec is already installed with huggingface_hub, reads credentials the way each
store's own client does (boto3's chain: ``AWS_*`` variables, profiles, instance roles, and
``AWS_ENDPOINT_URL`` for S3-compatible stores), and moves lists of files concurrently and copies
inside the store. pyarrow's S3 client is a large native library with its own credential rules;
Optuna's artifact stores keep opaque blobs per trial id, not the browsable ``run-*/``, ``best/``
layout that every backend (Ray's and W&B's too) writes and that users open.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from hpsweep import faults
from hpsweep.errors import UserError
from hpsweep.runs._atomic import _json_default, atomic_dir, read_json, write_json
from hpsweep.runs._best import promote_if_best, settle_front
from hpsweep.runs._checkpoint_files import CHECKPOINT_PREFIX, checkpoints
from hpsweep.runs._model_folder import (
    ARGS_FILE,
    README,
    ModelKind,
    best_run_readme,
    clean_args,
    is_model_file,
    model_files,
    model_kind,
    model_kind_of,
)
from hpsweep.runs._records import (
    BEST_DIR,
    BEST_FILE,
    RESERVED,
    TRIAL_FILE,
    BestRun,
    TrialRecord,
    best_records,
    front_after,
    is_better,
    safe_name,
)

#: In an uploaded checkpoint folder, written after all its files: the checkpoint is whole.
COMPLETE = ".complete"
ERROR_FILE = "error.log"
#: Records at the top of a home that `hpsweep show` and `hpsweep report` read beside the trials':
#: the trials ``--warm-start`` took, and the decision of a ``--stop-when`` rule.
TOP_RECORDS = ("warm_start.json", "stopping.json")
#: URL scheme -> (the fsspec package that serves it, the hpsweep extra that installs it). ``file``
#: serves a Ray trial's folder in Ray's storage on a mount (`RemoteHome` with its own ``local``).
SCHEMES = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "file": ("fsspec", "ray"),
}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_home(spec: str | os.PathLike) -> Home:
    """The home ``spec`` names: a local path (the folder itself) or ``s3://`` / ``gs://`` URL.

    A URL is checked before anything is written (the package, the store, the bucket, the
    credentials): each problem is one `UserError` line naming the fix; no secret is printed.
    """
    text = str(spec)
    match = _URL.match(text)
    if match is None or match.group(1).lower() == "file":
        return Home(Path(text[7:] if match else text).resolve())
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise UserError(
            f"{_shown(text)}: {scheme}:// is not a home hpsweep can keep a sweep in; give a "
            "folder, s3://bucket/prefix or gs://bucket/prefix"
        )
    home = RemoteHome(text)
    home.check()
    return home


class Home:
    """A home on a local (or network-mounted) folder: everything is written there directly, so
    the hooks cost nothing."""

    remote = False

    def __init__(self, local: Path) -> None:
        self.local = local
        self.url = str(local)

    def upload_checkpoint(self, run_dir: Path, checkpoint_dir: Path) -> None:
        """Send a whole checkpoint to the home (nothing to do here: it is there)."""

    def upload_record(self, run_dir: Path) -> None:
        """Send the run's ``trial.json`` and ``error.log`` to the home (nothing to do here)."""

    def pull_run(self, run_name: str) -> Path:
        """The run folder on this machine, with its records and complete checkpoints."""
        return self.local / run_name

    def promote_best(self, record: TrialRecord) -> bool:
        """Make ``record`` the home's best run if it beats the current one; returns whether it did."""
        return promote_if_best(self.local, record)

    def settle(self) -> None:
        """At the end of a command: leave the home's best, and this machine's copy of it, right
        (here: a Pareto front that lacks a trial whose process died as it was promoted gets it)."""
        settle_front(self.local)

    def snapshot(self, dest: Path, checkpoints: bool = False) -> Path:
        """A local folder holding the records and ``best_run.json`` (and ``best/``): the folder itself."""
        return self.local


class RemoteHome(Home):
    """A home in an object store, with a staging folder on this machine (see the module's docstring).

    Picklable: worker processes and nodes get it with the sweep's job and open their own client.
    ``local``: this machine's folder for it, instead of the staging folder.
    """

    remote = True

    def __init__(self, url: str, local: Path | None = None) -> None:
        self.scheme = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
        path = url[len(self.scheme) + 3 :].strip("/")
        self.root = f"/{path}" if self.scheme == "file" else path
        self.url = f"{self.scheme}://{self.root}"
        self.bucket = self.root.split("/", 1)[0]
        self.endpoint = _endpoint() if self.scheme == "s3" else None
        self.local = local if local is not None else staging_folder(self.url, self.endpoint)
        self._fs: Any = None
        self._fs_pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_fs_pid": 0}

    @property
    def fs(self) -> Any:
        """This process's client (a forked worker opens its own: the parent's event loop is not its)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, self._fs_pid = _filesystem(self.scheme, probe=False), os.getpid()
        return self._fs

    # --- checks ----------------------------------------------------------------------------------

    def check(self) -> None:
        """One request (the bucket's metadata) with few retries: reachable, credentials, bucket."""
        if not self.bucket:
            raise UserError(
                f"{_shown(self.url)}: name a bucket, as in {self.scheme}://bucket/sweep"
            )
        fs = _filesystem(self.scheme, probe=True)
        try:
            fs.info(self.bucket)
        except Exception as exc:
            raise _refusal(exc, self) from None

    # --- uploads -----------------------------------------------------------------------------------

    def upload_checkpoint(self, run_dir: Path, checkpoint_dir: Path) -> None:
        remote = f"{self.root}/{run_dir.name}/{checkpoint_dir.name}"
        self._rm_marker(remote)  # a checkpoint of that name written again
        self._put_folder(checkpoint_dir, remote)
        faults.reached("uploading")
        self.fs.pipe_file(f"{remote}/{COMPLETE}", b"{}\n")
        self._drop_rotated(run_dir)

    def _put_folder(self, folder: Path, remote: str, last: str | None = None) -> list[str]:
        """``folder``'s files to ``remote``; ``last``: the one sent after all others."""
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        first = [n for n in names if n != last]
        if first:
            self.fs.put([str(folder / n) for n in first], [f"{remote}/{n}" for n in first])
        if last in names:
            self.fs.put_file(str(folder / last), f"{remote}/{last}")
        return names

    def _drop_rotated(self, run_dir: Path) -> None:
        """Remove the checkpoints rotated away on this machine (marker first: never half of one)."""
        kept = {p.name for p in checkpoints(run_dir)}
        for path in self._ls(f"{self.root}/{run_dir.name}"):
            name = path.rsplit("/", 1)[-1]
            if name.startswith(CHECKPOINT_PREFIX) and name not in kept:
                self._rm_marker(path)
                self.fs.rm(path, recursive=True)

    def _rm_marker(self, checkpoint: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{checkpoint}/{COMPLETE}")

    def upload_record(self, run_dir: Path) -> None:
        data = read_json(run_dir / TRIAL_FILE)
        if not data:
            return
        at_home = f"{self.url}/{run_dir.name}"
        data = _moved(data, str(run_dir), at_home, ("run_dir", "resumed_from"))
        self.fs.pipe_file(f"{self.root}/{run_dir.name}/{TRIAL_FILE}", _json_bytes(data))
        if (run_dir / ERROR_FILE).exists():
            self.fs.put_file(str(run_dir / ERROR_FILE), f"{self.root}/{run_dir.name}/{ERROR_FILE}")

    def upload_file(self, path: Path, name: str) -> str:
        """Put one file at the top of the home (``hpsweep report``'s page); returns its URL."""
        self.fs.put_file(str(path), f"{self.root}/{name}")
        return f"{self.url}/{name}"

    def put_run(self, run_dir: Path, name: str) -> str:
        """Replace the folder ``name`` at the home with the whole ``run_dir``, its ``trial.json``
        last (whoever reads it finds the folder whole), as a Ray trial on a node without the
        sweep's folder ships its run; returns the folder's path in the store."""
        remote = f"{self.root}/{name}"
        if self._find(remote):
            self.fs.rm(remote, recursive=True)  # checkpoints rotated away since the last trip
        self._put_folder(run_dir, remote, last=TRIAL_FILE)
        return remote

    # --- downloads ---------------------------------------------------------------------------------

    def get_run(self, name: str, dest: Path) -> None:
        """The folder ``name`` at the home (`put_run`), swapped in whole at ``dest``."""
        remote = f"{self.root}/{name}"
        self._get_folder(self._find(remote), remote, dest)

    def read_record(self, name: str) -> TrialRecord | None:
        """The ``trial.json`` in the folder ``name`` at the home, if any."""
        data = self._cat(f"{self.root}/{name}/{TRIAL_FILE}")
        return None if data is None else TrialRecord.from_dict(_loads(data))

    def pull_run(self, run_name: str) -> Path:
        """Download what this machine lacks of the run: its complete checkpoints (each swapped into
        place whole) and, when missing here, its ``trial.json`` and ``error.log``."""
        local, remote = self.local / run_name, f"{self.root}/{run_name}"
        keys = self._find(remote)
        # a trial stopped before its first checkpoint has only its records at the home
        local.mkdir(parents=True, exist_ok=True)
        for name in sorted(_complete_checkpoints(keys, remote)):
            if not (local / name).is_dir():
                self._get_folder(keys, f"{remote}/{name}", local / name)
        for name in (TRIAL_FILE, ERROR_FILE):
            if not (local / name).exists() and f"{remote}/{name}" in keys:
                self.fs.get_file(f"{remote}/{name}", str(local / name))
        if (local / TRIAL_FILE).exists():
            data = read_json(local / TRIAL_FILE)
            write_json(local / TRIAL_FILE, _moved(data, f"{self.url}/{run_name}", str(local)))
        return local

    def _get_folder(self, keys: list[str], remote: str, final: Path) -> None:
        wanted = [k for k in keys if k.startswith(remote + "/") and not k.endswith("/" + COMPLETE)]
        with atomic_dir(final) as tmp:
            self.fs.get(wanted, [str(tmp / k[len(remote) + 1 :]) for k in wanted])

    def snapshot(self, dest: Path, checkpoints: bool = False) -> Path:
        """Download every ``trial.json``, ``best_run.json`` and the sweep's other records at the
        top (`TOP_RECORDS`; and ``best/`` with ``checkpoints``) into ``dest``; their paths stay
        the home's URLs."""
        for name, data in self._records_raw().items():
            (dest / name).mkdir(parents=True, exist_ok=True)
            (dest / name / TRIAL_FILE).write_bytes(data)
        for name in TOP_RECORDS:
            data = self._cat(f"{self.root}/{name}")
            if data is not None:
                (dest / name).write_bytes(data)
        best = self._cat(f"{self.root}/{BEST_FILE}")
        if best is not None:
            (dest / BEST_FILE).write_bytes(best)
            keys = self._find(self._best) if checkpoints else []
            if keys:
                self._get_folder(keys, self._best, dest / BEST_DIR)
        return dest

    # --- the best run ------------------------------------------------------------------------------

    def promote_best(self, record: TrialRecord) -> bool:
        """This machine's best first (``best/`` in the folder the run is in: the staging folder,
        or a Ray node's own), then the home's: compared with the home's ``best_run.json``,
        whichever machine wrote it."""
        from filelock import FileLock

        here = Path(record.run_dir).parent
        promote_if_best(here, record, where=self._where)
        with FileLock(str(here / ".best-home.lock")):  # this machine's workers, one at a time
            current = self._read_best()
            if len(record.directions) > 1:
                return self._promote_to_front(record, current)
            value = current.get("objective") if isinstance(current, dict) else None
            if not is_better(record.objective, value, record.directions[0]):  # type: ignore[arg-type]
                return False
            checkpoint = Path(record.run_dir) / record.checkpoint if record.checkpoint else None
            best = self._best_at_home(record)
            if checkpoint is not None and checkpoint.is_dir():
                names = self._put_model(checkpoint)
                self._replace_best_dir(names, best, model_kind_of(checkpoint))
            self.fs.pipe_file(f"{self.root}/{BEST_FILE}", _json_bytes(best.to_dict()))
            return True

    def _put_model(self, checkpoint: Path) -> list[str]:
        """The model's files of ``checkpoint`` into ``best/`` (not its training state; the
        arguments without secrets); returns their names."""
        names = model_files(checkpoint)
        files = [n for n in names if n != ARGS_FILE]
        if files:
            self.fs.put([str(checkpoint / n) for n in files], [f"{self._best}/{n}" for n in files])
        if ARGS_FILE in names:
            args = clean_args((checkpoint / ARGS_FILE).read_bytes())
            self.fs.pipe_file(f"{self._best}/{ARGS_FILE}", args)
        return names

    def settle(self) -> None:
        """Put the best of every trial at the home into ``best/`` and ``best_run.json`` if a race
        left another there (see the module's docstring), send the top records this machine holds
        (`TOP_RECORDS`), then bring the home's best to this machine."""
        records = self.records()
        if records:
            directions = records[0].directions
            if len(directions) > 1:
                self._write_front(records)
            else:
                self._repair_best(best_records(records, directions), directions[0])
        for name in TOP_RECORDS:
            if (self.local / name).exists():
                self.upload_file(self.local / name, name)
        self._pull_best()

    def records(self) -> list[TrialRecord]:
        """Every trial recorded at the home, by number."""
        found = []
        for data in self._records_raw().values():
            record = TrialRecord.from_dict(_loads(data))
            if record is not None:
                found.append(record)
        return sorted(found, key=lambda r: (r.number, r.id))

    def _repair_best(self, best: list[TrialRecord], direction: str) -> None:
        current = self._read_best()
        if not best or (isinstance(current, dict) and current.get("run_id") == best[0].id):
            return
        value = current.get("objective") if isinstance(current, dict) else None
        if value is not None and not is_better(best[0].objective, value, direction):  # type: ignore[arg-type]
            return  # a tie: the one there is as good
        record, run = best[0], f"{self.root}/{Path(best[0].run_dir).name}"
        winner = self._best_at_home(record)
        keys = self._find(f"{run}/{record.checkpoint}") if record.checkpoint else []
        if f"{run}/{record.checkpoint}/{COMPLETE}" in keys:
            source = f"{run}/{record.checkpoint}"
            names = self._copy_model(source, [k[len(source) + 1 :] for k in keys])
            kind = model_kind(names, lambda name: self.fs.open(f"{source}/{name}", "rb"))
            self._replace_best_dir(names, winner, kind)
        self.fs.pipe_file(f"{self.root}/{BEST_FILE}", _json_bytes(winner.to_dict()))

    def _copy_model(self, source: str, names: list[str]) -> list[str]:
        """The model's files among ``names`` of the checkpoint at ``source`` into ``best/``, copied
        inside the store (the arguments without secrets); returns their names."""
        names = [n for n in names if is_model_file(n)]
        files = [n for n in names if n != ARGS_FILE]
        if files:
            self.fs.copy([f"{source}/{n}" for n in files], [f"{self._best}/{n}" for n in files])
        if ARGS_FILE in names:
            args = clean_args(self.fs.cat_file(f"{source}/{ARGS_FILE}"))
            self.fs.pipe_file(f"{self._best}/{ARGS_FILE}", args)
        return names

    def _replace_best_dir(self, names: list[str], best: BestRun, kind: ModelKind) -> None:
        """After the new files are in ``best/``: drop those of the run it held before, then write
        the README (last: it names the run whose files are there)."""
        keep = {f"{self._best}/{n}" for n in names} | {f"{self._best}/{README}"}
        stale = [k for k in self._find(self._best) if k not in keep]
        if stale:
            self.fs.rm(stale)
        readme = best_run_readme(best, kind, self._where)
        self.fs.pipe_file(f"{self._best}/{README}", readme.encode())

    def _promote_to_front(self, record: TrialRecord, current: Any) -> bool:
        """Several directions: the home's ``best_run.json`` becomes the front it holds with
        ``record`` offered to it, one read and one write whatever the size of the sweep; every
        record at the home is read only when `front_after` says so (and by `settle`)."""
        entry = self._best_at_home(record).to_dict()
        front = front_after(current, entry, record)
        if front is None:
            return self._write_front()
        if not any(e is entry for e in front):
            return False
        self.fs.pipe_file(f"{self.root}/{BEST_FILE}", _json_bytes(front))
        return True

    def _write_front(self, records: list[TrialRecord] | None = None) -> bool:
        """Several directions: ``best_run.json`` is the Pareto front of every trial at the home."""
        records = self.records() if records is None else records
        if not records:
            return False
        front = best_records(records, records[0].directions)
        data = [self._best_at_home(r).to_dict() for r in front]
        self.fs.pipe_file(f"{self.root}/{BEST_FILE}", _json_bytes(data))
        return True

    def _pull_best(self) -> None:
        """The home's ``best_run.json`` (and ``best/``) into the staging folder, with local paths,
        so that what the sweep returns, and `Trainer.model` after it, is the study's best."""
        from filelock import FileLock

        data = self._read_best()
        if data is None:
            return
        self.local.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.local / ".best.lock")):
            here = read_json(self.local / BEST_FILE)
            if isinstance(data, dict) and (
                here.get("run_id") != data.get("run_id") or not (self.local / BEST_DIR).is_dir()
            ):
                keys = self._find(self._best)
                if keys:
                    self._get_folder(keys, self._best, self.local / BEST_DIR)
            write_json(self.local / BEST_FILE, _moved(data, self.url, str(self.local)))

    def _best_at_home(self, record: TrialRecord) -> BestRun:
        best = BestRun.from_record(record)
        best.run_dir = f"{self.url}/{Path(record.run_dir).name}"
        best.checkpoint = f"{best.run_dir}/{record.checkpoint}" if record.checkpoint else None
        return best

    # --- small reads -------------------------------------------------------------------------------

    @property
    def _best(self) -> str:
        return f"{self.root}/{BEST_DIR}"

    @property
    def _where(self) -> str:
        """``best/`` as the card's usage names it: the folder a download of it makes."""
        return f"{self.root.rsplit('/', 1)[-1]}/{BEST_DIR}"

    def _read_best(self) -> Any:
        data = self._cat(f"{self.root}/{BEST_FILE}")
        return None if data is None else _loads(data)

    def _records_raw(self) -> dict[str, bytes]:
        """Run folder name -> its ``trial.json`` bytes, read concurrently."""
        names = [
            path.rsplit("/", 1)[-1]
            for path in self._ls(self.root)
            if not path.rsplit("/", 1)[-1].startswith(".")
            and path.rsplit("/", 1)[-1] not in RESERVED
        ]
        wanted = {f"{self.root}/{n}/{TRIAL_FILE}": n for n in names}
        found = self.fs.cat(list(wanted), on_error="omit") if wanted else {}
        return {wanted[key]: data for key, data in found.items() if key in wanted}

    def _cat(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(key)
        except FileNotFoundError:
            return None

    def _ls(self, key: str) -> list[str]:
        try:
            return self.fs.ls(key, detail=False)
        except FileNotFoundError:
            return []

    def _find(self, key: str) -> list[str]:
        try:
            return self.fs.find(key)
        except FileNotFoundError:
            return []


# --- the staging folder, clients and refusals ---------------------------------------------------


def staging_folder(url: str, endpoint: str | None) -> Path:
    """This machine's folder for ``url``: the same on every run here (a rerun continues), another
    for the same bucket name on another endpoint. Under ``$HPSWEEP_CACHE``, else the user's cache."""
    root = os.environ.get("HPSWEEP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpsweep"
    )
    digest = hashlib.sha1(f"{endpoint or ''}|{url}".encode()).hexdigest()[:12]
    return Path(root).resolve() / "homes" / f"{safe_name(url, 'home')[:60]}-{digest}"


def _filesystem(scheme: str, *, probe: bool) -> Any:
    """A fresh client for ``scheme`` (never fsspec's cached one: credentials come from the
    environment when it is made). ``probe``: one quick try, for the check before a sweep."""
    import fsspec

    package, extra = SCHEMES[scheme]
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise UserError(
            f"{scheme}:// homes need {package}; pip install 'hpsweep[{extra}]'"
        ) from None
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if scheme == "file":
        options["auto_mkdir"] = True
    if scheme == "s3" and probe:
        options["config_kwargs"] = {"retries": {"max_attempts": 2}, "connect_timeout": 10}
    fs = cls(**options)
    if probe:
        fs.retries = 1
    return fs


def _refusal(exc: BaseException, home: RemoteHome) -> UserError:
    """One line for what stopped the check; the exception's own text is left out (it may quote
    a key), only its type is named."""
    kind = type(exc).__name__
    where = _shown(home.url)
    if isinstance(exc, FileNotFoundError):
        return UserError(
            f"{where}: the bucket {home.bucket!r} does not exist{_at(home)}; create it or name "
            "another"
        )
    if isinstance(exc, PermissionError):
        return UserError(
            f"{where}: access denied{_at(home)}; check the credentials (AWS_ACCESS_KEY_ID / "
            "AWS_PROFILE, or GOOGLE_APPLICATION_CREDENTIALS) and the bucket's permissions"
        )
    if "Credentials" in kind or "credentials" in kind.lower():
        return UserError(
            f"{where}: no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE) for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://"
        )
    if "Connect" in kind or "Timeout" in kind or isinstance(exc, (ConnectionError, TimeoutError)):
        return UserError(
            f"{where}: cannot reach the object store{_at(home)} ({kind}); check AWS_ENDPOINT_URL "
            "and the network"
        )
    return UserError(f"{where}: cannot open the home{_at(home)} ({kind}); check its URL and access")


def _endpoint() -> str | None:
    """The S3-compatible endpoint boto3 would use, if one is named."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _at(home: RemoteHome) -> str:
    return f" at {_shown(home.endpoint)}" if home.endpoint else ""


def _shown(url: str) -> str:
    """``url`` with any user and password in it replaced by ``***``."""
    return re.sub(r"(://)[^/@]*@", r"\1***@", url)


# --- JSON ----------------------------------------------------------------------------------------


def _moved(data: Any, old: str, new: str, keys: tuple[str, ...] = ()) -> Any:
    """``data`` with the paths under ``old`` (in ``keys``; every string when none are named) moved
    under ``new``: a record's paths as the home names them, or as this machine does."""

    def move(value: Any) -> Any:
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            return new + value[len(old) :]
        return value

    if isinstance(data, list):
        return [_moved(d, old, new, keys) for d in data]
    if not isinstance(data, dict):
        return data
    return {k: move(v) if not keys or k in keys else v for k, v in data.items()}


def _complete_checkpoints(keys: list[str], remote: str) -> set[str]:
    """The checkpoint folders under ``remote`` whose ``.complete`` marker was written."""
    found = set()
    for key in keys:
        parts = key[len(remote) + 1 :].split("/")
        if len(parts) == 2 and parts[1] == COMPLETE and parts[0].startswith(CHECKPOINT_PREFIX):
            found.add(parts[0])
    return found


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, default=_json_default) + "\n").encode()


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
