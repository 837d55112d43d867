"""weft-dsv4 against Hugging Face's DeepseekV4ForCausalLM with identical random weights (fp32, CPU).

transformers' indexer calls ``torch.topk``, whose CPU tie order depends on the row length, so its
top-k is made stable (ties to the lower entry index, as Weft's decode_topk orders them) while it
runs: see ``weft_dsv4.reference.stable_topk`` and shared/reference/dsv4.md.

Tolerance for logits: fp32 on both sides, same math in a different order (Weft computes each
request's attention over a window ring and compressed-entry caches; HF over concatenated tensors)
gives differences of a few 1e-6 on logits of magnitude ~1-3; we assert atol = rtol = 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("weft_dsv4")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV4ForCausalLM (needs >= 5.17; CI pins 5.24)", allow_module_level=True)

from weft.testing import ModelContract  # noqa: E402
from weft_dsv4.config import CSA, HCA, SLIDING  # noqa: E402
from weft_dsv4.reference import Driver, stable_topk  # noqa: E402
from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint  # noqa: E402

ATOL = RTOL = 1e-4

# Two schedules: A mixes all three layer types with 2 streams; B has 3 streams, a shorter window,
# HCA at rate 16, one hash-MoE layer, a sigmoid router and YaRN on the compressed branches'
# RoPE (beyond 32 positions). Small index_topk makes selection matter.
CONFIGS = {
    "A": tiny_config([HCA, CSA, SLIDING, CSA], hc_mult=2, index_topk=3),
    "B": tiny_config(
        [CSA, HCA, CSA],
        hc_mult=3,
        sliding_window=8,
        index_topk=4,
        index_n_heads=3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp(f"dsv4{request.param}"), CONFIGS[request.param], seed=7)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return folder, hf


def random_ids(count: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(2, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with stable_topk(), torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_transformers_weights_load_under_their_own_names(checkpoint):
    folder, hf = checkpoint
    driver = Driver(folder)
    ours = dict(driver.model.named_parameters())
    theirs = hf.state_dict()
    layer = next(i for i, kind in enumerate(hf.config.layer_types) if kind == CSA)
    prefix = f"model.layers.{layer}.self_attn"
    assert torch.equal(
        ours[f"{prefix}.indexer.weights_proj.weight"], theirs[f"{prefix}.compressor.indexer.scorer.weights_proj.weight"]
    )
    assert torch.equal(
        ours[f"{prefix}.indexer.compressor.position_bias"], theirs[f"{prefix}.compressor.indexer.position_bias"]
    )
    assert torch.equal(
        ours["model.layers.0.mlp.experts.gate_up_proj"], theirs["model.layers.0.mlp.experts.gate_up_proj"]
    )
    assert torch.equal(ours["lm_head.weight"], theirs["lm_head.weight"])


def test_the_weight_name_map_reads_every_saved_tensor_and_writes_every_parameter_back(checkpoint):
    from safetensors import safe_open

    from weft_dsv4.weights import checkpoint_name, parameter_name

    folder, _ = checkpoint
    model = Driver(folder).model
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    read = set()
    with safe_open(str(folder / "model.safetensors"), "pt") as saved:
        for key in saved.keys():
            name, expert, part = parameter_name(key)
            target = ours[name]
            if expert is not None:  # one expert's w1/w3 (rows of gate_up_proj) or w2 (down_proj)
                size = model.settings.moe_intermediate_size
                target = target[expert] if part == "down" else target[expert][(0 if part == "gate" else size) :][:size]
            assert torch.equal(target, saved.get_tensor(key).to(target.dtype)), key
            read.add((name, expert, part))
    for name, expert, part in read:
        assert parameter_name(checkpoint_name(name, expert, part)) == (name, expert, part)
    assert {name for name, _, _ in read} == {name for name in ours if not name.endswith((".cos", ".sin"))}


def test_prefill_logits_match_transformers(checkpoint):
    folder, hf = checkpoint
    ids = random_ids(70, seed=1)  # crosses several windows of every rate and the sliding window
    ours = Driver(folder).step([("a", ids)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_indexer_on_the_triton_top_k_matches_transformers(checkpoint):
    pytest.importorskip("triton")
    import functools

    from weft_triton.decode_topk_policy import DecodeTopKLaunch
    from weft_triton.ops import DecodeTopKTriton

    folder, hf = checkpoint
    ids = random_ids(34, seed=8)
    # Two CTAs per row folding tiles of 8 and merged: every geometry gives the policy's result
    # (tests/test_decode_topk.py), and the interpreter sorts in Python, so small tiles keep this quick.
    small = DecodeTopKLaunch(chunks=2, block=8, warps=1, stages=1)
    driver = Driver(folder, topk_op=functools.partial(DecodeTopKTriton(None), launch=small))
    prefill = driver.step([("a", ids[:30])])[0]
    decoded = [driver.step([("a", [token])])[0][0] for token in ids[30:]]
    torch.testing.assert_close(torch.cat([prefill, torch.stack(decoded)]), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_the_engine_gives_the_indexer_the_op_it_chose(checkpoint):
    from weft.builtins.decode_topk import DecodeTopKTorch

    folder, _ = checkpoint
    llm = _llm(folder)
    attention = [
        layer.self_attn for layer in llm.engine.worker.model.model.layers if layer.self_attn.indexer is not None
    ]
    assert attention and all(isinstance(layer.topk_op, DecodeTopKTorch) for layer in attention)  # the CPU's choice


def test_logits_at_each_position_ignore_later_tokens(checkpoint):
    folder, _ = checkpoint
    ids = random_ids(48, seed=2)
    other = ids[:20] + random_ids(28, seed=3)
    driver = Driver(folder)
    full, changed = driver.step([("a", ids), ("b", other)])
    torch.testing.assert_close(full[:20], changed[:20], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full[20:], changed[20:], atol=1e-3)
    for length in (1, 3, 4, 7, 8, 15, 16, 17, 33):
        prefix = Driver(folder).step([("p", ids[:length])])[0]
        torch.testing.assert_close(prefix, full[:length], atol=1e-5, rtol=1e-5)


def test_incremental_decode_equals_one_shot_prefill(checkpoint):
    folder, _ = checkpoint
    ids = random_ids(41, seed=4)
    one_shot = Driver(folder).step([("a", ids)])[0]
    driver = Driver(folder)
    rows = [driver.step([("a", [token])])[0][0] for token in ids]
    torch.testing.assert_close(torch.stack(rows), one_shot, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_equals_one_full_forward(checkpoint):
    folder, _ = checkpoint
    ids = random_ids(60, seed=5)
    full = Driver(folder).step([("a", ids)])[0]
    driver, rows, start = Driver(folder), [], 0
    for size in (3, 1, 5, 8, 2, 13, 4, 24):
        # Batched with an unrelated request of its own phase, as continuous batching does.
        chunk, _ = driver.step([("a", ids[start : start + size]), (f"other{start}", random_ids(size + 2, seed=start))])
        rows.append(chunk)
        start += size
    torch.testing.assert_close(torch.cat(rows), full, atol=ATOL, rtol=RTOL)


def _llm(folder, plugins=None, **engine):
    from weft.entrypoints.llm import LLM

    settings = {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": 24}
    settings.update(engine)
    return LLM(model=str(folder), engine=settings, plugins=plugins or {})


PROMPT_LENGTHS = (5, 23, 41)


def _engine_tokens(folder, max_tokens=64, plugins=None, **engine) -> list[list[int]]:
    from weft.sampling_params import SamplingParams

    llm = _llm(folder, plugins, **engine)
    prompts = [random_ids(length, seed=10 + length) for length in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    llm.preemptions = llm.engine.scheduler.num_preemptions
    return [list(output.outputs[0].token_ids) for output in outputs], llm


def test_greedy_generation_through_the_engine_equals_transformers_generate(checkpoint):
    folder, hf = checkpoint
    tokens, _ = _engine_tokens(folder)
    for length, ours in zip(PROMPT_LENGTHS, tokens, strict=False):
        prompt = random_ids(length, seed=10 + length)
        with stable_topk(), torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert ours == generated[0, length:].tolist(), f"prompt of {length} tokens"


FP8_KEYS = {"DeepseekV4ForCausalLM": {"indexer_key_dtype": "fp8_e4m3"}}


def test_fp8_entries_round_each_key_to_float8_with_its_own_scale():
    from weft_dsv4.compressor import FP8_MAX, Fp8EntryFormat

    keys = torch.randn(6, 5, 32, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 5)[None, :, None]
    keys[0, 0] = 0.0
    key_format = Fp8EntryFormat()
    rows = key_format.encode(keys.to(torch.bfloat16), torch.uint8)
    assert rows.dtype == torch.uint8 and rows.shape == (6, 5, 36) == (6, 5, key_format.row_width(32))
    back = key_format.decode(rows)
    assert back.dtype == torch.float32 and torch.equal(back[0, 0], torch.zeros(32))
    source = keys.to(torch.bfloat16).float()
    scale = source.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    # e4m3: 3 mantissa bits (half an ulp: 1/16 of the value), subnormals in steps of 2**-9 of the scale.
    assert ((back - source).abs() <= source.abs() / 16 + scale * 2.0**-10 + 1e-30).all()
    assert torch.equal(back.abs().amax(dim=-1), source.abs().amax(dim=-1))  # each key's largest is exact
    # The same rows from a slice of a cache (strided rows) read back alike.
    cache = torch.zeros(4, 3, 36, dtype=torch.uint8)
    cache.view(-1, 36)[torch.tensor([1, 5, 7])] = rows[0, :3]
    assert torch.equal(key_format.decode(cache.view(-1, 36)[torch.tensor([1, 5, 7])]), back[0, :3])


def test_fp8_indexer_keys_equal_transformers_scoring_keys_rounded_alike(checkpoint):
    """``indexer_key_dtype = "fp8_e4m3"``: the indexer_keys group is a uint8 cache of float8 keys and their
    scales (under half the bytes), and greedy decoding equals transformers' whose indexer scores the same
    keys rounded the same way (its scorer patched); the other groups are untouched."""
    from weft_dsv4.reference import fp8_indexer_keys

    folder, hf = checkpoint
    tokens, llm = _engine_tokens(folder, plugins=FP8_KEYS)
    groups = {group.name: group.spec for group in llm.engine.kv_cache_manager.groups}
    plain = {group.name: group.spec for group in Driver(folder).groups}
    assert groups["indexer_keys"].dtype == "uint8"
    assert groups["indexer_keys"].entry_dim == plain["indexer_keys"].entry_dim + 4
    assert groups["indexer_keys"].page_size_bytes() * 2 < plain["indexer_keys"].page_size_bytes()
    assert all(groups[name] == spec for name, spec in plain.items() if name != "indexer_keys")
    for length, ours in zip(PROMPT_LENGTHS, tokens, strict=False):
        prompt = random_ids(length, seed=10 + length)
        with stable_topk(), fp8_indexer_keys(), torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert ours == generated[0, length:].tolist(), f"prompt of {length} tokens"
    # Prefix-cache hits and preemption read the float8 keys back as computed.
    cached, _ = _shared_prefix_tokens(folder, FP8_KEYS, enable_prefix_caching=True)
    uncached, _ = _shared_prefix_tokens(folder, FP8_KEYS, enable_prefix_caching=False)
    assert cached == uncached


def test_prefills_of_several_requests_are_attended_as_one_batch_and_match_transformers(checkpoint, monkeypatch):
    from weft.sampling_params import SamplingParams
    from weft_dsv4 import step

    folder, hf = checkpoint
    sizes = []
    original = step.PrefillBatch.__init__

    def recording(self, layout, window):
        original(self, layout, window)
        sizes.append(tuple(self.query_valid.sum(dim=1).tolist()))

    monkeypatch.setattr(step.PrefillBatch, "__init__", recording)
    llm = _llm(folder, max_num_batched_tokens=128)  # every prompt's prefill in the first step
    prompts = [random_ids(length, seed=30 + length) for length in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert sizes[0] == PROMPT_LENGTHS
    for prompt, output in zip(prompts, outputs, strict=False):
        with stable_topk(), torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert list(output.outputs[0].token_ids) == generated[0, len(prompt) :].tolist()


def test_preemption_and_prefix_caching_change_no_token(checkpoint):
    folder, _ = checkpoint
    reference, _ = _engine_tokens(folder, enable_prefix_caching=False)
    # 32 blocks per group is what one 256-token request needs; three requests growing to ~105
    # tokens each need more, so the scheduler preempts and recomputes.
    tight, llm = _engine_tokens(folder, num_kv_blocks=32)
    assert llm.preemptions > 0
    assert tight == reference
    cached, llm = _engine_tokens(folder, enable_prefix_caching=True)
    assert cached == reference


SHARED = random_ids(48, seed=20)  # a multiple of both schedules' snapshot unit (8 and 16 tokens)
# Hits that leave one token (a decode-shaped first step), a short and a long (chunked) rest.
SHARED_PROMPTS = [
    SHARED + [7],
    SHARED + random_ids(5, seed=21),
    SHARED[:33] + random_ids(30, seed=22),
    SHARED + random_ids(40, seed=23),
]


def _shared_prefix_tokens(folder, plugins=None, **engine):
    from weft.sampling_params import SamplingParams

    llm = _llm(folder, plugins, **engine)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.generate([SHARED + random_ids(3, seed=24)], params)  # computes (and publishes) the shared prefix
    rest = llm.generate(SHARED_PROMPTS, params)
    llm.preemptions = llm.engine.scheduler.num_preemptions
    return [list(output.outputs[0].token_ids) for output in first + rest], llm


def test_prefix_cache_hits_resume_from_the_ring_and_state_snapshots(checkpoint):
    folder, _ = checkpoint
    reference, _ = _shared_prefix_tokens(folder, enable_prefix_caching=False)
    cached, llm = _shared_prefix_tokens(folder, enable_prefix_caching=True)
    manager = llm.engine.kv_cache_manager
    assert manager.prefix_caching
    names = {group.name for group in manager.groups}
    assert {"window_checkpoint", "state_checkpoint"} <= names
    # The first prompt's 48 shared tokens, found again by every later prompt (the third one up to its
    # last snapshot boundary before token 33); chunked by the 24-token budget.
    assert manager.stats.hit_tokens >= 3 * 48 + 32 - 16
    assert cached == reference


def test_prefix_cache_hits_after_preemption_change_no_token(checkpoint):
    folder, _ = checkpoint
    reference, _ = _shared_prefix_tokens(folder, enable_prefix_caching=False)
    # Few blocks: requests are preempted, and resume from their own (or each other's) snapshots.
    tight, llm = _shared_prefix_tokens(folder, enable_prefix_caching=True, num_kv_blocks=20, max_model_len=160)
    assert llm.preemptions > 0 and llm.engine.kv_cache_manager.stats.hit_tokens > 0
    assert tight == reference


def test_snapshot_groups_exist_only_under_prefix_caching(checkpoint):
    import msgspec

    folder, _ = checkpoint
    config = Driver(folder).config
    plain = {group.name: group for group in Driver(folder).family.kv_cache_groups(config)}
    cached = {
        group.name: group
        for group in Driver(folder).family.kv_cache_groups(msgspec.structs.replace(config, enable_prefix_caching=True))
    }
    assert set(cached) - set(plain) == {"window_checkpoint", "state_checkpoint"}
    assert cached["window"].checkpointed and cached["compressor_state"].checkpointed
    assert not plain["window"].checkpointed and not plain["compressor_state"].checkpointed
    assert cached["window_checkpoint"].prefix_cacheable and cached["state_checkpoint"].spec.dtype == "float32"


def test_kv_cache_groups_and_their_flags(checkpoint):
    folder, _ = checkpoint
    groups = {group.name: group for group in Driver(folder).groups}
    config = json.loads((folder / "config.json").read_text())
    kinds = config["layer_types"]
    assert set(groups) == {"window", "compressor_state", "indexer_keys", "csa_kv"} | (
        {"hca_kv"} if HCA in kinds else set()
    )
    for name in ("window", "compressor_state"):
        assert not groups[name].prefix_cacheable and groups[name].transferable
    for name in ("csa_kv", "hca_kv", "indexer_keys"):
        if name in groups:
            assert groups[name].prefix_cacheable and groups[name].transferable
    assert len(groups["window"].layer_names) == len(kinds)
    assert len(groups["csa_kv"].layer_names) == kinds.count(CSA) == len(groups["indexer_keys"].layer_names)
    assert len(groups["compressor_state"].layer_names) == kinds.count(CSA) + kinds.count(HCA)
    assert groups["compressor_state"].spec.dtype == "float32"


def test_the_manager_grows_and_frees_every_group(checkpoint):
    from weft.engine.core.kv_cache_manager import KVCacheManager

    folder, _ = checkpoint
    groups = Driver(folder).groups
    manager = KVCacheManager(groups, [64] * len(groups))
    index = {group.name: i for i, group in enumerate(groups)}
    window = groups[index["window"]].spec
    for length in (1, 8, 9, 40, 200):
        assert manager.allocate_slots("r", length)
        held = {group.name: len(blocks) for group, blocks in zip(groups, manager.block_ids("r"), strict=False)}
        assert held["window"] == min(-(-length // 8), window.ring_blocks)  # the ring stops growing
        assert held["compressor_state"] == 1
        for name in ("csa_kv", "hca_kv", "indexer_keys"):
            if name in held:
                assert held[name] == -(-length // groups[index[name]].spec.block_size)
    assert manager.allocate_slots("other", 30)
    manager.free("r")
    manager.free("other")
    assert manager.num_free_blocks() == (64,) * len(groups)


def test_mhc_weights_are_doubly_stochastic_with_post_in_0_2(checkpoint):
    folder, _ = checkpoint
    model = Driver(folder).model
    streams = torch.randn(
        37, model.settings.hc_mult, model.settings.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    for layer in model.model.layers:
        for connection in (layer.attn_hc, layer.ffn_hc):
            pre, post, comb = connection.weights(streams)
            # Sinkhorn ends on a column normalisation: columns sum to 1 up to hc_eps; rows only
            # approximately after 20 rounds (up to ~0.03 with these random weights), and they converge.
            torch.testing.assert_close(comb.sum(dim=-2), torch.ones(comb.shape[:-1]), atol=1e-5, rtol=0)
            torch.testing.assert_close(comb.sum(dim=-1), torch.ones(comb.shape[:-1]), atol=5e-2, rtol=0)
            assert bool((post > 0).all() and (post < 2).all() and (pre > 0).all())
            row_error = (comb.sum(dim=-1) - 1).abs().max()
            connection.iterations = 500
            _, _, converged = connection.weights(streams)
            converged_error = (converged.sum(dim=-1) - 1).abs().max()
            assert converged_error < 1e-3 and (row_error < 1e-5 or converged_error < row_error / 10)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("hc_mult", [2, 3, 4])
def test_the_fused_mhc_kernel_matches_the_torch_reference(hc_mult):
    pytest.importorskip("triton")
    from weft_dsv4.mhc import mhc_weights
    from weft_dsv4.mhc_kernel import MhcWeightsKernel

    generator = torch.Generator().manual_seed(hc_mult)
    width = (2 + hc_mult) * hc_mult
    base, scale = torch.randn(width, generator=generator), 1 + torch.rand(3, generator=generator)
    kernel = MhcWeightsKernel()
    for tokens in (1, 17, 40):
        mixes = torch.randn(tokens, width, generator=generator) * 3
        for iterations in (1, 20):
            fused = kernel(mixes=mixes, base=base, scale=scale, eps=1e-6, iterations=iterations)
            for ours, reference in zip(fused, mhc_weights(mixes, base, scale, 1e-6, iterations), strict=False):
                torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_the_model_on_the_fused_mhc_kernel_matches_transformers(checkpoint):
    pytest.importorskip("triton")
    from weft_dsv4.mhc_kernel import MhcWeightsKernel

    folder, hf = checkpoint
    ids = random_ids(20, seed=9)
    driver = Driver(folder)
    kernel = MhcWeightsKernel()
    for layer in driver.model.model.layers:
        layer.attn_hc.kernel = layer.ffn_hc.kernel = kernel
    torch.testing.assert_close(driver.step([("a", ids)])[0], hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def _attention_case(dtype, head_dim, generator):
    """A decode batch of 4 rows (in no order, of a 6-row step) over 40 heads: masked window keys at a sequence's
    start, masked picks anywhere, a row with no entry, a row with nothing but the sink; NaN in every slot
    nothing valid points at, as another request's garbage would be."""
    heads, window, picks, slots = 40, 8, 11, 64
    query = torch.randn(6, heads, head_dim, generator=generator).to(dtype)
    ring = torch.randn(slots, head_dim, generator=generator).to(dtype)
    entries = torch.randn(slots, head_dim, generator=generator).to(dtype)
    sinks = torch.randn(heads, generator=generator) * 2
    rows = torch.tensor([4, 0, 2, 5])
    window_slots = torch.randint(1, slots, (4, window), generator=generator)
    window_slots[0, :3] = -1
    window_slots[3] = -1
    entry_slots = torch.randint(1, slots, (4, picks), generator=generator)
    entry_slots[0, 2::3] = -1
    entry_slots[1] = -1
    entry_slots[3] = -1
    ring[0] = entries[0] = float("nan")
    return query, rows, sinks, ring, window_slots, entries, entry_slots


