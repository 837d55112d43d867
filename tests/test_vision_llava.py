"""LLaVA 1.5 (weft-vision) against transformers' LlavaForConditionalGeneration on a tiny random checkpoint, and the
engine's image path: encoder cache, prefix-cache keys with item hashes, image spans across chunk boundaries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy
import pytest
import torch

from weft import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE_TOKEN = 49152
NEW_TOKENS = 6
PATCHES = 16
"""Image positions per image: (32 // 8) ** 2 patches, the class token dropped."""


def make_tiny_llava(folder: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A random-weight LLaVA 1.5 checkpoint (CLIP tower 32x32 pixels, patch 8; Llama LM) with SmolLM2's tokenizer plus
    ``<image>`` (id 49152) and a CLIP image processor config."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=IMAGE_TOKEN + 1,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE_TOKEN,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not flat
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    model.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    tokenizer.save_pretrained(str(folder))
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"), tokenizer_files)


def image(width: int, height: int, seed: int) -> numpy.ndarray:
    """A smooth random RGB image (gradients plus noise), uint8 ``[height, width, 3]``."""
    rng = numpy.random.default_rng(seed)
    y, x = numpy.mgrid[0:height, 0:width]
    base = numpy.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return numpy.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(numpy.uint8)


def hf_pixels(folder: Path, images: list[numpy.ndarray]) -> torch.Tensor:
    """transformers' own preprocessing (CLIP's Pillow backend, as llava-hf's checkpoints name)."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil.from_pretrained(str(folder))
    return processor([Image.fromarray(array) for array in images], return_tensors="pt")["pixel_values"]


def hf_greedy(model, prompt_ids: list[int], pixel_values: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of transformers' LLaVA, recomputing the whole sequence each token (no cache, no EOS)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.fixture(scope="module")
def hf_llava(tiny_llava):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(tiny_llava), dtype=torch.float32).eval()


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_processor_pixels_equal_transformers(tiny_llava):
    from weft.contracts.mm_processor import ImageItem, MMProcessorConfig
    from weft_vision.llava_processor import LlavaProcessor, pixel_values

    hf_config = json.loads((tiny_llava / "config.json").read_text())
    processor = LlavaProcessor(None, MMProcessorConfig("LlavaForConditionalGeneration", hf_config, str(tiny_llava)))
    for size in [(40, 56), (64, 48), (33, 33), (32, 90), (17, 23)]:
        array = image(*size, seed=sum(size))
        ours = pixel_values(ImageItem.from_array(array), processor.settings)
        numpy.testing.assert_allclose(ours, hf_pixels(tiny_llava, [array])[0].numpy(), atol=1e-5)
    processed = processor.process([5, IMAGE_TOKEN, 6], [ImageItem.from_array(image(40, 56, 1))])
    assert processed.token_ids == [5, *[IMAGE_TOKEN] * PATCHES, 6]


def test_greedy_equals_transformers_with_images(tiny_llava, hf_llava):
    """Several sizes, two images in one prompt, one image repeated across requests; a small step budget so that
    image spans cross chunk boundaries."""
    a, b, c = image(40, 56, 1), image(64, 48, 2), image(33, 33, 3)
    prompts = [
        ("USER: <image>\nWhat is in the picture? ASSISTANT:", [a]),
        ("USER: Compare <image> and <image> please. ASSISTANT:", [b, c]),
        ("USER: <image>\nDescribe it. ASSISTANT:", [a]),  # a again: an encoder-cache hit
        ("<image>", [c]),
    ]
    llm = LLM(
        model=str(tiny_llava),
        engine={
            "max_num_batched_tokens": 12,  # every prompt's image span crosses a chunk boundary
            "encoder_cache_size": 64,
            "block_size": 8,
            "num_kv_blocks": 256,
            "quantization": "none",
            "dtype": "float32",
        },
    )
    outputs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts], GREEDY
    )
    for (text, images), output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids.count(IMAGE_TOKEN) == PATCHES * len(images)
        expected = hf_greedy(hf_llava, output.prompt_token_ids, hf_pixels(tiny_llava, images))
        assert output.outputs[0].token_ids == expected, text
    stats = llm.engine.core.scheduler.encoder_cache.stats
    assert stats.queries >= 4 and stats.hits >= 1


def test_repeated_image_hits_the_encoder_and_prefix_caches(tiny_llava, hf_llava):
    """The second request with the same image shares the blocks before its last one (prefix cache) and takes the
    image's remaining rows from the encoder cache; a different image at the same place shares no block."""
    llm = LLM(
        model=str(tiny_llava),
        engine={"block_size": 8, "num_kv_blocks": 256, "quantization": "none", "dtype": "float32"},
    )
    tokenizer = llm.tokenizer
    head = tokenizer.encode("USER: look at this", add_special_tokens=False)[:5]
    prompt_ids = [*head, IMAGE_TOKEN, *tokenizer.encode(" ok?", add_special_tokens=False)[:2]]
    # 5 text positions, 16 image positions, 2 text: the prefix cache holds 16 of the 23 (two blocks of 8), the image
    # ends at position 21, inside the third block.
    x, y = image(40, 56, 7), image(40, 56, 8)
    scheduler = llm.engine.core.scheduler

    def run(picture):
        (output,) = llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": picture}}, GREEDY)
        return output

    first = run(x)
    stats_before = scheduler.stats(0)
    second = run(x)
    stats_after = scheduler.stats(0)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 16
    assert stats_after.prefix_cache_hit_tokens - stats_before.prefix_cache_hit_tokens == 16
    assert stats_after.encoder_cache_queries - stats_before.encoder_cache_queries == 1
    assert stats_after.encoder_cache_hits - stats_before.encoder_cache_hits == 1

    other = run(y)
    assert other.num_cached_tokens == 0, "a different image behind the same placeholder ids shared blocks"
    assert other.outputs[0].token_ids == hf_greedy(hf_llava, other.prompt_token_ids, hf_pixels(tiny_llava, [y]))
    assert first.outputs[0].token_ids == hf_greedy(hf_llava, first.prompt_token_ids, hf_pixels(tiny_llava, [x]))


def test_an_image_larger_than_the_encoder_cache_is_refused(tiny_llava):
    llm = LLM(
        model=str(tiny_llava),
        engine={"encoder_cache_size": 8, "num_kv_blocks": 64, "quantization": "none", "dtype": "float32"},
    )
    with pytest.raises(ValueError, match=r"needs 16 embedding rows.*engine.encoder_cache_size = 8"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image(32, 32, 0)}}, GREEDY)


