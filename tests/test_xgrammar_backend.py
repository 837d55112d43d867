"""weft-xgrammar against xgrammar itself, and the pieces the engine builds on: the vocabulary's bytes,
the bitmask applied on the device, rollback, validation messages."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xgrammar as xgr

from weft.builtins.bitmask_argmax import BitmaskArgmaxTorch
from weft.builtins.hf_tokenizer import HFTokenizer, vocabulary_bytes
from weft.config import load_config
from weft.contracts.structured_output import StructuredOutputsParams, Vocabulary, bitmask_words
from weft.plugins import PluginRegistry
from weft.resolve import load_tokenizer, resolve_source
from weft.runner.logits_processors import TokenBitmask
from weft.testing import StructuredOutputContract
from weft_xgrammar.backend import XgrammarBackend


@pytest.fixture(scope="module")
def tokenizer():
    registry, config = PluginRegistry(), load_config(None, {})
    _, source = resolve_source(registry, config)
    return load_tokenizer(registry, config, source)


@pytest.fixture(scope="module")
def backend(tokenizer):
    vocabulary = Vocabulary(tokenizer.vocabulary_bytes(), tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    return XgrammarBackend(None, vocabulary)


def test_vocabulary_bytes_decode_like_the_tokenizer(tokenizer):
    table = tokenizer.vocabulary_bytes()
    assert len(table) == tokenizer.vocab_size
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text and table[token_id]:  # part of a multi-byte character: compared below, joined
            assert table[token_id].decode() == text, token_id
    assert all(table[token_id] == b"" for token_id in tokenizer.eos_token_ids)  # special tokens are never text
    text = 'Grüße, {"ключ": "値"} 🌍\n\ttabs'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[token_id] for token_id in ids).decode() == text


def test_vocabulary_bytes_of_a_sentencepiece_style_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "▁world": 4, "<0xC3>": 5, "<0xA9>": 6, "a": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    table = vocabulary_bytes(backend, len(vocab))
    assert table[3] == b" hello" and table[4] == b" world" and table[5] == b"\xc3" and table[6] == b"\xa9"
    assert table[1] == table[2] == b"" and table[7] == b"a"
    assert HFTokenizer(lambda *a: [], lambda *a: "", 8, frozenset(), {}, None, backend).vocabulary_bytes() == table


def test_the_bitmask_applied_on_the_device_equals_xgrammars_own(backend, tokenizer):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    matchers = [backend.matcher(compiled) for _ in range(20)]
    for count, matcher in enumerate(matchers):  # each at another point of '{"a": 12, "b": "x"}'
        for token in tokenizer.encode('{"a": 12, "b": "x"}', add_special_tokens=False)[: count % 8]:
            assert matcher.accept_token(token)
    vocab = tokenizer.vocab_size
    bitmask = torch.zeros(len(matchers), bitmask_words(vocab), dtype=torch.int32)
    backend.fill_bitmasks(matchers, bitmask)  # 20 rows: xgrammar's batch path
    serial = torch.zeros_like(bitmask)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(serial, row)
    assert torch.equal(bitmask, serial)
    token_bitmask = TokenBitmask(torch.device("cpu"))
    logits = torch.randn(len(matchers) + 3, vocab)
    rows = [index + 3 for index in range(len(matchers))]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected[3:], bitmask)
    token_bitmask.apply(logits, rows, bitmask.numpy().tobytes())
    assert torch.equal(logits, expected)
    # Rows scattered over the batch (some requests sample freely), the staging buffer reused.
    logits = torch.randn(2 * len(matchers), vocab)
    rows = [2 * index + index % 3 % 2 for index in range(len(matchers))]
    expected = logits.clone()
    masked = expected[rows]
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    expected[rows] = masked
    token_bitmask.apply(logits, rows, bitmask.numpy().tobytes())
    assert torch.equal(logits, expected)
    # The greedy path: the mask and the argmax in one op (the reference here), the free rows unmasked.
    logits = torch.randn(2 * len(matchers), vocab)
    expected = logits.clone()
    masked = expected[rows]
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    expected[rows] = masked
    tokens, healthy = token_bitmask.argmax(logits, rows, bitmask.numpy().tobytes(), BitmaskArgmaxTorch(None))
    assert torch.equal(tokens, expected.argmax(dim=-1)) and bool(healthy.all())
    assert all(
        bool(bitmask[index, token // 32] >> (token % 32) & 1) for index, token in enumerate(tokens[rows].tolist())
    )


def test_rollback_returns_to_an_earlier_state(backend, tokenizer):
    compiled = backend.compile(StructuredOutputsParams(regex=r"(ab|cd){2}!"))
    matcher = backend.matcher(compiled)
    masks = []
    tokens = [tokenizer.encode(piece, add_special_tokens=False)[0] for piece in ("ab", "cd", "!")]
    for token in tokens:
        mask = torch.zeros(1, bitmask_words(tokenizer.vocab_size), dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        masks.append(mask)
        assert matcher.accept_token(token)
    assert not matcher.is_terminated()
    eos = min(tokenizer.eos_token_ids)
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(3)  # back to after "ab": the end token and "!" and "cd" undone
    assert not matcher.is_terminated()
    mask = torch.zeros_like(masks[1])
    matcher.fill_bitmask(mask, 0)
    assert torch.equal(mask, masks[1])
    assert not matcher.accept_token(tokens[2])  # "!" is not allowed after one pair


def test_accepting_a_batch_equals_accepting_one_at_a_time(backend, tokenizer):
    """xgrammar's batch accept (one call a step) against the contract's default, one matcher at a time: the same
    accepted flags (a refused token changes nothing), the same terminations (only after an end token)."""
    from weft.contracts.structured_output import StructuredOutputBackend

    compiled = backend.compile(StructuredOutputsParams(regex=r"(ab|cd){2}!"))
    ab, cd, bang = (tokenizer.encode(piece, add_special_tokens=False)[0] for piece in ("ab", "cd", "!"))
    eos = min(tokenizer.eos_token_ids)
    histories = [[ab, cd, bang], [ab, cd], [ab], [cd, ab, bang], []]
    tokens = [eos, bang, bang, ab, cd]  # ends / ends the pattern / refused / refused after "!" / starts
    batched, single = [backend.matcher(compiled) for _ in histories], [backend.matcher(compiled) for _ in histories]
    for matchers in (batched, single):
        for matcher, history in zip(matchers, histories, strict=False):
            assert all(matcher.accept_token(token) for token in history)
    got = backend.accept_tokens(batched, tokens)
    want = StructuredOutputBackend.accept_tokens(backend, single, tokens)
    assert got == want == [(True, True), (True, False), (False, False), (False, False), (True, False)]
    for one, other in zip(batched[1:], single[1:], strict=False):  # the same states after: the same next masks
        masks = [torch.zeros(1, bitmask_words(tokenizer.vocab_size), dtype=torch.int32) for _ in range(2)]
        one.fill_bitmask(masks[0], 0)
        other.fill_bitmask(masks[1], 0)
        assert torch.equal(*masks)


BOUNDED_STRINGS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1},
        "note": {"type": "string", "minLength": 2, "maxLength": 24},
    },
    "required": ["name", "tags", "note"],
}
"""Strings with maxLength or minLength: xgrammar 0.2.9's own rule for them admits raw control characters."""
AT_LEAST_ONE_CHARACTER = {
    **BOUNDED_STRINGS,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "note": {"type": "string", "minLength": 1},
    },
}


