"""The sweep's home in an object store (moto's S3 server on 127.0.0.1): what is uploaded and when,
what another machine can trust and pull back, and the best run across machines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.s3 import SECRET, s3_server

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.runs.home import staging_folder


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture
def aws(s3, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3


def machine(monkeypatch, tmp_path: Path, name: str, url: str) -> runs.RemoteHome:
    """The home as the machine ``name`` opens it (its own cache folder, as its own HOME gives)."""
    monkeypatch.setenv("HPSWEEP_CACHE", str(tmp_path / name))
    home = runs.open_home(url)
    assert isinstance(home, runs.RemoteHome)
    return home


def write_run(home: runs.Home, number: int, objective: float, steps=(2,)) -> runs.TrialRecord:
    """A finished trial in the home's staging folder, with real checkpoints of a tiny model whose
    weights are filled with ``objective`` (so the best run's weights say which run they are)."""
    run_dir = home.local / f"run-{number}"
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, objective)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for step in steps:
        runs.write_checkpoint(
            run_dir / f"checkpoint-{step}",
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state={"global_step": step},
            args={},
        )
    record = runs.TrialRecord(
        id=str(number),
        number=number,
        backend="optuna",
        params={"learning_rate": objective},
        state="complete",
        objective=objective,
        objective_name="eval_accuracy",
        directions=["maximize"],
        checkpoint=f"checkpoint-{steps[-1]}",
        run_dir=str(run_dir),
    )
    record.save()
    return record


def publish(home: runs.Home, record: runs.TrialRecord) -> bool:
    """What the trial runner does with a finished trial: its checkpoints, its record, best/."""
    run_dir = Path(record.run_dir)
    for checkpoint in runs.checkpoints(run_dir):
        home.upload_checkpoint(run_dir, checkpoint)
    home.upload_record(run_dir)
    return home.promote_best(record)


def best_weight(folder: Path) -> float:
    from safetensors.torch import load_file

    return float(load_file(str(folder / "model.safetensors"))["weight"][0, 0])


def test_a_local_path_is_its_own_home_and_costs_nothing(tmp_path):
    home = runs.open_home(tmp_path / "out")
    assert not home.remote and home.local == (tmp_path / "out").resolve()
    home.upload_checkpoint(home.local / "run-0", home.local / "run-0" / "checkpoint-1")
    home.upload_record(home.local / "run-0")
    assert home.pull_run("run-0") == home.local / "run-0"
    assert home.snapshot(tmp_path / "elsewhere") == home.local
    assert list(tmp_path.iterdir()) == []  # nothing written by opening it or by its hooks


