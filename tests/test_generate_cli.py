"""`weft generate` on the embedded default model and on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import last_json, make_tiny_model


def weft(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weft.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_default_model_answers():
    result = weft("generate", "--prompt", "What is the capital of France?", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_json_output_with_prompts_file_and_config(tmp_path, tokenizer_files):
    folder = make_tiny_model(tmp_path / "tiny", "qwen2", tokenizer_files)
    (tmp_path / "weft.toml").write_text(f'model = "{folder}"\n[engine]\nblock_size = 8\nnum_kv_blocks = 256\n')
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Hello"}) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
    )
    result = weft(
        "generate",
        "--prompts-file",
        str(prompts),
        "--json",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--no-chat",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = last_json(result.stdout)
    assert [row["prompt"] for row in rows] == ["Hello", [{"role": "user", "content": "Hi"}]]
    for row in rows:
        (output,) = row["outputs"]
        assert len(output["token_ids"]) == 5 and output["finish_reason"] == "length" and isinstance(output["text"], str)


def test_bad_arguments_are_reported_without_a_traceback(tmp_path):
    missing = weft("generate", "--max-tokens", "4")
    assert missing.returncode == 1 and "no prompts" in missing.stderr
    bad = weft("generate", "--prompt", "x", "--top-p", "0")
    assert bad.returncode == 1 and "--top-p = 0" in bad.stderr and "Traceback" not in bad.stderr
    unknown = weft("generate", "--prompt", "x", "--model", str(tmp_path / "nowhere"))
    assert unknown.returncode == 1 and f"{tmp_path / 'nowhere'} does not exist" in unknown.stderr  # issue 49