def control_tokens(tokenizer) -> list[int]:
    """The tokens holding a raw control character (U+0000-U+001F), which a JSON string may not."""
    return [token for token, text in enumerate(tokenizer.vocabulary_bytes()) if any(byte < 0x20 for byte in text)]


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json=BOUNDED_STRINGS),
        StructuredOutputsParams(json=BOUNDED_STRINGS, any_whitespace=False),
        StructuredOutputsParams(json=AT_LEAST_ONE_CHARACTER),
        StructuredOutputsParams(json_object=True),
    ],
)
def test_no_raw_control_character_is_allowed_inside_a_string(backend, tokenizer, constraint):
    """At the start of each string and inside it, the mask allows no token holding a control character
    (json.loads would refuse it), and still allows ordinary text."""
    separator = " " if constraint.any_whitespace else ""
    pieces = [
        "{",
        '"name"',
        f":{separator}",
        '"',
        "A",
        "da",
        '"',
        f",{separator}",
        '"tags"',
        f":{separator}",
        '["',
        "x",
        '"',
        "]",
        f",{separator}",
        '"note"',
        f":{separator}",
        '"',
        "o",
        "k",
        '"',
        "}",
    ]
    in_string = {4, 5, 6, 11, 12, 18, 19, 20}  # after this many pieces the output is inside a string
    matcher = backend.matcher(backend.compile(constraint))
    for index, piece in enumerate(pieces):
        for token in tokenizer.encode(piece, add_special_tokens=False):
            assert matcher.accept_token(token), (piece, token)
        if index + 1 in in_string:
            _assert_string_mask(matcher, tokenizer, "".join(pieces[: index + 1]))
    assert matcher.accept_token(min(tokenizer.eos_token_ids)) and matcher.is_terminated()


def test_no_raw_control_character_is_allowed_in_a_forced_tool_calls_string(backend, tokenizer):
    from weft.serve.tools import ToolSettings, forced_constraint

    weather = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    }
    for choice, opening in (
        ("required", '[{"name": "get_weather", "parameters": {"city": "'),
        ("function", '{"city": "P'),
    ):
        constraint = forced_constraint(ToolSettings([weather], choice, "get_weather" if choice == "function" else None))
        matcher = backend.matcher(backend.compile(constraint))
        for token in tokenizer.encode(opening, add_special_tokens=False):
            assert matcher.accept_token(token), (opening, token)
        _assert_string_mask(matcher, tokenizer, opening)


