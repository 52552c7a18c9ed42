"""Search backends. Each is one module behind `Backend`; `get_backend` imports it lazily, so an
extra that is not installed costs nothing until its backend is asked for."""

from __future__ import annotations

import importlib
from typing import Any

from hpsweep.errors import TrialFailed, UserError
from hpsweep.search.backends._base import Backend, TrialFunction
from hpsweep.search.options import SearchOptions

#: name -> (module, class, pip extra that provides its library)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "optuna": ("._optuna", "OptunaBackend", "hpsweep"),
    "ray": ("._ray", "RayBackend", "hpsweep[ray]"),
    "wandb": ("._wandb", "WandbBackend", "hpsweep[wandb]"),
}


def get_backend(name: str, settings: SearchOptions) -> Backend:
    """The backend called ``name``, constructed (and so validated) for ``settings``."""
    return backend_class(name)(settings)


def transformers_keywords(
    name: str, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """`Backend.transformers_keywords` of the backend ``name``; nothing changed when there is no such
    backend or its package is missing (`get_backend` then says so)."""
    try:
        cls = backend_class(name)
    except UserError:
        return options, {}, None
    return cls.transformers_keywords(options)


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise UserError(f"--backend {name!r} is not one of {', '.join(BACKENDS)}")
    module_name, class_name, extra = BACKENDS[name]
    try:
        module = importlib.import_module(module_name, __name__)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("hpsweep"):
            raise UserError(
                f"the {name} backend needs the package {exc.name!r}; install it with: pip install '{extra}'"
            ) from None
        raise
    return getattr(module, class_name)


__all__ = [
    "Backend",
    "SearchOptions",
    "TrialFailed",
    "TrialFunction",
    "get_backend",
    "transformers_keywords",
    "BACKENDS",
]
