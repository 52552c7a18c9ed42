"""Publish to the Hugging Face Hub: the sweep's best run with a model card, or checkpoints during training.

    $ hpsweep push out --repo-id me/tiny-mlp            # after a sweep
    $ hpsweep run space.py --push-to-hub me/tiny-mlp    # at the end of a sweep

    >>> trainer = Trainer(..., callbacks=[PushToHubCallback("me/tiny-mlp", every=500)])

The token comes from where ``huggingface_hub`` looks (``HF_TOKEN``, ``hf auth login``); it is
never taken from the command line, printed, or written into the card. ``HF_ENDPOINT`` points the
client at another Hub. Failures (a bad token, no network) are one line naming the fix.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.redaction import is_secret_name
from hpsweep.search.job import SweepCallback
from hpsweep.train.callbacks import TrainerCallback
from hpsweep.train.metrics import SPEED_SUFFIXES

logger = logging.getLogger("hpsweep.hub")


def push_best(
    output_dir: Path,
    repo_id: str,
    *,
    private: bool | None = False,
    revision: str | None = None,
    token: str | None = None,
) -> str:
    """Push ``output_dir/best`` (the model folder: weights, config, tokenizer) with a model card
    to ``repo_id`` (a bare name is the token's user's, as transformers names a ``hub_model_id``).

    Creates the repo (and the ``revision`` branch) when needed; ``private`` None leaves the Hub's
    default visibility. Returns the commit URL.
    """
    output_dir = Path(output_dir)
    best = runs.read_best(output_dir)
    if best is None or not (output_dir / runs.BEST_DIR).is_dir():
        raise UserError(
            f"{output_dir}: no best run to push (no best_run.json and best/); "
            "give the --output-dir of a sweep with a completed trial"
        )
    token = _token(token)
    repo_id = _full_repo_id(repo_id, token)
    chosen = best[0] if isinstance(best, list) else best
    records = runs.read_trials(output_dir)
    with tempfile.TemporaryDirectory(prefix="hpsweep-push-") as tmp:
        staging = stage_model(output_dir / runs.BEST_DIR, Path(tmp) / "model")
        card = model_card(chosen, records, staging, front=best, repo_id=repo_id)
        (staging / "README.md").write_text(card, encoding="utf-8")
        return _upload(
            staging,
            repo_id,
            private=private,
            revision=revision,
            token=token,
            message=f"hpsweep: best of {len(records)} trials ({Path(chosen.run_dir).name})",
        )


def stage_model(checkpoint: Path, staging: Path) -> Path:
    """A copy of ``checkpoint`` holding only the model's files (`runs.copy_model`: not its training
    state, and training_args.json without credentials)."""
    staging.mkdir(parents=True, exist_ok=True)
    runs.copy_model(checkpoint, staging)
    return staging


def _full_repo_id(repo_id: str, token: str) -> str:
    """``repo_id`` with its namespace: a bare name goes under the token's user."""
    if "/" in repo_id:
        return repo_id
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        return f"{api.whoami()['name']}/{repo_id}"
    except Exception as exc:
        raise push_error(exc, repo_id, api.endpoint, token) from None


def _upload(
    folder: Path,
    repo_id: str,
    *,
    private: bool | None,
    revision: str | None,
    token: str | None,
    message: str,
    create: bool = True,
) -> str:
    from huggingface_hub import HfApi

    token = _token(token)
    api = HfApi(token=token)
    try:
        if create:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=message
        )
    except UserError:
        raise
    except Exception as exc:
        raise push_error(exc, repo_id, api.endpoint, token) from None
    return str(getattr(info, "commit_url", info))


def _token(token: str | None) -> str:
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise UserError(
            "no Hugging Face token found; log in with `hf auth login` or set HF_TOKEN "
            "(a token with write access)"
        )
    return found


