"""What hpsweep does with each field of ``transformers.TrainingArguments`` that its own
`TrainingArguments` does not share by name: the one table (`FIELDS`) that the keyword check, the
conversion of a transformers instance and the field table of docs/huggingface.md all read.

Each field is one of:

- ``honoured``: a field of hpsweep's `TrainingArguments` too; it does what it does there.
- ``mapped``: a field of hpsweep's `TrainingArguments` too, that sets a feature hpsweep has under
  another name (the reason names it).
- ``accepted``: any value is taken and changes nothing hpsweep computes (the reason says why).
- ``refused``: its default is taken; another value needs an engine or a feature hpsweep does not
  have, and is one line saying why and what to use.

    >>> FIELDS["deepspeed"][0], FIELDS["hub_token"][0], FIELDS["tf32"][0], FIELDS["project"][0]
    ('refused', 'mapped', 'honoured', 'accepted')
"""

from __future__ import annotations

from typing import Any

from hpsweep.errors import UserError

HONOURED, MAPPED, ACCEPTED, REFUSED = "honoured", "mapped", "accepted", "refused"

_PUSH = (
    "with push_to_hub=True, hyperparameter_search pushes the sweep's best run once it ends, as "
    "--push-to-hub does"
)
_ENGINE = "use --processes-per-trial N (accelerate data parallel)"
_LOGS = (
    "the level of hpsweep's and transformers' logs, set when a Trainer is built, on the main "
    "process and on the others, as in transformers"
)
_DDP = (
    "passed to DistributedDataParallel (accelerate's DistributedDataParallelKwargs) in a "
    "--processes-per-trial trial and under torchrun"
)
_GROUP = "the process group of a --processes-per-trial trial, or of torchrun's processes"
_DATALOADER = "only with dataloader_num_workers > 0, as in transformers"

