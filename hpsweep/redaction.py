"""What never leaves hpsweep: passwords and tokens, in URLs, params and environment variables.

Every side uses it (the search layer labels ``--storage`` URLs with it, integrations scrub MLflow
params and model cards), so it sits at the bottom of the layering with `hpsweep.errors`. A
password prints as ``***``; an entry that holds a secret is left out (docs/security.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

#: Names that look like credentials: never logged, never written into a card.
SECRET_NAME = re.compile(
    r"secret|passw|credential|(^|[_.-])(token|pwd|key|auth|apikey)$", re.IGNORECASE
)
HIDDEN = "***"
#: ``scheme://user:password@`` in text that does not parse as a URL
_USERINFO = re.compile(r"(://[^:/@\s]*):\S*@")
#: ``user:password@host`` with no scheme in front
_BARE_USERINFO = re.compile(r"^([^:/@\s]*):\S*@")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def _secret_env_values() -> list[str]:
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
    """``url`` with its password, and any query parameter named like one, as ``***``
    (``postgresql://hp:pw@host/db?sslpassword=x`` -> ``postgresql://hp:***@host/db?sslpassword=***``).
    The user name stays: it says who connects and opens nothing. Also ``hp:pw@host:5432`` given
    without a scheme; the rest of the text stays as it was written (``sqlite:////abs/path``)."""
    if "://" not in url:
        return _BARE_USERINFO.sub(rf"\1:{HIDDEN}@", url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a malformed port raises here, as it would when connecting
    except ValueError:
        return _USERINFO.sub(rf"\1:{HIDDEN}@", url)
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        hidden = f"{userinfo.partition(':')[0]}:{HIDDEN}@{hostinfo}"
        url = url.replace(parts.netloc, hidden, 1)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(is_secret_name(k) for k, _ in pairs):
        query = urlencode([(k, HIDDEN if is_secret_name(k) else v) for k, v in pairs], safe="*")
        url = url.replace(f"?{parts.query}", f"?{query}", 1)
    return url


def describe(value: Any) -> str:
    """How a setting that may hold credentials is shown (``--storage``, a tracking URI): a path
    or URL without its password, an object by its type and the URL it holds, if any (an Optuna
    ``RDBStorage``)."""
    if value is None or isinstance(value, (str, os.PathLike)):
        return redact_url(os.fspath(value or ""))
    url = getattr(value, "url", None)
    return (
        f"{type(value).__name__}({redact_url(url)})"
        if isinstance(url, str)
        else type(value).__name__
    )