def _assert_string_mask(matcher, tokenizer, written: str) -> None:
    """Inside a string: the mask allows no token holding a control character, and allows ordinary text."""
    controls = control_tokens(tokenizer)
    assert len(controls) >= 32
    mask = torch.zeros(1, bitmask_words(tokenizer.vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    allowed = [token for token in controls if (int(mask[0, token // 32]) >> (token % 32)) & 1]
    assert allowed == [], f"after {written!r}: {[tokenizer.vocabulary_bytes()[token] for token in allowed][:8]}"
    ordinary = [tokenizer.encode(text, add_special_tokens=False)[0] for text in ("a", "ab", " ", "é")]
    assert all((int(mask[0, token // 32]) >> (token % 32)) & 1 for token in ordinary), written


def test_outputs_pushed_toward_control_characters_stay_json(tiny_llama, tokenizer, one_torch_thread):
    """Sampling at temperature 1.0 with +30 on every control-character token: each finished output
    parses with json.loads (strict, as JSON is) and validates against the schema."""
    import jsonschema

    from weft import LLM, SamplingParams

    bias = {token: 30.0 for token in control_tokens(tokenizer)}
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            max_tokens=80,
            logit_bias=bias,
            structured_outputs=StructuredOutputsParams(json=BOUNDED_STRINGS),
        )
        for seed in range(6)
    ]
    with LLM(model=str(tiny_llama), engine={"max_num_seqs": 6}) as llm:
        outputs = llm.generate([[1, 5, 9, 200 + seed, 31] for seed in range(6)], params)
    finished = [output.outputs[0].text for output in outputs if output.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 3
    for text in finished:
        jsonschema.validate(json.loads(text), BOUNDED_STRINGS)


TOOL_CALL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer"},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "unit"],
}


def json_grammar_without_raw_controls(schema: dict, **settings) -> str:
    """xgrammar's grammar for ``schema``, its character class of length-bounded strings (which admits raw
    control characters in xgrammar 0.2.9) replaced by JSON's: the grammar weft-xgrammar should build."""
    grammar = str(xgr.Grammar.from_json_schema(json.dumps(schema), **settings))
    return grammar.replace('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]')


def hf_constrained_greedy(folder, prompts: list[list[int]], schema: dict, max_new_tokens: int, device: str = "cpu"):
    """Transformers' greedy ``generate()`` under xgrammar's own logits processor, its vocabulary read from the
    Hugging Face tokenizer (independently of Weft's ``vocabulary_bytes``), the grammar
    :func:`json_grammar_without_raw_controls`."""
    import xgrammar.contrib.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_grammar(
        json_grammar_without_raw_controls(schema, max_whitespace_cnt=4)
    )
    outputs = []
    for prompt in prompts:
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)],
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_greedy_equals_transformers_under_xgrammars_processor(
    tiny_llama, async_scheduling, one_torch_thread
):
    """The whole path (vocabulary, compile, bitmask in the core, mask on the logits, accepting tokens) against
    transformers + xgrammar's own logits processor on identical weights; with asynchronous scheduling the
    forward of each step is launched before the previous step's tokens are accepted."""
    from weft import LLM, SamplingParams

    prompts = [[1, 5, 9, 200 + index, 31] for index in range(4)]
    expected = hf_constrained_greedy(tiny_llama, prompts, TOOL_CALL, 40)
    with LLM(model=str(tiny_llama), engine={"max_num_seqs": 4, "async_scheduling": async_scheduling}) as llm:
        assert llm.engine.core.async_scheduling is async_scheduling
        params = SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=TOOL_CALL)
        )
        outputs = llm.generate(prompts, params)
    for output, reference in zip(outputs, expected, strict=False):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)] and len(reference) - len(tokens) <= 1  # HF keeps the final EOS
        if output.outputs[0].finish_reason == "stop":
            assert json.loads(output.outputs[0].text).keys() == TOOL_CALL["properties"].keys()


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_constrained_greedy_through_the_mask_graphs_equals_transformers(
    tiny_llama, one_torch_thread, eager_replay_platform, monkeypatch, launch_ahead
):
    """Decode graphs (replayed eagerly here, through the runner's static buffers and padding) and the mask graph
    after each: constrained greedy requests equal transformers under xgrammar's own processor, with a free request
    in the batch (an unmasked row of the graph) and steps whose batch is padded to the captured size; a batch with
    a request that wants logprobs takes the unfused path instead, with the same tokens. ``launch_ahead`` (what an
    accelerator's executor does): each decode step's graph inputs are staged while the step before waits for its
    mask, and its forward launched right after that step samples."""
    from transformers import AutoModelForCausalLM

    from weft import LLM, SamplingParams
    from weft.builtins.torch_attention import TorchAttention

    # Torch's attention reads the static buffers as any batch: replayed eagerly, it stands in for a capturable one.
    monkeypatch.setattr(TorchAttention, "supports_graph_capture", True)
    prompts = [[1, 5, 9, 500 + index, 31, 4 * index] for index in range(5)]
    constrained = [0, 1, 3, 4]
    expected = dict(
        zip(
            constrained,
            hf_constrained_greedy(tiny_llama, [prompts[i] for i in constrained], TOOL_CALL, 24),
            strict=False,
        )
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        free = model.generate(
            torch.tensor([prompts[2]]),
            attention_mask=torch.ones(1, 6, dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=0,
        )[0, 6:].tolist()
    schema = StructuredOutputsParams(json=TOOL_CALL)
    engine = {"max_num_seqs": 8, "graph_batch_sizes": [1, 2, 4, 8], "async_scheduling": True, "max_model_len": 64}
    with LLM(model=str(tiny_llama), use={"ops": {"bitmask_argmax": "torch"}}, engine=engine) as llm:
        runner = llm.engine.runner
        assert runner.mask_graphs is not None and sorted(runner.mask_graphs.graphs) == [1, 2, 4, 8]
        real, sampled = runner.mask_graphs.sample, []

        def counted(size, count, rows, bitmask):
            sampled.append((size, count))
            return real(size, count, rows, bitmask)

        runner.mask_graphs.sample = counted
        llm.engine.core.executor.launch_ahead = launch_ahead
        graphs = runner.decode_graphs
        stage_ahead, staged = graphs.stage_ahead, []

        def counted_staging(step, requests):
            stage_ahead(step, requests)
            staged.append(graphs.staged)

        graphs.stage_ahead = counted_staging
        params = [
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            if index == 2
            else SamplingParams(temperature=0, max_tokens=14 + 2 * index, structured_outputs=schema)
            for index in range(len(prompts))
        ]
        outputs = llm.generate(prompts, params)
        assert any(size > count for size, count in sampled) and len({size for size, _ in sampled}) > 1  # padded rows
        # Staged ahead: most decode steps (not a step right after a request's prefill or a finish).
        assert sum(stage is not None for stage in staged) >= (10 if launch_ahead else 0) and (
            launch_ahead or not staged
        )
        assert outputs[2].outputs[0].token_ids == free
        for index in constrained:
            tokens, reference = outputs[index].outputs[0].token_ids, expected[index]
            assert tokens == reference[: len(tokens)], index
            assert len(tokens) == params[index].max_tokens or len(reference) - len(tokens) <= 1, index  # HF keeps EOS
        calls = len(sampled)
        with_logprobs = [
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=schema, logprobs=index % 2 or None)
            for index in range(2)
        ]
        unfused = llm.generate([prompts[0], prompts[1]], with_logprobs)
        assert len(sampled) == calls
        for index in range(2):
            tokens = unfused[index].outputs[0].token_ids
            assert tokens == expected[index][: len(tokens)]
    # Structured outputs turned off: no op for them and no mask graph.
    with LLM(model=str(tiny_llama), use={"structured_output": "none"}, engine=engine) as llm:
        assert (
            llm.engine.runner.graphs
            and llm.engine.runner.mask_graphs is None
            and llm.engine.runner.bitmask_argmax is None
        )


@pytest.mark.parametrize("fill", ["thread", "process", "process-2", "process-launch-ahead"])
def test_the_fill_overlapping_the_next_step_keeps_every_token_in_order(tiny_llama, one_torch_thread, fill):
    """Asynchronous scheduling, each step's bitmask filled on its own thread while the core schedules the
    next: 20 constrained requests (xgrammar's threaded fill) of staggered lengths, with unconstrained ones
    among them (the masked rows are not the batch's first ones), each equal to transformers (under
    xgrammar's own logits processor for the constrained ones). A mask filled before the previous token
    was accepted, or a token accepted twice or out of order, breaks the equality. ``process``: the matchers in
    the fill process (``engine.structured_output_fill``); once every request ended, it holds none of them.
    ``process-2``: two fill processes, each holding its share of the matchers and filling its rows.
    ``process-launch-ahead``: each step's forward deferred behind the sampling of the step before, as an
    accelerator's executor does (here its eager forward, which stages nothing ahead)."""
    from transformers import AutoModelForCausalLM

    from weft import LLM, SamplingParams

    prompts = [[1, 5, 9, 300 + index, 31, 2 * index] for index in range(24)]
    free = [index for index in range(len(prompts)) if index % 6 == 2]
    lengths = [12 + index % 5 * 7 for index in range(len(prompts))]
    constrained = [index for index in range(len(prompts)) if index not in free]
    expected = dict(
        zip(
            constrained,
            hf_constrained_greedy(tiny_llama, [prompts[i] for i in constrained], TOOL_CALL, 40),
            strict=False,
        )
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    for index in free:
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([prompts[index]]),
                attention_mask=torch.ones(1, 6, dtype=torch.long),
                do_sample=False,
                max_new_tokens=lengths[index],
                pad_token_id=0,
            )
        expected[index] = generated[0, 6:].tolist()
    schema = StructuredOutputsParams(json=TOOL_CALL)
    params = [
        SamplingParams(temperature=0, max_tokens=length, structured_outputs=None if index in free else schema)
        for index, length in enumerate(lengths)
    ]
    processes = 2 if fill == "process-2" else None
    engine = {
        "max_num_seqs": len(prompts),
        "async_scheduling": True,
        "structured_output_fill": fill.partition("-")[0],
        "structured_output_fill_processes": processes,
    }
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        assert llm.engine.core.async_scheduling
        executor = llm.engine.core.executor
        executor.launch_ahead, execute, flagged = fill.endswith("launch-ahead"), executor.execute_model, []

        def counted(step):
            flagged.append(step.launch_after_sampling)
            return execute(step)

        executor.execute_model = counted
        outputs = llm.generate(prompts, params)
        assert sum(flagged) >= (20 if executor.launch_ahead else 0) and (executor.launch_ahead or not any(flagged))
        manager = llm.engine.core.scheduler.structured_outputs
        assert manager.fills_in_process is (fill != "thread")
        if fill != "thread":
            group = manager._process.result()
            assert len(group.children) == (processes or 1)
            group.step([], [], [])  # carries the drops
            # No matcher left; the one schema stays compiled, in each child (each held some of the 20 matchers).
            assert group.held() == (0, processes or 1)
    for index, output in enumerate(outputs):
        tokens, reference = output.outputs[0].token_ids, expected[index]
        assert tokens == reference[: len(tokens)], index  # HF keeps the final EOS; the length caps the rest
        assert len(tokens) == lengths[index] or len(reference) - len(tokens) <= 1, index


@pytest.mark.parametrize("fault", ["killed", "failed step"])
def test_fill_processes_that_fail_mid_generation_are_started_again_and_their_requests_lose_nothing(
    tiny_llama, one_torch_thread, caplog, fault
):
    """A fill child killed (SIGKILL), or one whose answer to a step fails (``failed step``: the matchers may have
    taken part of its tokens), while constrained requests decode beside a free one: the step that finds it fails
    once, the core replaces the fill processes and makes each matcher again, caught up on its request's output,
    and every request ends as it would have without the fault (greedy, the same engine's earlier run)."""
    import signal

    from weft import LLM, SamplingParams

    prompts = [[1, 5, 9, 300 + index, 31, 2 * index] for index in range(6)]
    schema = StructuredOutputsParams(json=TOOL_CALL)
    params = [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=None if index == 2 else schema)
        for index in range(len(prompts))
    ]
    engine = {
        "max_num_seqs": len(prompts),
        "async_scheduling": True,
        "structured_output_fill": "process",
        "structured_output_fill_processes": 2,
    }
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        expected = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
        manager = llm.engine.core.scheduler.structured_outputs
        first = manager._process.result()
        states = [
            llm.engine.add_request(f"{fault}-{index}", prompt, sampling, stream_text=False)
            for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True))
        ]
        while min(len(state.output_token_ids) for state in states) < 8:
            llm.engine.step()
        if fault == "killed":
            os.kill(first.pids[0], signal.SIGKILL)
        else:
            child = first.children[1]
            real = child.receive_step

            def fails_once():
                child.receive_step = real
                real()
                raise RuntimeError("an injected fill failure")

            child.receive_step = fails_once
        with caplog.at_level("ERROR", logger="weft.engine"):
            while llm.engine.has_unfinished:
                llm.engine.step()
        assert [state.output_token_ids for state in states] == expected
        assert ("a fill process exited" if fault == "killed" else "a fill step failed") in caplog.text
        group = manager._process.result()
        assert group is not first and group.alive and not set(group.pids) & set(first.pids)
        assert not any(child._process.is_alive() for child in first.children)
        group.step([], [], [])  # carries the drops
        assert group.held() == (0, 2)  # every remade matcher dropped as its request ended


