"""Speculative decoding under structured outputs: constrained requests verify proposals, each position masked by
the grammar advanced over the proposals before it; the proposals the step rejects are rolled back.

The masks at each position against a matcher walked to that position by hand (xgrammar's own fill), in the fill
thread's functions and in fill processes; then the engine: greedy output identical with speculation off, with
``ngram`` and with a self-draft, in a batch mixing JSON-schema, regex and choice constraints with free rows, stop
strings and n=2; rejected proposals rolled back, the output still valid JSON.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("weft_xgrammar")

from weft.contracts.structured_output import StructuredOutputsParams, Vocabulary, bitmask_words  # noqa: E402
from weft.engine.core.grammar_proposals import fill_positions, settle  # noqa: E402
from weft_xgrammar.backend import XgrammarBackend, XgrammarMatcher  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
}
DOCUMENT = '{"name":"bob","ok":true,"n":42}'


@pytest.fixture(scope="module")
def tokenizer():
    from weft.config import load_config
    from weft.plugins import PluginRegistry
    from weft.resolve import load_tokenizer, resolve_source

    registry, config = PluginRegistry(), load_config(None, {})
    _, source = resolve_source(registry, config)
    return load_tokenizer(registry, config, source)


@pytest.fixture(scope="module")
def backend(tokenizer):
    vocabulary = Vocabulary(tokenizer.vocabulary_bytes(), tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    return XgrammarBackend(None, vocabulary)


@pytest.fixture(scope="module")
def compiled(backend):
    return backend.compile(StructuredOutputsParams(json=SCHEMA, any_whitespace=False))


def walked(backend, compiled, tokens):
    """A fresh matcher that accepted ``tokens`` one by one: the reference for a position's mask."""
    matcher = backend.matcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    return matcher


def mask_after(backend, compiled, tokens, words):
    row = torch.zeros(1, words, dtype=torch.int32)
    walked(backend, compiled, tokens).fill_bitmask(row, 0)
    return row[0]


def refused_after(backend, compiled, tokens):
    """A token the grammar refuses after ``tokens``."""
    matcher = walked(backend, compiled, tokens)
    for token in range(3, 2000):
        if not matcher.accept_token(token):
            return token
        matcher.rollback(1)
    raise AssertionError(f"the grammar takes every token after {tokens}")


class CountingMatcher(XgrammarMatcher):
    """Counts the tokens rolled back."""

    def __init__(self, matcher):
        super().__init__(matcher.matcher)
        self.rolled_back = []

    def rollback(self, num_tokens):
        self.rolled_back.append(num_tokens)
        super().rollback(num_tokens)