def bad_homes(s3, monkeypatch, tmp_path):
    """Each bad home, with the environment that makes it bad, and what its one line says."""
    from support import free_port

    def unreachable():
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")

    def no_credentials():
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))

    return {
        "unknown scheme": ("ftp://host/sweep", None, ["ftp://", "s3://bucket/prefix"]),
        "no bucket named": ("s3://", None, ["name a bucket"]),
        "missing bucket": ("s3://no-such-bucket/sweep", None, ["'no-such-bucket' does not exist"]),
        "unreachable": (
            "s3://sweeps/x",
            unreachable,
            ["cannot reach the object store", "AWS_ENDPOINT_URL"],
        ),
        "no credentials": (
            "s3://sweeps/x",
            no_credentials,
            ["no credentials", "AWS_ACCESS_KEY_ID"],
        ),
        "gcsfs missing": ("gs://bucket/sweep", None, ["gcsfs", "pip install 'hpsweep[gcs]'"]),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown scheme",
        "no bucket named",
        "missing bucket",
        "unreachable",
        "no credentials",
        "gcsfs missing",
    ],
)
def test_a_bad_home_is_one_line_and_nothing_is_written(aws, monkeypatch, tmp_path, case):
    aws.make_bucket("sweeps")
    url, environment, needles = bad_homes(aws, monkeypatch, tmp_path)[case]
    if environment:
        environment()
    monkeypatch.setenv("HPSWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as raised:
        runs.open_home(url)
    line = str(raised.value)
    assert "\n" not in line and SECRET not in line
    for needle in needles:
        assert needle in line, line
    assert list(tmp_path.iterdir()) == []
    assert aws.keys("sweeps") == []


def test_another_machine_pulls_only_complete_checkpoints(aws, monkeypatch, tmp_path):
    aws.make_bucket("pulls")
    first = machine(monkeypatch, tmp_path, "a", "s3://pulls/sweep")
    record = write_run(first, 0, 0.25, steps=(1, 2))
    run_dir = Path(record.run_dir)
    publish(first, record)
    # a machine killed while uploading checkpoint-3: its files, no marker
    aws.client().put_object(
        Bucket="pulls", Key="sweep/run-0/checkpoint-3/model.safetensors", Body=b"x"
    )
    # save_total_limit=1 rotated checkpoint-1 away here: the home drops it when the next is sent
    runs.rotate_checkpoints(run_dir, 1, None)
    first.upload_checkpoint(run_dir, run_dir / "checkpoint-2")

    keys = aws.keys("pulls", "sweep/run-0/")
    assert "sweep/run-0/checkpoint-2/.complete" in keys
    assert not any(k.startswith("sweep/run-0/checkpoint-1/") for k in keys)
    at_home = json.loads(
        aws.client().get_object(Bucket="pulls", Key="sweep/run-0/trial.json")["Body"].read()
    )
    assert at_home["run_dir"] == "s3://pulls/sweep/run-0"

    second = machine(monkeypatch, tmp_path, "b", "s3://pulls/sweep")
    assert second.local != first.local
    pulled = second.pull_run("run-0")
    assert pulled == second.local / "run-0"
    assert [p.name for p in runs.checkpoints(pulled)] == ["checkpoint-2"]  # never checkpoint-3
    assert runs.TrialRecord.load(pulled / "trial.json").run_dir == str(pulled)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    state, _ = runs.read_checkpoint(
        pulled / "checkpoint-2", model=model, optimizer=optimizer, scheduler=scheduler
    )
    assert state["global_step"] == 2 and float(model.weight[0, 0].detach()) == 0.25


def test_the_home_keeps_the_best_of_every_machine(aws, monkeypatch, tmp_path):
    aws.make_bucket("bests")
    url = "s3://bests/sweep"
    first = machine(monkeypatch, tmp_path, "a", url)
    second = machine(monkeypatch, tmp_path, "b", url)
    assert publish(first, write_run(first, 0, 0.5))
    assert publish(second, write_run(second, 1, 0.75))
    assert not publish(
        first, write_run(first, 2, 0.625)
    )  # better than a's own best, not the home's

    best = json.loads(
        aws.client().get_object(Bucket="bests", Key="sweep/best_run.json")["Body"].read()
    )
    assert best["run_id"] == "1" and best["checkpoint"] == f"{url}/run-1/checkpoint-2"
    snap = second.snapshot(tmp_path / "snap", checkpoints=True)
    assert best_weight(snap / "best") == 0.75
    assert sorted(p.name for p in snap.glob("run-*")) == ["run-0", "run-1", "run-2"]
    assert card_of(snap / "best" / "README.md")["best_run"] == "run-1"

    # Two machines that finished at once: the worse one wrote last. The command's end sets it right.
    stale = json.dumps({**best, "run_id": "2", "objective": 0.625}).encode()
    aws.client().put_object(Bucket="bests", Key="sweep/best_run.json", Body=stale)
    first.settle()
    best = json.loads(
        aws.client().get_object(Bucket="bests", Key="sweep/best_run.json")["Body"].read()
    )
    assert best["run_id"] == "1"
    here = runs.read_best(first.local)
    assert here.run_id == "1" and here.run_dir == str(first.local / "run-1")
    assert best_weight(first.local / "best") == 0.75  # run-1 ran on the other machine
    # the copy inside the store took the model's files of run-1's checkpoint, not its training state
    at_home = aws.keys("bests", "sweep/best/")
    assert [k.removeprefix("sweep/best/") for k in at_home] == [
        "README.md",
        "model.safetensors",
        "training_args.json",
    ]
    assert card_of(first.local / "best" / "README.md")["best_run"] == "run-1"


TOKEN = "hf_testTOKENtestTOKENtestTOKEN1234"


def hf_run(home: runs.Home, number: int, objective: float) -> runs.TrialRecord:
    """A finished trial whose checkpoint holds a tiny transformers text classifier and its
    tokenizer, with the optimizer, schedule and RNG state a resume needs, and arguments that
    still hold a token (as an older checkpoint's did)."""
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, num_labels=3,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2ForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    run_dir = home.local / f"run-{number}"
    checkpoint = runs.write_checkpoint(
        run_dir / "checkpoint-4",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state={"global_step": 4},
        args={"learning_rate": 0.01, "hub_token": TOKEN},
    )
    words = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "good": 2}, unk_token="[UNK]"))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(checkpoint)  # as the trial's trainer saves its processing_class
    record = runs.TrialRecord(
        id=str(number),
        number=number,
        backend="optuna",
        params={"learning_rate": 0.01},
        state="complete",
        objective=objective,
        objective_name="eval_accuracy",
        directions=["maximize"],
        checkpoint=checkpoint.name,
        run_dir=str(run_dir),
    )
    record.save()
    return record


