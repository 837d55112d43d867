"""Prefill/decode disaggregation of a hybrid model: tiny DeepSeek V4 (weft-dsv4) with a sliding-window ring,
compressed entries and the compressor's recurrent state, behind ``weft proxy pd`` (see tests/test_disagg.py).

The decode instance runs with prefix caching (its snapshot groups exist): a transfer moves the ring and
state themselves, not the snapshots, so a transferred prefix ending exactly on a snapshot boundary must not
be restored from snapshots, nor published for later local hits. Its direct answers (the reference) then
find nothing cached and compute every prompt."""

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
    running = Cluster(model, tmp_path_factory.mktemp("dsv4-logs"), prefill_instances=1, decode_prefix_caching=True)
    yield running
    running.stop()


def test_a_hybrid_model_moves_its_ring_compressed_and_recurrent_groups_and_decodes_exactly(dsv4_cluster):
    """DeepSeek V4 (tiny): a sliding-window ring of 16 tokens, compressed entries and the compressor's state;
    prompts shorter than the window and many times longer (the ring wrapped) continue exactly."""
    cluster = dsv4_cluster
    # The last prompt (token ids) moves 128 tokens: a multiple of every snapshot unit of this model.
    prompts = [
        "Hello there",
        "The quick brown fox jumps over the lazy dog and keeps running into the forest",
        " ".join(str(number) for number in range(60)),
        [(7 * index + 5) % 400 + 3 for index in range(129)],
    ]
    before = cluster.metrics("decode")
    proxied = [ask(cluster.client("proxy"), cluster.model_name, "completions", prompt, False) for prompt in prompts]
    after = cluster.metrics("decode")
    assert proxied == [
        ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False) for prompt in prompts
    ]
    lengths = [
        httpx.post(f"{cluster.urls['decode']}/tokenize", json={"prompt": prompt}).json()["count"]
        for prompt in prompts[:-1]
    ] + [len(prompts[-1])]
    assert max(lengths) > 4 * 16
    hits = "weft_external_prefix_cache_hits_total"
    assert after[hits] - before[hits] == sum(n - 1 for n in lengths)
    assert after["weft_kv_connector_receive_failures_total"] == before["weft_kv_connector_receive_failures_total"]
