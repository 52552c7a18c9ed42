"""The tiny models and data the Hugging Face tests share: rows of a fixed 4-class problem, a model
that returns its outputs as transformers' models do, and a tiny GPT-2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

import hpsweep
from hpsweep import TrainingArguments

W = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


def rows(n: int, seed: int, label: str = "labels") -> list[dict]:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return [{"x": xi, label: int(yi)} for xi, yi in zip(x, (x @ W).argmax(-1))]


class Net(nn.Module):
    """Returns its outputs the way the test asks: a (loss, logits) tuple, a ModelOutput or a dict."""

    def __init__(self, kind: str = "tuple") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels)
        if self.kind == "tuple":
            return loss, logits
        if self.kind == "model_output":
            from transformers.modeling_outputs import SequenceClassifierOutput

            return SequenceClassifierOutput(loss=loss, logits=logits)
        return {"loss": loss, "logits": logits}


def accuracy(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((np.asarray(p.predictions).argmax(-1) == p.label_ids).mean())}


def tiny_gpt2(n_layer: int = 1, dropout: bool = True):
    """A seeded GPT-2 of a few thousand weights (16 wide, 2 heads, 32 tokens); without ``dropout``
    its three dropouts are 0, for tests that compare numbers across runs."""
    import transformers

    torch.manual_seed(0)
    off = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, n_positions=16, **off
        )
    )


def args(out: Path, **kw) -> TrainingArguments:
    return TrainingArguments(
        str(out),
        num_train_epochs=kw.pop("num_train_epochs", 2),
        learning_rate=5e-2,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        disable_tqdm=True,
        save_strategy=kw.pop("save_strategy", "no"),
        **kw,
    )
