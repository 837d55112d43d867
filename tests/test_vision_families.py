"""weft-vision's families (Qwen2.5-VL, Idefics3, LLaVA-Next) and their processors against transformers, on tiny
random checkpoints made here and images made here (several sizes).

- the processor's pixel values equal transformers' Pillow image processor's (explicit settings), and its
  expansion equals the Hugging Face processor's (built offline on a tokenizer made here);
- ``encode`` equals the HF model's ``get_image_features``;
- the logits of a prompt holding two images equal HF's forward, the encoder rows merged as the runner does
  (``context.multimodal``), Qwen2.5-VL's 3-axis positions from the processor;
- each processor passes the kit's :class:`~weft.testing.MMProcessorContract`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("weft_vision")
pytest.importorskip("PIL")

from weft.contracts.mm_processor import ImageItem, MMProcessorConfig  # noqa: E402
from weft.testing import MMProcessorContract  # noqa: E402

VOCAB = 400
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IMAGE_TOKEN = 390
SIZES = [(32, 32), (64, 40), (17, 93), (120, 50), (90, 90)]
"""(width, height) of the test images: square, wide, tall and thin, larger than one crop or tile."""

PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
IDEFICS3_MARKERS = dict(fake=380, global_=381, row_col=list(range(340, 376)), newline=[10], double_newline=[11])


def hf_configs():
    from transformers import Idefics3Config, LlavaNextConfig, Qwen2_5_VLConfig

    return {
        # Windows of 2x2 merged blocks (window_size 56 / merge 2 / patch 14), the second block full attention.
        "qwen2_5_vl": Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=48,
                num_heads=2,
                out_hidden_size=64,
                window_size=56,
                fullatt_block_indexes=[1],
            ),
            image_token_id=IMAGE_TOKEN,
            vision_start_token_id=391,
            vision_end_token_id=392,
            video_token_id=393,
        ),
        "idefics3": Idefics3Config(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            ),
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        ),
        # Three CLIP layers, features after the second (vision_feature_layer -2).
        "llava_next": LlavaNextConfig(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=3,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                projection_dim=32,
            ),
            image_token_id=IMAGE_TOKEN,
            image_grid_pinpoints=PINPOINTS,
        ),
    }


def hf_model(kind: str):
    from transformers import (
        Idefics3ForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
    )

    classes = {
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "idefics3": Idefics3ForConditionalGeneration,
        "llava_next": LlavaNextForConditionalGeneration,
    }
    torch.manual_seed(0)
    model = classes[kind](hf_configs()[kind]).eval()
    with torch.no_grad():  # every parameter random, norms and image_newline included
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, HF model): the model saved as transformers writes it, with a preprocessor config."""
    made = {}
    for kind in ("qwen2_5_vl", "idefics3", "llava_next"):
        folder = tmp_path_factory.mktemp(kind)
        model = hf_model(kind)
        model.save_pretrained(folder)
        (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[kind]))
        made[kind] = (folder, model)
    return made