def test_each_position_is_masked_as_after_the_proposals_before_it(backend, compiled, tokenizer):
    """Three matchers in one fill: one verifying proposals the grammar takes, one whose third proposal the grammar
    refuses (its rows from there allow everything: nothing past a refused proposal is kept; its refused proposal is
    masked off at its own position), one without proposals; rows request after request."""
    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    words = bitmask_words(backend.vocabulary.size)
    start = text[:2]
    refused = refused_after(backend, compiled, text[:4])
    cases = [text[2:6], [text[2], text[3], refused, text[5]], []]
    matchers = [walked(backend, compiled, start) for _ in cases]
    bitmask = torch.zeros(sum(len(proposed) + 1 for proposed in cases), words, dtype=torch.int32)
    took = fill_positions(backend, matchers, cases, bitmask)
    assert took == [text[2:6], text[2:4], []]
    expected = [mask_after(backend, compiled, start + text[2 : 2 + j], words) for j in range(5)]
    assert torch.equal(bitmask[0:5], torch.stack(expected))
    assert torch.equal(bitmask[5:8], torch.stack(expected[:3]))
    assert not bitmask[7, refused // 32] >> (refused % 32) & 1  # the refused proposal is masked at its position
    assert torch.equal(bitmask[8:10], torch.full((2, words), -1, dtype=torch.int32))
    assert torch.equal(bitmask[10], expected[0])
    # The matchers stand after the proposals they took.
    row = torch.zeros(1, words, dtype=torch.int32)
    matchers[0].fill_bitmask(row, 0)
    assert torch.equal(row[0], mask_after(backend, compiled, start + text[2:6], words))


def test_settling_keeps_the_accepted_proposals_and_rolls_back_the_rest(backend, compiled, tokenizer):
    """A step that accepted two of four proposals and replaced the third: the matcher keeps two, rolls back two and
    takes the replacement as usual; one whose tokens never came (preempted) rolls all back when it fills again; one
    that ended on an accepted proposal (the end token) is reported with the index of that token."""
    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    eos = min(backend.vocabulary.eos_token_ids)
    words = bitmask_words(backend.vocabulary.size)
    matchers = {
        "partial": CountingMatcher(walked(backend, compiled, text[:2])),
        "preempted": CountingMatcher(walked(backend, compiled, text[:2])),
        "ended": CountingMatcher(walked(backend, compiled, text[:-2])),
    }
    proposals = {"partial": text[2:6], "preempted": text[2:5], "ended": [text[-2], text[-1], eos]}
    bitmask = torch.zeros(sum(len(tokens) + 1 for tokens in proposals.values()), words, dtype=torch.int32)
    took = fill_positions(backend, list(matchers.values()), list(proposals.values()), bitmask)
    advanced = dict(zip(proposals, took, strict=True))
    assert advanced == proposals
    replacement = next(
        token
        for token in range(3, 2000)
        if token != text[4] and walked(backend, compiled, text[:4]).accept_token(token)
    )
    accepted = [
        ("ended", text[-2]),
        ("partial", text[2]),
        ("ended", text[-1]),
        ("partial", text[3]),
        ("partial", replacement),
        ("ended", eos),
    ]
    keep, ended = settle(advanced, accepted, ["preempted"], matchers.__getitem__)
    assert keep == [4] and ended == [(5, "ended")] and not advanced
    assert matchers["partial"].rolled_back == [2] and matchers["preempted"].rolled_back == [3]
    assert matchers["ended"].rolled_back == [] and matchers["ended"].is_terminated()
    assert matchers["partial"].accept_token(replacement)
    for name, tokens in (("partial", [*text[:4], replacement]), ("preempted", text[:2])):
        row = torch.zeros(1, words, dtype=torch.int32)
        matchers[name].fill_bitmask(row, 0)
        assert torch.equal(row[0], mask_after(backend, compiled, tokens, words)), name


@pytest.mark.parametrize("processes", [1, 2])
def test_fill_processes_mask_each_position_and_settle_by_the_steps_tokens(backend, compiled, tokenizer, processes):
    """The same in fill processes: handles verifying proposals fill a row per position, child after child; the next
    step's tokens keep the accepted proposals and roll back the rest (the masks after it are those of the tokens the
    requests really generated)."""
    from weft.engine.core.grammar_group import FillGroup

    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    words = bitmask_words(backend.vocabulary.size)
    refused = refused_after(backend, compiled, text[:3])
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, words, processes=processes, spin=0.001)
    try:
        handles = [group.new_handle() for _ in range(3)]
        payload = backend.serialize_compiled(compiled)
        proposals = [text[2:5], [], [text[2], refused, text[4]]]
        accepted = [(handle, token) for token in text[:2] for handle in handles]
        reply = group.step([(handle, 0, payload) for handle in handles], accepted, handles, proposals)
        assert sorted(reply.filled) == handles and not reply.ended and not reply.refused
        expected = {
            handles[0]: [mask_after(backend, compiled, text[: 2 + j], words) for j in range(4)],
            handles[1]: [mask_after(backend, compiled, text[:2], words)],
            handles[2]: [mask_after(backend, compiled, text[: 2 + j], words) for j in range(2)]
            + [torch.full((words,), -1, dtype=torch.int32)] * 2,
        }
        count = sum(len(expected[handle]) for handle in reply.filled)
        rows = torch.frombuffer(bytearray(group.rows(count)), dtype=torch.int32).view(-1, words)
        assert torch.equal(rows, torch.stack([row for handle in reply.filled for row in expected[handle]]))
        # Request 0 kept one proposal and drew another token; request 2 kept its one; request 1 decoded one token.
        replacement = next(
            token
            for token in range(3, 2000)
            if token != text[3] and walked(backend, compiled, text[:3]).accept_token(token)
        )
        generated = {handles[0]: [text[2], replacement], handles[1]: [text[2]], handles[2]: [text[2], text[3]]}
        accepted = [(handle, token) for handle in handles for token in generated[handle]]
        reply = group.step([], accepted, handles)
        assert sorted(reply.filled) == handles and not reply.refused
        rows = torch.frombuffer(bytearray(group.rows(3)), dtype=torch.int32).view(-1, words)
        for row, handle in zip(rows, reply.filled, strict=True):
            assert torch.equal(row, mask_after(backend, compiled, text[:2] + generated[handle], words)), handle
    finally:
        group.close()


# The engine.

ENGINE = {"block_size": 4, "num_kv_blocks": 1024, "max_num_batched_tokens": 128, "max_num_seqs": 16}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
JSON = StructuredOutputsParams(json=SCHEMA, any_whitespace=False)
REGEX = StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){0,4}")
CHOICE = StructuredOutputsParams(choice=("yes", "no", "maybe so"))
PASSAGE = ' {"name":"ada","ok":false,"n":7} {"name":"bob","ok":true,"n":42} {"name":"cy","ok":true,"n":5}'


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_files):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("spec-structured") / "llama", "llama", tokenizer_files)


