"""What a newcomer reads while Weft starts: one line per step, the startup summary, and the weft-gguf cache
(keyed by the GGUF file's content; ``weft cache list | clear``)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import free_port, smollm2_gguf, start_weft_serve
from weft import progress
from weft.runner.cpu_isa import describe, detect
from weft_gguf import files
from weft_gguf.loader import GGUFLoader

MODEL = "smollm2-135m-instruct"


def weft_lines(output: str) -> list[str]:
    """The ``weft:`` lines up to the last line of the summary, their prefix removed."""
    return [line.removeprefix("weft: ") for line in output.splitlines() if line.startswith("weft: ")]


def expected_kv() -> tuple[int, int]:
    """The KV blocks and context length from the model's shape and the CPU platform's defaults (1 GiB of KV
    cache, blocks of 16 tokens), computed here from the GGUF metadata: float32 keys and values of every layer."""
    import gguf

    reader = gguf.GGUFReader(str(smollm2_gguf()))

    def field(key):
        return reader.fields[key].contents()

    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    bytes_per_token = 2 * field("llama.block_count") * kv_heads * (field("llama.embedding_length") // heads) * 4
    return (1 << 30) // (bytes_per_token * 16), field("llama.context_length")


def startup_lines(cache: str, url: str | None, dense: bool) -> list[str]:
    """``dense``: ``engine.quantization = 'none'``, the GGUF dequantized to float32 (and cached) on its first start;
    else the default, its blocks kept quantized (nothing converted, nothing cached)."""
    blocks, context = expected_kv()
    return [
        f"starting the engine for {MODEL}",
        f"loading the weights of {MODEL} (SmolLM2-135M-Instruct.Q4_1.gguf, 98.4 MB)",
        *(
            [
                "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf to float32 (first start only): 272 tensors",
                f"cached for next time: {cache}/gguf/HASH-float32-v2.safetensors (538.1 MB; weft cache list shows it, "
                f"weft cache clear frees it)",
            ]
            if dense
            else []
        ),
        f"allocating the KV cache: {blocks:,} blocks of 16 tokens",
        "warming up kernels",
        "ready in SECONDS s",
        f"  model     {MODEL} (LlamaForCausalLM, gguf file SmolLM2-135M-Instruct.Q4_1.gguf)",
        "  platform  cpu",
        f"  CPU       {describe(detect())}",
        "  dtype     float32 (converted from the gguf file's weights)"
        if dense
        else "  weights   cpu_int4 (the gguf file's blocks kept quantized, the rest float32; weft config show lists "
        "each format)",
        f"  KV cache  {blocks * 16:,} tokens ({blocks:,} blocks of 16); up to {context:,} tokens per request",
        "  sampling  temperature=0.2, top_p=0.9 (the model's defaults; a request's own values win)",
        *([f"  serving   {url} (OpenAI-compatible)"] if url else []),
    ]


def normalized(lines: list[str]) -> list[str]:
    lines = [re.sub(r"^ready in \d+\.\d s$", "ready in SECONDS s", line) for line in lines]
    return [re.sub(r"/gguf/[0-9a-f]{20}-float32", "/gguf/HASH-float32", line) for line in lines]


def test_first_start_and_rerun_print_their_steps_and_the_summary(tmp_path):
    """A first start on dense weights dequantizes (with the note that it is cached); a server with the default
    (quantized) weights prints only its steps and the summary with the URL; nothing else (no internal detail) comes
    before it."""
    cache = str(tmp_path / "cache")
    env = {**os.environ, "WEFT_CACHE_DIR": cache}
    first = subprocess.run(
        [sys.executable, "-m", "weft.cli", "generate", "--quantization", "none", "--max-tokens", "4", "Hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines() == [f"weft: {line}" for line in weft_lines(first.stderr)], first.stderr
    assert normalized(weft_lines(first.stderr)) == startup_lines(cache, None, dense=True)

    port = free_port()
    server, log = start_weft_serve([], port, env)
    try:
        output = "".join(log)
        ready = output.splitlines()
        summary_end = next(index for index, line in enumerate(ready) if line.startswith("weft:   serving"))
        assert all(line.startswith("weft: ") for line in ready[: summary_end + 1]), output
        url = f"http://127.0.0.1:{port}/v1"
        assert normalized(weft_lines("\n".join(ready[: summary_end + 1]))) == startup_lines(cache, url, dense=False)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_the_cache_is_keyed_by_content_and_hashes_a_file_once(tmp_path, monkeypatch):
    """A copy of the GGUF elsewhere names the same cache entries; a second key of an unchanged file reads the
    recorded hash (the file is not read again); a changed file gets a new key."""
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path / "cache"))
    original = smollm2_gguf()
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    digest = hashlib.sha256(original.read_bytes()).hexdigest()
    assert files.file_key(original, "float32") == f"{digest[:20]}-float32-v{files.CACHE_FORMAT}"
    assert files.file_key(copy, "float32") == files.file_key(original, "float32")

    def no_reading(*args, **kwargs):
        raise AssertionError("the file was hashed again")

    with monkeypatch.context() as patch:
        patch.setattr(hashlib, "file_digest", no_reading)
        assert files.file_key(copy, "config") == f"{digest[:20]}-config-v{files.CACHE_FORMAT}"
    with open(copy, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 1]))
    assert files.file_key(copy, "float32") != files.file_key(original, "float32")


def test_cache_list_and_clear(tmp_path, monkeypatch):
    """``weft cache list`` names the source file of each entry; ``clear`` frees the folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("WEFT_CACHE_DIR", str(cache))
    loader = GGUFLoader()
    loader.resolve(MODEL)  # config, generation config and tokenizer (the weights are not needed here)
    (cache / "gguf" / "0123456789abcdef0123456789abcdef.json").write_text("{}")  # an earlier version's name
    env = {**os.environ, "WEFT_CACHE_DIR": str(cache)}

    def weft(*args):
        return subprocess.run(
            [sys.executable, "-m", "weft.cli", "cache", *args], capture_output=True, text=True, env=env, timeout=120
        )

    listing = weft("list")
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[2:-1]]
    assert [row[:2] for row in rows] == [
        ["SmolLM2-135M-Instruct.Q4_1.gguf", what] for what in ("config", "generation_config", "tokenizer")
    ] + [["?", "1"]]
    assert listing.stdout.splitlines()[0].startswith(f"{cache / 'gguf'}: ")
    cleared = weft("clear")
    assert cleared.returncode == 0 and cleared.stdout.startswith("freed "), cleared.stdout + cleared.stderr
    assert not (cache / "gguf").exists()
    assert weft("list").stdout.startswith("the cache is empty")


@pytest.mark.parametrize("arguments", [[], ["bogus"]])
def test_cache_without_a_command_says_how_to_use_it(arguments):
    result = subprocess.run(
        [sys.executable, "-m", "weft.cli", "cache", *arguments], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and (
        "usage: weft cache list | clear" in result.stderr or "invalid choice" in result.stderr
    )


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_draws_in_place_on_a_terminal_and_is_one_line_elsewhere(capsys, monkeypatch, terminal):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert list(progress.bar(iter("abcd"), 4, "converting model.gguf", "tensors")) == list("abcd")
    written = capsys.readouterr().err
    if terminal:
        full = "#" * progress.BAR_WIDTH
        half = "#" * (progress.BAR_WIDTH // 2) + "." * (progress.BAR_WIDTH - progress.BAR_WIDTH // 2)
        assert written.startswith("\rweft: converting model.gguf [") and written.endswith(f"[{full}] 4/4 tensors\n")
        assert f"\rweft: converting model.gguf [{half}] 2/4 tensors" in written and written.count("\r") == 4
    else:
        assert written == "weft: converting model.gguf: 4 tensors\n"
