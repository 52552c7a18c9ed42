"""The `accelerate.Accelerator` a run trains with: one per run, made from its arguments.

accelerate keeps its state per process; a process that trains several runs one after another
(a sweep's worker) resets it so that each run gets its own precision and accumulation. Processes
that a launcher started together (``torchrun --nproc_per_node N``) train each run together, on
the CPU too (`hpsweep.devices.process_group.join_launched`).
"""

from __future__ import annotations

import functools
from typing import Any

from hpsweep.devices.process_group import join_launched
from hpsweep.errors import UserError


def make_accelerator(args: Any) -> Any:
    """An ``Accelerator`` for ``args`` (``mixed_precision``, ``use_cpu``,
    ``gradient_accumulation_steps``, the ``ddp_*`` options); a precision the device cannot run is
    one `UserError`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, TorchDynamoPlugin

    _cache_accelerate_package_probes()
    join_launched(args)  # torchrun's processes train each run together
    # Each run may use a different precision and accumulation; accelerate keeps a process-wide
    # state (its process group, kept, is PartialState's).
    AcceleratorState._reset_state()
    GradientState._reset_state()
    # torch_compile: accelerate compiles the model in prepare, as transformers has it do
    dynamo = (
        TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        if args.torch_compile
        else None
    )
    try:
        acc = Accelerator(
            mixed_precision=args.mixed_precision,
            cpu=args.use_cpu,
            dynamo_plugin=dynamo,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            dataloader_config=DataLoaderConfiguration(
                use_seedable_sampler=True, data_seed=args.data_seed
            ),
            kwargs_handlers=ddp_kwargs(args),
        )
    except ValueError as exc:
        raise UserError(
            f"mixed_precision={args.mixed_precision!r}: {exc}; use 'no' or 'bf16' on CPU"
        ) from None
    if args.mixed_precision == "fp16" and acc.device.type == "cpu":
        # accelerate accepts it and trains in fp32 without saying so: a run the user did not ask for.
        raise UserError(
            "mixed_precision='fp16' (fp16=True) needs a CUDA GPU and this run is on the CPU; "
            "use bf16=True or no mixed precision on CPU"
        )
    apply_tf32(args.tf32, acc.device)
    return acc


#: transformers' ddp_* fields, each the DistributedDataParallel option of the same name
DDP_OPTIONS = ("find_unused_parameters", "bucket_cap_mb", "broadcast_buffers", "static_graph")


def ddp_kwargs(args: Any) -> list[Any]:
    """accelerate's ``DistributedDataParallelKwargs`` with the ``ddp_*`` options ``args`` sets (None
    leaves torch's default), for the model of a ``--processes-per-trial`` trial; none when unset."""
    from accelerate.utils import DistributedDataParallelKwargs

    given = {name: getattr(args, f"ddp_{name}", None) for name in DDP_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    return [DistributedDataParallelKwargs(**given)] if given else []


def apply_tf32(tf32: bool | None, device: Any) -> None:
    """transformers' ``tf32``: TF32 matmuls and convolutions on (True) or off (False) for the
    process, where the run's device has them (a CUDA GPU of compute capability 8 or more). On a
    CPU, or an older GPU, it changes nothing (transformers refuses it there; hpsweep runs the same
    arguments on every device). None leaves torch's setting."""
    import torch

    if tf32 is None or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.9's switch
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


def bare_model(model: Any) -> Any:
    """The user's module inside ``model``: without data-parallel wrappers or ``torch.compile``'s (its
    weights' names, its forward's signature and its config are the module's own). What
    ``Accelerator.unwrap_model(model, keep_torch_compile=False)`` does, without the accelerator."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


def is_prepared_loader(loader: Any) -> bool:
    """Whether ``loader`` came out of ``Accelerator.prepare`` (one process's shard of the data)."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    return isinstance(loader, (DataLoaderShard, DataLoaderDispatcher))


def _cache_accelerate_package_probes() -> None:
    """accelerate's optimizer asks `is_lomo_available()` twice per step, and each answer is a
    filesystem search (importlib find_spec + package metadata): ~0.3 ms a step, a third of a small
    model's step here. Installed packages do not change while we train, so ask once."""
    import accelerate.optimizer as acc_optimizer

    probe = acc_optimizer.is_lomo_available
    if not hasattr(probe, "cache_info"):
        acc_optimizer.is_lomo_available = functools.cache(probe)
