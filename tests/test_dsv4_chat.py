"""weft-dsv4's V4.1 chat normalisation and tokenizer, and the DSpark draft's parallel config."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

pytest.importorskip("weft_dsv4")

from weft_dsv4.chat import DeepseekV4Tokenizer, normalize_messages, reasoning_settings  # noqa: E402
from weft_dsv4.parallel import ParallelConfig, draft_parallel_config  # noqa: E402
from weft_dsv4.tiny_checkpoint import train_tokenizer  # noqa: E402

IMAGE = "<image>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.tools %}[tools:{{ m.tools | map(attribute='name') | join(',') }}]{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{{ reasoning_effort }}"
    "{% else %}</think>{% endif %}{% endif %}"
)


def test_text_parts_of_both_apis_join_with_blank_lines():
    for kind in ("text", "input_text", "output_text"):
        message = {"role": "user", "content": [{"type": kind, "text": "one"}, {"type": kind, "text": "two"}]}
        assert normalize_messages([message], IMAGE) == [{"role": "user", "content": "one\n\ntwo"}]


def test_images_become_the_placeholder_and_other_parts_are_refused():
    message = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "input_image"},
        ],
    }
    assert normalize_messages([message], IMAGE)[0]["content"] == f"look\n\n{IMAGE}\n\n{IMAGE}"
    with pytest.raises(
        ValueError,
        match=r"messages\[1\]\.content\[0\]: DeepSeek V4.1 supports text and image content only; got 'input_audio'",
    ):
        normalize_messages(
            [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "input_audio"}]}], IMAGE
        )
    with pytest.raises(ValueError, match="has no image token"):
        normalize_messages([message], None)


def test_roles_are_checked_and_reasoning_is_copied():
    with pytest.raises(ValueError, match=r"messages\[0\]\.role = 'robot'"):
        normalize_messages([{"role": "robot", "content": "x"}], IMAGE)
    (out,) = normalize_messages([{"role": "assistant", "content": "a", "reasoning": "because"}], IMAGE)
    assert out["reasoning_content"] == "because" and out["reasoning"] == "because"
    for role in ("system", "developer", "user", "assistant", "tool"):
        assert normalize_messages([{"role": role, "content": "x"}], IMAGE)[0]["role"] == role


def test_inputs_are_never_mutated_or_shared():
    messages = [
        {"role": "system", "content": "s", "meta": {"nested": [1]}},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": "a", "reasoning": "r"},
    ]
    tools = [{"name": "search", "parameters": {"type": "object"}}]
    before, tools_before = copy.deepcopy(messages), copy.deepcopy(tools)
    out = normalize_messages(messages, IMAGE, tools)
    out[0]["meta"]["nested"].append(2)
    out[0]["tools"][0]["parameters"]["type"] = "changed"
    assert messages == before and tools == tools_before


def test_tools_attach_to_the_first_system_message_or_a_new_one():
    tools = [{"name": "search"}]
    out = normalize_messages(
        [{"role": "user", "content": "u"}, {"role": "system", "content": "a"}, {"role": "system", "content": "b"}],
        IMAGE,
        tools,
    )
    assert [m.get("tools") for m in out] == [None, tools, None]
    out = normalize_messages([{"role": "user", "content": "u"}], IMAGE, tools)
    assert out[0] == {"role": "system", "content": "", "tools": tools} and out[1]["role"] == "user"


def test_reasoning_effort():
    assert reasoning_settings(None) == {"thinking": True, "reasoning_effort": "high"}
    assert reasoning_settings("none") == {"thinking": False, "reasoning_effort": None}
    for effort in ("low", "high", "xhigh", "max", 1, 100):
        assert reasoning_settings(effort) == {"thinking": True, "reasoning_effort": effort}
    for bad in ("medium", 0, 101, True, 2.5):
        with pytest.raises(ValueError, match="reasoning_effort"):
            reasoning_settings(bad)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv4tok")
    train_tokenizer(folder, 512)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return DeepseekV4Tokenizer.from_folder(folder)


def test_responses_api_parts_render_exactly_like_chat_text(tokenizer):
    def conversation(kind_user: str, kind_assistant: str) -> list[dict]:
        return [
            {"role": "user", "content": [{"type": kind_user, "text": "Hello"}, {"type": kind_user, "text": "there"}]},
            {"role": "assistant", "content": [{"type": kind_assistant, "text": "Hi"}], "reasoning": "greet"},
            {"role": "user", "content": "bye"},
        ]

    chat = tokenizer.apply_chat_template(tokenizer.normalize_messages(conversation("text", "text")))
    responses = tokenizer.apply_chat_template(tokenizer.normalize_messages(conversation("input_text", "output_text")))
    assert chat == responses
    assert "<user>Hello\n\nthere<assistant>Hi<think>greet</think><user>bye<assistant><think>high" in chat


def test_the_tokenizer_renders_tools_and_reasoning_settings(tokenizer):
    messages = [{"role": "user", "content": "q"}]
    off = tokenizer.apply_chat_template(messages, reasoning_effort="none", tools=[{"name": "search"}])
    assert off.endswith("<assistant></think>") and "[tools:search]<system>" in off
    assert tokenizer.apply_chat_template(messages, reasoning_effort=7).endswith("<think>7")


def test_image_parts_are_refused_unless_the_checkpoint_declares_a_vision_encoder(tokenizer, tmp_path):
    from weft.contracts.loader import ModelSource

    image = [
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}
    ]
    train_tokenizer(tmp_path, 512)

    def served(hf_config: dict) -> DeepseekV4Tokenizer:
        return DeepseekV4Tokenizer.from_source(ModelSource(str(tmp_path), "safetensors", hf_config, "dsv4", "tiny"))

    text_only = served({"architectures": ["DeepseekV4ForCausalLM"]})
    for call in (text_only.normalize_messages, text_only.apply_chat_template):
        with pytest.raises(
            ValueError,
            match=r"^messages\[0\]\.content\[1\]: this DeepSeek V4.1 checkpoint declares no "
            r"vision encoder \(its config.json has no 'vision_config'\)",
        ):
            call(image)
    assert text_only.normalize_messages([{"role": "user", "content": [{"type": "text", "text": "ok"}]}])
    with pytest.raises(ValueError, match="image token"):  # a vision checkpoint: the tiny vocabulary has no id 129264
        served({"vision_config": {}}).normalize_messages(image)
    with pytest.raises(ValueError, match="no vision encoder"):  # built from a folder alone, nothing declares one
        tokenizer.normalize_messages(image)


def test_a_served_chat_hands_tools_to_the_template_and_parses_thinking_and_dsml(tokenizer):
    from weft.serve.tools import AssistantOutput, ToolSettings, chat_input, reasoning_parser
    from weft_dsv4.parsers import DeepseekV4ReasoningParser, DeepseekV4ToolParser

    settings = ToolSettings([{"name": "search", "parameters": {"type": "object"}}], "auto")
    messages, kwargs = chat_input(
        tokenizer, [{"role": "user", "content": "q"}], True, settings, DeepseekV4ToolParser, {}
    )
    assert kwargs["tools"] == [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    prompt = tokenizer.apply_chat_template(tokenizer.normalize_messages(messages), True, **kwargs)
    assert "[tools:" in prompt and prompt.endswith("<think>high")  # the template rendered them itself
    thinking = reasoning_parser(DeepseekV4ReasoningParser, None, prompt)
    answer = (
        'Look it up.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" '
        'string="true">weft</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    reasoning, content, calls = AssistantOutput(thinking, DeepseekV4ToolParser()).parse(answer)
    assert (reasoning, content) == ("Look it up.\n\n", None) and [(call.name, call.arguments) for call in calls] == [
        ("search", '{"q": "weft"}')
    ]
    off = tokenizer.apply_chat_template(tokenizer.normalize_messages(messages), True, reasoning_effort="none", **kwargs)
    assert reasoning_parser(DeepseekV4ReasoningParser, None, off) is None  # thinking off: all of it is the answer


def test_draft_parallel_config_copies_everything_but_the_parallel_sizes():
    target = ParallelConfig(
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        data_parallel_size=4,
        enable_expert_parallel=True,
        distributed_backend="gloo",
    )
    draft = draft_parallel_config(target, tensor_parallel_size=2)
    assert (draft.tensor_parallel_size, draft.pipeline_parallel_size) == (2, 1)
    assert draft.world_size == 2 and target.world_size == 16
    unchanged = {
        k: v
        for k, v in msgspec.structs.asdict(target).items()
        if k not in ("tensor_parallel_size", "pipeline_parallel_size")
    }
    assert {k: msgspec.structs.asdict(draft)[k] for k in unchanged} == unchanged
    assert draft.enable_expert_parallel and draft.expert_parallel_size == 8  # a MoE draft keeps expert parallel
    dense = draft_parallel_config(target, tensor_parallel_size=1, draft_is_moe=False)
    assert not dense.enable_expert_parallel and dense.expert_parallel_size == 1


def test_fields_added_later_survive_the_copy():
    class FutureParallelConfig(ParallelConfig, frozen=True, kw_only=True):
        context_parallel_size: int = 1
        expert_placement: str = "linear"

    target = FutureParallelConfig(
        tensor_parallel_size=4, context_parallel_size=2, expert_placement="round_robin", enable_expert_parallel=True
    )
    draft = draft_parallel_config(target, tensor_parallel_size=1)
    assert type(draft) is FutureParallelConfig
    assert (draft.context_parallel_size, draft.expert_placement, draft.enable_expert_parallel) == (
        2,
        "round_robin",
        True,
    )
    with pytest.raises(ValueError, match="tensor_parallel_size = 0"):
        draft_parallel_config(target, tensor_parallel_size=0)
