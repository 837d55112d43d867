"""Decode steps as two nano-batches (``engine.decode_overlap``, the ``nano_batches`` op) on the CPU.

The op's streams implementation against its reference (the conformance kit: on the CPU its streams are torch's
no-op stubs, so this checks the interleaved order and the split), and an engine whose decode graphs run as
nano-batches against the plain engine: the same greedy tokens, on the runner's graph path (the CPU platform made
to "capture" by replaying the forward eagerly, ``eager_replay_platform``).
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from weft import LLM, SamplingParams
from weft.layers.nano_batches import split_rows
from weft.testing import OpContract


class TestNanoBatchesStreams(OpContract):
    plugin_name = "nano_batches.streams"


def test_split_rows_covers_the_step_in_two():
    assert split_rows(512) == ((0, 256), (256, 512))
    assert split_rows(5) == ((0, 3), (3, 5))
    with pytest.raises(ValueError, match="1 row"):
        split_rows(1)


class CountingOp:
    """Wraps the model's ``nano_batches`` op and counts its calls (the split path ran)."""

    def __init__(self, op):
        self.op, self.calls = op, []

    def __call__(self, layers, parts):
        self.calls.append([part.hidden.shape[0] for part in parts])
        return self.op(layers, parts)


def prompts(count: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 30, (count,), generator=generator).tolist()
    return [torch.randint(3, 49152, (length,), generator=generator).tolist() for length in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_nano_batch_decode_gives_the_plain_greedy_tokens(
    kind, tmp_path, tokenizer_files, eager_replay_platform, monkeypatch
):
    from weft.builtins.torch_attention import TorchAttention

    # The replayed "graph" runs the whole forward again, metadata included: the torch backend's host reads are
    # fine there, and it is the reference attention the CPU runs.
    monkeypatch.setattr(TorchAttention, "supports_graph_capture", True)
    folder = str(make_tiny_model(tmp_path / kind, kind, tokenizer_files))
    engine = {"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8, "graph_batch_sizes": [1, 2, 4, 8]}
    # Requests that finish at different steps: the batch shrinks through 8, 4 (split) and 2, 1 (whole).
    params = [SamplingParams(temperature=0, max_tokens=12 - i, ignore_eos=True) for i in range(6)]
    batch = prompts(6)
    plain = LLM(model=folder, engine={**engine, "decode_overlap": False})
    assert plain.engine.runner.decode_graphs.split_from is None
    expected = [output.outputs[0].token_ids for output in plain.generate(batch, params)]
    plain.close()
    split = LLM(model=folder, engine={**engine, "decode_overlap": True, "decode_overlap_min_batch": 4})
    assert split.engine.runner.decode_graphs.split_from == 4
    model = split.engine.runner.model.model
    model.nano_batches = counting = CountingOp(model.nano_batches)
    assert [output.outputs[0].token_ids for output in split.generate(batch, params)] == expected
    assert [4, 4] in counting.calls and [2, 2] in counting.calls  # batch 8, then 4 (padded rows included)
    assert all(sum(rows) >= 4 for rows in counting.calls)  # sizes 1 and 2 ran whole
    split.close()


def test_decode_overlap_is_off_by_default_on_the_cpu(tmp_path, tokenizer_files):
    folder = str(make_tiny_model(tmp_path / "llama", "llama", tokenizer_files))
    llm = LLM(model=folder, engine={"num_kv_blocks": 64, "max_num_seqs": 4})
    assert llm.engine.config.engine.decode_overlap is False
    llm.close()
