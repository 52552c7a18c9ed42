"""One trial's training, in one warm process: hpsweep's loop against the same loop written by hand.

    python bench/step_overhead.py                # 9 interleaved rounds: about 3 minutes here

No process start, no study: what the loop itself adds per step, per evaluation and per
checkpoint. Variants, one after the other in each round (CPU seconds of the process, so other
jobs on a shared machine move it less than wall time):

- hand-bare: the hand-written loop (AdamW, linear decay, clipping), no evaluation, no checkpoint;
- hand-bare-fused: the same with ``AdamW(fused=True)``, the kernel hpsweep's default ``adamw`` uses;
- hpsweep-bare: ``Trainer.train()`` the same way (``eval_strategy=save_strategy="no"``);
- hpsweep-bare-wrapped: the same with ``HPSWEEP_ACCELERATE_WRAPPERS=always`` (every accelerate
  wrapper kept, as before this change);
- hand: the hand loop evaluating and saving (model, optimizer, scheduler) every epoch;
- hpsweep: ``Trainer.train()`` at its defaults (evaluation and a checkpoint every epoch).

Task: core_overhead.py's (32-64-2 MLP, 3 epochs of 112 steps of batch 32), one torch thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_overhead import COMMON  # noqa: E402

namespace: dict = {"HIDDEN": [64]}  # the 32-64-2 MLP (core_overhead.py --hidden 64)
exec(COMMON, namespace)  # load() and MLP, as every core_overhead.py variant defines them
TRAIN, VAL, MLP = namespace["load"]("train"), namespace["load"]("eval"), namespace["MLP"]


def hand(out: Path, evaluate_and_save: bool, fused: bool | None = None) -> None:
    torch.manual_seed(42)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    loader = torch.utils.data.DataLoader(TRAIN, batch_size=32, shuffle=True)
    total = 3 * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    for epoch in range(3):
        model.train()
        for x, y in loader:
            model(x, y)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if not evaluate_and_save:
            continue
        model.eval()
        with torch.no_grad():
            sum(
                int((model(x, y)["logits"].argmax(-1) == y).sum())
                for x, y in torch.utils.data.DataLoader(VAL, 256)
            )
        (out / f"checkpoint-{epoch}").mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
            },
            out / f"checkpoint-{epoch}" / "state.pt",
        )


def ours(out: Path, evaluate_and_save: bool, wrapped: bool = False) -> None:
    import hpsweep

    os.environ["HPSWEEP_ACCELERATE_WRAPPERS"] = "always" if wrapped else ""
    extra = {} if evaluate_and_save else {"eval_strategy": "no", "save_strategy": "no"}
    args = hpsweep.TrainingArguments(
        output_dir=str(out),
        num_train_epochs=3,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=256,
        learning_rate=1e-3,
        disable_progress=True,
        **extra,
    )

    def accuracy(p: hpsweep.EvalPrediction) -> dict:
        return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}

    hpsweep.Trainer(
        model_init=MLP, args=args, train_dataset=TRAIN, eval_dataset=VAL, compute_metrics=accuracy
    ).train()


VARIANTS = {
    "hand-bare": lambda out: hand(out, False),
    "hand-bare-fused": lambda out: hand(out, False, fused=True),
    "hpsweep-bare": lambda out: ours(out, False),
    "hpsweep-bare-wrapped": lambda out: ours(out, False, wrapped=True),
    "hand": lambda out: hand(out, True),
    "hpsweep": lambda out: ours(out, True),
}
PEERS = {
    "hand-bare-fused": "hand-bare",
    "hpsweep-bare": "hand-bare",
    "hpsweep-bare-wrapped": "hand-bare",
    "hpsweep": "hand",
}


def optimizer_step_us(fused: bool | None, steps: int = 2000) -> float:
    """CPU µs of one ``AdamW.step()`` alone on the MLP's gradients (torch's default kernel, or fused)."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    x, y = TRAIN.tensors[0][:32], TRAIN.tensors[1][:32]
    model(x, y)["loss"].backward()
    for _ in range(20):
        opt.step()
    start = time.process_time()
    for _ in range(steps):
        opt.step()
    return 1e6 * (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for (
            name,
            fn,
        ) in VARIANTS.items():  # warm-up: imports, torch._dynamo via AdamW, first-call caches
            fn(Path(tmp) / f"warm-{name}")
        for r in range(ns.rounds):
            for name, fn in VARIANTS.items():
                start = time.process_time()
                fn(Path(tmp) / f"{name}-{r}")
                cpu[name].append(time.process_time() - start)
    steps = 3 * 112
    print(
        f"\nCPU ms per trial (336 steps), {ns.rounds} interleaved rounds in one warm process; ratios are "
        "medians over rounds of (variant / its peer in the same round)"
    )
    print("| variant | median CPU ms | vs peer | peer | per-step CPU us |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name in VARIANTS:
        peer = PEERS.get(name)
        ratio = (
            f"{statistics.median(a / b for a, b in zip(cpu[name], cpu[peer])):.3f}x" if peer else ""
        )
        print(
            f"| {name} | {1000 * statistics.median(cpu[name]):.0f} | {ratio} | {peer or ''} | "
            f"{1e6 * statistics.median(cpu[name]) / steps:.0f} |"
        )
    saved = statistics.median(
        w - b for w, b in zip(cpu["hpsweep-bare-wrapped"], cpu["hpsweep-bare"])
    )
    print(
        f"\nskipping accelerate's no-op wrappers: {1e6 * saved / steps:.0f} us of "
        f"{1e6 * statistics.median(cpu['hpsweep-bare-wrapped']) / steps:.0f} us per step "
        f"({statistics.median(b / w for w, b in zip(cpu['hpsweep-bare-wrapped'], cpu['hpsweep-bare'])):.3f}x)"
    )
    alone = {
        k: statistics.median(optimizer_step_us(k) for _ in range(ns.rounds)) for k in (None, True)
    }
    print(
        f"AdamW.step() alone: {alone[None]:.0f} us with torch's default kernel, {alone[True]:.0f} us fused "
        f"({alone[True] / alone[None]:.2f}x)"
    )
    print(f"reproduce: python bench/step_overhead.py --rounds {ns.rounds}")


if __name__ == "__main__":
    main()
