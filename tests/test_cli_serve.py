"""The command line as a user of vLLM expects it (issue 49): ``weft serve MODEL``, the port checked before the
model loads, help grouped with examples, ``weft generate`` with its own flags only, no help string cut short,
and a model path that does not exist named as such."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import pytest

from weft.cli import build_parser, config_from_args
from weft.config import ConfigError
from weft.resolve import missing_path


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.fixture(autouse=True)
def no_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./weft.toml of the caller's


def test_serve_takes_the_model_as_its_first_argument_or_as_model():
    assert config_from_args(parse("serve", "org/name"))[0].model == "org/name"
    assert config_from_args(parse("serve", "--model", "org/name", "--port", "9001"))[0].model == "org/name"
    assert config_from_args(parse("serve", "org/name", "--model", "org/name"))[0].model == "org/name"
    with pytest.raises(ConfigError, match=r"given twice, as MODEL 'a/b' and as --model 'c/d'"):
        config_from_args(parse("serve", "a/b", "--model", "c/d"))


def test_strict_fields_is_a_flag_of_serve():
    assert config_from_args(parse("serve", "--strict-fields"))[0].server.strict_fields is True
    assert config_from_args(parse("serve"))[0].server.strict_fields is False


def _weft(*argv: str, cwd) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "weft.cli", *argv], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    return result, time.monotonic() - began


def test_a_busy_port_fails_in_under_3_s_without_loading_the_model(tmp_path):
    """Under 3 s; on a loaded machine, under twice what ``weft --version`` takes to start there (the budget is the
    interpreter's start and the CLI's import: the model, torch included, would take far longer)."""
    _, start_up = _weft("--version", cwd=tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, elapsed = _weft("serve", "smollm2-135m-instruct", "--port", str(port), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"weft: error: server.port {port}: 127.0.0.1:{port} is already in use" in result.stderr
    assert "--port" in result.stderr  # the fix
    assert "serving" not in result.stderr and "ops:" not in result.stderr  # nothing loaded
    assert elapsed < max(3.0, 2 * start_up), f"{elapsed:.1f} s (weft --version: {start_up:.1f} s)"


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        parse(*command, "--help")
    return capsys.readouterr().out


def test_serve_help_is_grouped_with_examples(capsys):
    text = _help(capsys, "serve")
    assert text.startswith("usage: weft serve [MODEL] [options]")
    for title in ("model and configuration", "plugins ([use]", "engine ([engine])", "server ([server])", "examples:"):
        assert title in text, title
    assert text.index("--max-num-seqs") < text.index("server ([server])") < text.index("--port")


def test_generate_help_shows_only_its_own_flags(capsys):
    text = _help(capsys, "generate")
    for flag in ("--port", "--api-key", "--host", "--strict-fields", "--shutdown-timeout", "server ([server])"):
        assert flag not in text, flag
    for flag in ("--max-tokens", "--sample-seed", "--max-num-seqs", "--platform", "examples:"):
        assert flag in text, flag


DANGLING = {
    "a",
    "an",
    "the",
    "of",
    "to",
    "and",
    "or",
    "can",
    "where",
    "with",
    "for",
    "in",
    "on",
    "by",
    "is",
    "as",
    "than",
    "that",
    "which",
    "when",
    "its",
    "their",
}


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "weft") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subcommands(sub, f"{prefix} {name}")
    return found


def test_no_help_string_is_cut_short():
    """Every flag's help ends as a sentence may (no dangling "where the backend can"), brackets closed."""
    problems = []
    for command, parser in _subcommands(build_parser()):
        for action in parser._actions:
            text = (action.help or "").strip()
            if not text or text == argparse.SUPPRESS:
                continue
            last = text.rstrip(".)").split()[-1].lower()
            if last in DANGLING or text.count("(") != text.count(")"):
                problems.append(f"{command} {'/'.join(action.option_strings) or action.dest}: {text!r}")
    assert not problems, "\n".join(problems)


def test_seed_and_sample_seed_are_told_apart(capsys):
    serve = " ".join(_help(capsys, "serve").split())
    generate = " ".join(_help(capsys, "generate").split())
    assert "requests that give no seed of their own" in serve
    assert "--sample-seed" in serve  # engine.seed's help points at the per-request seed
    assert "--seed (engine.seed)" in generate


def test_a_model_path_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "weft.cli", "generate", "--model", str(missing), "hello"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert f"{missing} does not exist" in result.stderr, result.stderr
    assert "no installed loader" not in result.stderr and "pip install" not in result.stderr


def test_missing_path_tells_paths_from_repo_ids_and_aliases(tmp_path):
    assert missing_path("org/name") is None and missing_path("org/name@main") is None
    assert missing_path("smollm2-135m-instruct") is None
    assert missing_path(str(tmp_path)) is None  # it exists
    for spelled in ("./nothing", "/no/such/folder", "~/no-such-model-here", "model.gguf", "a/b/c"):
        assert "does not exist" in missing_path(spelled), spelled


def test_vllm_names_of_weft_options_set_them():
    """``-tp``, ``--tool-call-parser``... are Weft's own options under vLLM's names (weft.cli.vllm_flags.ALIASES)."""
    args = parse(
        "serve", "org/name", "-tp", "2", "-pp", "1", "-q", "none", "--tool-call-parser", "hermes", "--device", "cpu",
        "--load-format", "safetensors", "--guided-decoding-backend", "xgrammar", "--num-gpu-blocks-override", "64",
    )  # fmt: skip
    config = config_from_args(args)[0]
    assert (config.engine.tensor_parallel_size, config.engine.pipeline_parallel_size) == (2, 1)
    assert (config.engine.quantization, config.engine.num_kv_blocks) == ("none", 64)
    assert (config.use.tool_parser, config.use.platform, config.use.loader) == ("hermes", "cpu", "safetensors")
    assert config.use.structured_output == "xgrammar"


