"""``weft verify`` against Hugging Face transformers on tiny random checkpoints (CPU, float32).

Correct families exit 0: Llama, Qwen3 (q/k norm), Mistral (a sliding window of 8 tokens, which
every prompt but the first outgrows) and DeepSeek V4, whose reference runs under the family's
stable top-k (``hf_reference_context``; without it the third default prompt of the tiny
checkpoint diverges at its first token); so does the default model, a GGUF file that both sides
dequantize. A broken family exits 1 naming the first divergence: tests/broken_llama_plugin
registers the Llama family with a rope base ten times the checkpoint's as
``BrokenLlamaForCausalLM``, naming transformers' ``LlamaForCausalLM`` as its reference
(scripts/test.sh installs it); and the Llama family made to ignore Mistral's window.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

import pytest
import torch

from conftest import make_tiny_model
from weft.cli import main
from weft.models.llama import LlamaSettings
from weft.outputs import Logprob
from weft.verify import (
    NOISE_FACTOR,
    TIE_SAFETY,
    TIE_ULPS,
    first_divergence,
    near_tie_bound,
    read_prompts,
    rounding_noise,
)

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 1, 2, 3, 5, 8,",
)
MULTILINE_PROMPT = "def fibonacci(n):\n    if n < 2:"
MAX_TOKENS = 6
# fp32 on both sides, same math in another order: the tiny models' teacher-forced error is about 1e-6.
MAX_TEACHER_FORCED_ERROR = 1e-4
WINDOW = 8
"""Mistral's sliding window here: the prompts are 5, 15 and 17 tokens (13 for the multi-line one), so all
but the first outgrow it, and every continuation does by its last token."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def jsonl_prompts_file(tmp_path_factory):
    """PROMPTS and a prompt of two lines as JSON Lines: JSON strings and ``{"prompt": ...}`` objects."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps(PROMPTS[0]), json.dumps({"prompt": MULTILINE_PROMPT}), *map(json.dumps, PROMPTS[1:])]
    path.write_text("\n".join(lines) + "\n")
    return path


def weft_verify(model, prompts_file, capsys, max_tokens=MAX_TOKENS) -> tuple[int, str, str]:
    """``weft verify MODEL`` in this process; no prompts file: the built-in prompts."""
    prompts = ["--prompts", str(prompts_file)] if prompts_file is not None else []
    code = main(["verify", str(model), *prompts, "--max-tokens", str(max_tokens)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def max_teacher_forced_error(table: str) -> float:
    return float(re.search(r"max teacher-forced error (\S+)", table).group(1))


@pytest.mark.parametrize(
    ("kind", "sizes"),
    [("llama", {}), ("qwen3", {}), ("mistral-window", {"sliding_window": WINDOW})],
    ids=["llama", "qwen3", "mistral-window"],
)
def test_llama_family_checkpoints_match_transformers(
    kind, sizes, tmp_path, tokenizer_files, jsonl_prompts_file, capsys
):
    folder = make_tiny_model(tmp_path / kind, kind, tokenizer_files, **sizes)
    code, out, err = weft_verify(folder, jsonl_prompts_file, capsys)
    assert code == 0, out + err
    count = len(PROMPTS) + 1
    assert f"{count}/{count} prompts matched" in out, out
    assert repr(MULTILINE_PROMPT)[:20] in out, out  # the JSON Lines file's prompt of two lines, whole
    assert max_teacher_forced_error(out) < MAX_TEACHER_FORCED_ERROR, out


def test_a_family_ignoring_the_sliding_window_exits_1(monkeypatch, tmp_path, tokenizer_files, prompts_file, capsys):
    """The Mistral case reaches past its window: Weft attending to every token diverges from transformers."""
    folder = make_tiny_model(tmp_path / "mistral", "mistral-window", tokenizer_files, sliding_window=WINDOW)
    monkeypatch.setattr(LlamaSettings, "_sliding_windows", lambda self, config, architecture: [None] * self.num_layers)
    code, out, err = weft_verify(folder, prompts_file, capsys)
    assert code == 1, out + err
    assert re.search(r"prompt \d \(.*\) diverged at step \d+: weft \d+ .* vs reference \d+ ", err), err
    assert max_teacher_forced_error(out) > 1e-2, out


def test_deepseek_v4_matches_transformers_under_its_reference_context(tmp_path, capsys):
    pytest.importorskip("weft_dsv4")
    from weft_dsv4.tiny_checkpoint import main as write_tiny_checkpoint

    folder = tmp_path / "dsv4"
    assert write_tiny_checkpoint([str(folder)]) == 0
    capsys.readouterr()
    code, out, err = weft_verify(folder, None, capsys)
    assert code == 0, out + err
    assert "DeepseekV4ForCausalLM (weft_dsv4.model:DeepseekV4Family)" in out
    assert "4/4 prompts matched" in out, out  # the default prompts: the third needs the stable top-k
    assert max_teacher_forced_error(out) < MAX_TEACHER_FORCED_ERROR, out


def test_a_broken_family_exits_1_naming_the_first_divergence(tmp_path, tokenizer_files, prompts_file, capsys):
    try:
        importlib.metadata.distribution("weft-test-broken-llama")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the test plugin is not installed: pip install ./tests/broken_llama_plugin (scripts/test.sh does)")
    folder = make_tiny_model(tmp_path / "broken", "llama", tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BrokenLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))

    code, out, err = weft_verify(folder, prompts_file, capsys)
    assert code == 1, out + err
    assert "reference    transformers" in out and "LlamaForCausalLM" in out
    rows = [line for line in out.splitlines() if re.match(r"\d ", line)]
    first = next(index for index, row in enumerate(rows) if " diverged " in row)
    step = int(re.search(r"diverged (\d+)/", rows[first]).group(1))
    assert re.search(rf"prompt {first} \(.*\) diverged at step {step}: weft \d+ .* vs reference \d+ ", err), err
    assert max_teacher_forced_error(out) > 1e-2, out


def test_the_default_gguf_model_matches_transformers_dequantizing_the_same_file(tmp_path, capsys):
    """SmolLM2-135M (Q4_1): transformers dequantizes the GGUF in memory, Weft's gguf loader on its own. One
    prompt, two tokens: transformers parsing the file twice is most of this test's 30 s of CPU."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS[0] + "\n")
    code, out, err = weft_verify("smollm2-135m-instruct", prompts, capsys, max_tokens=2)
    assert code == 0, out + err
    assert "reference    transformers" in out and "LlamaForCausalLM" in out, out
    assert "1/1 prompts matched" in out, out
    assert max_teacher_forced_error(out) < MAX_TEACHER_FORCED_ERROR, out


