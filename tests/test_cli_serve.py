"""The command line as a user of vLLM expects it (issue 49): ``weft serve MODEL``, the port checked before the
model loads, help grouped with examples, ``weft generate`` with its own flags only, no help string cut short,
and a model path that does not exist named as such."""

from __future__ import annotations

import argparse
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
