"""Optuna's ``pytorch/pytorch_simple.py`` example (optuna/optuna-examples, MIT licence) moved to a
space file. Its code is kept as it was, with two changes:

- its ``objective(trial)`` is renamed ``optuna_objective``: in a space file ``objective`` names the
  metric to optimise, and hpsweep refuses a function of a trial there;
- FashionMNIST (a download) is replaced by a synthetic 10-class problem of the same shape.

The hpsweep part is at the end: ``model_init`` is the example's ``define_model(trial)`` with its
loss attached, ``hp_space`` samples the optimizer and learning rate as the example does, and each
epoch's accuracy is reported to Optuna's pruner as the example's loop did.

    hpsweep run search_spaces/optuna_pytorch_simple.py --n-trials 20

``python search_spaces/optuna_pytorch_simple.py`` still runs the example's own loop.
"""

import os

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
from optuna.trial import TrialState

import hpsweep

DEVICE = torch.device("cpu")
BATCHSIZE = 128
CLASSES = 10
DIR = os.getcwd()
EPOCHS = 10
LOG_INTERVAL = 10
N_TRAIN_EXAMPLES = BATCHSIZE * 30
N_VALID_EXAMPLES = BATCHSIZE * 10


def define_model(trial):
    # We optimize the number of layers, hidden units and dropout ratio in each layer.
    n_layers = trial.suggest_int("n_layers", 1, 3)
    layers = []

    in_features = 28 * 28
    for i in range(n_layers):
        out_features = trial.suggest_int(f"n_units_l{i}", 4, 128)
        layers.append(nn.Linear(in_features, out_features))
        layers.append(nn.ReLU())
        p = trial.suggest_float(f"dropout_l{i}", 0.2, 0.5)
        layers.append(nn.Dropout(p))

        in_features = out_features
    layers.append(nn.Linear(in_features, CLASSES))
    layers.append(nn.LogSoftmax(dim=1))

    return nn.Sequential(*layers)


class SyntheticFashion(torch.utils.data.Dataset):
    """28x28 "images" whose class is a fixed linear function of the pixels (FashionMNIST's shape)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, 28, 28, generator=g)
        w = torch.randn(28 * 28, CLASSES, generator=torch.Generator().manual_seed(0))
        self.y = (self.x.view(n, -1) @ w).argmax(-1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def get_mnist():
    # Load FashionMNIST dataset.
    train_loader = torch.utils.data.DataLoader(
        SyntheticFashion(N_TRAIN_EXAMPLES, seed=1),
        batch_size=BATCHSIZE,
        shuffle=True,
    )
    valid_loader = torch.utils.data.DataLoader(
        SyntheticFashion(N_VALID_EXAMPLES, seed=2),
        batch_size=BATCHSIZE,
        shuffle=True,
    )

    return train_loader, valid_loader


def optuna_objective(trial):

    # Generate the model.
    model = define_model(trial).to(DEVICE)

    # Generate the optimizers.
    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(optim, optimizer_name)(model.parameters(), lr=lr)

    # Get the FashionMNIST dataset.
    train_loader, valid_loader = get_mnist()

    # Training of the model.
    for epoch in range(EPOCHS):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            # Limiting training data for faster epochs.
            if batch_idx * BATCHSIZE >= N_TRAIN_EXAMPLES:
                break

            data, target = data.view(data.size(0), -1).to(DEVICE), target.to(DEVICE)

            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()

        # Validation of the model.
        model.eval()
        correct = 0
        with torch.no_grad():
            for batch_idx, (data, target) in enumerate(valid_loader):
                # Limiting validation data.
                if batch_idx * BATCHSIZE >= N_VALID_EXAMPLES:
                    break
                data, target = data.view(data.size(0), -1).to(DEVICE), target.to(DEVICE)
                output = model(data)
                # Get the index of the max log-probability.
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()

        accuracy = correct / min(len(valid_loader.dataset), N_VALID_EXAMPLES)

        trial.report(accuracy, epoch)

        # Handle pruning based on the intermediate value.
        if trial.should_prune():
            raise optuna.exceptions.TrialPruned()

    return accuracy


# --- the sweep, for hpsweep -------------------------------------------------------------------------


class WithLoss(nn.Module):
    """The example's network, with the example's loss: forward(data, target) -> (loss, log-probs)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, data, target):
        output = self.net(data.view(data.size(0), -1))
        return F.nll_loss(output, target), output


def model_init(trial):
    return WithLoss(define_model(trial))


def hp_space(trial):
    # The example's optimizer choice and learning rate, under the TrainingArguments names.
    return {
        "optim": trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"]),
        "learning_rate": trial.suggest_float("lr", 1e-5, 1e-1, log=True),
    }


def train_dataset():
    return SyntheticFashion(N_TRAIN_EXAMPLES, seed=1)


def eval_dataset():
    return SyntheticFashion(N_VALID_EXAMPLES, seed=2)


def compute_metrics(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


args = hpsweep.TrainingArguments(
    output_dir="hpsweep-output/optuna_pytorch_simple",
    num_train_epochs=EPOCHS,
    per_device_train_batch_size=BATCHSIZE,
    per_device_eval_batch_size=BATCHSIZE,
    lr_scheduler_type="constant",
    max_grad_norm=0.0,
    save_total_limit=1,
)
objective = "eval_accuracy"
direction = "maximize"


if __name__ == "__main__":
    study = optuna.create_study(direction="maximize")
    study.optimize(optuna_objective, n_trials=100, timeout=600)

    pruned_trials = study.get_trials(deepcopy=False, states=[TrialState.PRUNED])
    complete_trials = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])

    print("Study statistics: ")
    print("  Number of finished trials: ", len(study.trials))
    print("  Number of pruned trials: ", len(pruned_trials))
    print("  Number of complete trials: ", len(complete_trials))

    print("Best trial:")
    trial = study.best_trial

    print("  Value: ", trial.value)

    print("  Params: ")
    for key, value in trial.params.items():
        print(f"    {key}: {value}")
