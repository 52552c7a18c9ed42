"""``best/`` as a model folder: which files of a checkpoint are the model's, what model they hold,
and the README (a model card the Hub reads) that says so.

A checkpoint holds what resuming a run needs; a model folder holds what transformers'
``save_model`` writes: the weights, ``config.json`` (and ``generation_config.json``), the tokenizer
or processor, and the arguments it was trained with (``training_args.json``, without secrets).
The optimizer, schedule, RNG and gradient-scaler state and ``trainer_state.json`` stay in the
trial's checkpoints, so ``hf upload`` of ``best/`` publishes the model and nothing else.

The card's metadata block is written with huggingface_hub's ``ModelCardData``; the pipeline tag
and the Auto class come from transformers' own tables, so a card names what transformers names.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpsweep.redaction import scrub
from hpsweep.runs._checkpoint_files import MODEL_CLASS_KEY, SCALER_FILE
from hpsweep.runs._records import BestRun

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData

#: Files of a checkpoint that are training state, not the model: never in ``best/``, never pushed.
TRAINING_STATE = frozenset(
    {"optimizer.pt", "scheduler.pt", "rng_state.pth", SCALER_FILE, "trainer_state.json"}
)
ARGS_FILE = "training_args.json"
README = "README.md"
WEIGHTS = "model.safetensors"
CARD_TAGS = ["hpsweep", "hyperparameter-search"]
#: A file that ``AutoProcessor`` reads, else one ``AutoTokenizer`` reads: the folder carries one.
_PROCESSOR_FILES = {
    "processor_config.json": "AutoProcessor",
    "preprocessor_config.json": "AutoProcessor",
    "tokenizer_config.json": "AutoTokenizer",
}

Opener = Callable[[str], Any]  # a name in the folder -> a binary file object (a context manager)


# --- the model's files ---------------------------------------------------------------------------


def is_model_file(name: str) -> bool:
    """Whether ``name`` (a path inside a checkpoint, ``/``-separated) belongs in a model folder."""
    hidden = any(part.startswith(".") for part in name.split("/"))
    return not hidden and name not in TRAINING_STATE and name != README


def model_files(folder: Path) -> list[str]:
    """The model's files in ``folder``, as ``/``-separated names inside it, sorted."""
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(n for n in names if is_model_file(n))


def copy_model(checkpoint: Path, dest: Path) -> list[str]:
    """Put the model's files of ``checkpoint`` into ``dest`` (hard links where they can be:
    checkpoint files are never modified once their folder is renamed into place, and rotation
    only unlinks them); ``training_args.json`` is written again without secrets. Returns the
    names."""
    names = model_files(checkpoint)
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == ARGS_FILE:
            target.write_bytes(clean_args((checkpoint / name).read_bytes()))
        else:
            _link_or_copy(checkpoint / name, target)
    return names


def clean_args(data: bytes) -> bytes:
    """``training_args.json`` without the entries that look like credentials (`scrub`)."""
    try:
        args = json.loads(data)
    except ValueError:
        return data
    return (json.dumps(scrub(args), indent=2, default=str) + "\n").encode()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another device, or a file system without hard links
        shutil.copy2(src, dst)


# --- what model the folder holds -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelKind:
    """What a model folder holds, as its card names it."""

    #: ``transformers`` for a transformers model (a ``config.json`` it wrote), else ``pytorch``.
    library: str
    #: The model's class: ``BertForSequenceClassification``, or ``space.Net`` (module and name).
    class_name: str | None = None
    #: The Auto class that builds that class from the folder (transformers' models).
    auto_class: str | None = None
    pipeline_tag: str | None = None
    #: ``AutoTokenizer`` or ``AutoProcessor`` when the folder carries one.
    preprocessor: str | None = None


def model_kind_of(folder: Path) -> ModelKind:
    """What the model folder (or checkpoint) at ``folder`` on this machine holds."""
    return model_kind(model_files(folder), lambda name: open(folder / name, "rb"))


def model_kind(names: Iterable[str], open_file: Opener) -> ModelKind:
    """What a folder of ``names`` holds, reading ``config.json`` or the safetensors header of
    ``model.safetensors`` through ``open_file`` (a local folder's or an object store's)."""
    names = set(names)
    preprocessor = next((v for k, v in _PROCESSOR_FILES.items() if k in names), None)
    config = _read_json(open_file, "config.json") if "config.json" in names else {}
    if "transformers_version" in config:
        arch = (config.get("architectures") or [None])[0]
        task, auto = _transformers_tables(arch, config.get("model_type"))
        return ModelKind("transformers", arch, auto, task, preprocessor)
    metadata = _weights_metadata(open_file) if WEIGHTS in names else {}
    return ModelKind("pytorch", metadata.get(MODEL_CLASS_KEY), preprocessor=preprocessor)


def _read_json(open_file: Opener, name: str) -> dict[str, Any]:
    with open_file(name) as f:
        try:
            data = json.loads(f.read())
        except ValueError:
            return {}
    return data if isinstance(data, dict) else {}


