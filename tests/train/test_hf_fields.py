"""Every field of the installed ``transformers.TrainingArguments``: known to hpsweep, accepted at
its default (as a keyword and in a converted transformers instance), and at another value honoured,
mapped, accepted or refused in one line as ``hpsweep.train.hf_compat.fields.FIELDS`` says, which the
table in docs/huggingface.md shows."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import hpsweep
from hpsweep import TrainingArguments, UserError
from hpsweep.train.hf_compat import fields as hf_fields
from hpsweep.train.hf_compat.fields import ACCEPTED, FIELDS, HONOURED, MAPPED, REFUSED

HF_PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
THEIRS = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
OURS = {f.name for f in dataclasses.fields(TrainingArguments)}


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def other_than(default: Any) -> Any:
    """A value that is not ``default``, of a kind the field takes."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, str):
        return default + "x"
    return "x"


def fates(fate: str) -> list[str]:
    return [name for name, (f, _, _) in FIELDS.items() if f == fate and name in THEIRS]


def test_every_transformers_field_is_known_to_hpsweep_with_its_default() -> None:
    unknown = sorted(set(THEIRS) - OURS - set(FIELDS))
    assert not unknown, (
        f"add these transformers fields to hpsweep.train.hf_compat.fields.FIELDS: {unknown}"
    )
    for name, (fate, default, why) in FIELDS.items():
        assert (name in OURS) == (fate in (HONOURED, MAPPED)), name
        assert why and "\n" not in why and "|" not in why, name
        if name in THEIRS:
            assert hf_fields.same(default_of(THEIRS[name]), default), name


def test_every_field_at_its_default_is_accepted_as_a_keyword_one_by_one_and_all_at_once() -> None:
    defaults = {name: default_of(f) for name, f in THEIRS.items()}
    for name, value in defaults.items():
        TrainingArguments(**{name: value})
    args = TrainingArguments(**defaults)  # a script that spells out transformers' defaults
    assert (args.output_dir, args.save_strategy, args.save_steps) == (
        "hpsweep-output",
        "steps",
        500,
    )
    assert args.activation_checkpointing is False and args.eval_strategy == "no"
    assert TrainingArguments(eval_strategy="steps", logging_steps=20).eval_steps == 20


def test_a_transformers_instance_at_its_defaults_or_with_hub_fields_converts(
    tmp_path: Path,
) -> None:
    assert (
        hpsweep.Trainer(
            model_init=Net, args=transformers.TrainingArguments(str(tmp_path))
        ).args.save_steps
        == 500
    )
    token = "hf_" + "s3cret" * 6
    hf_args = transformers.TrainingArguments(
        str(tmp_path),
        hub_model_id="me/model",
        hub_token=token,
        hub_strategy="end",
        hub_private_repo=True,
        report_to="none",
    )
    args = hpsweep.Trainer(model_init=Net, args=hf_args).args
    assert args.output_dir == str(tmp_path)
    assert (args.hub_model_id, args.hub_strategy, args.hub_private_repo) == (
        "me/model",
        "end",
        True,
    )
    # the token is there for the push, and nowhere the arguments are written or logged
    shown = repr(args) + json.dumps(args.to_dict(), default=str) + args.to_json_string()
    shown += json.dumps(args.to_sanitized_dict())
    assert args.hub_token == token and token not in shown and "hub_token" not in args.to_dict()


@pytest.mark.parametrize("name", fates(ACCEPTED))
def test_an_accepted_field_takes_another_value(name: str) -> None:
    TrainingArguments(**{name: other_than(FIELDS[name][1])})


def test_accepted_fields_set_in_a_transformers_instance_convert(tmp_path: Path) -> None:
    hf_args = transformers.TrainingArguments(
        str(tmp_path),
        log_level="info",
        logging_nan_inf_filter=False,
        skip_memory_metrics=False,
        include_num_input_tokens_seen="all",
        eval_accumulation_steps=2,
        torch_empty_cache_steps=4,
        resume_from_checkpoint=str(tmp_path / "checkpoint-1"),
        ddp_timeout=60,
        report_to="none",
    )
    assert hpsweep.Trainer(model_init=Net, args=hf_args).args.output_dir == str(tmp_path)