#: field -> (what happens, its transformers default, why / what to use). Fields of transformers 4
#: that transformers 5 dropped are here too, so either version's instance converts.
FIELDS: dict[str, tuple[str, Any, str]] = {
    # data loading
    "dataloader_persistent_workers": (
        HONOURED,
        False,
        f"the workers live on between epochs; {_DATALOADER}",
    ),
    "dataloader_prefetch_factor": (
        HONOURED,
        None,
        f"batches each worker loads ahead; {_DATALOADER}",
    ),
    "dataloader_multiprocessing_context": (
        HONOURED,
        None,
        f"how workers start ('spawn', 'fork', 'forkserver'); {_DATALOADER}",
    ),
    "dataloader_in_order": (
        HONOURED,
        True,
        f"False: batches as soon as a worker has one, not in dispatch order; {_DATALOADER}",
    ),
    # logging and metrics
    "log_level": (HONOURED, "passive", _LOGS),
    "log_level_replica": (HONOURED, "warning", _LOGS),
    "log_on_each_node": (HONOURED, True, _LOGS),
    "logging_nan_inf_filter": (
        HONOURED,
        True,
        "a NaN or inf step loss is logged (and counted in train_loss) as the mean of the logging "
        "interval's steps so far",
    ),
    "skip_memory_metrics": (
        HONOURED,
        True,
        "False adds train_/eval_mem_cpu_alloc_delta and _peaked_delta (and _mem_gpu_ on CUDA) to "
        "the metrics",
    ),
    "include_num_input_tokens_seen": (
        HONOURED,
        "no",
        "'all' (or True) counts the main input's tokens, 'non_padding' those its attention_mask "
        "keeps; every log and state.num_input_tokens_seen carry the count",
    ),
    "project": (ACCEPTED, "huggingface", "Trackio is not started; a sweep is tracked by --mlflow"),
    "trackio_space_id": (ACCEPTED, None, "Trackio is not started; use --mlflow"),
    "trackio_bucket_id": (ACCEPTED, None, "Trackio is not started; use --mlflow"),
    "trackio_static_space_id": (ACCEPTED, None, "Trackio is not started; use --mlflow"),
    # evaluation
    "eval_accumulation_steps": (
        HONOURED,
        None,
        "an evaluation's gathered predictions stay on the device for N batches, then move to the "
        "CPU together (None: each batch's as it ends, as with 1; transformers keeps them all there)",
    ),
    "eval_do_concat_batches": (
        HONOURED,
        True,
        "False: predictions, labels, inputs and losses reach compute_metrics and predict() as lists "
        "of one array per batch",
    ),
    "eval_use_gather_object": (
        REFUSED,
        False,
        "predictions are gathered as tensors; return tensors from the model",
    ),
    "batch_eval_metrics": (
        HONOURED,
        False,
        "compute_metrics(batch, compute_result=) is called on each evaluation batch's gathered "
        "tensors, compute_result=True on the last, whose metrics the evaluation reports",
    ),
    "average_tokens_across_devices": (
        ACCEPTED,
        True,
        "hpsweep passes no num_items_in_batch: each batch's loss is its own mean",
    ),
    "past_index": (REFUSED, -1, "models' past states are not fed back; leave it -1"),
    "use_legacy_prediction_loop": (ACCEPTED, False, "hpsweep has one prediction loop"),
    # hardware and memory
    "tf32": (
        HONOURED,
        None,
        "TF32 matmuls and convolutions on or off on a GPU that has them (compute capability 8+); "
        "on a CPU or an older GPU it is accepted and changes nothing",
    ),
    "torch_empty_cache_steps": (
        HONOURED,
        None,
        "the accelerator's memory cache is emptied every N optimizer steps; on a CPU it changes "
        "nothing",
    ),
    "use_cache": (ACCEPTED, False, "the model's config is left as the model sets it"),
    # checkpoints and resuming
    "save_on_each_node": (ACCEPTED, False, "a trial runs on one machine; its first process saves"),
    "resume_from_checkpoint": (
        HONOURED,
        None,
        "train() without one of its own resumes from it (True: the latest in output_dir); a "
        "sweep's trials resume from their own checkpoints, as transformers' search ignores it",
    ),
    "restore_callback_states_from_checkpoint": (
        ACCEPTED,
        False,
        "callbacks' states are restored on every resume, so a resumed run stops where it would have",
    ),
    "ignore_data_skip": (
        HONOURED,
        False,
        "True: a resumed run starts its epoch again at the first batch, not where it stopped",
    ),
    "enable_jit_checkpoint": (
        REFUSED,
        False,
        "no checkpoint on SIGTERM; a trial cut short resumes from its last save_strategy checkpoint",
    ),
    # the Hub
    "hub_model_id": (
        MAPPED,
        None,
        f"the repo; {_PUSH} (None: the output folder's name, under the token's user)",
    ),
    "hub_strategy": (
        MAPPED,
        "every_save",
        f"'every_save' and 'end': {_PUSH}, never a trial's checkpoints; 'checkpoint' and "
        "'all_checkpoints' push training state and are refused with push_to_hub=True",
    ),
    "hub_token": (
        MAPPED,
        None,
        "the token of that push (None: `hf auth login` / HF_TOKEN); never in a log, a record, "
        "training_args.json, repr() or a trial's arguments",
    ),
    "hub_private_repo": (MAPPED, None, f"the repo is created private (--hub-private); {_PUSH}"),
    "hub_always_push": (
        ACCEPTED,
        False,
        "the best run is pushed once, when the sweep ends, and waited for: no push is ever skipped",
    ),
    "hub_revision": (MAPPED, None, f"the branch pushed to (--hub-revision); {_PUSH}"),
    # processes and engines
    "local_rank": (ACCEPTED, -1, "the process's rank comes from accelerate"),
    "ddp_backend": (
        HONOURED,
        None,
        f"the backend of {_GROUP} (None: gloo on the CPU, nccl on GPUs)",
    ),
    "ddp_timeout": (
        HONOURED,
        1800,
        f"seconds a process of {_GROUP} waits for the others (unset in hpsweep's arguments: "
        "HPSWEEP_DIST_TIMEOUT_S, else 600)",
    ),
    "ddp_find_unused_parameters": (
        HONOURED,
        None,
        f"{_DDP} (None: torch's False; transformers' None is True unless activation "
        "checkpointing is on)",
    ),
    "ddp_bucket_cap_mb": (HONOURED, None, f"{_DDP} (None: torch's 25)"),
    "ddp_broadcast_buffers": (HONOURED, None, f"{_DDP} (None: torch's True)"),
    "ddp_static_graph": (HONOURED, None, f"{_DDP} (None: torch's False)"),
    "accelerator_config": (
        REFUSED,
        None,
        "hpsweep configures accelerate itself; leave it None",
    ),
    "parallelism_config": (REFUSED, None, f"tensor/context parallelism is not run; {_ENGINE}"),
    "fsdp": (REFUSED, None, f"FSDP is not run; {_ENGINE}"),
    "fsdp_config": (REFUSED, None, f"FSDP is not run; {_ENGINE}"),
    "deepspeed": (REFUSED, None, f"DeepSpeed is not run; {_ENGINE}"),
    "debug": (REFUSED, "", "transformers' debug modes are not run; leave it ''"),
    "optim_target_modules": (
        REFUSED,
        None,
        "GaLore/APOLLO optimizers are not among optim's; pick another optim",
    ),
    "use_liger_kernel": (
        REFUSED,
        False,
        "Liger kernels are not applied; patch the model with liger_kernel in model_init",
    ),
    "liger_kernel_config": (
        REFUSED,
        None,
        "Liger kernels are not applied; patch the model with liger_kernel in model_init",
    ),
}

#: The fields `FIELDS` lists that hpsweep's `TrainingArguments` holds too.
HONOURED_FIELDS = frozenset(
    name for name, (fate, _, _) in FIELDS.items() if fate in (HONOURED, MAPPED)
)


def check(name: str, value: Any, default: Any, where: str) -> None:
    """Raise a one-line `UserError` when ``name`` is refused and ``value`` is not ``default``."""
    fate, _, why = FIELDS[name]
    if fate == REFUSED and not same(value, default):
        raise UserError(f"{where}: {name}={value!r} is not supported: {why}")


def same(a: Any, b: Any) -> bool:
    """``a == b``, for values whose ``==`` raises or is not a bool too."""
    try:
        return bool(a == b)
    except Exception:
        return a is b


def markdown_table() -> str:
    """The table of these fields in docs/huggingface.md, one row each, in `FIELDS`' order."""
    rows = ["| field | what happens | why / what to use |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {fate} | {why} |" for name, (fate, _, why) in FIELDS.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