def _weights_metadata(open_file: Opener) -> dict[str, str]:
    """The ``__metadata__`` of ``model.safetensors``, read from its header alone (an 8-byte
    little-endian length, then that much JSON: the format's own layout), so a model in an object
    store is not downloaded for it; safetensors' ``safe_open`` reads local files only."""
    with open_file(WEIGHTS) as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else {}
        except ValueError:
            return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _transformers_tables(arch: str | None, model_type: str | None) -> tuple[str | None, str | None]:
    """The pipeline tag of ``arch`` (transformers' model-card table, as its ``Trainer`` finds it)
    and the first Auto class whose mapping builds ``arch`` for ``model_type``."""
    if not arch:
        return None, None
    try:
        from transformers import CONFIG_MAPPING
        from transformers.modelcard import TASK_MAPPING
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None, None
    task = next((t for t, names in TASK_MAPPING.items() if arch in _flat(names.values())), None)
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if config_class is None:
        return task, None
    for name in modeling_auto.__all__:
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        if name.startswith("AutoModel") and mapping is not None and config_class in mapping:
            with contextlib.suppress(Exception):  # a model whose extra package is missing
                if arch in (c.__name__ for c in _flat([mapping[config_class]])):
                    return task, name
    return task, None


def _flat(values: Iterable[Any]) -> list[Any]:
    """Mapping values, where one may be a tuple of several."""
    return [x for v in values for x in (v if isinstance(v, (tuple, list)) else (v,))]


# --- the card ------------------------------------------------------------------------------------


def card_metadata(best: BestRun, kind: ModelKind, *, name: str, **sweep: Any) -> ModelCardData:
    """The card's metadata block (a ``ModelCardData``): library, pipeline tag, tags, the objective
    as an evaluation result (``model-index``), and under ``hpsweep`` the trial it came from (its
    number, run, hyperparameters without secrets) with ``sweep``'s entries."""
    from huggingface_hub import EvalResult, ModelCardData

    summary = best.run_summary
    objective = summary.get("objective_name", "objective")
    results = None
    if isinstance(best.objective, (int, float)):
        results = [
            EvalResult(
                task_type=kind.pipeline_tag or "other",
                dataset_type="eval_dataset",
                dataset_name="the sweep's evaluation data",
                metric_type=objective.removeprefix("eval_"),
                metric_name=objective,
                metric_value=best.objective,
            )
        ]
    trial = {
        "objective": {
            "name": objective,
            "value": best.objective,
            "direction": ",".join(summary.get("directions", ["minimize"])),
        },
        "hyperparameters": scrub(best.hyperparameters),
        "backend": summary.get("backend"),
        "best_trial": summary.get("number"),
        "best_run": Path(best.run_dir).name,
    }
    return ModelCardData(
        library_name=kind.library,
        pipeline_tag=kind.pipeline_tag,
        tags=list(CARD_TAGS),
        model_name=name,
        eval_results=results,
        hpsweep={**trial, **sweep},
    )


def card_usage(kind: ModelKind, where: str, *, hub: bool = False) -> list[str]:
    """The card's code block that loads the model from ``where`` (a folder, or a Hub repo id with
    ``hub``): the model's own Auto class for a transformers model, its class and safetensors for
    a plain torch one."""
    if kind.library == "transformers":
        return _transformers_usage(kind, where)
    module, _, cls = (kind.class_name or "").rpartition(".")
    if "<" in module or not cls:  # unknown, or a class defined inside a function
        imports, build = [], "model = MyModel(...)  # the class model_init builds"
    else:
        imports = [f"from {module} import {cls}" if module else f"# {cls}: from your own code"]
        build = f"model = {cls}(...)  # as model_init builds it for the hyperparameters above"
    weights = f"hf_hub_download({_q(where)}, {_q(WEIGHTS)})" if hub else _q(f"{where}/{WEIGHTS}")
    fetch = ["from huggingface_hub import hf_hub_download"] if hub else []
    return [
        "```python",
        *fetch,
        "from safetensors.torch import load_model",
        *imports,
        "",
        build,
        f"load_model(model, {weights})",
        "```",
    ]


def _transformers_usage(kind: ModelKind, where: str) -> list[str]:
    cls = kind.auto_class or kind.class_name or "AutoModel"
    imported = [cls] if kind.auto_class or _in_transformers(cls) else []
    imported += [kind.preprocessor] if kind.preprocessor else []
    lines = ["```python"]
    if imported:
        lines.append(f"from transformers import {', '.join(imported)}")
    if cls not in imported:
        lines.append(f"# {cls}: the class model_init builds, from your own code")
    lines += ["", f"model = {cls}.from_pretrained({_q(where)})"]
    if kind.preprocessor:
        variable = "processor" if kind.preprocessor == "AutoProcessor" else "tokenizer"
        lines.append(f"{variable} = {kind.preprocessor}.from_pretrained({_q(where)})")
    return [*lines, "```"]


def _q(text: str) -> str:
    """``text`` as a Python string literal in double quotes, as the snippets are written."""
    return json.dumps(text)


def _in_transformers(name: str) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, name)


def best_run_readme(best: BestRun, kind: ModelKind, where: str) -> str:
    """README.md of ``best/``: the metadata block, where the model came from, and how to load it
    from ``where`` (the folder as the user names it, ``out/best``)."""
    from huggingface_hub import ModelCard

    run = Path(best.run_dir).name
    data = card_metadata(best, kind, name=run)
    objective = data.hpsweep["objective"]
    rows = [(k, str(v).replace("|", "\\|")) for k, v in data.hpsweep["hyperparameters"].items()]
    params = "\n".join(f"| `{k}` | `{v}` |" for k, v in rows)
    body = [
        f"# Best run: {run}",
        "",
        f"Trial {data.hpsweep['best_trial']} of an [hpsweep](https://pypi.org/project/hpsweep/) "
        f"hyperparameter search: **{objective['name']} = {objective['value']}** "
        f"({objective['direction']}).",
        "",
        "| parameter | value |\n| --- | --- |\n" + params,
        "",
        "## Use",
        "",
        *card_usage(kind, where),
        "",
        "The optimizer, schedule and RNG state stay in the trial's checkpoint (`best_run.json`"
        " names it): resume from there.",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"))
