"""Verify graphs on the CPU: speculating steps through the runner's static buffers (:class:`VerifyGraphs`).

A CPU has no graphs; ``eager_replay_platform`` makes its platform "capture" by returning the function itself, so
a replay runs the captured forward eagerly over the static buffers, with the padding a CUDA graph's replay has
(rows of no query token, tokens of no request in the scratch block). The torch attention reads those buffers as
any batch (its metadata is rebuilt on every call here), standing in for a capturable backend. Each verify step's
logits are checked against the eager forward of the same step, and greedy output against plain decoding's.
The GPU's tests are in tests/test_speculative_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import target_and_small_draft
from test_speculative import ENGINE, GREEDY, NGRAM, repetitive_prompts, spec_counts, token_ids
from weft import LLM, SamplingParams
from weft.runner.forward import BatchForward
from weft.runner.graphs import VerifyGraphs, padded_tables, verify_graph_sizes

GRAPHS = {**ENGINE, "max_num_seqs": 8, "graph_batch_sizes": [1, 2, 4, 8]}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_files):
    return target_and_small_draft(tmp_path_factory.mktemp("spec_graphs"), tokenizer_files)


@pytest.fixture
def capturable(eager_replay_platform, monkeypatch):
    """The CPU platform 'captures' (replays run eagerly) and the torch attention is taken as capturable."""
    from weft.builtins.torch_attention import TorchAttention

    monkeypatch.setattr(TorchAttention, "supports_graph_capture", True)
    monkeypatch.setattr(TorchAttention, "supports_verify_graph_capture", True)
    return eager_replay_platform


class Checked(list):
    """The (size, rows, tokens) of each verify replay, and the replays whose logits differed from the eager
    forward's (a step's error is the engine's to report: it would not reach the test as raised)."""

    def __init__(self) -> None:
        super().__init__()
        self.mismatches: list[str] = []


@pytest.fixture
def checked_against_eager(monkeypatch):
    """Every verify replay's logits, checked against the eager forward of the same step (which writes the same
    keys and values to the same slots again)."""
    checked = Checked()
    replay = BatchForward._replay_verify

    def replay_and_check(self, states, counts, size, proposals):
        logits = replay(self, states, counts, size, proposals).clone()
        eager = self._execute_eager(states, counts, list(range(len(states))), {}, proposals)
        try:  # float32 GEMMs of other row counts round their last bits differently
            torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
            assert torch.equal(logits.argmax(-1), eager.argmax(-1)), "greedy tokens differ"
        except AssertionError as error:
            checked.mismatches.append(f"size {size}, counts {counts}: {error}")
        checked.append((size, len(counts), sum(counts)))
        return logits

    monkeypatch.setattr(BatchForward, "_replay_verify", replay_and_check)
    return checked


def test_verify_graph_sizes_thin_the_decode_sizes():
    decode = [1, 2, 4, *range(8, 257, 8)]
    assert verify_graph_sizes(decode) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert verify_graph_sizes([1, 2, 4, 8, 16, 24, 30]) == [1, 2, 4, 8, 16, 30]  # the largest always
    assert verify_graph_sizes([3]) == [3]


def test_block_tables_are_padded_and_cut_to_the_static_width():
    """A request's blocks past max_model_len (the k slots allocated ahead for a draft) are cut: a captured forward
    reads no position there, and the static table is max_model_len wide."""
    table = padded_tables([[5, 6], [7], [1, 2, 3, 4, 9]], limit=4)
    assert table.dtype == torch.int32 and table.tolist() == [[5, 6, 0, 0], [7, 0, 0, 0], [1, 2, 3, 4]]
    assert padded_tables([[5, 6], [7]], limit=4).tolist() == [[5, 6], [7, 0]]


def test_a_step_replays_the_smallest_graph_its_rows_and_tokens_fit():
    graphs = VerifyGraphs(torch.nn.Identity(), None, [], {}, torch.device("cpu"))
    graphs.graphs = {size: (lambda: None) for size in (1, 2, 4, 8)}
    graphs.query_len = 5
    graphs.tokens = {1: 5, 2: 10, 4: 20, 8: 24}  # the largest capped by a 24-token budget
    assert graphs.size_for([5]) == 1
    assert graphs.size_for([1, 1]) == 2
    assert graphs.size_for([5, 5, 1]) == 4  # three rows: the size 4 graph, its fourth row padding
    assert graphs.size_for([5, 5, 5, 5, 1]) == 8
    assert graphs.size_for([6]) is None  # a row longer than 1 + k
    assert graphs.size_for([5] * 5) is None  # 25 tokens: over every graph's
    assert graphs.size_for([1] * 9) is None  # more rows than the largest size
    assert VerifyGraphs(torch.nn.Identity(), None, [], {}, torch.device("cpu")).size_for([1]) is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_verify_graphs_equal_eager_and_plain_decoding(
    models, capturable, checked_against_eager, async_scheduling
):
    """Rows proposing k, fewer or no tokens in one verify graph, padded to the captured size; with asynchronous
    scheduling a row without proposals feeds its last token from the device (the step before's, not yet on the
    host) into the static buffer."""
    prompts = repetitive_prompts(count=7)  # 7 rows: the size 8 graph, a padding row; later fewer (3: size 4)
    engine = {**GRAPHS, "async_scheduling": async_scheduling}
    with LLM(model=str(models[0]), engine=engine) as plain:
        expected = token_ids(plain.generate(prompts, GREEDY))
        single = token_ids(plain.generate(prompts[2:3], GREEDY))
    with LLM(model=str(models[0]), engine={**engine, "speculative": NGRAM}) as llm:
        graphs = llm.engine.runner.verify_graphs
        assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.query_len == 5
        assert graphs.tokens == {1: 5, 2: 10, 4: 20, 8: 40}
        got = token_ids(llm.generate(prompts, GREEDY))
        alone = token_ids(llm.generate(prompts[2:3], GREEDY))
        drafted, accepted = spec_counts(llm)
        assert graphs.replays == len(checked_against_eager)
    assert not checked_against_eager.mismatches, checked_against_eager.mismatches[0]
    assert got == expected and alone == single
    assert drafted > accepted > 0
    sizes = {size for size, _, _ in checked_against_eager}
    assert {1, 8} <= sizes, sizes  # batch 1, and the batch of 7 padded to 8
    assert any(rows < size for size, rows, _ in checked_against_eager)  # padding rows
    assert any(tokens < rows * 5 for _, rows, tokens in checked_against_eager)  # rows proposing fewer than k
    assert any(tokens > rows for _, rows, tokens in checked_against_eager)


