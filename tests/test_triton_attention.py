"""weft-triton's attention kernel passes the attention contract: on the CPU under Triton's
interpreter (small shapes), and on an NVIDIA GPU in bf16 when one is present."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from weft.testing import AttentionContract  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
class TestTritonAttentionInterpreted(AttentionContract):
    plugin_name = "triton"
    head_dims = (64,)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
class TestTritonAttentionOnGPU(AttentionContract):
    plugin_name = "triton"
    device = "cuda"
    dtype = "bfloat16"
    tolerance = (2e-2, 2e-2)
    head_dims = (64, 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
class TestTritonAttentionInterpretedSmallBlocks(AttentionContract):
    plugin_name = "triton"
    head_dims = (32,)
    block_size = 4


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not _has_cuda(), reason="needs TRITON_INTERPRET=1 or a GPU"
)
@pytest.mark.parametrize("requests", [1, 3, 12])
@pytest.mark.parametrize("window", [None, 37])
def test_split_key_decode_matches_torch_backend(requests, window):
    """Decode-only steps of few requests take the split-key path (partial softmaxes merged); same result."""
    import torch

    from weft.builtins.cpu import CpuPlatform
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionBatch, AttentionLayer
    from weft_cuda.platform import CudaPlatform
    from weft_triton.attention import TritonAttention, decode_splits

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    dtype = torch.float32
    generator = torch.Generator().manual_seed(requests)
    layer = AttentionLayer(num_heads=8, num_kv_heads=2, head_dim=32, scale=32**-0.5, sliding_window=window)
    block = 8
    lengths = torch.randint(1, 150, (requests,), generator=generator).tolist()
    lengths[0] = 149  # one long context: every key range holds keys
    per_request = -(-max(lengths) // block)
    num_blocks = requests * per_request + 1
    cache = torch.randn(2, num_blocks, block, 2, 32, generator=generator).to(device, dtype)
    table = torch.randperm(num_blocks - 1, generator=generator)[: requests * per_request].view(requests, per_request)
    table = table.to(device, torch.int32)
    positions = torch.tensor([length - 1 for length in lengths], device=device)
    slots = table[torch.arange(requests, device=device), positions // block].long() * block + positions % block
    batch = AttentionBatch(
        query_start=torch.arange(requests + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=slots.to(torch.int32),
        max_query_len=1,
        max_seq_len=max(lengths),
        block_size=block,
    )
    query = torch.randn(requests, 8, 32, generator=generator).to(device, dtype)
    key = torch.randn(requests, 2, 32, generator=generator).to(device, dtype)
    value = torch.randn(requests, 2, 32, generator=generator).to(device, dtype)
    results = {}
    platform = CpuPlatform() if device == "cpu" else CudaPlatform()
    for backend in (TritonAttention(None, platform), TorchAttention(None, platform)):
        backend.prepare([layer], "float32")
        metadata = backend.build_metadata(batch)
        results[backend.name] = backend.forward(layer, query, key, value, cache.clone(), metadata)
    assert TritonAttention(None, platform).build_metadata(batch).splits == decode_splits(requests) > 1
    torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not _has_cuda(), reason="needs TRITON_INTERPRET=1 or a GPU"
)
@pytest.mark.parametrize(
    ("heads", "soft_cap", "window", "sinks"),
    [
        ((6, 2), None, None, False),
        ((9, 3), None, None, False),
        ((10, 2), None, None, False),
        ((6, 2), 2.0, None, False),
        ((9, 3), 2.0, 11, False),
        ((8, 2), None, None, True),
        ((8, 2), None, 11, True),
    ],
)
def test_groups_that_are_not_powers_of_two_match_torch_backend(heads, soft_cap, window, sinks):
    """Groups of 3 and 5 (SmolLM2's 9 query heads over 3 KV heads): a step mixing prefill chunks and decode
    rows, then a decode-only step on the split-key path, both equal to the torch backend; with Gemma 2's
    soft-capped scores (a cap small enough to bind) and a sliding window too; and gpt-oss's attention sinks
    (a logit per head, large enough to take much of the weight), alone and with a sliding window."""
    import torch

    from weft.builtins.cpu import CpuPlatform
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionBatch, AttentionLayer
    from weft_cuda.platform import CudaPlatform
    from weft_triton.attention import TritonAttention

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    num_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(num_heads)
    layer = AttentionLayer(
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        scale=32**-0.5,
        logits_soft_cap=soft_cap,
        sliding_window=window,
        sinks=sinks,
    )
    sink_logits = {"sinks": (torch.randn(num_heads, generator=generator) * 3).to(device)} if sinks else {}
    block = 8
    platform = CpuPlatform() if device == "cpu" else CudaPlatform()
    for query_lens, lengths in (([7, 1, 19], [30, 41, 19]), ([1, 1], [90, 13])):
        requests = len(lengths)
        per_request = -(-max(lengths) // block)
        num_blocks = requests * per_request + 1
        cache = torch.randn(2, num_blocks, block, kv_heads, 32, generator=generator).to(device)
        table = torch.randperm(num_blocks - 1, generator=generator)[: requests * per_request].view(
            requests, per_request
        )
        table = table.to(device, torch.int32)
        positions = torch.cat(
            [torch.arange(length - count, length) for count, length in zip(query_lens, lengths, strict=True)]
        )
        rows = torch.repeat_interleave(torch.arange(requests), torch.tensor(query_lens))
        slots = table.cpu()[rows, positions // block].long() * block + positions % block
        tokens = sum(query_lens)
        batch = AttentionBatch(
            query_start=torch.tensor(
                [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
            ),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_table=table,
            slot_mapping=slots.to(device, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(lengths),
            block_size=block,
        )
        query = torch.randn(tokens, num_heads, 32, generator=generator).to(device)
        key = torch.randn(tokens, kv_heads, 32, generator=generator).to(device)
        value = torch.randn(tokens, kv_heads, 32, generator=generator).to(device)
        results = {}
        for backend in (TritonAttention(None, platform), TorchAttention(None, platform)):
            backend.prepare([layer], "float32")
            results[backend.name] = backend.forward(
                layer, query, key, value, cache.clone(), backend.build_metadata(batch), **sink_logits
            )
        torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not _has_cuda(), reason="needs TRITON_INTERPRET=1 or a GPU"
)
@pytest.mark.parametrize("window", [None, 11])
def test_a_padded_verify_batch_matches_the_unpadded_one(window):
    """A verify graph's batch (weft.runner.graphs.VerifyGraphs): rows of up to 1 + k query tokens under a static
    max_query_len of 1 + k, a padding row of no query token, and tokens past the last row's that belong to no
    request, their keys and values going to the scratch block. The real rows' outputs and the cache outside the
    scratch block equal the unpadded batch's, through the torch backend."""
    import torch

    from weft.builtins.cpu import CpuPlatform
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionBatch, AttentionLayer
    from weft_cuda.platform import CudaPlatform
    from weft_triton.attention import TritonAttention

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    generator = torch.Generator().manual_seed(7)
    layer = AttentionLayer(num_heads=8, num_kv_heads=2, head_dim=32, scale=32**-0.5, sliding_window=window)
    block, query_len, size = 8, 5, 4
    query_lens, lengths = [5, 1, 3], [40, 17, 23]
    requests, tokens = len(lengths), sum(query_lens)
    per_request = -(-max(lengths) // block)
    num_blocks = requests * per_request + 1
    scratch = num_blocks - 1
    cache = torch.randn(2, num_blocks, block, 2, 32, generator=generator).to(device)
    table = torch.randperm(scratch, generator=generator)[: requests * per_request].view(requests, per_request)
    positions = torch.cat([torch.arange(length - n, length) for n, length in zip(query_lens, lengths, strict=True)])
    rows = torch.repeat_interleave(torch.arange(requests), torch.tensor(query_lens))
    slots = (table[rows, positions // block].long() * block + positions % block).to(torch.int32)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    unpadded = AttentionBatch(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=table.to(device, torch.int32),
        slot_mapping=slots.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(lengths),
        block_size=block,
    )
    static_tokens = size * query_len
    padded_table = torch.full((size, per_request + 2), scratch, dtype=torch.int32)  # wider: as a static table
    padded_table[:requests, :per_request] = table
    padded = AttentionBatch(
        query_start=torch.tensor([*starts, tokens], dtype=torch.int32, device=device),  # row 3: no query token
        seq_lens=torch.tensor([*lengths, 1], dtype=torch.int32, device=device),
        block_table=padded_table.to(device),
        slot_mapping=torch.cat([slots, torch.full((static_tokens - tokens,), scratch * block, dtype=torch.int32)]).to(
            device
        ),
        max_query_len=query_len,
        max_seq_len=64,
        block_size=block,
    )
    query = torch.randn(static_tokens, 8, 32, generator=generator).to(device)
    key = torch.randn(static_tokens, 2, 32, generator=generator).to(device)
    value = torch.randn(static_tokens, 2, 32, generator=generator).to(device)
    platform = CpuPlatform() if device == "cpu" else CudaPlatform()
    reference_backend = TorchAttention(None, platform)
    reference_backend.prepare([layer], "float32")
    reference_cache = cache.clone()
    reference = reference_backend.forward(
        layer,
        query[:tokens],
        key[:tokens],
        value[:tokens],
        reference_cache,
        reference_backend.build_metadata(unpadded),
    )
    triton_backend = TritonAttention(None, platform)
    triton_backend.prepare([layer], "float32")
    padded_cache = cache.clone()
    output = triton_backend.forward(layer, query, key, value, padded_cache, triton_backend.build_metadata(padded))
    torch.testing.assert_close(output[:tokens], reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_cache[:, :scratch], reference_cache[:, :scratch], rtol=0, atol=0)
    assert not torch.equal(padded_cache[:, scratch], cache[:, scratch])  # the padding tokens wrote there
