"""A small Hugging Face BERT, built from a config (no download), on a synthetic sentiment task.

    hpsweep run search_spaces/hf_text_classifier.py --n-trials 10

It proves transformers models work as they are: the batch is a dict with input_ids,
attention_mask and labels, the model returns its own output with loss and logits, and best/
holds config.json + model.safetensors, so `AutoModelForSequenceClassification.from_pretrained`
loads it. Needs the `hf` extra: pip install 'hpsweep[hf]'.
"""

import random

import torch

import hpsweep

POSITIVE = "good great fine lovely superb excellent happy brilliant pleasant wonderful".split()
NEGATIVE = "bad awful poor terrible horrible sad dreadful nasty grim dire".split()
FILLER = "the a film plot actor scene was is very quite really movie story ending music".split()
VOCAB = {w: i for i, w in enumerate(["[PAD]", "[CLS]", *POSITIVE, *NEGATIVE, *FILLER])}
MAX_LEN = 16


class Sentiment(torch.utils.data.Dataset):
    """Sentences of filler words with one or two sentiment words; label 1 when positive."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.rows = []
        for _ in range(n):
            label = rng.random() < 0.5
            words = rng.sample(FILLER, rng.randint(4, 10)) + rng.sample(
                POSITIVE if label else NEGATIVE, 2
            )
            rng.shuffle(words)
            ids = [VOCAB["[CLS]"], *(VOCAB[w] for w in words)][:MAX_LEN]
            self.rows.append((ids, int(label)))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, label = self.rows[i]
        pad = MAX_LEN - len(ids)
        return {
            "input_ids": torch.tensor(ids + [0] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(label),
        }


def train_dataset():
    return Sentiment(512, seed=1)


def eval_dataset():
    return Sentiment(256, seed=2)


def model_init(trial):
    from transformers import BertConfig, BertForSequenceClassification

    params = trial.params if trial is not None else {}
    hidden = params.get("hidden_size", 32)
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        num_hidden_layers=params.get("num_layers", 1),
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=MAX_LEN,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def compute_metrics(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


space = {
    "learning_rate": hpsweep.Float(1e-4, 1e-2, log=True),
    "warmup_ratio": hpsweep.Float(0.0, 0.2),
    "hidden_size": hpsweep.Categorical([16, 32, 64]),
    "num_layers": hpsweep.Int(1, 2),
}
args = hpsweep.TrainingArguments(
    output_dir="hpsweep-output/hf",
    num_train_epochs=3,
    per_device_train_batch_size=32,
    per_device_eval_batch_size=128,
    weight_decay=0.01,
    save_total_limit=1,
)
objective = "eval_accuracy"
direction = "maximize"