def test_fill_processes_that_failed_to_start_are_started_again_later(tiny_llama, one_torch_thread, monkeypatch):
    """The fill processes fail to start (a process limit reached for a moment): constrained requests are refused
    naming why until :data:`FILL_START_RETRY_S` passed, then a start is tried again and they run (before, the
    failure was kept for the engine's life)."""
    from weft import LLM, SamplingParams
    from weft.engine.core import structured_output

    prompt = [1, 5, 9, 77, 31]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    engine = {"max_num_seqs": 2, "structured_output_fill": "process", "structured_output_fill_processes": 1}
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        manager = llm.engine.core.scheduler.structured_outputs
        starts = []

        def fails_then_starts():
            starts.append(len(starts))
            if len(starts) == 1:
                raise RuntimeError("no process left for the moment")
            return structured_output.StructuredOutputManager._start_process(manager)

        manager._start_process = fails_then_starts
        for _ in range(2):  # refused, and refused again within the interval (no new start)
            with pytest.raises(ValueError, match="no process left for the moment"):
                llm.generate([prompt], params)
        assert starts == [0]
        monkeypatch.setattr(structured_output, "FILL_START_RETRY_S", 0.0)
        with pytest.raises(ValueError, match="no process left for the moment"):  # this one starts them again
            llm.generate([prompt], params)
        output = llm.generate([prompt], params)[0].outputs[0]
        assert starts == [0, 1] and manager._process.result().alive
    assert output.token_ids == hf_constrained_greedy(tiny_llama, [prompt], TOOL_CALL, 20)[0]


