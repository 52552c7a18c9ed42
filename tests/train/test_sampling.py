"""train_sampling_strategy: transformers' training orders. group_by_length batches samples of like
length (transformers' LengthGroupedSampler, so padded batches are narrow), each epoch's order drawn
from the seed and the epoch, so a resume mid-epoch trains what the uninterrupted run trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hpsweep
from hpsweep import UserError

VOCAB = 50


class Bag(nn.Module):
    """A bag of token embeddings; records the padded width of every training batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out, self.widths = nn.Embedding(VOCAB, 8), nn.Linear(8, 2), []

    def forward(self, input_ids, attention_mask, labels):
        if self.training:
            self.widths.append(input_ids.shape[1])
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(
            1, keepdim=True
        )
        logits = self.out(h)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def texts(n: int = 256, seed: int = 0):
    import datasets

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 41, (n,), generator=g).tolist()
    ids = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": [int(sum(i) % 2) for i in ids]})


def pad(features: list[dict]) -> dict[str, torch.Tensor]:
    width = max(len(f["input_ids"]) for f in features)
    return {
        "input_ids": torch.tensor(
            [f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]
        ),
        "attention_mask": torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        ),
        "labels": torch.tensor([f["labels"] for f in features]),
    }


def trainer(out: Path, strategy: str, model: Bag | None = None, **kw) -> hpsweep.Trainer:
    args = hpsweep.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        train_sampling_strategy=strategy,
        num_train_epochs=2,
        eval_strategy="no",
        learning_rate=0.05,
        seed=3,
        disable_progress=True,
        **kw,
    )
    return hpsweep.Trainer(
        model=model,
        model_init=None if model else Bag,
        args=args,
        train_dataset=texts(),
        data_collator=pad,
    )


def test_group_by_length_batches_like_lengths_in_transformers_order_per_epoch(
    tmp_path: Path,
) -> None:
    from transformers.trainer_pt_utils import get_length_grouped_indices

    grouped, shuffled = Bag(), Bag()
    trainer(tmp_path / "grouped", "group_by_length", grouped, save_strategy="no").train()
    trainer(tmp_path / "random", "random", shuffled, save_strategy="no").train()
    lengths = [len(ids) for ids in texts()["input_ids"]]
    expected = []
    for epoch in range(2):  # transformers' function, drawn from the seed and the epoch
        order = get_length_grouped_indices(
            lengths, 8, generator=torch.Generator().manual_seed(3 + epoch)
        )
        expected += [max(lengths[i] for i in order[s : s + 8]) for s in range(0, len(order), 8)]
    assert grouped.widths == expected and len(expected) == 64
    # narrower padded batches (0.64x): less padding
    assert sum(grouped.widths) < 0.7 * sum(shuffled.widths)


def test_group_by_length_reads_the_lengths_from_a_column_when_the_dataset_has_one(
    tmp_path: Path,
) -> None:
    from transformers.trainer_pt_utils import get_length_grouped_indices

    data = texts()
    lengths = [len(ids) for ids in data["input_ids"]]
    # what the column says, not what the samples hold: the order follows it
    told = [41 - n for n in lengths]
    model = Bag()
    grouped = trainer(
        tmp_path, "group_by_length", model, save_strategy="no", length_column_name="n_tokens"
    )
    # read for the order, then dropped: the model
    grouped.train_dataset = data.add_column("n_tokens", told)
    grouped.train()  # does not take it
    expected = []
    for epoch in range(2):
        order = get_length_grouped_indices(
            told, 8, generator=torch.Generator().manual_seed(3 + epoch)
        )
        expected += [max(lengths[i] for i in order[s : s + 8]) for s in range(0, len(order), 8)]
    assert model.widths == expected


def test_a_run_resumed_mid_epoch_goes_on_in_the_grouped_order_bit_for_bit(tmp_path: Path) -> None:
    full = trainer(tmp_path / "full", "group_by_length", save_strategy="steps", save_steps=3)
    full.train()
    resumed = trainer(tmp_path / "resumed", "group_by_length")
    # mid second epoch of 32 steps
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-39"))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sequential_trains_in_the_datasets_order(tmp_path: Path) -> None:
    model = Bag()
    trainer(tmp_path, "sequential", model, save_strategy="no").train()
    lengths = [len(ids) for ids in texts()["input_ids"]]
    assert model.widths == [max(lengths[s : s + 8]) for s in range(0, 256, 8)] * 2


def test_what_group_by_length_cannot_read_is_one_line(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.zeros(16, dtype=torch.long))
    args = hpsweep.TrainingArguments(
        output_dir=str(tmp_path),
        train_sampling_strategy="group_by_length",
        disable_progress=True,
        eval_strategy="no",
    )
    with pytest.raises(UserError, match="give the train_dataset a 'length' column"):
        hpsweep.Trainer(model_init=lambda: nn.Linear(4, 2), args=args, train_dataset=data).train()
    with pytest.raises(
        UserError,
        match="train_sampling_strategy='batch_rebalance' is not one of random, sequential, "
        "group_by_length",
    ):
        hpsweep.TrainingArguments(train_sampling_strategy="batch_rebalance")


def test_transformers_arguments_keep_their_sampling_strategy(tmp_path: Path) -> None:
    import transformers

    hf = transformers.TrainingArguments(
        str(tmp_path),
        train_sampling_strategy="group_by_length",
        length_column_name="n_tokens",
        report_to="none",
    )
    args = hpsweep.Trainer(model_init=Bag, args=hf).args
    assert (args.train_sampling_strategy, args.length_column_name) == (
        "group_by_length",
        "n_tokens",
    )


def test_group_by_length_over_several_processes_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    t = trainer(tmp_path, "group_by_length")
    with pytest.raises(UserError, match="with --processes-per-trial"):
        t.hyperparameter_search(
            space={"learning_rate": hpsweep.Float(1e-3, 1e-1)},
            n_trials=1,
            processes_per_trial=2,
            show_progress=False,
        )
    assert not any(tmp_path.iterdir())