@pytest.mark.parametrize("draft", ["small", "self"])
def test_draft_graphs_propose_as_eager_and_verify_graphs_equal_plain_decoding(
    models, capturable, checked_against_eager, draft
):
    """The draft's k - 1 chained one-token forwards replay one graph (DraftGraphs): the same proposals as the eager
    loop (the same draft and acceptance counts), every one accepted with a self-draft; output as plain decoding's."""
    prompts = repetitive_prompts(count=5)
    source = models[1] if draft == "small" else models[0]
    speculative = {"method": "draft", "model": str(source), "num_speculative_tokens": 3}
    eager = {key: value for key, value in GRAPHS.items() if key != "graph_batch_sizes"}
    with LLM(model=str(models[0]), engine={**eager, "enforce_eager": True, "speculative": speculative}) as llm:
        assert llm.engine.runner.speculation.speculator.graphs is None
        eager_tokens = token_ids(llm.generate(prompts, GREEDY))
        eager_counts = spec_counts(llm)
    with LLM(model=str(models[0]), engine=GRAPHS) as plain:
        expected = token_ids(plain.generate(prompts, GREEDY))
    with LLM(model=str(models[0]), engine={**GRAPHS, "speculative": speculative}) as llm:
        assert llm.engine.runner.verify_graphs.query_len == 4
        draft_graphs = llm.engine.runner.speculation.speculator.graphs
        assert sorted(draft_graphs.graphs) == [1, 2, 4, 8] and draft_graphs.steps == 2
        got = token_ids(llm.generate(prompts, GREEDY))
        counts = spec_counts(llm)
        assert draft_graphs.replays > 0
    assert not checked_against_eager.mismatches, checked_against_eager.mismatches[0]
    assert got == expected == eager_tokens
    assert counts == eager_counts and counts[0] > 0
    if draft == "self":
        assert counts[1] == counts[0]
    assert checked_against_eager


def test_eager_engines_and_backends_that_cannot_capture_them_have_no_verify_graph(models, capturable, monkeypatch):
    eager = {key: value for key, value in GRAPHS.items() if key != "graph_batch_sizes"}
    with LLM(model=str(models[0]), engine={**eager, "enforce_eager": True, "speculative": NGRAM}) as llm:
        assert not llm.engine.runner.graphs and not llm.engine.runner.verify_graphs.graphs
    from weft.builtins.torch_attention import TorchAttention

    monkeypatch.setattr(TorchAttention, "supports_verify_graph_capture", False)
    with LLM(model=str(models[0]), engine={**GRAPHS, "speculative": NGRAM}) as llm:
        assert llm.engine.runner.graphs and not llm.engine.runner.verify_graphs.graphs
        assert token_ids(llm.generate(repetitive_prompts(count=2), GREEDY))  # speculating steps run eagerly


@pytest.mark.parametrize("graphs", [False, True])
def test_a_draft_proposes_nothing_past_max_model_len(models, capturable, graphs):
    """Requests that run into max_model_len: the draft proposes no token at or past it (it once computed
    positions the rotary table does not hold), eagerly and through its graphs; output as plain decoding's."""
    engine = {**GRAPHS, "max_model_len": 64}
    if not graphs:
        engine = {key: value for key, value in engine.items() if key != "graph_batch_sizes"} | {"enforce_eager": True}
    prompts = repetitive_prompts(count=3)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    speculative = {"method": "draft", "model": str(models[0]), "num_speculative_tokens": 3}
    with LLM(model=str(models[0]), engine=engine) as plain:
        expected = plain.generate(prompts, params)
    with LLM(model=str(models[0]), engine={**engine, "speculative": speculative}) as llm:
        got = llm.generate(prompts, params)
        drafted, accepted = spec_counts(llm)
    assert [len(prompt) + len(output.outputs[0].token_ids) for prompt, output in zip(prompts, got, strict=True)] == [
        64
    ] * 3
    assert token_ids(got) == token_ids(expected)
    assert drafted == accepted > 0