class UnbuildableBackend(XgrammarBackend):
    """Fails where a fill child builds its backend (a module-level class: the spawned child imports it)."""

    def __init__(self, options, vocabulary) -> None:
        raise RuntimeError("no grammar engine in this child")


def test_a_fill_group_that_cannot_start_says_why(backend):
    from weft.engine.core.grammar_group import FillGroup

    with pytest.raises(RuntimeError, match="(?s)fill process failed.*no grammar engine in this child"):
        FillGroup(
            UnbuildableBackend, backend.options, backend.vocabulary, bitmask_words(backend.vocabulary.size), processes=2
        )


@pytest.mark.parametrize("fill", ["thread", "process"])
def test_a_launch_failing_while_the_fill_works_loses_no_token(tiny_llama, one_torch_thread, fill):
    """The forward's launch raises once while the fill works on that step's mask, after the core applied the
    step before it (its tokens accepted first, as a CPU worker's are): the core takes the fill's answer before
    it retries (the fill process's next answer is then the next step's), the applied step's tokens still
    reach the caller (they were lost, one token a request, before), and every constrained request equals
    transformers under xgrammar's own logits processor."""
    from weft import LLM, SamplingParams

    prompts = [[1, 5, 9, 400 + index, 31, 3 * index] for index in range(6)]
    expected = hf_constrained_greedy(tiny_llama, prompts, TOOL_CALL, 30)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    engine = {"max_num_seqs": len(prompts), "async_scheduling": True, "structured_output_fill": fill}
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        core = llm.engine.core
        real, calls, failed = core.executor.execute_model, [0], []

        def flaky(output):
            calls[0] += core._bitmask is not None  # this step's mask is asked of the fill process
            if calls[0] == 5 and not failed:
                failed.append(core._bitmask)
                raise RuntimeError("injected launch failure")
            return real(output)

        core.executor.execute_model = flaky
        outputs = llm.generate(prompts, params)
        assert failed and failed[0] is not None and failed[0].done()  # its answer was read before the retry
    for output, reference in zip(outputs, expected, strict=False):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)] and len(reference) - len(tokens) <= 1


