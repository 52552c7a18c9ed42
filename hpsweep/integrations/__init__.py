"""Integrations around a sweep: MLflow tracking, the HTML report and pushing to the Hugging Face Hub.

Each lives in its own module and imports its library only when used::

    from hpsweep.integrations.mlflow import MLflowTracker      # --mlflow
    from hpsweep.integrations.report import write_report       # hpsweep report DIR
    from hpsweep.integrations.hub import PushToHubCallback, push_best   # hpsweep push DIR
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: Names that look like credentials: never logged, never written into a card.
SECRET_NAME = re.compile(
    r"secret|passw|credential|(^|[_.-])(token|pwd|key|auth|apikey)$", re.IGNORECASE
)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def _secret_env_values() -> list[str]:
    import os

    return [v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= 8]


def scrub(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without entries whose name looks like a credential or whose value holds one
    (a value of a secret-looking environment variable, or a Hugging Face token ``hf_...``)."""
    secrets = _secret_env_values()
    out = {}
    for name, value in values.items():
        text = str(value)
        if (
            is_secret_name(name)
            or any(s in text for s in secrets)
            or re.search(r"\bhf_[A-Za-z0-9]{20,}", text)
        ):
            continue
        out[name] = value
    return out


def redact_url(url: str) -> str:
    """``url`` without the user name and password it may carry (``https://u:p@host`` -> ``https://host``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
