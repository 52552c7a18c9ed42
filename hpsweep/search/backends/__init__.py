"""Search backends. Each is one module behind `Backend`, whose `Backend.searcher` is an
`AskTellSearcher` (the search layer's loop asks and tells it) or a `Driver` (it starts its
trials itself). `get_backend` imports a backend lazily, so an extra that is not installed costs
nothing until its backend is asked for."""

from __future__ import annotations

import importlib
from typing import Any

from hpsweep.errors import TrialFailed, UserError
from hpsweep.search.ask_tell import AskTellSearcher, ObjectiveValue, TrialEnd
from hpsweep.search.backends._base import Backend, Driver, Searcher, TrialFunction
from hpsweep.search.options import SearchOptions

#: name -> (module, class, pip extra that provides its library), imported when asked for; or the
#: backend class itself (`register_backend`).
BACKENDS: dict[str, tuple[str, str, str] | type[Backend]] = {
    "optuna": ("._optuna", "OptunaBackend", "hpsweep"),
    "ray": ("._ray", "RayBackend", "hpsweep[ray]"),
    "wandb": ("._wandb", "WandbBackend", "hpsweep[wandb]"),
}


def register_backend(name: str, cls: type[Backend]) -> None:
    """Make ``cls`` the backend ``--backend name`` / ``backend=name`` runs, in this process (a
    backend kept outside hpsweep; tests/search/backends/test_seam.py registers one).

    ``cls`` subclasses `Backend` and is, or hands out (`Backend.searcher`), an
    `AskTellSearcher` or a `Driver`; a name already taken is refused.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"register_backend({name!r}, {cls!r}): a backend subclasses Backend")
    if name in BACKENDS:
        raise ValueError(f"register_backend({name!r}, ...): the name is taken; choose another")
    BACKENDS[name] = cls


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
    entry = BACKENDS[name]
    if isinstance(entry, type):
        return entry
    module_name, class_name, extra = entry
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
    "AskTellSearcher",
    "Backend",
    "BACKENDS",
    "Driver",
    "ObjectiveValue",
    "Searcher",
    "SearchOptions",
    "TrialEnd",
    "TrialFailed",
    "TrialFunction",
    "backend_class",
    "get_backend",
    "register_backend",
    "transformers_keywords",
]
