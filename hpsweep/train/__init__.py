"""One training run: the loop over `accelerate`, its arguments, callbacks, evaluation and
checkpoints, and the surface transformers' ``Trainer`` users know.

- `trainer`: `Trainer` (``train``, ``evaluate``, ``predict``, ``save_model``);
- `training_loop`: `TrainingLoop`, one run of ``train`` step by step;
- `arguments`: `TrainingArguments`, and applying a trial's params to a copy of them;
- `callbacks`: `TrainerCallback` and the built-in callbacks (NEFTune's among them);
- `evaluation`, `predictions`, `metrics`: passes without gradients, what a model returns, speed;
- `trainer_checkpoints`: the trainer's side of the ``checkpoint-<step>`` folders of a run (the
  files themselves are `hpsweep.runs`');
- `optim`, `steps`, `accelerator`, `data`, `model_init`: the pieces the loop is made of;
- `batch_size_finder`: ``auto_find_batch_size``, training again with half the batch;
- `hf_compat`: compatibility with transformers (its ``TrainingArguments`` fields, converted to
  ours; the Trainer arguments its users pass beside the model; its ``Trainer`` methods around the
  loop, such as ``log_metrics`` and ``add_callback``).

Nothing here imports `hpsweep.search`: a run talks to a `hpsweep.Trial` and never names a
backend. The one exception is ``Trainer.hyperparameter_search``, which hands the trainer to the
search layer (a lazy import, as transformers' own method does).
"""
