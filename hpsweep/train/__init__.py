"""One training run: the loop over `accelerate`, its arguments, callbacks, evaluation and
checkpoints, and the surface transformers' ``Trainer`` users know.

- `trainer`: `Trainer` (``train``, ``evaluate``, ``predict``, ``save_model``);
- `training_loop`: `TrainingLoop`, one run of ``train`` step by step;
- `arguments`: `TrainingArguments`, and applying a trial's params to a copy of them;
- `callbacks`: `TrainerCallback` and the built-in callbacks (NEFTune's among them);
- `evaluation`, `predictions`, `metrics`: passes without gradients, what a model returns, speed;
- `checkpointing`: the ``checkpoint-<step>`` folders of a run;
- `optim`, `steps`, `accelerator`, `data`, `model_init`: the pieces the loop is made of;
- `batch_size_finder`: ``auto_find_batch_size``, training again with half the batch;
- `transformers_args`, `transformers_view`: transformers' ``TrainingArguments``, converted to ours,
  and what it offers besides its fields;
- `transformers_components`, `transformers_api`: the Trainer arguments its users pass beside the
  model, and its ``Trainer`` methods around the loop (``log_metrics``, ``add_callback``, ...).

Nothing here imports `hpsweep.search`: a run talks to a `hpsweep.Trial` and never names a
backend. The one exception is ``Trainer.hyperparameter_search``, which hands the trainer to the
search layer (a lazy import, as transformers' own method does).
"""
