"""The documentation site builds, with every link, anchor and API reference resolved.

`mkdocs build --strict` turns every warning into a failure: a page linking to a page or heading
that is gone, a page left out of the navigation, an API reference (`::: hpsweep...`) naming
something renamed or removed, a docstring whose arguments do not match the signature. So a
change that breaks the docs fails here, in CI, not on the published site.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import hpsweep

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in DOCS.glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert name in pages, f"{page.name} was not built"
    api = (site / "api" / "index.html").read_text()
    for name in hpsweep.__all__:
        assert f'id="{_anchor(name)}"' in api, f"the API reference has no entry for hpsweep.{name}"


def test_every_public_name_has_a_reference_entry() -> None:
    """A name added to hpsweep.__all__ gets its `::: ...` entry in docs/api.md."""
    entries = set(
        re.findall(r"^::: hpsweep\.[\w.]*?\.?(\w+)$", (DOCS / "api.md").read_text(), re.M)
    )
    missing = set(hpsweep.__all__) - entries
    assert not missing, f"docs/api.md has no `::: ...` entry for {sorted(missing)}"


def _anchor(name: str) -> str:
    """The id mkdocstrings gives an object's heading: its full dotted path."""
    entry = re.search(rf"^::: (hpsweep\.[\w.]*\b{name})$", (DOCS / "api.md").read_text(), re.M)
    assert entry, f"docs/api.md has no entry for {name}"
    return entry.group(1)


def test_the_readme_and_bench_links_lead_somewhere() -> None:
    """The README and bench/README.md are read on the repository's host, outside the site: their
    relative links (into docs/, to files) must name files that exist, and their anchors headings
    that exist on the docs page they point at."""
    for page in (ROOT / "README.md", ROOT / "bench" / "README.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            assert file.exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", _with_snippets(file.read_text()), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{target}: no such heading"


def _slug(heading: str) -> str:
    """The anchor MkDocs (and the repository's host) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.lower().replace("`", ""))
    return re.sub(r"\s+", "-", text.strip())


def _with_snippets(text: str) -> str:
    """A page with the files it includes (`--8<-- "path:section"`) appended, as the site shows it."""
    included = re.findall(r'^--8<-- "([^":]+)(?::[\w-]+)?"$', text, re.M)
    return "\n".join([text, *((ROOT / path).read_text() for path in included)])
