"""weft.api, the plugin API beyond the contracts: each name is its module's object, loaded on first use."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import weft.api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(weft.api.NAMES))
def test_each_name_is_the_object_its_module_defines(name):
    module, attribute = weft.api.NAMES[name]
    assert getattr(weft.api, name) is getattr(importlib.import_module(module), attribute)


def test_importing_the_api_loads_no_module_it_names():
    """A plugin loaded in the API server's process (an HTTP route, a tool parser) imports weft.api without torch."""
    code = (
        "import sys, weft.api\n"
        "print(sorted(m for m in {module for module, _ in weft.api.NAMES.values()} | {'torch'} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_a_name_outside_the_api_is_refused_with_the_rule():
    with pytest.raises(
        AttributeError,
        match=r"'Scheduler'.*not part of weft-core's plugin API.*weft.contracts and "
        r"weft.api \(see docs/plugin-authors.md\)",
    ):
        weft.api.Scheduler  # noqa: B018
    with pytest.raises(ImportError):
        exec("from weft.api import Scheduler", {})


def test_all_lists_every_name_and_the_release():
    assert set(weft.api.__all__) == {"NAMES", "__version__", *weft.api.NAMES}
    assert set(dir(weft.api)) >= set(weft.api.__all__)
    assert weft.api.__version__ == weft.__version__


def test_the_plugin_authors_guide_lists_every_name():
    guide = (ROOT / "docs" / "plugin-authors.md").read_text()
    listed = set(re.findall(r"`(\w+)`", guide))
    missing = sorted(set(weft.api.NAMES) - listed)
    assert not missing, f"docs/plugin-authors.md does not list these names of weft.api: {missing}"
