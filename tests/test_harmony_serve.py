"""gpt-oss's harmony output through a real server and the official openai client: the reasoning parser and the
tool parser ``harmony`` (the defaults for ``GptOssForCausalLM``) on chat, whole and streamed.

The model is a one-layer gpt-oss whose weights make it write a chosen harmony token sequence (checked with
transformers' ``generate``): its next token depends on the current token and on whether an ``<|end|>`` is in
the context (one attention head looks for one), so the second message's header can repeat the first's tokens.
The markers are special tokens added to SmolLM2's tokenizer, as in gpt-oss's own.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_reasoning_serve import ASK, WEATHER, _server, _streamed

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
"""gpt-oss's prompt shape, its messages ended by a line break instead of ``<|end|>``: the model's phase is whether
an ``<|end|>`` has been written, so the prompt has none."""
REASONING, ANSWER = "The user asks", "It is Paris."
ANALYSIS = ["<|channel|>", "analysis", "<|message|>", REASONING, "<|end|>", "<|start|>", "assistant"]
ANSWER_OUTPUT = [*ANALYSIS, "<|channel|>", "final", "<|message|>", ANSWER, "<|return|>"]
CALL_OUTPUT = [
    *ANALYSIS,
    "<|channel|>",
    "commentary to=functions.get_weather ",
    "<|constrain|>",
    "json",
    "<|message|>",
    '{"city": "Paris"}',
    "<|call|>",
]
HIDDEN, HEAD_DIM = 128, 64
PHASE = (HIDDEN - 2, HIDDEN - 1)
"""The residual stream's dimensions that say "no <|end|> yet" and "after <|end|>"; the others are token slots."""


def harmony_model(folder, tokenizer_files, pieces: list[str]):
    """A gpt-oss checkpoint that, after :data:`TEMPLATE`'s prompt for :data:`ASK`, writes ``pieces`` (each encoded on
    its own; the last one an end-of-sequence marker)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files))
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    chain = [prompt[-1], *(token for piece in pieces for token in tokenizer.encode(piece, add_special_tokens=False))]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    phases = [int(end in chain[: index + 1]) for index in range(len(chain))]
    successors: dict[tuple[int, int], int] = {}
    for token, phase, following in zip(chain, phases, chain[1:], strict=False):
        assert successors.setdefault((token, phase), following) == following, "a token leads to one successor a phase"
    slots = {token: slot for slot, token in enumerate(dict.fromkeys(chain))}
    assert len(slots) <= PHASE[0]

    eos = [tokenizer.convert_tokens_to_ids(marker) for marker in ("<|return|>", "<|call|>")]
    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
        sliding_window=128,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in state.items():
        if "router" not in name and "gate_up" not in name:
            tensor.zero_()
    scale = 1 / math.sqrt(HIDDEN)  # a unit embedding row leaves the (all-ones) RMSNorm scaled by sqrt(HIDDEN)
    layer = "model.layers.0."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        state[f"{layer}{norm}.weight"].fill_(1.0)
    state["model.norm.weight"].fill_(1.0)
    for token, slot in slots.items():
        state["model.embed_tokens.weight"][token, slot] = 1.0
    # The head's query and the keys of <|end|> meet in the rotary pair turning slowest (dimensions 31 and 63), where
    # their score does not depend on the distance: any <|end|> in the context takes all the attention.
    state[f"{layer}self_attn.q_proj.bias"][HEAD_DIM // 2 - 1] = 14.0
    state[f"{layer}self_attn.k_proj.weight"][HEAD_DIM // 2 - 1, slots[end]] = 14.0 * scale
    # Every token's value says "phase 0" (the bias), <|end|>'s "phase 1"; with no <|end|> the attention is uniform.
    state[f"{layer}self_attn.v_proj.bias"][0] = 1.0
    state[f"{layer}self_attn.v_proj.weight"][0, slots[end]] = -scale
    state[f"{layer}self_attn.v_proj.weight"][1, slots[end]] = scale
    state[f"{layer}self_attn.o_proj.weight"][PHASE[0], 0] = 1.0
    state[f"{layer}self_attn.o_proj.weight"][PHASE[1], 1] = 1.0
    state[f"{layer}self_attn.sinks"].fill_(-30.0)
    for (token, phase), following in successors.items():  # the experts' down projections stay zero: no MLP output
        state["lm_head.weight"][following, slots[token]] += 10.0
        state["lm_head.weight"][following, PHASE[phase]] += 10.0
    model.load_state_dict(state)
    model.save_pretrained(str(folder))

    written = model.generate(torch.tensor([prompt]), max_new_tokens=len(chain) + 4, do_sample=False)
    assert written[0, len(prompt) :].tolist() == chain[1:], "transformers does not write the chosen sequence"
    return folder


@pytest.fixture(scope="module")
def answering(tmp_path_factory, tokenizer_files, one_torch_thread):
    folder = harmony_model(tmp_path_factory.mktemp("harmony-answer"), tokenizer_files, ANSWER_OUTPUT)
    server, client = _server(folder)
    yield client
    server.stop()


@pytest.fixture(scope="module")
def calling(tmp_path_factory, tokenizer_files, one_torch_thread):
    folder = harmony_model(tmp_path_factory.mktemp("harmony-call"), tokenizer_files, CALL_OUTPUT)
    server, client = _server(folder)
    yield client
    server.stop()


def _chat(client, stream=False, **extra):
    return client.chat.completions.create(
        model=client.served_model, messages=ASK, stream=stream, max_tokens=60, temperature=0, **extra
    )


def test_the_analysis_channel_is_the_reasoning_and_the_final_one_the_answer(answering):
    choice = _chat(answering).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, ANSWER)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert _streamed(_chat(answering, stream=True)) == (REASONING, ANSWER, [], ["stop"])
    # Offered tools it does not call, the model answers as before.
    assert _chat(answering, tools=[WEATHER]).choices[0].message.content == ANSWER
    # A constraint covers the final message's body only: the analysis is the model's own.
    choices = ["Rome", "Madrid"]
    constrained = _chat(answering, extra_body={"structured_outputs": {"choice": choices}}).choices[0].message
    assert constrained.reasoning_content == REASONING and constrained.content in choices


def test_a_commentary_message_to_a_function_is_a_tool_call(calling):
    choice = _chat(calling, tools=[WEATHER]).choices[0]
    assert choice.message.reasoning_content == REASONING and choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    reasoning, content, calls, finish = _streamed(_chat(calling, stream=True, tools=[WEATHER]))
    assert (reasoning, content, finish) == (REASONING, "", ["tool_calls"])
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Paris"})]
