"""Per-trial overhead of hpsweep's Ray backend against bare Ray Tune, in the same run.

    python bench/ray_overhead.py --trials 20 --concurrency 2

All sides share one local Ray instance and run N trials with the same Tune settings
(``max_concurrent_trials``, ``reuse_actors``, random search, ``CheckpointConfig(num_to_keep=2)``):

- trivial:  a function trainable that imports nothing and reports one metric: what Ray Tune itself
            costs per trial (scheduling, actor start or reset, results);
- torch:    the fair peer. A function trainable a user writes by hand without hpsweep, doing the
            same training as the hpsweep space file: imports torch, builds the same 1-parameter
            model, trains the same step on the same sample, evaluates, saves a state dict and calls
            ``tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(...))``;
- hpsweep:  ``hpsweep.run(space.py, backend="ray")`` on that space file (trainer, checkpoint
            reported to Tune, trial.json, the best-run promotion).

Each side runs with ``reuse_actors`` off and on. Prints seconds per trial (wall time of the whole
search / N), the time spent inside the trial function, and hpsweep / torch peer.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SPACE = """
import torch
import hpsweep

class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x, y):
        return {"loss": ((self.w * x - y) ** 2).mean()}

def data():
    return torch.utils.data.TensorDataset(torch.ones(1, 1), torch.ones(1, 1))

model_init = lambda: One()
train_dataset = data
eval_dataset = data
space = {"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)}
args = hpsweep.TrainingArguments(output_dir="unused", num_train_epochs=1, per_device_train_batch_size=1,
                                 per_device_eval_batch_size=1, save_strategy="epoch", logging_strategy="no",
                                 disable_progress=True)
"""


def trivial_trainable(config: dict) -> None:
    from ray import tune

    tune.report({"objective": config["learning_rate"]})


def torch_trainable(config: dict) -> None:
    """What a user writes by hand for the same training: the fair peer of hpsweep's trial."""
    import torch
    from ray import tune

    # after the imports, like hpsweep's trial.json duration (its runner arrives with torch)
    start = time.perf_counter()

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, y):
            return {"loss": ((self.w * x - y) ** 2).mean()}

    data = torch.utils.data.TensorDataset(torch.ones(1, 1), torch.ones(1, 1))
    model = One()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["learning_rate"])
    model.train()
    for x, y in torch.utils.data.DataLoader(data, batch_size=1, shuffle=True):
        model(x, y)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        losses = [
            model(x, y)["loss"].item() for x, y in torch.utils.data.DataLoader(data, batch_size=1)
        ]
    eval_loss = sum(losses) / len(losses)
    with tempfile.TemporaryDirectory() as folder:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            os.path.join(folder, "checkpoint.pt"),
        )
        tune.report(
            {
                "eval_loss": eval_loss,
                "objective": eval_loss,
                "inside_s": time.perf_counter() - start,
            },
            checkpoint=tune.Checkpoint.from_directory(folder),
        )


def bare(
    trainable, n: int, concurrency: int, storage: Path, reuse: bool
) -> tuple[float, float | None]:
    from ray import tune

    name = f"{trainable.__name__}-{reuse}-{time.monotonic_ns()}"
    tuner = tune.Tuner(
        trainable,
        param_space={"learning_rate": tune.loguniform(1e-3, 1e-1)},
        tune_config=tune.TuneConfig(
            num_samples=n,
            max_concurrent_trials=concurrency,
            metric="objective",
            mode="min",
            reuse_actors=reuse,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(storage),
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
        ),
    )
    start = time.perf_counter()
    results = tuner.fit()
    per_trial = (time.perf_counter() - start) / n
    inside = [r.metrics["inside_s"] for r in results if r.metrics and "inside_s" in r.metrics]
    return per_trial, statistics.mean(inside) if inside else None


def ours(n: int, concurrency: int, folder: Path, reuse: bool) -> tuple[float, float]:
    import hpsweep
    from hpsweep import runs

    folder.mkdir(parents=True)
    space = folder / "space.py"
    space.write_text(SPACE)
    out = folder / "hpsweep-out"
    start = time.perf_counter()
    hpsweep.run(
        space,
        backend="ray",
        n_trials=n,
        n_jobs=concurrency,
        output_dir=out,
        sampler="random",
        show_progress=False,
        reuse_actors=reuse,
    )
    per_trial = (time.perf_counter() - start) / n
    records = runs.read_trials(out)
    assert len(records) == n and all(r.state == "complete" for r in records), [
        r.state for r in records
    ]
    return per_trial, statistics.mean(r.duration_s for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--reuse",
        choices=("both", "off", "on"),
        default="both",
        help="Ray's reuse_actors setting(s) to measure (default: both)",
    )
    parser.add_argument(
        "--no-warm", action="store_true", help="skip the warm-up runs (a smoke test of the script)"
    )
    ns = parser.parse_args()
    settings = {"both": (False, True), "off": (False,), "on": (True,)}[ns.reuse]

    from hpsweep.search.backends._ray._cluster import QUIET_ENV as _QUIET_ENV
    from hpsweep.search.backends._ray._cluster import WORKER_ENV

    for key, value in _QUIET_ENV.items():  # the same environment for every side
        os.environ.setdefault(key, value)
    import ray

    ray.init(
        address="local",
        num_cpus=ns.cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
        runtime_env={"env_vars": dict(WORKER_ENV)},
    )
    rows: dict[tuple[str, bool], tuple[float, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="hpbench") as tmp:
        folder = Path(tmp)
        # Warm every path once (imports into the OS page cache, Ray's worker pool), so no side pays first use.
        if not ns.no_warm:
            bare(trivial_trainable, 2, ns.concurrency, folder / "warm", reuse=False)
            bare(torch_trainable, 2, ns.concurrency, folder / "warm", reuse=False)
            ours(2, ns.concurrency, folder / "warm-ours", reuse=False)
        for reuse in settings:
            rows["trivial", reuse] = bare(
                trivial_trainable, ns.trials, ns.concurrency, folder / "ray", reuse
            )
            rows["torch", reuse] = bare(
                torch_trainable, ns.trials, ns.concurrency, folder / "ray", reuse
            )
            rows["hpsweep", reuse] = ours(
                ns.trials, ns.concurrency, folder / f"ours-{reuse}", reuse
            )
    ray.shutdown()

    print(f"trials={ns.trials} concurrency={ns.concurrency} cpus={ns.cpus} ray={ray.__version__}")
    print(f"{'':44}" + "".join(f" {f'reuse_actors={r}':>20}" for r in settings))
    labels = {
        "trivial": "Ray's own cost (trivial trainable), s/trial",
        "torch": "bare torch trainable, s/trial",
        "hpsweep": "hpsweep --backend ray, s/trial",
    }
    for side, label in labels.items():
        print(f"{label:44}" + "".join(f" {rows[side, r][0]:>20.3f}" for r in settings))
    ratios = [rows["hpsweep", r][0] / rows["torch", r][0] for r in settings]
    print(f"{'ratio hpsweep / bare torch trainable':44}" + "".join(f" {x:>20.2f}" for x in ratios))
    for side in ("torch", "hpsweep"):
        inside = "".join(f" {rows[side, r][1]:>20.3f}" for r in settings)
        print(f"{'inside the trial function, s (' + side + ')':44}{inside}")
    print(
        "(s/trial: wall time of the whole search / trials; inside: mean time in the trial function after its "
        "imports; hpsweep's from trial.json, so without the best/ promotion)"
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