@pytest.mark.parametrize("fill", ["thread", "process"])
def test_a_final_output_applied_before_a_failed_launch_is_still_reported(tiny_llama, one_torch_thread, fill):
    """The step applied before the failing launch finished the only request: the core still has work (that
    output) and reports it, as the engine core process's loop steps only while it has work."""
    from weft import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    engine = {"max_num_seqs": 2, "async_scheduling": True, "structured_output_fill": fill}
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        core = llm.engine.core
        real, fired = core.executor.execute_model, []

        def flaky(output):
            if not fired and core._bitmask is not None and not core.scheduler.has_unfinished:
                fired.append(list(output.num_scheduled_tokens))
                raise RuntimeError("injected launch failure")
            return real(output)

        core.executor.execute_model = flaky
        llm.engine.add_request("r", [1, 5, 9, 31], params)
        produced = []
        while core.has_work:
            produced += core.step_with_retry()
        assert fired and [output.request_id for output in produced if output.finish_reason] == ["r"]


def test_a_second_failure_still_reports_a_request_that_finished_before_it(tiny_llama, one_torch_thread):
    """Two launches fail in a row (the engine core process then fails the unfinished requests) after a step
    that finished request a was applied: a's end still comes out of the next step, b is failed."""
    from weft import LLM, SamplingParams

    constrained = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=TOOL_CALL)
    )
    free = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine = {"max_num_seqs": 2, "async_scheduling": True, "structured_output_fill": "thread"}
    with LLM(model=str(tiny_llama), engine=engine) as llm:
        core = llm.engine.core
        real, fired = core.executor.execute_model, []

        def flaky(output):
            done = [
                request_id
                for request_id in output.num_scheduled_tokens
                if request_id not in core.scheduler.unfinished_ids
            ]
            if (done and core._bitmask is not None and not fired) or len(fired) == 1:
                fired.append(done)
                raise RuntimeError("injected launch failure")
            return real(output)

        core.executor.execute_model = flaky
        llm.engine.add_request("a", [1, 5, 9, 31], constrained)
        llm.engine.add_request("b", [1, 6, 7, 31], free)
        produced, failed = [], {}
        while core.has_work:  # the engine core process's loop
            try:
                produced += core.step_with_retry()
            except Exception:
                held = core.scheduler.unfinished_ids
                core.reset_after_failure()
                failed.update(dict.fromkeys(held, "failed"))
        assert len(fired) == 2 and fired[0] == ["a"]
        assert [output.request_id for output in produced if output.finish_reason] == ["a"] and list(failed) == ["b"]


def test_an_interrupted_read_of_the_fill_processs_answer_leaves_the_next_steps_in_order(tiny_llama, one_torch_thread):
    """Ctrl-C while the core waits for the fill process's answer: the answer is read before the next message,
    so the next generate's answers are its own steps' and its output equals transformers'."""
    from weft import LLM, SamplingParams
    from weft.engine.core.grammar_process import FillProcess

    prompts = [[1, 5, 9, 400 + index, 31, 3 * index] for index in range(4)]
    expected = hf_constrained_greedy(tiny_llama, prompts, TOOL_CALL, 30)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    engine = {"max_num_seqs": len(prompts), "async_scheduling": True, "structured_output_fill": "process"}
    real, calls = FillProcess.receive_step, [0]

    def interrupted(self):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real(self)

    FillProcess.receive_step = interrupted
    try:
        with LLM(model=str(tiny_llama), engine=engine) as llm:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, params)
            outputs = llm.generate(prompts, params)
            assert (
                llm.engine.core.scheduler.structured_outputs._process.result().held()[1] == 1
            )  # a (matchers, compiled) answer
    finally:
        FillProcess.receive_step = real
    for output, reference in zip(outputs, expected, strict=False):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)] and len(reference) - len(tokens) <= 1


