"""Does a worker give a trial's memory back? RSS (and CUDA memory) at the start of trial 1 vs trial 50.

    python bench/memory.py                      # 50 trials on the CPU, a ~10 MB model
    python bench/memory.py --device cuda        # on the GPU: torch.cuda.memory_allocated too
    python bench/memory.py --trials 20 --hidden 2048 --json out.json

One process runs the whole sweep (``n_jobs=1``, the Python API), as a ``--n-jobs`` worker does.
Each trial builds a fresh model of ``--hidden`` units (AdamW, so weights + two moments), trains
one short epoch, evaluates and writes its checkpoint. A callback samples memory when training
starts (after the model, optimizer and loaders are built), so a trial that kept the previous
trial's model alive would show up as one model's worth of growth per trial.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hpsweep  # noqa: E402


def rss_mb() -> float:
    """Resident set size of this process, from /proc (no psutil needed)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_tensor_mb() -> float:
    """Bytes of the distinct tensor storages Python can still reach (what a leak would keep)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 2**20


class Sample(hpsweep.TrainerCallback):
    def __init__(self, device: str) -> None:
        self.device = device
        self.rows: list[dict[str, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        row = {
            "trial": state.trial_number + 1,
            "rss_mb": round(rss_mb(), 1),
            "live_tensors_mb": round(live_tensor_mb(), 1),
        }
        if self.device == "cuda":
            row["cuda_allocated_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
            row["cuda_reserved_mb"] = round(torch.cuda.memory_reserved() / 2**20, 1)
        self.rows.append(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=1024, help="width of the two hidden layers")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="also write the samples here")
    ns = parser.parse_args()

    def model_init() -> nn.Module:
        return nn.Sequential(
            nn.Linear(256, ns.hidden),
            nn.ReLU(),
            nn.Linear(ns.hidden, ns.hidden),
            nn.ReLU(),
            nn.Linear(ns.hidden, 10),
        )

    class Wrapped(nn.Module):  # the trainer's forward contract: the batch in, the loss out
        def __init__(self) -> None:
            super().__init__()
            self.net = model_init()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.TensorDataset(
        torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g)
    )
    val = torch.utils.data.TensorDataset(
        torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)
    )
    n_params = sum(p.numel() for p in Wrapped().parameters())
    sample = Sample(ns.device)
    with tempfile.TemporaryDirectory() as tmp:
        args = hpsweep.TrainingArguments(
            output_dir=tmp,
            num_train_epochs=1,
            per_device_train_batch_size=64,
            per_device_eval_batch_size=128,
            save_strategy="no",
            disable_progress=True,
            use_cpu=ns.device == "cpu",
        )
        trainer = hpsweep.Trainer(
            model_init=Wrapped, args=args, train_dataset=train, eval_dataset=val, callbacks=[sample]
        )
        started = time.perf_counter()
        trainer.hyperparameter_search(
            space={"learning_rate": hpsweep.Float(1e-4, 1e-2, log=True)},
            n_trials=ns.trials,
            sampler="random",
            pruner="none",
            seed=0,
            show_progress=False,
        )
        elapsed = time.perf_counter() - started
    rows = sample.rows
    first, last = rows[0], rows[-1]
    print(
        f"model: {n_params / 1e6:.2f} M params = {n_params * 4 / 2**20:.1f} MB of fp32 weights "
        f"(+ {2 * n_params * 4 / 2**20:.1f} MB of AdamW state); {len(rows)} trials in {elapsed:.1f} s on {ns.device}"
    )
    keys = [k for k in first if k != "trial"]
    print("trial  " + "  ".join(f"{k:>18}" for k in keys))
    for row in rows:
        if row["trial"] in (1, 2, 5, 10, 25, len(rows)) or row is last:
            print(f"{row['trial']:>5}  " + "  ".join(f"{row[k]:>18.1f}" for k in keys))
    second = rows[1] if len(rows) > 1 else first
    for k in keys:
        print(
            f"{k}: trial {last['trial']} - trial 1 = {last[k] - first[k]:+.1f} MB; trial {last['trial']} - trial 2 "
            f"(after the first trial's one-time allocations) = {last[k] - second[k]:+.1f} MB"
        )
    if ns.json:
        Path(ns.json).write_text(
            json.dumps({"params": n_params, "device": ns.device, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
