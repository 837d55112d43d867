"""The per-platform test requirements stay in sync with their common base (requirements/test/).

Each platform file (cpu.in, cuda.in, rocm.in, xpu.in) starts from common.in and only adds; each lock
file beside it (cpu.txt, ...) was compiled from its current inputs by
scripts/compile-test-requirements.sh, pins every direct requirement within its range, leaves torch
(the platform's runtime) out, and pins every package it shares with the other locks at the same
version, so the common base resolves the same way on every platform."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "requirements" / "test"
PLATFORMS = ("cpu", "cuda", "rocm", "xpu")
FIX = "edit the .in files, then run: bash scripts/compile-test-requirements.sh"
PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)\s*(?:;(?P<marker>[^#]*))?(?:#\s*via\s*(?P<via>.*))?$"
)


def input_lines(path: Path) -> list[str]:
    """The requirement and option lines of a .in file, comments and blanks dropped."""
    lines = (line.split(" #", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def direct_requirements(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in input_lines(path) if not line.startswith("-")]


def lock_pins(platform: str) -> dict[tuple[str, str], tuple[str, str]]:
    """``(package, marker) -> (version, via)`` of a lock, packages that are never installed left out."""
    pins = {}
    for line in (FOLDER / f"{platform}.txt").read_text().splitlines():
        match = PIN.match(line.strip())
        if match is None:
            continue
        marker = (match["marker"] or "").strip()
        if "sys_platform == 'never'" in marker:
            continue
        pins[(canonicalize_name(match["name"]), marker)] = (match["version"], (match["via"] or "").strip())
    return pins


@pytest.mark.parametrize("platform", PLATFORMS)
def test_platform_file_starts_from_the_common_base_and_only_adds(platform):
    lines = input_lines(FOLDER / f"{platform}.in")
    assert lines and lines[0] == "-r common.in", f"requirements/test/{platform}.in must start with '-r common.in'"
    common = {canonicalize_name(requirement.name) for requirement in direct_requirements(FOLDER / "common.in")}
    again = sorted(common & {canonicalize_name(r.name) for r in direct_requirements(FOLDER / f"{platform}.in")})
    assert not again, (
        f"requirements/test/{platform}.in repeats {again} from common.in; change it there, for every platform"
    )


@pytest.mark.parametrize("platform", PLATFORMS)
def test_lock_was_compiled_from_the_current_inputs(platform):
    header = (FOLDER / f"{platform}.txt").read_text().splitlines()[:3]
    inputs = b"".join((FOLDER / name).read_bytes() for name in ("common.in", f"{platform}.in", "torch-provided.txt"))
    expected = f"# inputs sha256: {hashlib.sha256(inputs).hexdigest()}"
    assert expected in header, f"requirements/test/{platform}.txt is older than its inputs; {FIX}"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_lock_pins_every_direct_requirement_within_its_range_and_no_torch(platform):
    pins = lock_pins(platform)
    versions = {name: version for (name, _), (version, _) in pins.items()}
    for source in ("common.in", f"{platform}.in"):
        for requirement in direct_requirements(FOLDER / source):
            name = canonicalize_name(requirement.name)
            assert name in versions, f"requirements/test/{platform}.txt lacks {requirement} from {source}; {FIX}"
            assert requirement.specifier.contains(versions[name], prereleases=True), (
                f"requirements/test/{platform}.txt pins {name}=={versions[name]}, outside {requirement} ({source}); "
                f"{FIX}"
            )
    assert "torch" not in versions, "torch is the platform's runtime; the locks must not pin it (torch-provided.txt)"
    stale = sorted(name for (name, _), (_, via) in pins.items() if re.search(rf"-r (?!common\.in|{platform}\.in)", via))
    assert not stale, f"requirements/test/{platform}.txt names inputs it was not compiled from: {stale}"


def test_packages_shared_by_the_locks_have_one_version():
    """The common base resolves alike everywhere: a package (with the same markers) pinned by several locks
    is pinned at one version."""
    seen: dict[tuple[str, str], dict[str, str]] = {}
    for platform in PLATFORMS:
        for key, (version, _) in lock_pins(platform).items():
            seen.setdefault(key, {})[platform] = version
    differing = {key: versions for key, versions in seen.items() if len(set(versions.values())) > 1}
    assert not differing, f"the locks disagree on {differing}; {FIX}"
    common = {canonicalize_name(requirement.name) for requirement in direct_requirements(FOLDER / "common.in")}
    for name in common:
        assert all(any(key[0] == name for key in lock_pins(platform)) for platform in PLATFORMS), name


def test_test_script_installs_the_lock_of_the_platform_it_detects():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "requirements=$root/requirements/test/$platform.txt" in script
    for platform in PLATFORMS:
        assert f"platform={platform}" in script or platform == "cpu" and "WEFT_TEST_PLATFORM:-cpu" in script