def test_a_fill_group_splits_the_matchers_and_answers_in_child_order(backend, tokenizer):
    """Three children polling for their messages (``spin``): each new matcher goes to the child holding the fewest,
    a step's rows come back in child order equal to the backend's own fill, a dropped matcher's token and row are
    left out, and a child that fails answers with its error after the others were read (the next step still
    works)."""
    from weft.engine.core.grammar_group import FillFailed, FillGroup

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    words = bitmask_words(tokenizer.vocab_size)
    text = tokenizer.encode('{"a": 12, "b": "x"}', add_special_tokens=False)
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, words, processes=3, spin=0.001)
    try:
        handles = [group.new_handle() for _ in range(7)]
        assert [group._owner[handle] for handle in handles] == [0, 1, 2, 0, 1, 2, 0]
        payload = backend.serialize_compiled(compiled)
        reply = group.step([(handle, 0, payload) for handle in handles], [], handles)
        assert sorted(reply.filled) == handles and not reply.ended and not reply.refused
        assert reply.filled == [0, 3, 6, 1, 4, 2, 5]  # child after child
        local = [backend.matcher(compiled) for _ in handles]
        group.drop(handles[4])  # its token below is left out
        for step in range(3):
            accepted = [(handle, text[step]) for handle in handles]
            live = [handle for handle in handles if handle != handles[4]]
            reply = group.step([], accepted, handles)
            assert reply.filled == [handle for handle in [0, 3, 6, 1, 4, 2, 5] if handle in live]
            for matcher in local:
                assert matcher.accept_token(text[step])
            expected = torch.zeros(len(reply.filled), words, dtype=torch.int32)
            backend.fill_bitmasks([local[handle] for handle in reply.filled], expected)
            rows = torch.frombuffer(bytearray(group.rows(len(reply.filled))), dtype=torch.int32).view(-1, words)
            assert torch.equal(rows, expected)
            assert group.rows(2) == group.rows(len(reply.filled))[: 2 * words * 4]
        assert group.held() == (6, 3)
        gone = group.new_handle()  # made, and its request ended, before its first step
        group.drop(gone)
        group.step([(gone, 0, payload)], [], [gone])
        assert group.held() == (6, 3)
        new = group.new_handle()
        assert group._owner[new] == 1  # child 1 lost handle 4: it holds the fewest
        with pytest.raises(FillFailed, match="fill process failed") as failed:
            group.step([(new, 99, b"not a compiled grammar")], [(handles[0], text[3])], handles[:1] + [new])
        assert failed.value.reply.ended == [] and failed.value.reply.refused == []  # child 0's report, nothing ended
        reply = group.step([], [(handles[0], text[4])], [handles[0]])  # child 0 took text[3] in the failed step
        assert reply.filled == [handles[0]] and not reply.refused
        assert local[0].accept_token(text[3])
        expected = torch.zeros(1, words, dtype=torch.int32)
        backend.fill_bitmasks([local[0]], expected)
        assert not torch.equal(torch.frombuffer(bytearray(group.rows(1)), dtype=torch.int32), expected[0])
        assert local[0].accept_token(text[4])
        backend.fill_bitmasks([local[0]], expected)
        assert torch.equal(torch.frombuffer(bytearray(group.rows(1)), dtype=torch.int32), expected[0])
    finally:
        group.close()
    assert all(not child._process.is_alive() for child in group.children)


def test_a_fill_groups_rows_skip_a_matcher_that_refused_its_token(backend, tokenizer):
    """Two children fill into one shared segment, each from its own first row: a matcher refusing its token fills
    no row, which leaves a gap there, and :meth:`FillGroup.rows` still answers the filled rows in child order."""
    from weft.engine.core.grammar_group import FillGroup

    compiled = backend.compile(
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    )
    words = bitmask_words(tokenizer.vocab_size)
    text = tokenizer.encode('{"a": 12}', add_special_tokens=False)
    probe = backend.matcher(compiled)
    assert probe.accept_token(text[0])
    refused = next(token for token in range(tokenizer.vocab_size) if token != text[1] and not probe.accept_token(token))
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, words, processes=2, spin=0.001)
    try:
        handles = [group.new_handle() for _ in range(4)]  # child 0: 0 and 2; child 1: 1 and 3
        payload = backend.serialize_compiled(compiled)
        assert group.step([(handle, 0, payload) for handle in handles], [], handles).filled == [0, 2, 1, 3]
        local = {handle: backend.matcher(compiled) for handle in handles}
        for tokens in ([text[0]] * 4, [refused, text[1], text[1], text[1]], [None, text[2], text[2], text[2]]):
            accepted = [(handle, token) for handle, token in zip(handles, tokens, strict=True) if token is not None]
            reply = group.step(
                [], accepted, [handle for handle, token in zip(handles, tokens, strict=True) if token is not None]
            )
            assert reply.refused == ([(0, refused)] if refused in tokens else [])
            for handle, token in accepted:
                if token != refused:
                    assert local[handle].accept_token(token)
            assert reply.filled == ([0, 2, 1, 3] if tokens[0] == text[0] else [2, 1, 3])
            expected = torch.zeros(len(reply.filled), words, dtype=torch.int32)
            backend.fill_bitmasks([local[handle] for handle in reply.filled], expected)
            rows = torch.frombuffer(bytearray(group.rows(len(reply.filled))), dtype=torch.int32).view(-1, words)
            assert torch.equal(rows, expected)
            assert group.rows(1) == group.rows(len(reply.filled))[: words * 4]
    finally:
        group.close()


