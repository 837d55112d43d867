"""CORE_API has one source of truth: weft-core's release number."""

import importlib.metadata

import weft
from weft.contracts import CORE_API


def test_core_api_is_the_installed_release_major_minor():
    major, minor = importlib.metadata.version("weft-core").split(".")[:2]
    assert CORE_API == (int(major), int(minor))
    assert weft.CORE_API == CORE_API
