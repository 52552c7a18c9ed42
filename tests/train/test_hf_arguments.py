"""TrainingArguments as a Hugging Face user writes them: transformers' names, a transformers
instance, subclasses with their own fields, and transformers' optimizer names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hpsweep
import hpsweep.train.hf_compat.args
import hpsweep.train.optim
from hpsweep import TrainingArguments, UserError
from hpsweep.train.arguments import apply_params
from hpsweep.train.optim import create_optimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(
        x, (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
    )


def test_transformers_names_mean_what_they_mean_there() -> None:
    args = TrainingArguments(
        "out",
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        disable_tqdm=True,
        report_to="none",
        remove_unused_columns=False,
        label_names=["target"],
        evaluation_strategy="steps",
        eval_steps=5.0,
        save_strategy="steps",
        save_steps=10,
        metric_for_best_model="accuracy",
        run_name="baseline",
        logging_dir="out/logs",
        include_inputs_for_metrics=True,
        warmup_steps=0.1,
        do_train=True,
    )
    assert (args.train_batch_size, args.eval_batch_size) == (16, 32)
    assert args.disable_progress and args.disable_tqdm
    assert (args.eval_strategy, args.eval_steps) == (
        "steps",
        5,
    )  # transformers 4's name, a whole float
    assert args.metric_for_best_model == "eval_accuracy" and args.greater_is_better is True
    assert TrainingArguments(metric_for_best_model="loss").greater_is_better is False
    assert args.include_for_metrics == ["inputs"] and args.label_names == ["target"]
    assert args.warmup_for(200) == 20  # transformers 5: warmup_steps below 1 is a ratio
    # Our name for the same setting wins over the alias' old value when changed.
    assert args.replace(disable_progress=False).disable_tqdm is False


def test_warmup_ratio_none_of_transformers_5_0_to_5_14_is_no_warmup() -> None:
    # those releases default warmup_ratio to None (deprecated): a converted instance carries it
    ours = TrainingArguments("out", warmup_ratio=None)
    assert ours.warmup_ratio == 0.0 and ours.warmup_for(100) == 0
    assert TrainingArguments("out", warmup_ratio=None, warmup_steps=0.1).warmup_for(100) == 10


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(learning_rte=1e-3), ["'learning_rte'", "did you mean 'learning_rate'"]),
        (dict(deepspeed="ds.json"), ["deepspeed='ds.json'", "--processes-per-trial"]),
        (
            dict(push_to_hub=True, hub_strategy="checkpoint"),
            ["hub_strategy='checkpoint' with push_to_hub=True", "'end'"],
        ),
        (dict(hub_strategy="never"), ["hub_strategy='never'", "every_save, end"]),
        (
            dict(torch_compile_backend="inductr"),
            ["torch_compile_backend='inductr'", "did you mean 'inductor'"],
        ),
        (dict(torch_compile_mode="fast"), ["torch_compile_mode='fast'", "max-autotune"]),
        (dict(label_smoothing_factor=1.0), ["label_smoothing_factor=1.0", "[0, 1)"]),
        (dict(eval_steps=0.25, eval_strategy="steps"), ["eval_steps=0.25", "whole number"]),
        (dict(optim="lion"), ["optim='lion'", "adamw_torch"]),
        (dict(save_strategy="best"), ["save_strategy='best'", "no, steps, epoch"]),
    ],
)
def test_what_hpsweep_does_not_support_is_one_line_naming_it(
    kwargs: dict, needles: list[str]
) -> None:
    with pytest.raises(UserError) as info:
        TrainingArguments(**kwargs)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_report_to_names_a_sweep_feeds_are_accepted_quietly() -> None:
    import warnings

    with warnings.catch_warnings():
        # what each one feeds, and the names refused: tests/integrations/test_report_to.py
        warnings.simplefilter("error")
        assert TrainingArguments(report_to="all").report_to == "all"
        assert TrainingArguments(report_to=["mlflow", "wandb"]).report_to == ["mlflow", "wandb"]


@dataclasses.dataclass
class RegressionArguments(TrainingArguments):
    a: float = 0.0
    tag: str = "x"


def test_a_subclass_with_its_own_fields_is_cast_replaced_and_searched() -> None:
    args = RegressionArguments("out", a=1, tag=3, learning_rate="0.1")
    assert (args.a, args.tag, args.learning_rate) == (1.0, "3", 0.1)
    copy = apply_params(args, {"a": 2, "learning_rate": 0.5, "hidden": 8})
    assert type(copy) is RegressionArguments and (copy.a, copy.learning_rate) == (2.0, 0.5)
    with pytest.raises(UserError, match="'c' is not a field"):
        RegressionArguments(c=1)


def test_a_transformers_training_arguments_is_converted_by_field_name(tmp_path: Path) -> None:
    import transformers
    from transformers.trainer_utils import IntervalStrategy

    hf_args = transformers.TrainingArguments(
        str(tmp_path),
        learning_rate=0.05,
        per_device_train_batch_size=32,
        eval_strategy=IntervalStrategy.EPOCH,
        save_strategy="epoch",
        num_train_epochs=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        optim="sgd",
        disable_tqdm=True,
        report_to="none",
        seed=3,
        remove_unused_columns=False,
    )
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=hf_args,
        train_dataset=data(64, 1),
        eval_dataset=data(32, 2),
        compute_metrics=lambda p: {
            "accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())
        },
    )
    args = trainer.args
    assert isinstance(args, TrainingArguments)
    assert (
        args.learning_rate,
        args.per_device_train_batch_size,
        args.eval_strategy,
        args.optim,
        args.seed,
    ) == (0.05, 32, "epoch", "sgd", 3)
    assert (
        args.metric_for_best_model == "eval_accuracy"
        and args.greater_is_better
        and args.disable_progress
    )
    out = trainer.train()
    assert out.global_step == 4 and out.metrics["eval_accuracy"] == trainer.state.best_metric
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)


def test_a_transformers_setting_hpsweep_cannot_honour_is_refused_naming_it(tmp_path: Path) -> None:
    import transformers

    hf_args = transformers.TrainingArguments(
        str(tmp_path), enable_jit_checkpoint=True, report_to="none"
    )
    with pytest.raises(UserError) as info:
        hpsweep.Trainer(model_init=Net, args=hf_args)
    message = str(info.value)
    assert "enable_jit_checkpoint=True" in message and "save_strategy checkpoint" in message
    compiled = transformers.TrainingArguments(
        str(tmp_path), torch_compile_mode="max-autotune", report_to="none"
    )
    args = hpsweep.Trainer(model_init=Net, args=compiled).args  # converted: compiling is supported
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (
        True,
        "inductor",
        "max-autotune",
    )
    # --set turns it off, though a backend was named
    off = args.with_overrides(["torch_compile=false"])
    assert (off.torch_compile, off.torch_compile_backend, off.torch_compile_mode) == (
        False,
        None,
        None,
    )
    with pytest.raises(
        UserError, match=r"Trainer\(args=...\) is a dict; use hpsweep.TrainingArguments"
    ):
        hpsweep.Trainer(model_init=Net, args={"learning_rate": 0.1})


@pytest.mark.parametrize(
    "optim, expected",
    [
        ("adamw_torch", "AdamW"),
        ("adamw_torch_fused", "AdamW"),
        ("adamw_hf", "AdamW"),
        ("sgd", "SGD"),
        ("adagrad", "Adagrad"),
        ("rmsprop", "RMSprop"),
        ("RMSprop", "RMSprop"),
        ("SGD", "SGD"),
        ("Adam", "Adam"),
        ("AdamW", "AdamW"),
        ("adafactor", "Adafactor"),
    ],
)
def test_optim_takes_transformers_and_torch_names(optim: str, expected: str) -> None:
    args = TrainingArguments(optim=optim, learning_rate=0.01, weight_decay=0.1, momentum=0.9)
    optimizer = create_optimizer(Net(), args)
    assert type(optimizer).__name__ == expected
    decays = sorted(g["weight_decay"] for g in optimizer.param_groups)
    assert decays == [0.0, 0.1]  # no decay on biases and norms, as transformers does
    if optim == "adafactor":
        assert type(optimizer).__module__.startswith("transformers")


def test_an_optuna_style_optimizer_name_trains(tmp_path: Path) -> None:
    args = TrainingArguments(
        str(tmp_path),
        optim="RMSprop",
        learning_rate=1e-2,
        num_train_epochs=1,
        per_device_train_batch_size=16,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = hpsweep.Trainer(
        model=Net(), args=args, train_dataset=data(64, 1), eval_dataset=data(32, 2)
    )
    out = trainer.train()
    assert out.global_step == 4 and isinstance(trainer.optimizer.optimizer, torch.optim.RMSprop)


PROCESS = (
    "device",
    "n_gpu",
    "world_size",
    "process_index",
    "local_process_index",
    "should_log",
    "should_save",
)


def test_code_written_for_transformers_reads_its_process_from_the_arguments(tmp_path: Path) -> None:
    import transformers

    theirs = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    ours = TrainingArguments(str(tmp_path), use_cpu=True)
    assert {name: getattr(ours, name) for name in PROCESS} == {
        name: getattr(theirs, name) for name in PROCESS
    }
    # one process: the block just runs
    with ours.main_process_first(desc="dataset map pre-processing"):
        prepared = data(64, 1)
    assert json.loads(ours.to_json_string()) == ours.to_dict()
    sanitized = ours.to_sanitized_dict()
    # transformers' form
    assert sanitized["train_batch_size"] == 8 and sanitized["label_names"] == "None"
    assert set(sanitized) == set(ours.to_dict()) | {"train_batch_size", "eval_batch_size"}

    seen = []

    class OnDevice(hpsweep.TrainerCallback):  # what a callback written for transformers reads
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append(
                (args.device, next(model.parameters()).device, args.should_save, args.world_size)
            )

    trainer = hpsweep.Trainer(
        model_init=Net,
        args=TrainingArguments(str(tmp_path), num_train_epochs=1),
        train_dataset=prepared,
        eval_dataset=data(32, 2),
        callbacks=[OnDevice()],
    )
    trainer.train()
    ((device, model_device, should_save, world_size),) = seen
    assert device.type == model_device.type and should_save and world_size == 1


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("linear", None),
        ("cosine", None),
        ("cosine", {"num_cycles": 1.5}),
        ("constant", None),
        ("constant_with_warmup", None),
        ("polynomial", None),
        ("polynomial", {"power": 2.0, "lr_end": 1e-3}),
        ("cosine_with_restarts", None),
        ("cosine_with_restarts", {"num_cycles": 3}),
    ],
)
def test_learning_rate_schedules_are_transformers_to_the_bit(
    kind: str, kwargs: dict | None
) -> None:
    from transformers import get_scheduler

    total, warmup = 20, 3
    args = TrainingArguments(
        "out",
        learning_rate=0.1,
        lr_scheduler_type=kind,
        lr_scheduler_kwargs=kwargs,
        warmup_steps=warmup,
    )
    ours, theirs = (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for _ in range(2))
    schedules = (
        hpsweep.train.optim.create_scheduler(ours, args, total),
        get_scheduler(
            kind,
            theirs,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs=kwargs,
        ),
    )
    curves: tuple[list, list] = ([], [])
    for _ in range(total + 2):
        for curve, schedule in zip(curves, schedules):
            curve.append(schedule.get_last_lr()[0])
            schedule.optimizer.step()
            schedule.step()
    assert curves[0] == curves[1]


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (
            dict(lr_scheduler_type="linear", lr_scheduler_kwargs={"num_cycles": 2}),
            ["num_cycles=2", "takes no arguments"],
        ),
        (
            dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"cycles": 2}),
            ["cycles=2", "takes num_cycles"],
        ),
        (dict(lr_scheduler_type="polynomial", lr_scheduler_kwargs='{"power": 2'), ["not JSON"]),
    ],
)
def test_lr_scheduler_kwargs_a_schedule_does_not_take_are_one_line(
    kwargs: dict, needles: list[str]
) -> None:
    with pytest.raises(UserError) as info:
        TrainingArguments("out", **kwargs)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_lr_scheduler_kwargs_come_from_a_transformers_json_string_and_set(tmp_path: Path) -> None:
    import transformers

    hf_args = transformers.TrainingArguments(
        str(tmp_path),
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs='{"num_cycles": 2}',
        report_to="none",
    )
    assert hpsweep.Trainer(model_init=Net, args=hf_args).args.lr_scheduler_kwargs == {
        "num_cycles": 2
    }
    args = TrainingArguments("out", lr_scheduler_type="polynomial").with_overrides(
        ["lr_scheduler_kwargs={power: 2}"]
    )
    assert args.lr_scheduler_kwargs == {"power": 2}


@pytest.mark.parametrize(
    "optim, optim_args",
    [
        ("sgd", "momentum=0.9, nesterov=true, dampening=0"),
        ("adagrad", "lr_decay=0.01,eps=1e-8"),
        ("rmsprop", "momentum=0.5,alpha=0.9,centered=yes"),
    ],
)
def test_optim_args_build_the_optimizer_transformers_builds(optim: str, optim_args: str) -> None:
    import transformers

    hf_args = transformers.TrainingArguments(
        "out", optim=optim, optim_args=optim_args, learning_rate=0.01, report_to="none"
    )
    model = Net()
    theirs_cls, theirs_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(hf_args, model)
    ours_cls, ours_kwargs = hpsweep.Trainer.get_optimizer_cls_and_kwargs(
        hpsweep.train.hf_compat.args.as_training_arguments(hf_args), model
    )
    assert ours_cls is theirs_cls
    ours, theirs = (
        ours_cls(model.parameters(), **ours_kwargs),
        theirs_cls(model.parameters(), **theirs_kwargs),
    )
    assert ours.defaults == theirs.defaults  # every setting of the optimizer, defaults included


def test_optim_args_that_change_nothing_say_so_and_bad_ones_are_one_line() -> None:
    with pytest.warns(UserWarning, match=r"optim_args: momentum change nothing with optim='adamw'"):
        hpsweep.train.optim.optimizer_cls_and_kwargs(
            TrainingArguments("out", optim_args="momentum=0.9")
        )
    with pytest.warns(
        UserWarning, match=r"optim_args: scale change nothing with optim='adafactor'"
    ):
        _, kwargs = hpsweep.train.optim.optimizer_cls_and_kwargs(
            TrainingArguments("out", optim="adafactor", optim_args="scale=2")
        )
    assert "scale" not in kwargs
    with pytest.raises(UserError, match="optim_args='momentum=fast': write key=number pairs"):
        hpsweep.train.optim.optimizer_cls_and_kwargs(
            TrainingArguments("out", optim="sgd", optim_args="momentum=fast")
        )
