"""``weft verify`` against Hugging Face transformers on tiny random checkpoints (CPU, float32).

Correct families exit 0: Llama, Qwen3 (q/k norm), Mistral (sliding window) and DeepSeek V4,
whose reference runs under the family's stable top-k (``hf_reference_context``; without it
the third default prompt of the tiny checkpoint diverges at its first token). A broken family
exits 1 naming the first divergence: tests/broken_llama_plugin registers the Llama family with
a rope base ten times the checkpoint's as ``BrokenLlamaForCausalLM``, naming transformers'
``LlamaForCausalLM`` as its reference (scripts/test.sh installs it).
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
from weft.outputs import Logprob
from weft.verify import TIE_ULPS, first_divergence

PROMPTS = ("The capital of France is", "Once upon a time, in a small village by the sea, there lived", "1, 1, 2, 3, 5, 8,")
MAX_TOKENS = 6
# fp32 on both sides, same math in another order: the tiny models differ by about 1e-6 relative.
MAX_RELATIVE_ERROR = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def weft_verify(folder, prompts_file, capsys) -> tuple[int, str, str]:
    """``weft verify FOLDER`` in this process; no prompts file: the built-in prompts."""
    prompts = ["--prompts", str(prompts_file)] if prompts_file is not None else []
    code = main(["verify", str(folder), *prompts, "--max-tokens", str(MAX_TOKENS)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def max_relative_error(table: str) -> float:
    return float(re.search(r"max relative logit error (\S+)", table).group(1))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral-window"])
def test_llama_family_checkpoints_match_transformers(kind, tmp_path, tokenizer_files, prompts_file, capsys):
    folder = make_tiny_model(tmp_path / kind, kind, tokenizer_files)
    code, out, err = weft_verify(folder, prompts_file, capsys)
    assert code == 0, out + err
    assert f"{len(PROMPTS)}/{len(PROMPTS)} prompts matched" in out, out
    assert max_relative_error(out) < MAX_RELATIVE_ERROR, out


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
    assert max_relative_error(out) < MAX_RELATIVE_ERROR, out


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
    assert max_relative_error(out) > 1e-2, out


def test_a_gguf_source_is_refused_naming_what_verify_needs(capsys):
    assert main(["verify", "smollm2-135m-instruct"]) == 1
    err = capsys.readouterr().err
    assert "gguf source" in err and "config.json and *.safetensors" in err, err


def test_without_transformers_it_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["verify", str(tmp_path)]) == 1
    assert "pip install transformers" in capsys.readouterr().err


def test_a_near_tie_is_reported_as_such_and_a_clear_preference_is_not():
    eps = torch.finfo(torch.float32).eps
    threshold = TIE_ULPS * eps * 10.0  # the largest logit below is 10
    prompt_length, weft_token, reference_token, other = 3, 7, 9, 4

    def divergence(reference_margin, weft_gap, weft_second=reference_token):
        logits = torch.zeros(prompt_length + 1, 16)
        logits[:, 0] = -10.0
        logits[prompt_length, reference_token] = 5.0
        logits[prompt_length, weft_token] = 5.0 - reference_margin
        weft = [{5: Logprob(-0.1, 1, "")}, {weft_token: Logprob(-0.5, 1, ""), weft_second: Logprob(-0.5 - weft_gap, 2, "")}]
        return first_divergence([5, weft_token], weft, [5, reference_token], logits, prompt_length, "float32", str)

    tie = divergence(reference_margin=threshold / 2, weft_gap=threshold / 2)
    assert tie.step == 1 and tie.tie and tie.threshold == pytest.approx(threshold)
    assert not divergence(reference_margin=4 * threshold, weft_gap=threshold / 2).tie
    assert not divergence(reference_margin=threshold / 2, weft_gap=4 * threshold).tie
    assert not divergence(reference_margin=threshold / 2, weft_gap=threshold / 2, weft_second=other).tie
    assert first_divergence([5, 6], [{}, {}], [5, 6], torch.zeros(5, 16), prompt_length, "float32", str) is None