@pytest.mark.parametrize("name", fates(REFUSED))
def test_a_refused_field_at_another_value_is_one_line_saying_why_and_what_to_use(name: str) -> None:
    value = other_than(FIELDS[name][1])
    with pytest.raises(UserError) as info:
        TrainingArguments(**{name: value})
    message = str(info.value)
    assert "\n" not in message and f"{name}={value!r}" in message, message
    assert FIELDS[name][2] in message


@pytest.mark.parametrize(
    "setting",
    [
        dict(eval_use_gather_object=True),
        dict(enable_jit_checkpoint=True),
        dict(debug="underflow_overflow"),
    ],
)
def test_a_refused_field_in_a_transformers_instance_is_one_line(tmp_path: Path, setting) -> None:
    hf_args = transformers.TrainingArguments(str(tmp_path), report_to="none", **setting)
    with pytest.raises(UserError) as info:
        hpsweep.Trainer(model_init=Net, args=hf_args)
    (name,) = setting
    assert "\n" not in str(info.value) and name in str(info.value)


def test_the_docs_field_table_is_the_code_table() -> None:
    assert hf_fields.markdown_table() in HF_PAGE.read_text(), (
        "docs/huggingface.md's table of transformers fields differs from hpsweep.train.hf_compat.fields.FIELDS; "
        "paste the output of `python -m hpsweep.train.hf_compat.fields` in its place"
    )


def run_args(out: Path, **fields: Any) -> TrainingArguments:
    """Arguments of a short training run in batches of 8 that evaluates and saves nothing."""
    quiet = dict(eval_strategy="no", save_strategy="no", disable_progress=True)
    return TrainingArguments(str(out), per_device_train_batch_size=8, **{**quiet, **fields})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x, labels):
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class PidRecording(torch.utils.data.Dataset):
    """Samples that write the id of the process loading them to ``log``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        with self.log.open("a") as out:
            out.write(f"{os.getpid()}\n")
        return self.x[i], int(self.x[i, 0] > 0)


def worker_pids(tmp_path: Path, persistent: bool) -> set[str]:
    """The worker processes that loaded two epochs of training data."""
    log = tmp_path / f"pids-{persistent}"
    args = run_args(
        tmp_path / str(persistent),
        num_train_epochs=2,
        dataloader_num_workers=1,
        dataloader_persistent_workers=persistent,
        dataloader_prefetch_factor=3,
        dataloader_multiprocessing_context="fork",
        dataloader_in_order=persistent,
    )
    trainer = hpsweep.Trainer(model_init=Net, args=args, train_dataset=PidRecording(log))
    loader = trainer.get_train_dataloader()
    assert (loader.persistent_workers, loader.prefetch_factor) == (persistent, 3)
    assert loader.in_order is persistent
    assert loader.multiprocessing_context is multiprocessing.get_context("fork")
    log.unlink(missing_ok=True)
    assert trainer.train().global_step == 8
    return set(log.read_text().split())


def test_dataloader_worker_fields_reach_the_training_loader(tmp_path: Path) -> None:
    # persistent workers load both epochs in one process; others start new ones each epoch
    assert len(worker_pids(tmp_path, persistent=True)) == 1
    assert len(worker_pids(tmp_path, persistent=False)) == 2
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    plain = TrainingArguments(str(tmp_path), dataloader_prefetch_factor=3)  # no workers: unused
    assert hpsweep.Trainer(model_init=Net, args=plain, train_dataset=data).get_train_dataloader()
    with pytest.raises(UserError, match="dataloader_multiprocessing_context='spwan'.*'spawn'"):
        TrainingArguments(dataloader_multiprocessing_context="spwan")


class Poisoned(nn.Module):
    """`Net` whose loss is NaN on the batches holding a NaN ``poison`` (gradients stay finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x, labels, poison):
        logits = self.linear(x)
        loss = nn.functional.cross_entropy(logits, labels) + poison.sum()
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter_logs_a_nan_step_as_its_intervals_mean(
    tmp_path: Path, nan_filter: bool
) -> None:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    poison = torch.zeros(32)
    poison[12] = float("nan")  # in the second batch of 8
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long(), poison)
    args = run_args(
        tmp_path,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        logging_strategy="steps",
        logging_steps=2,
        logging_nan_inf_filter=nan_filter,
    )
    trainer = hpsweep.Trainer(model_init=Poisoned, args=args, train_dataset=data)
    out = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and math.isfinite(losses[1])
    assert math.isfinite(losses[0]) == nan_filter and math.isfinite(out.training_loss) == nan_filter


