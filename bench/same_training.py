"""Does a trial trained by hpsweep learn what the hand loop learns? Paired final accuracies.

    python bench/same_training.py --configs 200 --seed 1     # about 1.5 minutes here

The time-to-target runs on digits left one question: the hand loop's median best was one
evaluation image higher than hpsweep's on 40 held-out seeds. The pruner was ruled out (see
bench/README.md, "Pruning"). This script rules the training in or out: it draws ``--configs``
random points of the digits space (Optuna's RandomSampler, seeded) and trains each one fully,
without pruning, three ways in one process:

- the hand loop of bench/_tasks.py (``torch.optim.AdamW``'s default kernel);
- the same with ``AdamW(fused=True)``;
- hpsweep's `Trainer` with the space file's arguments, evaluating every epoch, no checkpoints.

All three start from the same weights (seed 42). They draw the data order and dropout from
different random streams, so single runs differ. Training that is the same in expectation shows
paired differences centred on zero.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import optuna
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _tasks  # noqa: E402

import hpsweep  # noqa: E402


def train_hpsweep(module, task, params: dict, out: str) -> float:
    args = hpsweep.TrainingArguments(
        output_dir=out,
        per_device_eval_batch_size=256,
        lr_scheduler_type="linear",
        learning_rate=params["learning_rate"],
        per_device_train_batch_size=params["per_device_train_batch_size"],
        num_train_epochs=params["num_train_epochs"],
        save_strategy="no",
        eval_strategy="epoch",
        disable_progress=True,
    )
    trainer = hpsweep.Trainer(
        model_init=lambda: module.MLP(hidden=params["hidden"], dropout=params["dropout"]),
        args=args,
        train_dataset=_tasks.dataset(task, "train"),
        eval_dataset=_tasks.dataset(task, "eval"),
        compute_metrics=module.compute_metrics,
    )
    return trainer.train().metrics["eval_accuracy"]


def summary(name: str, diffs: list[float]) -> str:
    if not diffs:  # a short run may draw no config of that kind
        return f"| {name} | 0 | | | |"
    better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return (
        f"| {name} | {len(diffs)} | {100 * statistics.mean(diffs):+.2f} | {100 * statistics.median(diffs):+.2f} "
        f"| {better} / {worse} / {len(diffs) - better - worse} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1, help="the RandomSampler's seed")
    parser.add_argument(
        "--good",
        type=float,
        default=0.95,
        help="'good' configs: the hand loop's accuracy above this",
    )
    opts = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    task, module = _tasks.get("digits"), _tasks._digits_module()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=opts.seed))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.configs):
            trial = study.ask()
            params = _tasks.suggest(trial, task.space)
            study.tell(trial, 0.0)
            rows.append(
                (
                    _tasks.hand_train(task, params, lambda epoch, acc: False),
                    _tasks.hand_train(task, params, lambda epoch, acc: False, fused=True),
                    train_hpsweep(module, task, params, f"{tmp}/run-{i}"),
                )
            )
    good = [r for r in rows if r[0] > opts.good]
    print(
        f"{opts.configs} random digits configs (seed {opts.seed}), each trained fully three ways; "
        f"accuracy differences in points, paired per config\n"
    )
    print("| pair | configs | mean difference | median difference | better / worse / equal |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(summary("hpsweep - hand loop", [r[2] - r[0] for r in rows]))
    print(summary("fused hand loop - hand loop", [r[1] - r[0] for r in rows]))
    print(
        summary(
            f"hpsweep - hand loop, configs the hand loop got above {opts.good}",
            [r[2] - r[0] for r in good],
        )
    )
    print(
        f"\nmean accuracy: hand loop {statistics.mean(r[0] for r in rows):.4f}, hpsweep "
        f"{statistics.mean(r[2] for r in rows):.4f}; best: {max(r[0] for r in rows):.4f} and "
        f"{max(r[2] for r in rows):.4f}"
    )
    print(f"reproduce: python bench/same_training.py --configs {opts.configs} --seed {opts.seed}")


if __name__ == "__main__":
    main()