def test_vllm_flags_with_nothing_to_do_are_accepted_and_say_why(monkeypatch):
    from weft.cli import vllm_flags

    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = parse(
        "serve", "org/name", "--trust-remote-code", "--disable-log-requests", "--swap-space", "4", "-O3",
        "--enable-auto-tool-choice", "--kv-cache-dtype", "auto", "-dp", "1", "--dtype", "half", "--hf-token", "hf_x",
    )  # fmt: skip
    notes = vllm_flags.apply(args)
    assert notes[0] == (
        "--trust-remote-code (vLLM's flag) changes nothing here: Weft runs no code from a checkpoint (its model "
        "families are its own, docs/models.md)"
    )
    assert [note.split(" (vLLM's")[0] for note in notes] == [
        "--trust-remote-code",
        "--disable-log-requests",
        "--swap-space 4",
        "-O 3",
        "--enable-auto-tool-choice",
        "--dtype half",
    ]
    assert notes[-1] == "--dtype half (vLLM's spelling) is float16"
    assert config_from_args(args)[0].engine.dtype == "float16"
    assert os.environ["HF_TOKEN"] == "hf_x"  # weft.hub reads it
    assert vllm_flags.apply(parse("serve", "org/name")) == []


@pytest.mark.parametrize("spelled, tokens", [("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("4096", 4096)])
def test_vllm_sizes_of_max_model_len(spelled, tokens):
    from weft.cli import vllm_flags

    args = parse("serve", "org/name", "--max-model-len", spelled)
    notes = vllm_flags.apply(args)
    assert config_from_args(args)[0].engine.max_model_len == tokens
    assert notes == ([] if spelled.isdigit() else [f"--max-model-len {spelled} (vLLM's spelling) is {tokens:,} tokens"])


def test_vllm_generation_config_vllm_is_none():
    from weft.cli import vllm_flags

    args = parse("serve", "org/name", "--generation-config", "vllm")
    assert vllm_flags.apply(args) == [
        "--generation-config vllm (vLLM's spelling) is none: Weft's defaults, not the model's"
    ]
    assert config_from_args(args)[0].engine.generation_config == "none"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--enable-lora"], "--enable-lora: a flag of vLLM's that Weft does not implement: Weft serves no LoRA"),
        (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4: a flag of vLLM's that Weft takes only as 0: Weft keeps"),
        (["--data-parallel-size", "2"], "--data-parallel-size 2: a flag of vLLM's that Weft takes only as 1: Weft"),
        (["--chat-template", "t.jinja"], "--chat-template t.jinja: a flag of vLLM's that Weft does not implement"),
    ],
)
def test_vllm_flags_asking_for_what_weft_lacks_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        parse("serve", "org/name", *argv)
    assert exit.value.code == 2
    assert f"weft serve: error: {message}" in capsys.readouterr().err


def test_a_vllm_tokenizer_path_is_refused_naming_what_weft_tokenizer_is(tmp_path):
    from weft.cli import vllm_flags

    for value in ("org/tokenizer", str(tmp_path)):
        with pytest.raises(ConfigError, match=r"Weft's --tokenizer names a tokenizer plugin .*leave --tokenizer out"):
            vllm_flags.apply(parse("serve", "org/name", "--tokenizer", value))
    assert vllm_flags.apply(parse("serve", "org/name", "--tokenizer", "hf")) == []


def test_serve_help_names_vllm_flags(capsys):
    text = _help(capsys, "serve")
    assert "-tp TENSOR_PARALLEL_SIZE" in text and "--tool-call-parser TOOL_PARSER" in text
    vllm = text[text.index("vLLM's flags:") :]
    for flag in ("--trust-remote-code", "--enable-lora", "--hf-token TOKEN", "--dtype half|float"):
        assert flag in vllm, flag
    assert "--trust-remote-code" not in text[: text.index("vLLM's flags:")]  # hidden above: named once, here


def test_a_vllm_command_line_serves_and_a_client_vendor_field_is_ignored(tmp_path):
    """``weft serve MODEL`` with flags written for ``vllm serve``, then the official client with a vendor field:
    200, the answer, and the field named in ``x-weft-ignored-fields`` (issue 49's "done when")."""
    import openai

    from conftest import free_port, start_weft_serve

    port = free_port()
    vllm_style = [
        "smollm2-135m-instruct", "--served-model-name", "smollm2", "--trust-remote-code", "--disable-log-requests",
        "-tp", "1", "--dtype", "float", "--kv-cache-dtype", "auto", "--max-model-len", "2048",
    ]  # fmt: skip
    server, log = start_weft_serve(vllm_style, port, dict(os.environ))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="smollm2",
            max_tokens=64,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            user="x",
            extra_body={"some_vendor_field": 1},
        )
        assert reply.http_response.status_code == 200
        assert reply.headers["x-weft-ignored-fields"] == "some_vendor_field"
        assert "Paris" in reply.parse().choices[0].message.content
        output = "".join(log)
        assert "weft: --trust-remote-code (vLLM's flag) changes nothing here: Weft runs no code" in output, output
        assert "weft: --dtype float (vLLM's spelling) is float32" in output
        assert output.index("--disable-log-requests (vLLM's flag)") < output.index("starting the engine"), output
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_an_unknown_flag_names_the_closest_one_and_where_the_flags_are_listed(capsys):
    from weft.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "--modle", "x", "--uvicorn-log-level", "debug"])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: weft serve [MODEL] [options]")
    assert (
        "weft serve: error: unrecognized arguments: --modle --uvicorn-log-level debug; --modle: did you mean --model? "
        "(weft serve --help lists its flags)"
    ) in error
