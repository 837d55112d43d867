"""Prefill/decode disaggregation of a hybrid model: tiny DeepSeek V4 (weft-dsv4) with a sliding-window ring,
compressed entries and the compressor's recurrent state, behind ``weft proxy pd`` (see tests/test_disagg.py)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("weft_dsv4")

from test_disagg import Cluster, ask  # noqa: E402  (skips with it when NIXL is missing)


@pytest.fixture(scope="module")
def dsv4_cluster(tmp_path_factory):
    from weft_dsv4.tiny_checkpoint import SHORT_NAMES, tiny_config, write_checkpoint

    layers = [SHORT_NAMES[kind] for kind in ("hca", "csa", "sliding", "csa")]
    model = write_checkpoint(tmp_path_factory.mktemp("dsv4"), tiny_config(layers))
    running = Cluster(model, tmp_path_factory.mktemp("dsv4-logs"), prefill_instances=1)
    yield running
    running.stop()


def test_a_hybrid_model_moves_its_ring_compressed_and_recurrent_groups_and_decodes_exactly(dsv4_cluster):
    """DeepSeek V4 (tiny): a sliding-window ring of 16 tokens, compressed entries and the compressor's state;
    prompts shorter than the window and many times longer (the ring wrapped) continue exactly."""
    cluster = dsv4_cluster
    prompts = ["Hello there", "The quick brown fox jumps over the lazy dog and keeps running into the forest",
               " ".join(str(number) for number in range(60))]
    before = cluster.metrics("decode")
    proxied = [ask(cluster.client("proxy"), cluster.model_name, "completions", prompt, False) for prompt in prompts]
    after = cluster.metrics("decode")
    assert proxied == [ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)
                       for prompt in prompts]
    lengths = [httpx.post(f"{cluster.urls['decode']}/tokenize", json={"prompt": prompt}).json()["count"]
               for prompt in prompts]
    assert max(lengths) > 4 * 16
    assert after["weft_kv_connector_hit_tokens"] - before["weft_kv_connector_hit_tokens"] == sum(n - 1 for n in lengths)
    assert after["weft_kv_connector_receive_failures_total"] == before["weft_kv_connector_receive_failures_total"]
