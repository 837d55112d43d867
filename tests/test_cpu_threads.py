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


def test_binding_applies_the_count_and_the_cpus():
    """In a fresh process (the binding holds for the whole process): torch's pool and the affinity follow the choice,
    as a worker started with engine.cpu_threads / engine.cpu_affinity does it."""
    import json
    import subprocess
    import sys

    first = cpu_threads.physical_cores(sorted(os.sched_getaffinity(0)))[0]
    code = (
        "import json, os, sys, torch\n"
        "from weft.runner.cpu_threads import bind_compute_threads\n"
        "count = bind_compute_threads(*json.loads(sys.argv[1]))\n"
        "print(json.dumps([count, torch.get_num_threads(), sorted(os.sched_getaffinity(0))]))\n"
    )
    for threads, affinity in ((1, None), (None, [first])):
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps([threads, affinity])], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
        count, pool, cpus = json.loads(result.stdout.strip().splitlines()[-1])
        assert count == pool == 1
        assert cpus == [first]
