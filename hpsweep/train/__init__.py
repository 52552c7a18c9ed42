"""One training run: the loop over `accelerate`, its arguments, callbacks, evaluation and
checkpoints, and the surface transformers' ``Trainer`` users know.

- `trainer`: `Trainer`, the loop (``train``, ``evaluate``, ``predict``, ``save_model``);
- `arguments`: `TrainingArguments`, and applying a trial's params to a copy of them;
- `callbacks`: `TrainerCallback` and the built-in callbacks;
- `evaluation`, `predictions`, `metrics`: passes without gradients, what a model returns, speed;
- `checkpointing`: the ``checkpoint-<step>`` folders of a run;
- `optim`, `steps`, `accelerator`, `data`, `model_init`: the pieces the loop is made of;
- `hf`, `transformers_view`: what transformers' users bring (its ``TrainingArguments``, its
  ``Trainer`` methods).

Nothing here imports `hpsweep.search`: a run talks to a `hpsweep.Trial` and never names a
backend. The one exception is ``Trainer.hyperparameter_search``, which hands the trainer to the
search layer (a lazy import, as transformers' own method does).
"""