def test_a_checkpoint_without_a_vision_config_reads_no_images(tmp_path, tiny_llava):
    """The same checkpoint with vision_config removed: the processor refuses, and images are refused saying so."""
    folder = tmp_path / "no-vision"
    shutil.copytree(tiny_llava, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (folder / "config.json").write_text(json.dumps(config))
    from weft.config import load_config
    from weft.engine.api.frontend import Frontend
    from weft.plugins import PluginRegistry

    frontend = Frontend(load_config(None, {"model": str(folder)}), PluginRegistry())
    assert frontend.mm_processor is None
    assert "declares no vision encoder" in frontend.images_refusal
    with pytest.raises(ValueError, match="declares no vision encoder"):
        frontend.process_images([IMAGE_TOKEN], [])


def test_an_encoder_store_hands_outputs_between_instances(tiny_llava, hf_llava, tmp_path):
    """E/P/D's hand-over on one machine: one engine encodes and writes the item's output to engine.encoder_store; a
    second engine on the same store reads it instead of encoding (its encode fails if called), output unchanged; a
    file of the wrong shape is ignored."""
    store = tmp_path / "store"
    engine = {"encoder_store": str(store), "num_kv_blocks": 64, "quantization": "none", "dtype": "float32"}
    picture = image(44, 36, 71)
    with LLM(model=str(tiny_llava), engine=engine) as encoder:
        encoder.generate({"prompt": "<image>", "multi_modal_data": {"image": picture}}, GREEDY)
    (written,) = store.glob("*.safetensors")
    assert not list(store.glob(".*.partial"))
    prompt = {"prompt": "USER: <image>\nWhat now? ASSISTANT:", "multi_modal_data": {"image": picture}}
    with LLM(model=str(tiny_llava), engine=engine) as prefill:
        runner = prefill.engine.core.executor.worker.runner.encoder

        def refuse(*args, **kwargs):
            raise AssertionError("encoded an item the store holds")

        runner.family = type("NoEncode", (), {"encode": refuse})()
        (output,) = prefill.generate(prompt, GREEDY)
        assert runner.store_reads == 1
    assert output.outputs[0].token_ids == hf_greedy(hf_llava, output.prompt_token_ids, hf_pixels(tiny_llava, [picture]))

    from safetensors.torch import save_file

    save_file({"embeddings": torch.zeros(3, 64)}, str(written))  # three rows: not this item's
    with LLM(model=str(tiny_llava), engine=engine) as again:
        (output,) = again.generate(prompt, GREEDY)
        assert again.engine.core.executor.worker.runner.encoder.store_reads == 0
    assert output.outputs[0].token_ids == hf_greedy(hf_llava, output.prompt_token_ids, hf_pixels(tiny_llava, [picture]))


def test_a_family_without_an_encoder_refuses_images_instead_of_reading_placeholders(tiny_llava, monkeypatch):
    """A model whose processor expands images but whose family encodes none (DeepSeek V4.1 today): the request is
    refused, saying why; before, its placeholders ran as plain tokens. Text requests still run."""
    from weft.contracts.model import ModelFamily
    from weft_vision.llava import LlavaFamily

    monkeypatch.setattr(LlavaFamily, "encode", ModelFamily.encode)
    llm = LLM(model=str(tiny_llava), engine={"num_kv_blocks": 64, "quantization": "none", "dtype": "float32"})
    with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration.*has no vision encoder"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image(32, 32, 0)}}, GREEDY)
    (output,) = llm.generate("USER: hello ASSISTANT:", GREEDY)
    assert len(output.outputs[0].token_ids) == NEW_TOKENS


def test_llm_chat_reads_image_parts_also_from_a_running_event_loop(tiny_llava, hf_llava, tmp_path):
    import asyncio

    from PIL import Image

    picture = image(40, 40, 81)
    Image.fromarray(picture).save(tmp_path / "cat.png")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": (tmp_path / "cat.png").as_uri()}},
            ],
        }
    ]
    llm = LLM(model=str(tiny_llava), engine={"num_kv_blocks": 64, "quantization": "none", "dtype": "float32"})
    (output,) = llm.chat(messages, GREEDY)
    assert output.prompt_token_ids.count(IMAGE_TOKEN) == PATCHES
    assert output.outputs[0].token_ids == hf_greedy(hf_llava, output.prompt_token_ids, hf_pixels(tiny_llava, [picture]))

    async def in_a_loop():
        return llm.chat(messages, GREEDY)

    (again,) = asyncio.run(in_a_loop())
    assert again.outputs[0].token_ids == output.outputs[0].token_ids