def push_error(exc: Exception, repo_id: str, endpoint: str, token: str | None) -> UserError:
    """One line for a failed push; the token never appears in it."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 401:
        text = (
            f"the Hugging Face Hub at {endpoint} rejected the token (401 Unauthorized); "
            "log in again with `hf auth login` or set HF_TOKEN to a valid token with write access"
        )
    elif status == 403:
        text = (
            f"the token may not write to {repo_id} (403 Forbidden); use a token with write access to that "
            "namespace, or a --repo-id under your own name"
        )
    elif status == 404:
        text = f"{repo_id} was not found on {endpoint} (404); check --repo-id and that the token can see it"
    elif status is not None:
        text = f"pushing to {repo_id} on {endpoint} failed: HTTP {status}; try again, or check the Hub's status"
    elif _is_network(exc):
        text = (
            f"cannot reach the Hugging Face Hub at {endpoint} ({type(exc).__name__}); check the network "
            "or HF_ENDPOINT, then run `hpsweep push DIR --repo-id ID` again"
        )
    else:
        first = (str(exc).splitlines() or [""])[0][:200]
        text = f"pushing to {repo_id} failed: {type(exc).__name__}: {first}"
    if token:
        text = text.replace(token, "***")
    return UserError(text)


def _is_network(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        name = type(seen).__name__
        if isinstance(seen, (ConnectionError, TimeoutError)) or name in (
            "ConnectError",
            "ConnectTimeout",
            "ReadTimeout",
            "NetworkError",
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# --- the model card ----------------------------------------------------------------------------------------


def model_card(
    best: runs.BestRun,
    records: Sequence[runs.TrialRecord],
    folder: Path,
    front: Any = None,
    repo_id: str = "REPO_ID",
) -> str:
    """README.md: the metadata block ``best/``'s card has (library, pipeline tag, the objective as
    an evaluation result, the trial; `runs.card_metadata`) with the model's metrics and the sweep's
    size, then the top trials, the best trial's evaluations and how to load it from ``repo_id``."""
    from huggingface_hub import ModelCard

    kind = runs.model_kind_of(folder)
    states = [r.state for r in records]
    data = runs.card_metadata(
        best,
        kind,
        name=repo_id,
        metrics=_model_metrics(best.run_summary.get("metrics") or {}),
        n_trials=len(records),
        n_complete=states.count("complete"),
        n_pruned=states.count("pruned"),
        n_failed=states.count("failed"),
        backend=best.run_summary.get("backend") or (records[0].backend if records else None),
    )
    body = _card_body(best, records, data.hpsweep, front)
    body += ["## Use", "", *runs.card_usage(kind, repo_id, hub=True)]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"))