def card_of(readme: Path) -> dict:
    """The ``hpsweep`` entry of a README's metadata block, as huggingface_hub reads it."""
    from huggingface_hub import ModelCard

    return ModelCard.load(readme).data.hpsweep


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_best_is_a_model_folder_ready_for_the_hub(request, monkeypatch, tmp_path, where):
    """best/ holds the model, its config and tokenizer and a model card naming its class, as
    transformers' save_model leaves a folder; the training state stays in the trial's checkpoint.
    On a local home and in a bucket (read back from another machine) alike."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if where == "bucket":
        request.getfixturevalue("aws").make_bucket("models")
        home = machine(monkeypatch, tmp_path, "a", "s3://models/sweep")
    else:
        home = runs.open_home(tmp_path / "sweep")
    record = hf_run(home, 0, 0.75)
    assert publish(home, record)
    best = home.local / "best"
    if where == "bucket":
        other = machine(monkeypatch, tmp_path, "b", "s3://models/sweep")
        best = other.snapshot(tmp_path / "snap", checkpoints=True) / "best"

    names = {p.name for p in best.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    assert runs.resumable(Path(record.run_dir) / record.checkpoint)
    model, info = AutoModelForSequenceClassification.from_pretrained(best, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set() and model.num_labels == 3
    assert AutoTokenizer.from_pretrained(best)("good")["input_ids"] == [2]

    card = ModelCard.load(best / "README.md")
    assert (card.data.library_name, card.data.pipeline_tag) == (
        "transformers",
        "text-classification",
    )
    [result] = card.data.eval_results
    assert (result.metric_name, result.metric_value) == ("eval_accuracy", 0.75)
    assert card.data.hpsweep["best_trial"] == 0
    assert card.data.hpsweep["hyperparameters"] == {"learning_rate": 0.01}
    assert 'AutoModelForSequenceClassification.from_pretrained("sweep/best")' in card.text
    assert 'AutoTokenizer.from_pretrained("sweep/best")' in card.text
    assert not any(TOKEN.encode() in p.read_bytes() for p in best.iterdir())


def test_the_staging_folder_is_the_same_on_every_run_of_one_machine(aws, tmp_path, monkeypatch):
    """A rerun on the same machine continues from its staging folder; another endpoint with the
    same bucket name is another home."""
    monkeypatch.setenv("HPSWEEP_CACHE", str(tmp_path / "cache"))
    aws.make_bucket("again")
    first, second = runs.open_home("s3://again/x"), runs.open_home("s3://again/x/")
    assert first.local == second.local and first.local.parent == tmp_path / "cache" / "homes"
    assert staging_folder("s3://again/x", "http://other:9000") != first.local