def engine_for(target, method, fill="thread"):
    from weft import LLM

    speculative = {
        "off": None,
        "ngram": NGRAM,
        "self-draft": {"method": "draft", "model": str(target), "num_speculative_tokens": 3},
    }[method]
    engine = {**ENGINE, "structured_output_fill": fill}
    if speculative is not None:
        engine["speculative"] = speculative
    return LLM(model=str(target), engine=engine)


@pytest.fixture(scope="module")
def plain(target, one_torch_thread):
    llm = engine_for(target, "off")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ngram(target, one_torch_thread):
    llm = engine_for(target, "ngram")
    yield llm
    llm.close()


def prompts(tokenizer, count):
    """Prompts holding JSON documents, words and answers the outputs may repeat, so prompt lookup proposes inside
    the constrained outputs."""
    texts = [f"Example {index}:{PASSAGE} yes no maybe so then {PASSAGE[: 20 + 7 * index]}" for index in range(count)]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def mixed_batch(tokenizer, plain):
    """Prompts and sampling parameters of a batch mixing every kind of row: constrained by a JSON schema (greedy,
    with n=2, cut by a stop string, seeded sampling), by a regex and by a choice, and free (greedy, seeded sampling, a
    stop string inside its greedy text)."""
    from weft import SamplingParams

    batch = prompts(tokenizer, 9)
    free_text = plain.generate([batch[7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = free_text.outputs[0].text[10:14]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON, n=2),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON, stop=[',"n"']),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=REGEX),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=CHOICE),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=20, ignore_eos=True),
    ]
    return batch, params


def completions(outputs):
    return [
        [(completion.token_ids, completion.text, completion.finish_reason) for completion in output.outputs]
        for output in outputs
    ]


def spec_counts(llm):
    stats = llm.engine.core.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "ngram-process", "self-draft"])
def test_a_mixed_batch_is_identical_with_speculation_off_and_on(target, tokenizer, plain, ngram, method, monkeypatch):
    """Greedy and seeded outputs of the mixed batch equal speculation off's, with ``ngram`` (the matchers in the fill
    thread, or in a fill process) and with the target as its own draft (whose proposals, drawn without the grammar,
    the constrained rows reject where the mask moves the argmax); constrained rows verified proposals."""
    batch, params = mixed_batch(tokenizer, plain)
    expected = completions(plain.generate(batch, params))
    assert expected[2][0][2] == "stop" and expected[7][0][2] == "stop"  # the stop strings cut
    verified = []
    if method == "ngram":
        llm = ngram
    elif method == "ngram-process":
        llm = engine_for(target, "ngram", fill="process")
    else:
        llm = engine_for(target, "self-draft")
    try:
        manager = llm.engine.core.scheduler.structured_outputs
        real = manager.grammar_output

        def recorded(request_ids, requests, proposals=None):
            verified.extend(len(proposals[request_id]) for request_id in request_ids if request_id in (proposals or {}))
            return real(request_ids, requests, proposals)

        monkeypatch.setattr(manager, "grammar_output", recorded)
        drafted_before, accepted_before = spec_counts(llm)
        assert completions(llm.generate(batch, params)) == expected
        drafted, accepted = spec_counts(llm)
        assert accepted > accepted_before and drafted > drafted_before
        assert verified and max(verified) == 3  # constrained rows verified proposals, k of them at most
        if method == "ngram-process":
            assert manager.fills_in_process
    finally:
        if llm is not ngram:
            llm.close()


def test_rejected_proposals_are_rolled_back_and_the_output_stays_valid_json(tokenizer, plain, ngram, monkeypatch):
    """Prompt lookup on a random model: some proposals of the constrained rows are rejected, their matchers roll them
    back, and every output is still a document of the schema (equal to speculation off's)."""
    from weft import SamplingParams

    rolled_back = []
    real = XgrammarMatcher.rollback

    def counted(self, num_tokens):
        rolled_back.append(num_tokens)
        real(self, num_tokens)

    monkeypatch.setattr(XgrammarMatcher, "rollback", counted)
    batch = prompts(tokenizer, 6)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON)
    drafted_before, accepted_before = spec_counts(ngram)
    outputs = ngram.generate(batch, params)
    drafted, accepted = spec_counts(ngram)
    assert accepted_before < accepted < accepted_before + (drafted - drafted_before)  # some accepted, some not
    assert rolled_back and all(0 < count <= NGRAM["num_speculative_tokens"] for count in rolled_back)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        document = json.loads(completion.text)
        assert document.keys() == SCHEMA["properties"].keys() and document["name"] in ("ada", "bob", "cy")
    assert completions(outputs) == completions(plain.generate(batch, params))


