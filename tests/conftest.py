"""Shared test helpers: throwaway plugin distributions that importlib.metadata really discovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


class Site:
    """A folder on sys.path holding throwaway distributions (``*.dist-info`` plus modules)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add_distribution(
        self,
        name: str,
        version: str = "0.1.0",
        entry_points: dict[str, dict[str, str]] | None = None,
        requires: tuple[str, ...] = ("weft-core>=1.0,<2",),
        modules: dict[str, str] | None = None,
    ) -> None:
        dist_info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        metadata = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {requirement}" for requirement in requires]
        (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
        lines = []
        for group, items in (entry_points or {}).items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in items.items()]
        (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in (modules or {}).items():
            path = self.root / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEFT_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH", "")]))
        env.update(extra)
        return env

    def python(self, code: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in a fresh interpreter that sees this site's distributions."""
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=self.env(**extra_env), timeout=120
        )

    def weft(self, *args: str, cwd: Path | None = None, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Run the ``weft`` command (as ``python -m weft.cli``) against this site."""
        return subprocess.run(
            [sys.executable, "-m", "weft.cli", *args], capture_output=True, text=True, env=self.env(**extra_env),
            cwd=cwd, timeout=120,
        )


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


PLATFORM_SOURCE = """
    from weft.contracts.platform import MemoryInfo, Platform, PlatformProbe

    class {cls}(Platform):
        name = "{name}"
        device_type = "cpu"
        distributed_backend = "gloo"
        default_attention = "torch"
        supported_dtypes = ("float32",)

        @classmethod
        def probe(cls):
            return PlatformProbe(available={available}, reason="throwaway", priority={priority})

        def memory_info(self, index=0):
            return MemoryInfo(free=1, total=2)
"""


def platform_module(name: str, available: bool = False, priority: int = 0, cls: str = "ThrowawayPlatform") -> str:
    return PLATFORM_SOURCE.format(name=name, available=available, priority=priority, cls=cls)


def last_json(output: str):
    return json.loads(output.strip().splitlines()[-1])
