"""weft-vision's Qwen2.5-VL, Idefics3 and LLaVA-Next families through the engine (``LLM.generate`` with images):
greedy tokens equal transformers' for several image sizes, two images in one prompt and one image repeated across
requests, with a step budget small enough that image spans cross chunk boundaries; the repeat hits the encoder
cache. The tiny checkpoints and the HF references are test_vision_families.py's (LLaVA 1.5: test_vision_llava.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("weft_vision.qwen2_5_vl")
pytest.importorskip("PIL")

from test_vision_families import (  # noqa: E402
    IDEFICS3_OPTIONS,
    IMAGE_TOKEN,
    KINDS,
    checkpoints,  # noqa: F401 - the fixture
    hf_image_processor,
    image,
    pil,
)
from weft import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def served_checkpoints(checkpoints):  # noqa: F811 - the imported fixture
    """test_vision_families' checkpoints with a tokenizer (trained here, of their vocabulary) for the engine."""
    from weft_dsv4.tiny_checkpoint import train_tokenizer

    for folder, _ in checkpoints.values():
        train_tokenizer(folder, 300)
    return checkpoints


def hf_greedy(kind: str, model, prompt_ids: list[int], items) -> list[int]:
    """transformers' greedy tokens, the whole sequence recomputed each token (no cache)."""
    images = [pil(item) for item in items]
    batch = hf_image_processor(kind)([images] if kind == "idefics3" else images, return_tensors="pt")
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tensor = torch.tensor([ids])
            if kind == "qwen2_5_vl":
                inputs = dict(image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(tensor == IMAGE_TOKEN).int())
            elif kind == "llava_next":
                inputs = dict(image_sizes=batch["image_sizes"])
            else:
                inputs = dict(pixel_attention_mask=batch["pixel_attention_mask"])
            logits = model(input_ids=tensor, pixel_values=batch["pixel_values"], **inputs).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_through_the_engine_equals_transformers(kind, served_checkpoints):
    import msgspec

    folder, model = served_checkpoints[kind]
    a, b, c = image(31, 64, 40), image(32, 17, 93), image(33, 90, 90)
    prompts = [
        ([1, 20, 21, IMAGE_TOKEN, 22, 23], [a]),
        ([1, 24, IMAGE_TOKEN, 25, 26, IMAGE_TOKEN, 27], [b, c]),  # two images of other sizes
        ([1, 28, 29, 30, IMAGE_TOKEN, 22], [a]),  # a again, after other text: an encoder-cache hit
    ]
    plugins = {"mm_processor.idefics3": msgspec.to_builtins(IDEFICS3_OPTIONS)} if kind == "idefics3" else {}
    llm = LLM(
        model=str(folder),
        engine={
            "max_num_batched_tokens": 16,  # image spans cross chunk boundaries
            "encoder_cache_size": 1024,
            "block_size": 8,
            "num_kv_blocks": 512,
            "quantization": "none",
            "dtype": "float32",
        },
        plugins=plugins,
    )
    requests = [{"prompt_token_ids": ids, "multi_modal_data": {"image": items}} for ids, items in prompts]
    outputs = llm.generate(requests[:2], GREEDY)
    hits = llm.engine.core.scheduler.encoder_cache.stats.hits
    outputs += llm.generate(requests[2:], GREEDY)  # after the others finished: its image's output is cached
    for (ids, items), output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(kind, model, output.prompt_token_ids, items)
        assert output.outputs[0].token_ids == expected, (kind, ids)
    assert llm.engine.core.scheduler.encoder_cache.stats.hits - hits == 1, "the repeated image was encoded again"