def test_constrained_rows_verify_no_more_proposals_than_their_matchers_roll_back(tokenizer, plain, ngram, monkeypatch):
    """A backend that rolls back one token at most: constrained rows verify one proposal a step, free rows ``k``."""
    from weft import SamplingParams

    monkeypatch.setattr(XgrammarBackend, "max_rollback_tokens", 1)
    scheduler = ngram.engine.core.scheduler
    real, widths = scheduler.schedule, {"constrained": [], "free": []}

    def recorded():
        output = real()
        for request_id, proposed in output.spec_token_ids.items():
            constrained = scheduler.requests[request_id].constraint is not None
            widths["constrained" if constrained else "free"].append(len(proposed))
        return output

    monkeypatch.setattr(scheduler, "schedule", recorded)
    batch = prompts(tokenizer, 4)
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON)
        if index % 2
        else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for index in range(len(batch))
    ]
    assert completions(ngram.generate(batch, params)) == completions(plain.generate(batch, params))
    assert max(widths["constrained"]) == 1 and max(widths["free"]) == NGRAM["num_speculative_tokens"]


def test_a_thinking_model_drafts_through_its_thinking_and_its_answer_keeps_the_constraint(
    tmp_path_factory, tokenizer_files, one_torch_thread
):
    """test_reasoning_serve's thinking model (it writes its reasoning, ``</think>``, then an answer) as its own draft:
    its proposals run through the thinking, unmasked, and stop at its end, whose next position the constraint masks;
    the answer is one of the choices, as without speculation, and the thinking's proposals were accepted."""
    import httpx

    from test_reasoning_serve import REASONING, TEMPLATE, THINKING_OUTPUT, _chain_model, _chat, _server

    folder = _chain_model(tmp_path_factory.mktemp("thinking"), tokenizer_files, TEMPLATE, [THINKING_OUTPUT])
    choices = ["Rome", "The user"]
    answers, accepted = [], None
    for speculative in (None, {"method": "draft", "model": str(folder), "num_speculative_tokens": 3}):
        server, client = _server(folder, engine={"speculative": speculative} if speculative else {})
        try:
            for stream in (False, True):
                extra = {"structured_outputs": {"choice": choices}}
                if stream:
                    chunks = _chat(client, stream=True, temperature=0, extra_body=extra)
                    answers.append("".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices))
                    continue
                message = _chat(client, temperature=0, extra_body=extra).choices[0].message
                answers.append((message.reasoning_content, message.content))
            metrics = httpx.get(f"{server.url}/metrics").text
        finally:
            server.stop()
        if speculative is not None:
            accepted = [
                line for line in metrics.splitlines() if line.startswith("weft_spec_decode_num_accepted_tokens_total")
            ]
    assert answers[0][0] == REASONING and answers[0][1] in choices and answers[1] == answers[0][1]
    assert answers[2:] == answers[:2]
    assert accepted and float(accepted[0].split()[-1]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("options", [{}, {"enforce_eager": True, "async_scheduling": False}], ids=["graphs", "eager"])
def test_a_mixed_batch_is_identical_with_ngram_on_cuda(tmp_path, tokenizer_files, options):
    """The mixed batch on CUDA (the masks staged in pinned memory and added to the verify logits' rows on the
    device), bf16, with the decode and mask graphs captured or eagerly without asynchronous scheduling; on a target
    whose greedy path does not hinge on bf16 rounding (:func:`conftest.damp_residual_branches`)."""
    from transformers import AutoTokenizer

    from conftest import damp_residual_branches, make_tiny_model
    from weft import LLM

    target = damp_residual_branches(make_tiny_model(tmp_path / "llama", "llama", tokenizer_files))

    sized = {key: value for key, value in ENGINE.items() if key != "num_kv_blocks"}  # sized by memory instead
    engine = {**sized, "dtype": "bfloat16", "gpu_memory_utilization": 0.2, "max_model_len": 512, **options}
    plain = LLM(model=str(target), engine=engine)
    try:
        batch, params = mixed_batch(AutoTokenizer.from_pretrained(str(tokenizer_files)), plain)
        expected = completions(plain.generate(batch, params, use_tqdm=False))
    finally:
        plain.close()
    llm = LLM(model=str(target), engine={**engine, "speculative": NGRAM})
    try:
        assert completions(llm.generate(batch, params, use_tqdm=False)) == expected
        drafted, accepted = spec_counts(llm)
    finally:
        llm.close()
    assert 0 < accepted < drafted
