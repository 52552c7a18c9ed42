"""Loading a space file: a Python module whose top-level names describe a sweep.

``args`` may be a ``transformers.TrainingArguments`` (converted by field name). An ``objective``
that is a function of a trial, as Optuna's examples define ``objective(trial)``, is refused with
the fix (rename it): hpsweep trains each trial itself, and its objective reads the metrics.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError, did_you_mean
from hpsweep.search.objective import check_objective
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.hf_compat.args import as_training_arguments

REQUIRED = ("model_init", "args", "train_dataset")
OPTIONAL = (
    "space",
    "hp_space",
    "eval_dataset",
    "compute_metrics",
    "objective",
    "direction",
    "data_collator",
    "callbacks",
    "hp_name",
    "processing_class",
    "preprocess_logits_for_metrics",
    "compute_loss_func",
)


@dataclass
class SpaceFile:
    """The names a space file defines (docs/space-file.md)."""

    path: Path
    module: Any
    model_init: Callable[..., Any]
    args: TrainingArguments
    train_dataset: Any
    eval_dataset: Any = None
    space: dict[str, Any] | None = None
    hp_space: Callable[..., Any] | None = None
    compute_metrics: Callable[..., Any] | None = None
    objective: Any = None
    direction: Any = "minimize"
    data_collator: Callable[..., Any] | None = None
    callbacks: list[Any] = field(default_factory=list)
    hp_name: Callable[..., str] | None = None
    processing_class: Any = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    compute_loss_func: Callable[..., Any] | None = None


def load_space_file(path: str | Path) -> SpaceFile:
    """Import ``path`` and read its names; any problem is one `UserError` line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: no such space file; give the path of a .py file defining model_init, args, space"
        )
    module_name = f"hpsweep_space_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None or path.suffix != ".py":
        raise UserError(f"{path}: a space file is a Python file ending in .py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # functions defined there must pickle by reference in workers
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except UserError as exc:
        sys.modules.pop(module_name, None)
        raise UserError(f"{path}: {exc}") from None
    except (SystemExit, KeyboardInterrupt) as exc:  # sys.exit() or an input() prompt in the file
        sys.modules.pop(module_name, None)
        raise UserError(
            f"{path}: importing the space file raised {type(exc).__name__}; a space file only "
            "defines names (move the script's run code under `if __name__ == '__main__':`)"
        ) from None
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise UserError(
            f"{path}:{exc.lineno}: syntax error: {exc.msg}; fix the space file"
        ) from None
    except Exception as exc:
        sys.modules.pop(module_name, None)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        where = f":{frames[-1].lineno}" if frames else ""
        raise UserError(
            f"{path}{where}: importing the space file raised {type(exc).__name__}: {exc}"
        ) from None
    finally:
        sys.path.remove(str(path.parent.resolve()))
    names = {
        n: getattr(module, n) for n in REQUIRED + OPTIONAL if getattr(module, n, None) is not None
    }
    defined = [n for n in vars(module) if not n.startswith("_")]
    for name in REQUIRED:
        if name not in names:
            raise UserError(
                f"{path}: the space file defines no {name!r}{did_you_mean(name, defined)}; "
                f"add a module-level {name}"
            )
    if "space" not in names and "hp_space" not in names:
        raise UserError(
            f"{path}: the space file defines neither 'space' nor 'hp_space'"
            f"{did_you_mean('space', defined)}; add space = {{'learning_rate': hpsweep.Float(1e-4, 1e-1)}}"
        )
    # a transformers.TrainingArguments too
    names["args"] = as_training_arguments(names["args"], f"{path}: args")
    check_objective(names.get("objective"), f"{path}: objective")
    callbacks = names.pop("callbacks", [])
    return SpaceFile(path=path, module=module, callbacks=list(callbacks), **names)
