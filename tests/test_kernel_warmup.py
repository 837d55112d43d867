"""The zero-JIT-at-runtime warm-up contract, with a fake backend that counts compiles."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from weft.kernels.warmup import (
    Choice,
    CompileKey,
    IntRange,
    Kernel,
    KernelRegistry,
    RuntimeMonitor,
    Zipped,
    collecting,
    compile_many,
    register,
)


class AttentionKey(CompileKey, frozen=True):
    dtype: str
    head_dim: int
    block: int


class FakeAttention(Kernel):
    """Specialises on dtype and head size; the token count only changes the launch grid."""

    name = "fake_attention"

    def __init__(self, monitor=None, compile_seconds=0.0, fail_on=None):
        super().__init__(monitor)
        self.compiles: list[CompileKey] = []
        self.threads: set[str] = set()
        self.compile_seconds = compile_seconds
        self.fail_on = fail_on

    def dispatch(self, dtype: str, head_dim: int) -> AttentionKey:
        return AttentionKey(dtype=dtype, head_dim=head_dim, block=64 if head_dim <= 64 else 32)

    def compile(self, key):
        if key == self.fail_on:
            raise RuntimeError(f"cannot compile {key}")
        time.sleep(self.compile_seconds)
        self.compiles.append(key)
        self.threads.add(threading.current_thread().name)
        return f"binary for {key}"

    def launch(self, compiled, **inputs):
        return compiled

    def input_space(self):
        return IntRange("num_tokens", 1, 9) * Choice("dtype", ["bfloat16", "float16"]) * Choice("head_dim", [64, 128])


def test_warmup_keys_collapse_inputs_the_key_ignores():
    kernel = FakeAttention()
    keys = kernel.warmup_keys()
    assert len(keys) == 4  # 8 token counts x 2 dtypes x 2 head sizes -> 4 variants
    assert keys[0] == AttentionKey("bfloat16", 64, 64) and keys[1] == AttentionKey("bfloat16", 128, 32)


def test_spaces_zip_and_filter():
    zipped = Zipped(head_dim=[64, 128], block=[64, 32])
    assert list(zipped.points()) == [{"head_dim": 64, "block": 64}, {"head_dim": 128, "block": 32}]
    filtered = (IntRange("n", 0, 10) * Choice("even", [True])).where(lambda n: n % 2 == 0)
    assert [point["n"] for point in filtered.points()] == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="one length"):
        Zipped(a=[1, 2], b=[1])


def test_compile_many_dedups_in_order_and_skips_compiled():
    kernel = FakeAttention()
    a, b = AttentionKey("bfloat16", 64, 64), AttentionKey("float16", 64, 64)
    assert compile_many(kernel, [a, a]) == [a]
    assert kernel.threads == {threading.current_thread().name}  # one missing key: no thread pool
    assert compile_many(kernel, [b, a, b]) == [b]
    assert compile_many(kernel, [a, b]) == []
    assert kernel.compiles == [a, b]


def test_compile_many_uses_at_most_four_workers():
    kernel = FakeAttention(compile_seconds=0.05)
    keys = [AttentionKey("float16", dim, 32) for dim in range(10)]
    assert compile_many(kernel, keys) == keys
    assert 1 < len(kernel.threads) <= 4
    assert all(name.startswith("compile-fake_attention") for name in kernel.threads)
    two = FakeAttention(compile_seconds=0.05)
    compile_many(two, keys[:2])
    assert len(two.threads) == 2  # min(4, missing)


def test_a_failed_compile_writes_nothing_back():
    keys = [AttentionKey("float16", dim, 32) for dim in range(5)]
    kernel = FakeAttention(fail_on=keys[3])
    with pytest.raises(RuntimeError, match="cannot compile"):
        compile_many(kernel, keys)
    assert kernel.compiled == {}


def test_registry_collects_during_construction_only():
    kernel = FakeAttention()
    register(kernel)  # outside collecting: ignored
    with collecting() as registry:
        for _ in range(30):  # thirty layers register the same kernel
            register(kernel)
    assert list(registry.kernels) == ["fake_attention"]
    assert registry.warm_up() == {"fake_attention": 4}
    assert registry.warm_up() == {"fake_attention": 0}


def test_unavailable_kernels_are_not_registered_and_names_are_unique():
    class NoBackend(FakeAttention):
        name = "no_backend"

        @classmethod
        def is_available(cls):
            return False

    registry = KernelRegistry()
    registry.add(NoBackend())
    assert registry.kernels == {}
    registry.add(FakeAttention())
    with pytest.raises(ValueError, match="fake_attention"):
        registry.add(FakeAttention())


def test_warn_mode_compiles_a_miss_and_reports_it(caplog):
    kernel = FakeAttention(RuntimeMonitor("warn"))
    compile_many(kernel, kernel.warmup_keys())
    before = len(kernel.compiles)
    with caplog.at_level(logging.WARNING, logger="weft.kernels"):
        kernel(dtype="float32", head_dim=64, num_tokens=3)
    assert len(kernel.compiles) == before + 1
    assert kernel.monitor.misses == [("fake_attention", AttentionKey("float32", 64, 64))]
    assert "warm-up did not cover it" in caplog.text


def test_error_mode_after_warmup_a_scripted_workload_compiles_nothing():
    kernel = FakeAttention(RuntimeMonitor("error"))
    with collecting() as registry:
        register(kernel)
    registry.warm_up()
    compiled = len(kernel.compiles)
    for step in range(50):  # a serving workload within the declared space
        kernel(dtype=("bfloat16", "float16")[step % 2], head_dim=(64, 128)[step % 3 % 2], num_tokens=step % 8 + 1)
    assert len(kernel.compiles) == compiled and kernel.monitor.misses == []
    with pytest.raises(RuntimeError, match="declare it in the kernel's input space"):
        kernel(dtype="float32", head_dim=64, num_tokens=1)


def test_monitor_mode_is_checked():
    with pytest.raises(ValueError, match="'loud'"):
        RuntimeMonitor("loud")