def _einsum_decode(query, rows, sinks, ring, window_slots, entries=None, entry_slots=None):
    """The model's torch path on the same slots: gathered keys into :meth:`DeepseekV4Attention._attend` (fp32)."""
    from weft_dsv4.attention import DeepseekV4Attention, gathered, slot_bias

    keys, bias = gathered(ring.float(), window_slots), slot_bias(window_slots)
    if entries is not None:
        keys = torch.cat([keys, gathered(entries.float(), entry_slots)], dim=1)
        bias = torch.cat([bias, slot_bias(entry_slots)], dim=1)
    layer = SimpleNamespace(head_dim=query.shape[-1], sinks=sinks)
    return DeepseekV4Attention._attend(layer, query[rows].float().unsqueeze(1), keys, bias.unsqueeze(1))[:, 0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("layer", ["compressed", "sliding", "no entries yet"])
def test_the_decode_attention_kernel_matches_the_einsum_path(dtype, head_dim, layer):
    check_decode_attention_kernel(dtype, head_dim, layer, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs an NVIDIA GPU"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 512])
@pytest.mark.parametrize("layer", ["compressed", "sliding", "no entries yet"])
def test_the_compiled_decode_attention_kernel_matches_the_einsum_path(dtype, head_dim, layer):
    check_decode_attention_kernel(dtype, head_dim, layer, "cuda")


def check_decode_attention_kernel(dtype, head_dim, layer, device):
    """Three blocks of 16 heads (the last partial), every masking case; fp32 to fp32 rounding, bf16 to its
    output's rounding (the kernel computes in fp32 what the reference computes in fp32 on the same inputs)."""
    pytest.importorskip("triton")
    from weft.kernels.warmup import RuntimeMonitor, compile_many
    from weft_dsv4.attention_kernel import DecodeAttentionKernel

    generator = torch.Generator().manual_seed(head_dim)
    case = [tensor.to(device) for tensor in _attention_case(dtype, head_dim, generator)]
    query, rows, sinks, ring, window_slots, entries, entry_slots = case
    if layer == "sliding":
        entries = entry_slots = None
    elif layer == "no entries yet":  # a compressed layer before its first entry: the slots have no column
        entry_slots = entry_slots[:, :0]
    kernel = DecodeAttentionKernel()
    kernel.add(dtype, head_dim)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1
    kernel.monitor = RuntimeMonitor("error")
    output = torch.full_like(query, 7.0)
    kernel(
        query=query,
        rows=rows,
        sinks=sinks,
        ring=ring,
        window_slots=window_slots,
        output=output,
        scale=head_dim**-0.5,
        entries=entries,
        entry_slots=entry_slots,
    )
    expected = _einsum_decode(query, rows, sinks, ring, window_slots, entries, entry_slots)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(output[rows].float(), expected, **tolerance)
    assert torch.equal(output[3].float(), torch.full_like(output[3].float(), 7.0))  # a row not decoding is not written
    assert torch.equal(output[5], torch.zeros_like(output[5]))  # nothing but the sink: no weight on any key


def _engine_tokens_on_the_kernels(folder, monkeypatch, kinds=("decode",), **engine):
    """The engine's greedy tokens with the attention kernels of ``kinds`` (``decode``, ``prefill``) chosen as on a
    GPU (interpreted here), each registered, warmed up and serving under runtime_jit = "error"."""
    from weft_dsv4 import attention, model

    for kind in kinds:
        choose = getattr(attention, f"{kind}_attention_kernel")
        monkeypatch.setattr(
            model,
            f"{kind}_attention_kernel",
            lambda device, dtype, head_dim, choose=choose: choose(torch.device("cuda"), dtype, head_dim),
        )
    tokens, llm = _engine_tokens(folder, runtime_jit="error", max_tokens=20, **engine)
    for kind in kinds:
        kernel = llm.engine.worker.kernels.kernels[f"weft_dsv4.{kind}_attention"]
        assert all(
            getattr(layer.self_attn, f"{kind}_kernel") is kernel for layer in llm.engine.worker.model.model.layers
        )
        assert kernel.compiled and kernel.monitor.mode == "error" and kernel.monitor.misses == []
    return tokens


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_the_engine_on_the_decode_attention_kernel_gives_the_torch_path_s_tokens(
    checkpoint, monkeypatch, eager_replay_platform
):
    """fp32 greedy tokens: the kernel (registered, warmed up, runtime_jit = "error") eagerly and in the decode
    graph path (full-width slots, padded rows, nothing read on the host) against the torch path eagerly."""
    pytest.importorskip("triton")
    folder, _ = checkpoint
    reference, _ = _engine_tokens(folder, max_tokens=20, enforce_eager=True)
    assert _engine_tokens_on_the_kernels(folder, monkeypatch, enforce_eager=True) == reference
    assert not eager_replay_platform
    assert _engine_tokens_on_the_kernels(folder, monkeypatch, graph_batch_sizes=[1, 2, 4]) == reference
    assert eager_replay_platform


PREFILL_SPANS = ((0, 37), (50, 66), (3, 5), (9, 41))
"""``(start, end)`` of each prefilling request of the kernel's test step: a whole prompt of no multiple of a
tile, a chunk past the window (its first keys from the ring), a two-token chunk, a chunk inside the first window."""


def _prefill_case(dtype, head_dim, layer, device, spans=PREFILL_SPANS):
    """A step of prefilling requests ``spans`` with a decoding row after every other one (the kernel leaves those
    alone) over 40 heads, window 40 (several tiles of keys), compression ratio 4. NaN in every key and entry no
    query may read (past each request's keys and entries in the padded batch), as garbage there would be; CSA
    picks of -1 anywhere and for every query before its first entry is complete."""
    from weft_dsv4.step import PrefillBatch, RequestRows

    heads, window, ratio = 40, 40, 4
    generator = torch.Generator().manual_seed(head_dim + len(spans))
    prefills, tokens = [], 0
    for number, (start, end) in enumerate(spans):
        prefills.append(RequestRows(number, tokens, tokens + end - start, end))
        tokens += end - start + (number + 1) % 2
    table = torch.zeros(len(spans), 4, dtype=torch.int32, device=device)
    step = SimpleNamespace(
        prefills=prefills,
        ring_blocks=4,
        boundaries=lambda start, end: [],
        batches={"window": SimpleNamespace(block_table=table, block_size=16)},
    )
    batch = PrefillBatch(step, window)
    requests, rows = batch.query_rows.shape
    query = torch.randn(tokens, heads, head_dim, generator=generator).to(device, dtype)
    sinks = (torch.randn(heads, generator=generator) * 2).to(device)
    keys = torch.randn(requests, batch.key_positions.shape[1], head_dim, generator=generator).to(device, dtype)
    keys[batch.key_positions >= batch.ends[:, None]] = float("nan")
    counts = batch.ends // ratio
    entries = torch.randn(requests, int(counts.max()), head_dim, generator=generator).to(device, dtype)
    entries[torch.arange(entries.shape[1], device=device) >= counts[:, None]] = float("nan")
    picks = None
    if layer == "sliding":
        entries = None
    elif layer == "no entries yet":  # an HCA layer before any request's first entry: no column
        entries = entries[:, :0]
    elif layer == "csa":
        complete = ((batch.query_positions + 1) // ratio).clamp(min=0)
        picks = (torch.rand(requests, rows, 11, generator=generator).to(device) * complete[..., None]).long()
        picks[torch.rand(picks.shape, generator=generator).to(device) < 0.3] = -1
        picks[complete == 0] = -1
    return batch, query, sinks, keys, window, ratio, entries, picks


def _einsum_prefill(batch, query, sinks, keys, window, ratio, entries=None, picks=None):
    """The model's torch path on the same batch (fp32): :meth:`DeepseekV4Attention._padded_entries` and
    :meth:`DeepseekV4Attention._attend` under the batch's ``window_bias``, for the real queries in step order.
    What no query reads is zeroed, as the model's vectors there are finite."""
    from weft_dsv4.attention import DeepseekV4Attention

    layer = SimpleNamespace(head_dim=query.shape[-1], sinks=sinks, compressor=SimpleNamespace(ratio=ratio))
    entry_bias = None
    if entries is not None:
        entries, entry_bias = DeepseekV4Attention._padded_entries(layer, batch, entries.float().nan_to_num(0.0), picks)
    attended = DeepseekV4Attention._attend(
        layer,
        query[batch.query_rows].float(),
        keys.float().nan_to_num(0.0),
        batch.window_bias,
        entries,
        entry_bias,
    )
    return attended[batch.query_valid]


def _prefill_kernel(dtype, head_dim):
    """The prefill kernel for ``dtype`` and ``head_dim``, warmed up (one variant) and refusing any further compile."""
    from weft.kernels.warmup import RuntimeMonitor, compile_many
    from weft_dsv4.attention_kernel import PrefillAttentionKernel

    kernel = PrefillAttentionKernel()
    kernel.add(dtype, head_dim)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1
    kernel.monitor = RuntimeMonitor("error")
    return kernel


def _run_prefill_kernel(kernel, case):
    batch, query, sinks, keys, window, ratio, entries, picks = case
    output = torch.full_like(query, 7.0)
    kernel(
        query=query,
        output=output,
        sinks=sinks,
        queries=batch.query_indices,
        query_rows=batch.query_rows,
        firsts=batch.firsts,
        ends=batch.ends,
        keys=keys,
        window=window,
        scale=query.shape[-1] ** -0.5,
        entries=entries,
        ratio=ratio,
        picks=picks,
    )
    return output


INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU"
)
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs an NVIDIA GPU"
)
COMPILED = [pytest.mark.gpu, NEEDS_GPU]


@pytest.mark.parametrize(
    "device, head_dim",
    [
        pytest.param("cpu", 32, marks=INTERPRETED),
        pytest.param("cpu", 48, marks=INTERPRETED),
        pytest.param("cuda", 64, marks=COMPILED),
        pytest.param("cuda", 512, marks=COMPILED),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layer", ["hca", "csa", "sliding", "no entries yet"])
def test_the_prefill_attention_kernel_matches_the_einsum_path(device, head_dim, dtype, layer):
    """Interpreted on the CPU (TRITON_INTERPRET=1) and compiled on a GPU: three blocks of 16 heads (the last
    partial), every masking case; fp32 to fp32 rounding, bf16 and fp16 to their output's rounding (the kernel
    computes in fp32 what the reference computes in fp32 on the same inputs)."""
    pytest.importorskip("triton")
    case = _prefill_case(dtype, head_dim, layer, device)
    output = _run_prefill_kernel(_prefill_kernel(dtype, head_dim), case)
    batch = case[0]
    expected = _einsum_prefill(*case)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    prefilling = batch.query_rows[batch.query_valid]
    torch.testing.assert_close(output[prefilling].float(), expected, **tolerance)
    decoding = torch.ones(output.shape[0], dtype=torch.bool, device=output.device)
    decoding[prefilling] = False
    assert decoding.sum() == 2 and torch.equal(output[decoding].float(), torch.full_like(output[decoding].float(), 7.0))


@pytest.mark.gpu
@NEEDS_GPU
def test_one_compiled_prefill_attention_variant_serves_every_layer_and_batch():
    """The warm-up's one bf16 variant (head size 512) serves every layer kind and every batch (one request or
    several, long and short prompts, chunks deep into a sequence) with no further Triton specialisation."""
    pytest.importorskip("triton")
    from weft_dsv4.attention_kernel import _prefill_attention_kernel

    kernel = _prefill_kernel(torch.bfloat16, 512)
    variants = []
    for spans in (PREFILL_SPANS, ((0, 2),), ((0, 700),), ((4000, 4517), (0, 33), (960, 1024))):
        for layer in ("hca", "csa", "sliding", "no entries yet"):
            case = _prefill_case(torch.bfloat16, 512, layer, "cuda", spans)
            output = _run_prefill_kernel(kernel, case)
            batch = case[0]
            torch.testing.assert_close(
                output[batch.query_rows[batch.query_valid]].float(), _einsum_prefill(*case), atol=1e-2, rtol=1e-2
            )
            variants.append(sum(len(caches[0]) for caches in _prefill_attention_kernel.device_caches.values()))
    assert kernel.monitor.misses == [] and len(set(variants)) == 1, variants


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_the_engine_on_the_prefill_attention_kernel_gives_the_torch_path_s_tokens(checkpoint, monkeypatch):
    """fp32 greedy tokens with prefill attention in the kernel (registered, warmed up, runtime_jit = "error") against
    the torch path: prompts chunked at 24 tokens a step, several requests in a step, later chunks reading their
    first keys from the ring, every layer kind."""
    pytest.importorskip("triton")
    folder, _ = checkpoint
    reference, _ = _engine_tokens(folder, max_tokens=20, enforce_eager=True)
    assert _engine_tokens_on_the_kernels(folder, monkeypatch, ("prefill",), enforce_eager=True) == reference


def test_routed_experts_sum_each_token_s_picks(checkpoint):
    """The sorted-token grouped GEMM against a plain per-token loop over the picked experts."""
    from weft_dsv4.moe import clamped_swiglu

    folder, _ = checkpoint
    model = Driver(folder).model
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(13, model.settings.hidden_size, generator=generator)
    experts_module = model.model.layers[-1].mlp.experts
    experts = torch.stack([torch.randperm(model.settings.num_experts, generator=generator)[:2] for _ in range(13)])
    experts[3] = experts[5]  # two tokens with the same picks
    weights = torch.rand(13, 2, generator=generator)
    expected = torch.zeros_like(hidden)
    for token in range(13):
        for slot in range(2):
            e = int(experts[token, slot])
            gate, up = (experts_module.gate_up_proj[e] @ hidden[token]).chunk(2)
            expected[token] += weights[token, slot] * (
                experts_module.down_proj[e] @ clamped_swiglu(gate, up, experts_module.limit)
            )
    torch.testing.assert_close(experts_module.partial(hidden, experts, weights), expected, atol=1e-5, rtol=1e-5)


def test_hash_routed_layers_pick_exactly_tid2eid(checkpoint):
    folder, hf = checkpoint
    model = Driver(folder).model
    ids = torch.tensor(random_ids(50, seed=6))
    hidden = torch.randn(50, model.settings.hidden_size, generator=torch.Generator().manual_seed(1))
    hashed = [i for i, kind in enumerate(model.settings.mlp_layer_types) if kind == "hash_moe"]
    assert hashed
    for index in hashed:
        experts, weights = model.model.layers[index].mlp.gate(hidden, ids)
        table = hf.model.layers[index].mlp.gate.tid2eid
        assert torch.equal(experts, table[ids])
        torch.testing.assert_close(weights.sum(-1), torch.full((50,), model.settings.routed_scaling_factor))


def test_plugins_list_shows_the_family_only_when_weft_dsv4_is_installed():
    code = """
        import contextlib, importlib.metadata as metadata, io, json, sys
        if sys.argv[1] == "hidden":
            everything = metadata.distributions
            metadata.distributions = lambda **kw: (d for d in everything(**kw) if d.metadata["Name"] != "weft-dsv4")
        from weft.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["plugins", "list", "--json"])
        rows = [row for row in json.loads(out.getvalue())["plugins"] if row["name"] == "DeepseekV4ForCausalLM"]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "weft_dsv4"))
        print(json.dumps({"rows": rows, "heavy": heavy}))
    """
    import textwrap

    shown = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "installed"], capture_output=True, text=True, timeout=120
    )
    hidden = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "hidden"], capture_output=True, text=True, timeout=120
    )
    shown_report = json.loads(shown.stdout.strip().splitlines()[-1])
    hidden_report = json.loads(hidden.stdout.strip().splitlines()[-1])
    assert [(row["slot"], row["distribution"], row["status"]) for row in shown_report["rows"]] == [
        ("model", "weft-dsv4", "ok")
    ]
    assert shown_report["heavy"] == []
    assert hidden_report["rows"] == []


