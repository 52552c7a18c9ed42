"""The transformers the tests run against is one the ``hf`` extra admits: its floor is the oldest
release the Hugging Face tests were seen to pass on, so a run on an older one fails here, naming
it, rather than passing on behaviour nobody checked."""

from __future__ import annotations

import tomllib
import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from support import ROOT


def test_the_installed_transformers_is_one_the_hf_extra_admits() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["optional-dependencies"]["hf"]]
    (transformers_req,) = [r for r in wanted if r.name == "transformers"]
    installed = Version(transformers.__version__)
    assert transformers_req.specifier.contains(installed, prereleases=True), (
        f"transformers {installed} is installed, and pyproject.toml's hf extra asks for "
        f"{transformers_req}: install a release it admits"
    )
