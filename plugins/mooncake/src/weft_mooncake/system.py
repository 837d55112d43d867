"""The system libraries Mooncake needs at run time, and why it cannot run here when one is missing.

Mooncake's wheel links its Python client and its binaries against Debian's RDMA and NUMA
libraries (``debian-packages.txt`` lists them; ``scripts/install.sh --all`` installs the missing ones
as root). Without them the client fails to import and ``mooncake_master`` exits at once with the
dynamic loader's "error while loading shared libraries".
"""

from __future__ import annotations

import ctypes
import subprocess
from importlib.resources import files

LOADER_ERROR = "error while loading shared libraries"


def debian_packages() -> dict[str, str]:
    """Each library's soname -> the Debian package that provides it."""
    text = files("weft_mooncake").joinpath("debian-packages.txt").read_text()
    pairs = (line.split() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return {soname: package for soname, package in pairs}


def missing_packages() -> list[str]:
    """The Debian packages whose library the dynamic loader cannot find here."""
    missing = []
    for soname, package in debian_packages().items():
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing.append(package)
    return missing


def install_hint(packages: list[str]) -> str:
    if not packages:
        return "install the system package that provides it (debian-packages.txt does not list it: add it there)"
    names = " ".join(packages)
    return (
        f"install the Debian packages {names} (as root: apt-get install {names}; bash scripts/install.sh --all does it)"
    )


def explain_import_error(error: ImportError) -> str:
    """What to do when ``mooncake.store`` does not import: a missing system library, or no Mooncake wheel."""
    if _is_missing_library(error):
        return f"Mooncake's Python client cannot load a system library ({error}): {install_hint(missing_packages())}"
    return (
        f"weft-mooncake needs Mooncake's Python client ({error}); install it with "
        f"pip install 'weft-mooncake[cpu]' (CPU-only machines) or 'weft-mooncake[cuda]'"
    )


def missing_library_problem() -> str | None:
    """Why Mooncake cannot run here for want of a system library or of its own package, or None when nothing is missing.

    Asks the real thing: imports Mooncake's client and runs ``mooncake_master --version``.
    """
    from weft_mooncake.local import mooncake_binary
    from weft_mooncake.store import import_store_class

    try:
        import_store_class()
    except ImportError as error:
        cause = error.__cause__
        if _is_missing_library(cause) or (
            isinstance(cause, ModuleNotFoundError) and (cause.name or "").startswith("mooncake")
        ):
            return str(error)  # a library, or Mooncake's own package (weft-mooncake[cpu] or [cuda]) not installed
        raise
    master = subprocess.run(
        [mooncake_binary("mooncake_master"), "--version"], capture_output=True, text=True, timeout=60
    )
    if LOADER_ERROR in master.stderr:
        return f"{master.stderr.strip()}: {install_hint(missing_packages())}"
    return None


def _is_missing_library(error: BaseException | None) -> bool:
    return isinstance(error, ImportError) and "cannot open shared object file" in str(error)