@pytest.fixture(scope="module")
def contract_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dsv4contract"), CONFIGS["A"], seed=3)


class TestDeepseekV4ModelContract(ModelContract):
    plugin_name = "DeepseekV4ForCausalLM"
    block_size = 8

    @pytest.fixture
    def model_source(self, contract_checkpoint) -> str:
        return str(contract_checkpoint)


def test_tiny_checkpoint_script_and_weft_generate(tmp_path):
    folder = tmp_path / "tiny"
    made = subprocess.run(
        [sys.executable, "-m", "weft_dsv4.tiny_checkpoint", str(folder), "--layer-types", "csa,hca,sliding"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DeepseekV4ForCausalLM"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "weft.cli",
            "generate",
            "--model",
            str(folder),
            "--prompt",
            "Hello, world!",
            "--prompt",
            "The lightning indexer picks the best entries.",
            "--max-tokens",
            "24",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [len(row["outputs"][0]["token_ids"]) for row in rows] == [24, 24]
    assert all(row["outputs"][0]["finish_reason"] == "length" for row in rows)
    bad = subprocess.run(
        [sys.executable, "-m", "weft_dsv4.tiny_checkpoint", str(tmp_path / "x"), "--layer-types", "csa,mla"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--layer-types: unknown ['mla']" in bad.stderr


def test_the_decode_graph_path_changes_no_token(checkpoint, eager_replay_platform):
    """Decode through the runner's static buffers (every group's block table padded to max_model_len, rows
    padded to the captured size, the model reading nothing on the host) gives the eager engine's tokens, with
    prefix caching on (snapshots written at boundaries from inside the graph) and off."""
    from weft.sampling_params import SamplingParams

    folder, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for caching in (False, True):
        reference, eager = _shared_prefix_tokens(folder, enable_prefix_caching=caching, enforce_eager=True)
        assert not eager_replay_platform
        graphs, llm = _shared_prefix_tokens(folder, enable_prefix_caching=caching, graph_batch_sizes=[1, 2, 4, 8])
        assert sorted(llm.engine.runner.graphs) == [1, 2, 4, 8]
        assert len(eager_replay_platform) >= 39  # the decode steps of both generate calls replayed
        assert graphs == reference
        # A follow-up turn: its prefix runs into the first request's generated tokens, whose snapshots the
        # graph wrote at the boundaries decode crossed.
        follow_up = SHARED + random_ids(3, seed=24) + reference[0][:37] + [9]
        hits = llm.engine.kv_cache_manager.stats.hit_tokens
        again = llm.generate([follow_up], params)[0].outputs[0].token_ids
        assert list(again) == list(eager.generate([follow_up], params)[0].outputs[0].token_ids)
        if caching:
            assert llm.engine.kv_cache_manager.stats.hit_tokens - hits >= 80  # past the 51 prompt tokens
        eager_replay_platform.clear()


def test_decode_pads_to_max_model_len_within_the_row_token_bound():
    """Decode graphs (full-width decode) past 16,384 tokens of max_model_len where few rows decode at once:
    the activation bound is max_model_len times the largest decode batch."""
    from weft.contracts.model import ModelConfig
    from weft_dsv4.model import FULL_WIDTH_DECODE_ROW_TOKENS, full_width_decode

    def config(max_model_len: int, max_num_seqs: int) -> ModelConfig:
        return ModelConfig(
            architecture="DeepseekV4ForCausalLM",
            hf_config={},
            dtype="bfloat16",
            block_size=16,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
        )

    assert full_width_decode(config(16384, 4096)) and full_width_decode(config(16384, 0))
    assert full_width_decode(config(32848, 16)) and full_width_decode(config(1 << 20, 8))
    assert not full_width_decode(config(32848, 512)) and not full_width_decode(config(32848, 0))
    assert full_width_decode(config(FULL_WIDTH_DECODE_ROW_TOKENS // 256, 256))
    assert not full_width_decode(config(FULL_WIDTH_DECODE_ROW_TOKENS // 256 + 1, 256))


def test_a_long_max_model_len_with_few_sequences_decodes_in_graphs(tmp_path, eager_replay_platform):
    """max_model_len 20,000 (past FULL_WIDTH_DECODE_MAX_LEN): engine.max_num_seqs reaches the family through
    ModelConfig, so 4 sequences decode in (the CPU's stand-in for) graphs with the eager engine's tokens, and
    512 decode eagerly."""
    from weft.sampling_params import SamplingParams

    folder = write_checkpoint(
        tmp_path / "long",
        tiny_config([HCA, CSA, SLIDING, CSA], hc_mult=2, index_topk=3, max_position_embeddings=20000),
        seed=3,
    )
    prompts = [random_ids(n, seed=n) for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = {"max_model_len": 20000, "num_kv_blocks": 2 * 2500 + 8, "max_num_batched_tokens": 64}
    reference = _llm(folder, enforce_eager=True, max_num_seqs=4, **engine)
    expected = [list(output.outputs[0].token_ids) for output in reference.generate(prompts, params)]
    assert not reference.engine.runner.graphs
    del reference
    graphed = _llm(folder, max_num_seqs=4, graph_batch_sizes=[1, 2, 4], **engine)
    assert sorted(graphed.engine.runner.graphs) == [1, 2, 4]
    assert [list(output.outputs[0].token_ids) for output in graphed.generate(prompts, params)] == expected
    assert len(eager_replay_platform) >= 10
    del graphed
    assert not _llm(folder, max_num_seqs=512, graph_batch_sizes=[1, 2, 4], **engine).engine.runner.graphs