class Tokens(nn.Module):
    """A classifier over token ids, as a language model takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.head((self.embed(input_ids) * attention_mask[..., None]).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def token_samples() -> list[dict[str, Any]]:
    """16 samples of 6 token ids, of which the first 3 + i % 4 are not padding."""
    return [
        {
            "input_ids": torch.arange(6) % 10,
            "attention_mask": (torch.arange(6) < 3 + i % 4).long(),
            "labels": i % 2,
        }
        for i in range(16)
    ]


@pytest.mark.parametrize(
    "count, per_epoch", [("all", 16 * 6), ("non_padding", 4 * (3 + 4 + 5 + 6))]
)
def test_include_num_input_tokens_seen_counts_and_logs_the_input_tokens(
    tmp_path: Path, count: str, per_epoch: int
) -> None:
    args = run_args(tmp_path, num_train_epochs=2, include_num_input_tokens_seen=count)
    trainer = hpsweep.Trainer(model_init=Tokens, args=args, train_dataset=token_samples())
    trainer.train()
    assert trainer.state.num_input_tokens_seen == 2 * per_epoch
    seen = [log["num_input_tokens_seen"] for log in trainer.state.log_history if "loss" in log]
    assert seen == [per_epoch, 2 * per_epoch]  # one log per epoch
    assert (
        TrainingArguments(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    )


def test_include_num_input_tokens_seen_without_token_ids_is_one_line(tmp_path: Path) -> None:
    x = torch.randn(8, 4)
    args = TrainingArguments(
        str(tmp_path), include_num_input_tokens_seen="all", disable_progress=True
    )
    data = torch.utils.data.TensorDataset(x, torch.zeros(8, dtype=torch.long))
    with pytest.raises(UserError, match=r"^include_num_input_tokens_seen='all'.*'input_ids'"):
        hpsweep.Trainer(model_init=Net, args=args, train_dataset=data).train()


@pytest.fixture
def log_levels():
    """hpsweep's and transformers' log levels, put back as they were after the test."""
    saved = logging.getLogger("hpsweep").level, transformers.logging.get_verbosity()
    yield
    logging.getLogger("hpsweep").setLevel(saved[0])
    transformers.logging.set_verbosity(saved[1])


def test_log_level_sets_hpsweep_and_transformers_logs_and_passive_leaves_them(
    tmp_path: Path, log_levels
) -> None:
    hpsweep.Trainer(model_init=Net, args=TrainingArguments(str(tmp_path), log_level="debug"))
    assert logging.getLogger("hpsweep.hub").isEnabledFor(logging.DEBUG)
    assert transformers.logging.get_verbosity() == logging.DEBUG
    hf_args = transformers.TrainingArguments(str(tmp_path), log_level="error", report_to="none")
    hpsweep.Trainer(model_init=Net, args=hf_args)
    assert not logging.getLogger("hpsweep.hub").isEnabledFor(logging.WARNING)
    assert transformers.logging.get_verbosity() == logging.ERROR
    hpsweep.Trainer(model_init=Net, args=TrainingArguments(str(tmp_path)))  # passive
    assert transformers.logging.get_verbosity() == logging.ERROR
    with pytest.raises(UserError, match="log_level='loud' is not one of detail, debug"):
        TrainingArguments(log_level="loud")


def test_skip_memory_metrics_false_reports_a_runs_and_an_evaluations_memory(tmp_path: Path) -> None:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    names = {f"mem_cpu_{kind}_delta" for kind in ("alloc", "peaked")}
    for skip in (True, False):
        args = run_args(tmp_path / str(skip), skip_memory_metrics=skip, eval_strategy="epoch")
        trainer = hpsweep.Trainer(model_init=Net, args=args, train_dataset=data, eval_dataset=data)
        out, metrics = trainer.train(), trainer.evaluate()
        during = [log for log in trainer.state.log_history if "eval_loss" in log]
        assert not any(k.startswith("eval_mem") for k in during[0])  # counted in the run's
        train = {k.removeprefix("train_") for k in out.metrics if k.startswith("train_mem")}
        evaluation = {k.removeprefix("eval_") for k in metrics if k.startswith("eval_mem")}
        assert train == evaluation == (set() if skip else names)
        if not skip:
            assert all(isinstance(out.metrics[f"train_{n}"], int) for n in names)
            assert out.metrics["train_mem_cpu_peaked_delta"] >= 0


def test_tf32_and_torch_empty_cache_steps_train_on_a_cpu_changing_nothing(tmp_path: Path) -> None:
    """On a GPU they switch TF32 and empty the cache (not testable here); on a CPU they are taken
    and the run trains what it trains without them."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    precision = torch.backends.cuda.matmul.fp32_precision
    weights = []
    for fields in ({}, {"tf32": True, "torch_empty_cache_steps": 1}):
        trainer = hpsweep.Trainer(
            model_init=Net, args=run_args(tmp_path / str(len(fields)), **fields), train_dataset=data
        )
        trainer.train()
        weights.append(trainer.model.linear.weight.detach().clone())
    assert torch.equal(*weights) and torch.backends.cuda.matmul.fp32_precision == precision
    with pytest.raises(UserError, match="^torch_empty_cache_steps=0 must be > 0$"):
        TrainingArguments(torch_empty_cache_steps=0)