PREPROCESSOR = {
    "qwen2_5_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64},
    "idefics3": {"size": {"longest_edge": 4 * 32}, "max_image_size": {"longest_edge": 32}},
    "llava_next": {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
}


def hf_image_processor(kind: str):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if kind == "qwen2_5_vl":
        return Qwen2VLImageProcessorPil(**PREPROCESSOR[kind], patch_size=14, merge_size=2, temporal_patch_size=2)
    if kind == "idefics3":
        return Idefics3ImageProcessorPil(**PREPROCESSOR[kind])
    return LlavaNextImageProcessorPil(**PREPROCESSOR[kind], image_grid_pinpoints=PINPOINTS)


def processor_for(kind: str, folder) -> object:
    from weft_vision.idefics3_processor import Idefics3Processor
    from weft_vision.llava_next_processor import LlavaNextProcessor
    from weft_vision.qwen2_5_vl_processor import Qwen2_5_VLProcessor

    config = json.loads((folder / "config.json").read_text())
    mm_config = MMProcessorConfig(config["architectures"][0], config, str(folder))
    if kind == "qwen2_5_vl":
        return Qwen2_5_VLProcessor(None, mm_config)
    if kind == "llava_next":
        return LlavaNextProcessor(None, mm_config)
    return Idefics3Processor(IDEFICS3_OPTIONS, mm_config)


def _idefics3_options():
    from weft_vision.idefics3_processor import Idefics3ProcessorOptions

    markers = IDEFICS3_MARKERS
    return Idefics3ProcessorOptions(
        fake_image_token_id=markers["fake"],
        global_image_token_id=markers["global_"],
        row_col_token_ids=markers["row_col"],
        newline_token_ids=markers["newline"],
        double_newline_token_ids=markers["double_newline"],
    )


IDEFICS3_OPTIONS = _idefics3_options()


def image(seed: int, width: int, height: int) -> ImageItem:
    """Smooth colour ramps plus noise: resizing filters see structure, not only noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return ImageItem.from_array(pixels)


def pil(item: ImageItem):
    from PIL import Image

    return Image.fromarray(item.to_array())


KINDS = ["qwen2_5_vl", "idefics3", "llava_next"]


@pytest.mark.parametrize("kind", KINDS)
def test_pixel_values_equal_the_hf_image_processor(kind, checkpoints):
    folder, _ = checkpoints[kind]
    processor = processor_for(kind, folder)
    reference = hf_image_processor(kind)
    for seed, (width, height) in enumerate(SIZES):
        item = image(seed, width, height)
        inputs = processor.process([5, IMAGE_TOKEN, 6], [item]).items[0].encoder_inputs
        expected = reference(pil(item), return_tensors="np")
        pixels = inputs["pixel_values"].to_numpy()
        if kind == "qwen2_5_vl":
            assert inputs["image_grid_thw"].to_numpy().tolist() == expected["image_grid_thw"][0].tolist()
            assert np.array_equal(pixels, expected["pixel_values"]), (width, height)
        elif kind == "idefics3":
            assert np.array_equal(pixels, expected["pixel_values"][0]), (width, height)
        else:
            assert inputs["image_sizes"].to_numpy().tolist() == [height, width]
            assert np.array_equal(pixels, expected["pixel_values"][0]), (width, height)


def encoder_inputs(processed) -> list[dict[str, torch.Tensor]]:
    return [{name: data.to_torch() for name, data in item.encoder_inputs.items()} for item in processed.items]


def hf_image_features(kind: str, model, items: list[ImageItem]) -> list[torch.Tensor]:
    """One tensor per image from the HF model's ``get_image_features`` on the HF image processor's inputs."""
    batch = hf_image_processor(kind)([pil(item) for item in items], return_tensors="pt")
    with torch.no_grad():
        if kind == "qwen2_5_vl":
            out = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
            return list(out.pooler_output)
        if kind == "llava_next":
            out = model.model.get_image_features(
                batch["pixel_values"],
                batch["image_sizes"],
                vision_feature_layer=model.config.vision_feature_layer,
                vision_feature_select_strategy=model.config.vision_feature_select_strategy,
            )
            return list(out.pooler_output)
        batch = hf_image_processor(kind)([[pil(item)] for item in items], return_tensors="pt")  # a sample each
        return list(model.model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"]).pooler_output)


def weft_module(kind: str, folder):
    """The family's module built on the CPU in float32 and loaded from the checkpoint folder."""
    from safetensors.torch import load_file

    from weft.contracts.model import ModelConfig
    from weft.plugins.registry import PluginRegistry

    config = json.loads((folder / "config.json").read_text())
    architecture = config["architectures"][0]
    family = PluginRegistry().load("model", architecture)()
    model_config = ModelConfig(architecture, config, "float32", 16, 1024)
    module = family.build(model_config, torch.device("cpu"))
    family.load_weights(module, load_file(str(folder / "model.safetensors")).items())
    return family, module


@pytest.mark.parametrize("kind", KINDS)
def test_encode_equals_hf_image_features(kind, checkpoints):
    folder, model = checkpoints[kind]
    family, module = weft_module(kind, folder)
    processor = processor_for(kind, folder)
    items = [image(seed, width, height) for seed, (width, height) in enumerate(SIZES)]
    processed = processor.process([5] + [IMAGE_TOKEN, 6] * len(items), items)
    outputs = family.encode(module, encoder_inputs(processed))
    expected = hf_image_features(kind, model, items)
    for item, output, reference, size in zip(processed.items, outputs, expected, SIZES, strict=True):
        assert output.shape == (item.num_embeddings, TEXT["hidden_size"]), size
        if kind == "idefics3":  # the markers' rows are their token embeddings, the <image> rows the features
            token_ids = item.encoder_inputs["token_ids"].to_torch()
            markers = token_ids != IMAGE_TOKEN
            with torch.no_grad():
                torch.testing.assert_close(output[markers], model.get_input_embeddings()(token_ids[markers]))
            output = output[~markers]
        torch.testing.assert_close(output, reference, rtol=1e-4, atol=1e-5, msg=f"{kind} {size}")


class CausalAttention:
    """An attention backend for one whole prompt without a cache: causal attention, grouped heads."""

    def forward(self, spec, query, key, value, cache, metadata, **kwargs):
        repeat = spec.num_heads // spec.num_kv_heads
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True, scale=spec.scale
        )
        return out.transpose(0, 1).reshape(query.shape[0], -1)