def test_without_transformers_it_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["verify", str(tmp_path)]) == 1
    assert "pip install transformers" in capsys.readouterr().err


def test_a_near_tie_is_reported_as_such_and_a_clear_preference_is_not():
    bound = 1e-3  # relative: with the largest logit below 10, gaps up to 1e-2 are near-ties
    threshold = bound * 10.0
    prompt_length, weft_token, reference_token, other = 3, 7, 9, 4

    def divergence(reference_margin, weft_gap, weft_second=reference_token):
        logits = torch.zeros(prompt_length + 1, 16)
        logits[:, 0] = -10.0
        logits[prompt_length, reference_token] = 5.0
        logits[prompt_length, weft_token] = 5.0 - reference_margin
        weft = [
            {5: Logprob(-0.1, 1, "")},
            {weft_token: Logprob(-0.5, 1, ""), weft_second: Logprob(-0.5 - weft_gap, 2, "")},
        ]
        return first_divergence([5, weft_token], weft, [5, reference_token], logits, prompt_length, bound, str)

    tie = divergence(reference_margin=threshold / 2, weft_gap=threshold / 2)
    assert tie.step == 1 and tie.tie and tie.threshold == pytest.approx(threshold)
    assert not divergence(reference_margin=4 * threshold, weft_gap=threshold / 2).tie
    assert not divergence(reference_margin=threshold / 2, weft_gap=4 * threshold).tie
    assert not divergence(reference_margin=threshold / 2, weft_gap=threshold / 2, weft_second=other).tie
    assert first_divergence([5, 6], [{}, {}], [5, 6], torch.zeros(5, 16), prompt_length, bound, str) is None


def test_the_near_tie_bound_grows_with_rounding_noise_but_not_with_a_defect():
    eps = torch.finfo(torch.float32).eps
    reference_noise = 3e-6
    # SmolLM2-135M's measured float32 error, above the dtype's resolution: the bound follows it,
    # or the reference's own noise when that is larger.
    assert rounding_noise(3.1e-6, reference_noise, "float32") == 3.1e-6
    assert rounding_noise(1e-6, reference_noise, "float32") == reference_noise
    assert near_tie_bound("float32", 3.1e-6) == pytest.approx(TIE_SAFETY * 3.1e-6)
    assert near_tie_bound("float32", 3.1e-6) > TIE_ULPS * eps
    # An error beyond NOISE_FACTOR times the reference's own noise is a defect: only that noise counts.
    assert rounding_noise(2 * NOISE_FACTOR * reference_noise, reference_noise, "float32") == reference_noise
    # A reference without measurable noise still leaves NOISE_FACTOR eps for the two implementations to differ.
    assert rounding_noise(NOISE_FACTOR * eps, 0.0, "float32") == NOISE_FACTOR * eps
    assert near_tie_bound("float32", 0.0) == TIE_ULPS * eps


def test_prompts_files_are_lines_or_json_lines(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text('first prompt\n\n  "quoted" words\n')
    assert read_prompts(text) == ("first prompt", '  "quoted" words')
    named = tmp_path / "prompts.jsonl"
    named.write_text('"one\\ntwo"\n\n{"prompt": "three"}\n')
    assert read_prompts(named) == ("one\ntwo", "three")
    detected = tmp_path / "detected.txt"  # no .jsonl name: the first line, a JSON object, says so
    detected.write_text('{"prompt": "a\\nb"}\n"c"\n')
    assert read_prompts(detected) == ("a\nb", "c")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('"fine"\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"wrong.jsonl:2: expected a JSON string or an object with a 'prompt'"):
        read_prompts(wrong)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(empty)
    with pytest.raises(ValueError, match="No such file"):
        read_prompts(tmp_path / "missing.txt")
