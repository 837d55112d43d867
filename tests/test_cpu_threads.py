"""The CPU worker's thread choice: one per physical core available, the cgroup quota and the overrides respected."""

from __future__ import annotations

import os

import pytest

from weft.runner import cpu_threads


def test_quota_caps_the_physical_cores(monkeypatch, tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) is None
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 1)
    cpus, why = cpu_threads.choose_cpus(None, None)
    assert len(cpus) == 1 and "quota" in why


def test_overrides_and_refusal(monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    available = sorted(os.sched_getaffinity(0))
    assert cpu_threads.choose_cpus(None, available[:1]) == (available[:1], "engine.cpu_affinity")
    cpus, why = cpu_threads.choose_cpus(1, None)
    assert cpus == cpu_threads.physical_cores(available)[:1] and "engine.cpu_threads = 1" in why
    with pytest.raises(ValueError, match="engine.cpu_affinity"):
        cpu_threads.choose_cpus(None, [max(available) + 1000])