def weft_logits(family, module, processed) -> torch.Tensor:
    """The prompt's logits in one step, the encoder rows merged as the runner merges them."""
    from weft.api import ForwardContext, MultimodalBatch

    rows = torch.tensor([r.offset + i for item in processed.items for r in item.ranges for i in range(r.length)])
    embeds = torch.cat(family.encode(module, encoder_inputs(processed)))
    positions = None if processed.positions is None else processed.positions.to_torch()
    context = ForwardContext(
        backend=CausalAttention(),
        metadata=[None],
        kv_caches={},
        multimodal=MultimodalBatch(rows=rows, embeds=embeds, positions=positions),
    )
    context.kv_caches = _NoCaches()
    ids = torch.tensor(processed.token_ids)
    with torch.inference_mode():
        hidden = module(ids, torch.arange(len(ids)), context)
        return module.compute_logits(hidden)


class _NoCaches(dict):
    def __missing__(self, key):
        return None


def hf_logits(kind: str, model, processed, items: list[ImageItem]) -> torch.Tensor:
    batch = hf_image_processor(kind)([pil(item) for item in items], return_tensors="pt")
    ids = torch.tensor([processed.token_ids])
    with torch.no_grad():
        if kind == "qwen2_5_vl":
            return model(
                input_ids=ids,
                pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"],
                mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            ).logits[0]
        if kind == "llava_next":
            return model(input_ids=ids, pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"]).logits[0]
        batch = hf_image_processor(kind)([[pil(item) for item in items]], return_tensors="pt")
        return model(
            input_ids=ids, pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"]
        ).logits[0]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_of_a_prompt_with_two_images_equal_hf(kind, checkpoints):
    folder, model = checkpoints[kind]
    family, module = weft_module(kind, folder)
    processor = processor_for(kind, folder)
    items = [image(7, 64, 40), image(8, 17, 93)]
    prompt = [1, 20, 21, IMAGE_TOKEN, 22, 23, 24, IMAGE_TOKEN, 25, 26]
    processed = processor.process(prompt, items)
    torch.testing.assert_close(
        weft_logits(family, module, processed), hf_logits(kind, model, processed, items), rtol=1e-4, atol=1e-4
    )


def test_hf_processors_expand_as_the_processors_do(checkpoints, tmp_path):
    """The HF processors (built offline on a word-level tokenizer made here) expand each image placeholder to the
    same ids as ours, for two images in one prompt (Qwen2.5-VL: its processor's rule, see below)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Idefics3Processor, LlavaNextProcessor, PreTrainedTokenizerFast

    names = {
        IMAGE_TOKEN: "<image>",
        391: "<|vision_start|>",
        392: "<|vision_end|>",
        393: "<|video_pad|>",
        IDEFICS3_MARKERS["fake"]: "<fake_token_around_image>",
        IDEFICS3_MARKERS["global_"]: "<global-img>",
        IDEFICS3_MARKERS["newline"][0]: "\n",
        IDEFICS3_MARKERS["double_newline"][0]: "\n\n",
        382: "<end_of_utterance>",
    }
    names.update({token: f"<row_{i // 6 + 1}_col_{i % 6 + 1}>" for i, token in enumerate(IDEFICS3_MARKERS["row_col"])})
    words = {index: names.get(index, f"w{index}") for index in range(VOCAB)}

    def tokenizer(image_name: str):
        table = {**words, IMAGE_TOKEN: image_name}
        model = models.WordLevel({word: index for index, word in table.items()}, unk_token="w3")
        raw = Tokenizer(model)
        raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w3")
        fast.add_special_tokens({"additional_special_tokens": [table[index] for index in names if index in table]})
        return fast

    items = [image(11, 64, 40), image(12, 90, 90)]
    prompt = [1, 20, IMAGE_TOKEN, 21, 22, IMAGE_TOKEN, 23]
    for kind in KINDS:
        folder, model = checkpoints[kind]
        if kind == "qwen2_5_vl":
            # Qwen2_5_VLProcessor needs torchvision (its video processor), which CI lacks: its rule, one
            # <|image_pad|> per merged patch of the HF image processor's grid, written out here.
            grids = hf_image_processor(kind)([pil(item) for item in items], return_tensors="np")["image_grid_thw"]
            counts = iter(int(grid.prod()) // 4 for grid in grids)
            expected = [t for token in prompt for t in ([token] * next(counts) if token == IMAGE_TOKEN else [token])]
            assert processor_for(kind, folder).process(prompt, items).token_ids == expected
            continue
        if kind == "idefics3":
            hf = Idefics3Processor(hf_image_processor(kind), tokenizer("<image>"), image_seq_len=4)
            text = "w1 w20 <image> w21 w22 <image> w23"
        else:
            hf = LlavaNextProcessor(
                hf_image_processor(kind),
                tokenizer("<image>"),
                patch_size=8,
                vision_feature_select_strategy="default",
                num_additional_image_tokens=1,
            )
            text = "w1 w20 <image> w21 w22 <image> w23"
        expected = hf(images=[pil(item) for item in items], text=text, return_tensors="np")["input_ids"][0].tolist()
        ours = processor_for(kind, folder).process(prompt, items).token_ids
        assert ours == expected, kind


def test_qwen2_5_vl_positions_equal_hf_rope_index(checkpoints):
    folder, model = checkpoints["qwen2_5_vl"]
    items = [image(13, 120, 50), image(14, 17, 93)]
    processed = processor_for("qwen2_5_vl", folder).process([1, 2, IMAGE_TOKEN, 3, IMAGE_TOKEN, 4, 5], items)
    ids = torch.tensor([processed.token_ids])
    grids = torch.stack([item.encoder_inputs["image_grid_thw"].to_torch() for item in processed.items])
    expected, _ = model.model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), image_grid_thw=grids)
    assert processed.positions.to_numpy().tolist() == expected[:, 0].tolist()


class TestQwen2_5_VLProcessorContract(MMProcessorContract):
    plugin_name = "qwen2_5_vl"
    hf_config = {"image_token_id": 151655, "vision_config": {"patch_size": 14, "spatial_merge_size": 2}}


class TestIdefics3ProcessorContract(MMProcessorContract):
    plugin_name = "idefics3"
    hf_config = {"image_token_id": IMAGE_TOKEN, "scale_factor": 2, "vision_config": {"image_size": 32, "patch_size": 8}}
    options = IDEFICS3_OPTIONS


class TestLlavaNextProcessorContract(MMProcessorContract):
    plugin_name = "llava_next"
    hf_config = {
        "image_token_index": IMAGE_TOKEN,
        "image_grid_pinpoints": PINPOINTS,
        "vision_config": {"image_size": 32, "patch_size": 8},
    }


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_without_a_vision_encoder_is_refused(kind):
    from weft.plugins.registry import PluginRegistry

    processor = PluginRegistry().load("mm_processor", kind)
    with pytest.raises(ValueError, match="declares no vision encoder"):
        processor(IDEFICS3_OPTIONS if kind == "idefics3" else None, MMProcessorConfig("X", {"image_token_id": 5}))


def test_a_repeated_image_is_processed_once_and_hashes_apart_from_other_settings(checkpoints):
    from weft_vision.qwen2_5_vl_processor import Qwen2_5_VLProcessor, Qwen2_5_VLProcessorOptions

    folder, _ = checkpoints["qwen2_5_vl"]
    processor = processor_for("qwen2_5_vl", folder)
    item = image(15, 64, 40)
    first = processor.process([1, IMAGE_TOKEN], [item])
    again = processor.process([1, 2, 3, IMAGE_TOKEN, IMAGE_TOKEN], [item, item])
    assert processor.cached_items == 1
    assert {entry.hash for entry in again.items} == {first.items[0].hash}
    config = MMProcessorConfig("Qwen2_5_VLForConditionalGeneration", json.loads((folder / "config.json").read_text()))
    smaller = Qwen2_5_VLProcessor(Qwen2_5_VLProcessorOptions(max_pixels=56 * 56), config)
    assert smaller.process([1, IMAGE_TOKEN], [item]).items[0].hash != first.items[0].hash
