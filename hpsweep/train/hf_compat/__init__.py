"""Compatibility with transformers, for code written for its ``Trainer``: nothing here imports it.

- `fields`: what hpsweep does with each ``TrainingArguments`` field it does not share by name;
- `args`: a ``transformers.TrainingArguments`` taken in as ours;
- `view`: what transformers' ``TrainingArguments`` offers besides its fields;
- `components`: the Trainer arguments its users pass beside the model (``processing_class``,
  ``preprocess_logits_for_metrics``, ``compute_loss_func``);
- `api`: transformers' ``Trainer`` methods around the loop (``log_metrics``, ``add_callback``, ...).
"""