def _model_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The model's metrics: how fast this machine evaluated is no property of the model
    (transformers' cards agree)."""
    return {
        k: v
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not k.endswith(SPEED_SUFFIXES)
    }


def _card_body(
    best: runs.BestRun, records: Sequence[runs.TrialRecord], meta: dict[str, Any], front: Any
) -> list[str]:
    """The card's sections before its usage: the result, hyperparameters, metrics, the sweep."""
    objective, states = meta["objective"], [r.state for r in records]
    directions = objective["direction"].split(",")
    body = [
        f"# {meta['best_run']}: best of a {len(records)}-trial hyperparameter sweep",
        "",
        f"Found by [hpsweep](https://pypi.org/project/hpsweep/) ({meta['backend']} backend): "
        f"**{objective['name']} = {_fmt(best.objective)}** ({', '.join(directions)}), "
        f"trial {meta['best_trial']}.",
        "",
        "## Hyperparameters",
        "",
        _table(["parameter", "value"], list(meta["hyperparameters"].items())),
        "",
        "## Metrics",
        "",
        _table(["metric", "value"], list(meta["metrics"].items())),
        "",
        "## Sweep",
        "",
        f"{len(records)} trials: {states.count('complete')} complete, "
        f"{states.count('pruned')} pruned, {states.count('failed')} failed.",
        "",
        top_trials(records, directions),
        "",
    ]
    if isinstance(front, list) and len(front) > 1:
        body += [f"This is one of {len(front)} runs on the Pareto front.", ""]
    trial = next((r for r in records if r.id == best.run_id), None)
    return body + ["## Evaluations", "", evaluation_log(trial), ""]


def top_trials(records: Sequence[runs.TrialRecord], directions: Sequence[str], n: int = 10) -> str:
    done = [r for r in records if r.state == "complete" and isinstance(r.objective, (int, float))]
    done.sort(key=lambda r: r.objective, reverse=directions[0] == "maximize")  # type: ignore[arg-type,return-value]
    names = sorted({k for r in done for k in r.params if not is_secret_name(k)})
    rows = [
        [
            r.number,
            Path(r.run_dir).name,
            r.objective,
            *(r.params.get(k, "") for k in names),
            f"{r.duration_s:.1f}s" if r.duration_s is not None else "",
        ]
        for r in done[:n]
    ]
    title = f"Top {min(n, len(done))} trials"
    return f"### {title}\n\n" + _table(
        ["#", "run", records[0].objective_name if records else "objective", *names, "time"], rows
    )


def evaluation_log(record: runs.TrialRecord | None) -> str:
    """The trial's evaluations during training (its record's history), one row each: what the
    card shows of training, the same from every home (``trainer_state.json`` stays in the
    trial's checkpoints)."""
    rows = [_model_metrics(h) for h in (record.history if record else [])]
    if not rows:
        return "The trial recorded no evaluation during training."
    keys = sorted(
        {k for h in rows for k in h if k not in ("step", "epoch") and not is_secret_name(k)}
    )
    return _table(
        ["step", "epoch", *keys],
        [[h.get("step"), h.get("epoch"), *(h.get(k, "") for k in keys)] for h in rows],
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


# --- pushing from a sweep and during training ------------------------------------------------------------


class PushBestAtEnd(SweepCallback):
    """``hpsweep run --push-to-hub ID`` (or ``push_to_hub=True`` in the arguments): push the best
    run once the sweep is done (not after Ctrl-C).

    ``token`` (the arguments' ``hub_token``; None: the login's) stays in this process: it is left
    out when the callback travels to the processes that run trials, and never shown."""

    def __init__(
        self,
        repo_id: str,
        *,
        private: bool | None = False,
        revision: str | None = None,
        token: str | None = None,
    ) -> None:
        self.repo_id, self.private, self.revision = repo_id, private, revision
        self._token = token

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_token": None}

    def on_sweep_begin(self, settings: Any) -> None:
        _token(self._token)  # no token: say so before training, not after
        self.output_dir = Path(settings.output_dir)

    def on_sweep_end(self, best: Any, records: list[Any], interrupted: bool) -> None:
        if interrupted or best is None:
            return
        try:
            url = push_best(
                self.output_dir,
                self.repo_id,
                private=self.private,
                revision=self.revision,
                token=self._token,
            )
        except UserError as exc:
            raise UserError(
                f"the sweep is done, but the push failed: {exc} (retry with "
                f"`hpsweep push {self.output_dir} --repo-id {self.repo_id}`)"
            ) from None
        print(f"pushed the best run to {url}")


class PushToHubCallback(TrainerCallback):
    """Push the latest checkpoint's model to the Hub while training goes on.

    At the first checkpoint saved after each epoch (``every="epoch"``) or after every ``every``
    steps, the model files are copied aside and uploaded in a background thread; a push that
    comes while the previous upload still runs is skipped. `on_train_end` pushes the final
    checkpoint and waits for it. Pushes need checkpoints: set ``save_strategy``.

    Args:
        repo_id: the model repo (created if needed).
        every: ``"epoch"`` or a number of steps.
        private: create the repo as private.
        revision: push to this branch (created if needed).
    """

    def __init__(
        self,
        repo_id: str,
        *,
        every: str | int = "epoch",
        private: bool = False,
        revision: str | None = None,
    ) -> None:
        if every != "epoch" and not (isinstance(every, int) and every > 0):
            raise UserError(
                f"PushToHubCallback(every={every!r}): give 'epoch' or a positive number of steps"
            )
        self.repo_id, self.every, self.private, self.revision = repo_id, every, private, revision
        self.pushed_steps: list[int] = []
        self.skipped = 0
        self._due = False
        self._last_due_step = 0
        self._future: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._error: UserError | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_future": None, "_pool": None}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from huggingface_hub import HfApi

        token = _token(None)
        api = HfApi(token=token)
        try:
            api.create_repo(self.repo_id, private=self.private, exist_ok=True)
            if self.revision:
                api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
        except Exception as exc:
            raise push_error(exc, self.repo_id, api.endpoint, token) from None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpsweep-push")

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every == "epoch":
            self._due = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if isinstance(self.every, int) and state.global_step - self._last_due_step >= self.every:
            self._due, self._last_due_step = True, state.global_step

    def on_save(
        self, args: Any, state: Any, control: Any, *, checkpoint: str, **kwargs: Any
    ) -> None:
        if self._due:
            self._due = False
            self._push(Path(checkpoint), state.global_step, wait=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait()
        latest = runs.latest_checkpoint(Path(args.output_dir))
        if latest is not None and (
            not self.pushed_steps or self.pushed_steps[-1] != state.global_step
        ):
            self._push(latest, state.global_step, wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._error is not None:
            raise self._error

    def on_exception(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _push(self, checkpoint: Path, step: int, *, wait: bool) -> None:
        if self._future is not None and not self._future.done():
            self.skipped += 1  # the previous upload still runs: training does not wait for it
            return
        self._collect()
        staging = Path(tempfile.mkdtemp(prefix="hpsweep-push-"))
        stage_model(checkpoint, staging / "model")  # the checkpoint may be rotated away meanwhile
        assert self._pool is not None
        self._future = self._pool.submit(self._upload, staging, step)
        self.pushed_steps.append(step)
        if wait:
            self._wait()

    def _upload(self, staging: Path, step: int) -> str:
        try:
            return _upload(
                staging / "model",
                self.repo_id,
                private=self.private,
                revision=self.revision,
                token=None,
                message=f"Training in progress, step {step}",
                create=False,
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _wait(self) -> None:
        if self._future is not None:
            try:
                self._future.result()
            except Exception:
                pass
            self._collect()

    def _collect(self) -> None:
        """Record the outcome of the finished upload: one warning for the first failure."""
        future, self._future = self._future, None
        if future is None or not future.done():
            self._future = future
            return
        exc = future.exception()
        if exc is None:
            self._error = None  # only the last push's failure fails training
        else:
            error = (
                exc
                if isinstance(exc, UserError)
                else UserError(f"pushing to {self.repo_id} failed: {exc}")
            )
            if self._error is None:
                logger.warning(f"hpsweep: warning: {error}")
            self._error = error