def test_a_fill_group_names_the_matchers_over_its_fill_budget_child_after_child(backend, tokenizer):
    """Two children timing their fills against a budget (``engine.structured_output_fill_budget``, 10 ms): 120 a's
    into the ambiguous grammar, its matchers' masks take several times that (33 ms at the 100th a on a test machine)
    and are named child after child; their rows are still filled that step, equal to the backend's own, then their
    children drop them (no row, no token taken) while the regex's matchers fill on."""
    from weft.engine.core.grammar_group import FillGroup

    ambiguous = backend.compile(StructuredOutputsParams(grammar='root ::= y\ny ::= y y | y "a" | "a" y | "a"'))
    cheap = backend.compile(StructuredOutputsParams(regex="a+"))
    words = bitmask_words(tokenizer.vocab_size)
    text = tokenizer.encode("a" * 120, add_special_tokens=False)
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, words, processes=2, spin=0.001, budget=0.01)
    try:
        handles = [group.new_handle() for _ in range(4)]  # child 0: 0 and 2; child 1: 1 and 3
        constraints = [(0, cheap), (1, ambiguous), (1, ambiguous), (0, cheap)]  # each handle's (key, compiled)
        made = [
            (handle, key, backend.serialize_compiled(compiled)) for handle, (key, compiled) in enumerate(constraints)
        ]
        reply = group.step(made, [], handles)
        assert reply.filled == [0, 2, 1, 3] and reply.over == []  # a mask at the grammar's start costs nothing
        reply = group.step([], [(handle, token) for token in text for handle in handles], handles)
        assert reply.filled == [0, 2, 1, 3] and reply.over == [2, 1] and not reply.ended and not reply.refused
        local = {handle: backend.matcher(compiled) for handle, (_, compiled) in enumerate(constraints)}
        for handle in handles:
            assert all(local[handle].accept_token(token) for token in text)
        expected = torch.zeros(4, words, dtype=torch.int32)
        backend.fill_bitmasks([local[handle] for handle in reply.filled], expected)
        assert torch.equal(torch.frombuffer(bytearray(group.rows(4)), dtype=torch.int32).view(-1, words), expected)
        reply = group.step([], [(handle, text[0]) for handle in handles], handles)
        assert reply.filled == [0, 3] and reply.over == [] and group.held() == (2, 4)
    finally:
        group.close()


def test_a_matcher_made_and_dropped_in_one_message_is_not_kept(backend):
    """One child (its messages passed on whole): a request that ended before its matcher's first step sends the
    matcher and its drop in the same message; the child makes it, then drops it."""
    from weft.engine.core.grammar_group import FillGroup

    compiled = backend.compile(StructuredOutputsParams(regex="[ab]+"))
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, bitmask_words(backend.vocabulary.size))
    try:
        kept, gone = group.new_handle(), group.new_handle()
        group.drop(gone)
        payload = backend.serialize_compiled(compiled)
        reply = group.step([(kept, 0, payload), (gone, 0, payload)], [], [kept, gone])
        assert reply.filled == [kept] and group.held() == (1, 1)
        # The core forgets the constraint and a new matcher sends it again, in one message; a third goes without it.
        group.forget(0)
        again, third = group.new_handle(), group.new_handle()
        group.step([(again, 0, payload)], [], [])
        reply = group.step([(third, 0, payload)], [], [kept, again, third])
        assert reply.filled == [kept, again, third] and group.held() == (3, 1)
    finally:
        group.close()


@pytest.mark.parametrize(
    ("constraint", "fragment"),
    [
        (
            StructuredOutputsParams(json={"type": "frobnicate"}),
            "structured_outputs.json: xgrammar cannot compile it: Unsupported type",
        ),
        (
            StructuredOutputsParams(regex="a(b"),
            "structured_outputs.regex: xgrammar cannot compile it: Regex parsing error",
        ),
        (
            StructuredOutputsParams(grammar="root ::= "),
            "structured_outputs.grammar: xgrammar cannot compile it: EBNF parser error",
        ),
    ],
)
def test_validation_names_the_field_and_the_reason(constraint, fragment):
    with pytest.raises(ValueError) as error:
        XgrammarBackend.validate(constraint)
    assert fragment in str(error.value) and "/project/cpp" not in str(error.value)


def test_constraints_are_checked_when_made():
    with pytest.raises(
        ValueError, match="exactly one of json, regex, choice, grammar or json_object; got regex, choice"
    ):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=())
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}}
    params = StructuredOutputsParams(json=schema)
    assert list(json.loads(params.json)["properties"]) == ["z", "a"]  # the order the output writes them in
    assert hash(params) == hash(StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":"))))


class TestXgrammarContract(StructuredOutputContract):
    """The conformance kit's suite on weft-xgrammar, over the default model's vocabulary."""

    plugin_name = "xgrammar"

    @pytest.fixture
    def tokenizer(self, plugin):
        registry, config = PluginRegistry(), load_config(None, {})
        _, source = resolve_source(registry, config)
        return load_tokenizer(registry, config, source)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "string", "minLength": -5}, "minLength = -5 (at #/minLength)"),
        (
            {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 1.5}}},
            "maxItems = 1.5 (at #/properties/tags/maxItems)",
        ),
        ({"type": "array", "items": {"type": "string", "maxLength": True}}, "maxLength = True (at #/items/maxLength)"),
    ],
)
def test_a_count_keyword_that_is_not_a_non_negative_integer_is_refused_naming_it(backend, schema, problem):
    with pytest.raises(ValueError) as refused:
        XgrammarBackend.validate(StructuredOutputsParams(json=schema))
    assert str(refused.value) == f"structured_outputs.json: {problem} must be a non-negative integer"
    # compile() (the engine's side) words xgrammar's errors the same way, without its timestamp and source path.
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: xgrammar cannot compile it: [^/\[]*$"):
        backend.compile(StructuredOutputsParams(json={"type": "string", "minLength": -5}))


def test_a_schema_string_too_deep_to_read_is_a_value_error():
    """The Python API's path (the server refuses it earlier, by the body's nesting limit)."""
    deep = StructuredOutputsParams(json='{"items":' * 5000 + "{}" + "}" * 5000)
    with pytest.raises(ValueError, match="nested too deeply"):
        deep.schema()