def test_set_and_config_files_take_transformers_fields_as_keywords_do(tmp_path: Path) -> None:
    args = TrainingArguments().with_overrides(["hub_model_id=me/model", "use_cache=true"])
    assert args.hub_model_id == "me/model" and not hasattr(args, "use_cache")
    config = tmp_path / "args.yaml"
    config.write_text("fsdp: full_shard\n")
    with pytest.raises(UserError, match=r"fsdp='full_shard' is not supported: .*--processes-per"):
        TrainingArguments.from_file(config)


@dataclasses.dataclass
class Transformers4Arguments(transformers.TrainingArguments):
    """transformers 4's token field, which transformers 5 dropped."""

    push_to_hub_token: str | None = None


def test_a_field_hpsweep_does_not_know_is_one_line_that_never_shows_a_token(tmp_path: Path) -> None:
    token = "hf_" + "s3cret" * 6
    hf_args = Transformers4Arguments(str(tmp_path), push_to_hub_token=token, report_to="none")
    with pytest.raises(UserError) as info:
        hpsweep.Trainer(model_init=Net, args=hf_args)
    assert "push_to_hub_token=a token" in str(info.value) and token not in str(info.value)


def labelled(n: int = 30) -> torch.utils.data.TensorDataset:
    """``n`` samples whose label is the sign of their first feature."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def accuracy(p) -> dict[str, float]:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def evaluator(out: Path, compute_metrics, **fields: Any) -> hpsweep.Trainer:
    """A Trainer over the same untrained model every time, evaluating `labelled` in batches of 8
    (8, 8, 8 and 6 samples)."""
    torch.manual_seed(0)
    args = run_args(out, per_device_eval_batch_size=8, **fields)
    return hpsweep.Trainer(
        model=Net(), args=args, eval_dataset=labelled(), compute_metrics=compute_metrics
    )


def test_batch_eval_metrics_calls_compute_metrics_per_batch_and_reports_its_last_call(
    tmp_path: Path,
) -> None:
    whole = evaluator(tmp_path / "whole", accuracy).evaluate()
    calls, counts = [], {"right": 0, "all": 0}

    def running_accuracy(p, compute_result: bool):
        calls.append((type(p.predictions), len(p.label_ids), compute_result))
        counts["right"] += int((p.predictions.argmax(-1) == p.label_ids).sum())
        counts["all"] += len(p.label_ids)
        if compute_result:
            return {"accuracy": counts["right"] / counts["all"]}

    trainer = evaluator(tmp_path / "batched", running_accuracy, batch_eval_metrics=True)
    batched = trainer.evaluate()
    # each batch's gathered tensors, as transformers hands them, the last one flagged
    assert calls == [(torch.Tensor, 8, False)] * 3 + [(torch.Tensor, 6, True)]
    assert batched["eval_accuracy"] == whole["eval_accuracy"]
    assert batched["eval_loss"] == whole["eval_loss"]
    assert trainer.state.log_history[-1]["eval_accuracy"] == whole["eval_accuracy"]
    with pytest.raises(UserError, match=r"^batch_eval_metrics=True .*compute_result parameter"):
        evaluator(tmp_path / "refused", accuracy, batch_eval_metrics=True)


def test_eval_do_concat_batches_false_hands_over_one_array_per_batch(tmp_path: Path) -> None:
    seen = []

    def per_batch(p):
        seen.append(p)
        return {"batches": len(p.predictions)}

    include = dict(include_for_metrics=["inputs", "loss"])
    joined = evaluator(tmp_path / "joined", per_batch, **include)
    joined.evaluate()
    trainer = evaluator(tmp_path / "lists", per_batch, eval_do_concat_batches=False, **include)
    assert trainer.evaluate()["eval_batches"] == 4
    whole, lists = seen
    for name in ("predictions", "label_ids", "inputs", "losses"):
        parts = getattr(lists, name)
        assert isinstance(parts, list) and [len(a) for a in parts] == [8, 8, 8, 6], name
        assert (
            torch.tensor(getattr(whole, name)) == torch.cat(list(map(torch.tensor, parts)))
        ).all()
    predicted = trainer.predict(labelled())
    assert isinstance(predicted.predictions, list) and len(predicted.label_ids) == 4


def test_eval_accumulation_steps_moves_predictions_in_groups_with_the_same_result(
    tmp_path: Path,
) -> None:
    runs_ = [
        evaluator(tmp_path / str(steps), accuracy, eval_accumulation_steps=steps)
        for steps in (None, 3)
    ]
    (plain, grouped) = (trainer.evaluate() for trainer in runs_)
    assert timeless(plain) == timeless(grouped)
    predictions = [trainer.predict(labelled()).predictions for trainer in runs_]
    assert predictions[0].shape == (30, 2) and (predictions[0] == predictions[1]).all()
    with pytest.raises(UserError, match="^eval_accumulation_steps=0 must be > 0$"):
        TrainingArguments(eval_accumulation_steps=0)


def timeless(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}


class IndexLogging(torch.utils.data.Dataset):
    """`labelled` samples that append the index of each one read to ``read``."""

    def __init__(self, n: int) -> None:
        self.data, self.read = labelled(n), []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.read.append(i)
        return self.data[i]


def test_resume_from_checkpoint_in_the_arguments_and_ignore_data_skip(tmp_path: Path) -> None:
    data = IndexLogging(32)  # 4 batches of 8 an epoch, read in order
    steps = dict(num_train_epochs=2, train_sampling_strategy="sequential")
    saving = dict(save_strategy="steps", save_steps=3)
    full = hpsweep.Trainer(
        model_init=Net, args=run_args(tmp_path / "full", **steps, **saving), train_dataset=data
    )
    full.train()
    checkpoint = str(tmp_path / "full" / "checkpoint-3")  # three batches into the first epoch
    weights = {}
    for ignore in (False, True):
        data.read.clear()
        args = run_args(
            tmp_path / str(ignore),
            **steps,
            resume_from_checkpoint=checkpoint,
            ignore_data_skip=ignore,
        )
        resumed = hpsweep.Trainer(model_init=Net, args=args, train_dataset=data)
        assert resumed.train().global_step == 8  # train() resumed from the arguments' checkpoint
        weights[ignore] = resumed.model.linear.weight.detach()
        if ignore:  # the first epoch again from its first batch
            assert data.read[:32] == list(range(32))
        else:  # on from the fourth batch, then the second epoch
            assert data.read[:40] == list(range(24, 32)) + list(range(32))
    assert torch.equal(weights[False], full.model.linear.weight.detach())  # the same run, resumed
    assert not torch.equal(weights[True], weights[False])


def test_a_single_train_with_push_to_hub_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    args = run_args(tmp_path / "out", push_to_hub=True, hub_model_id="me/model")
    trainer = hpsweep.Trainer(model_init=Net, args=args, train_dataset=labelled())
    with pytest.raises(UserError) as info:
        trainer.train()
    assert "\n" not in str(info.value) and "PushToHubCallback" in str(info.value)
    assert not (tmp_path / "out").exists()
