"""weft-dsv4's V4.1 image token stream (the ``dsv4`` mm processor): the expansion for 20 image sizes at 3 prompt
positions against the stream written out here, position independence, the per-item cache, and the kit's suite."""

from __future__ import annotations

import pytest

pytest.importorskip("weft_dsv4")
pytest.importorskip("PIL")

from weft.contracts.mm_processor import MMProcessorConfig  # noqa: E402
from weft.testing import MMProcessorContract  # noqa: E402
from weft.testing.mm_processor_suite import random_image  # noqa: E402
from weft_dsv4.mm import DeepseekV4MMOptions, DeepseekV4MMProcessor  # noqa: E402

VISION = {"architectures": ["DeepseekV4ForCausalLM"], "vision_config": {"patch_size": 16}}
IMAGE = 129264
# (width, height): squares, wide, tall, thin, tiny, sizes just off a multiple of 32, one past the token cap.
SIZES = [
    (32, 32),
    (64, 64),
    (33, 31),
    (47, 49),
    (1, 1),
    (5, 300),
    (300, 5),
    (96, 32),
    (32, 96),
    (100, 75),
    (75, 100),
    (128, 17),
    (17, 128),
    (250, 250),
    (63, 64),
    (65, 64),
    (16, 16),
    (48, 48),
    (200, 40),
    (2100, 1500),
]


def processor(**options) -> DeepseekV4MMProcessor:
    return DeepseekV4MMProcessor(DeepseekV4MMOptions(**options), MMProcessorConfig("DeepseekV4ForCausalLM", VISION))


def expected_grid(width: int, height: int) -> tuple[int, int] | None:
    """The grid written from the rule: one token per 32 pixels each way, rounded half to even, at least one; None
    past the cap of 4096 IMAGE tokens (that case is checked by its cap and aspect ratio)."""
    h, w = max(1, round(height / 32)), max(1, round(width / 32))
    return (h, w) if h * w <= 4096 else None


def expected_stream(h: int, w: int) -> list[str]:
    return ["START"] + (["IMAGE"] * w + ["NEWLINE"]) * h + ["END"]


ROLES = {0: "TEXT", 1: "START", 2: "IMAGE", 3: "NEWLINE", 4: "END"}


@pytest.mark.parametrize("width,height", SIZES)
def test_each_size_at_three_positions_expands_to_the_v41_stream(width, height):
    image = random_image(width * 7 + height, width, height)
    mm = processor()
    results = []
    for before in (0, 5, 211):
        prompt = [11 + index % 3 for index in range(before)] + [IMAGE] + [12, 13]
        processed = mm.process(prompt, [image])
        (item,) = processed.items
        (span,) = item.ranges
        assert span.offset == before
        roles = [ROLES[value] for value in processed.extras["token_types"].to_numpy().tolist()]
        grid = expected_grid(width, height)
        stream = roles[span.offset : span.offset + span.length]
        if grid is not None:
            h, w = grid
        else:  # over the cap: the grid keeps the aspect ratio and fits 4096 IMAGE tokens
            h = stream.count("NEWLINE")
            w = stream.count("IMAGE") // h
            assert h * w <= 4096 and abs(w / h - width / height) < 0.05, (h, w)
        assert stream == expected_stream(h, w), (width, height, before)
        assert span.length == h * (w + 1) + 2
        assert processed.token_ids == prompt[:before] + [IMAGE] * span.length + [12, 13]
        assert roles[:before] == ["TEXT"] * before and roles[span.offset + span.length :] == ["TEXT"] * 2
        assert processed.positions is None  # positions are consecutive: one per slot, as for text
        grid = item.encoder_inputs["grid"].to_numpy().tolist()
        pixels = item.encoder_inputs["pixels"]
        assert grid == [h, w] and pixels.shape == (h * 32, w * 32, 3) and pixels.dtype == "uint8"
        results.append((item.hash, stream, pixels.data))
    assert results[0] == results[1] == results[2], "the same image must expand the same way at every offset"


def test_the_resized_pixels_are_pillows_bicubic_resize():
    from PIL import Image

    image = random_image(9, 50, 70)
    (item,) = processor().process([IMAGE], [image]).items
    reference = Image.frombytes("RGB", (50, 70), image.pixels).resize((64, 64), Image.Resampling.BICUBIC)
    assert item.encoder_inputs["pixels"].data == reference.tobytes()


def test_two_images_in_one_prompt_and_updates_are_cached_per_item():
    mm = processor(cache_size=2)
    first, second, third = random_image(1, 64, 32), random_image(2, 32, 64), random_image(3, 32, 32)
    processed = mm.process([1, IMAGE, 2, IMAGE, 3], [first, second])
    a, b = processed.items
    assert (a.ranges[0].offset, a.ranges[0].length) == (1, 1 * 3 + 2)
    assert (b.ranges[0].offset, b.ranges[0].length) == (1 + 5 + 1, 2 * 2 + 2)
    assert processed.token_ids == [1] + [IMAGE] * 5 + [2] + [IMAGE] * 6 + [3]
    assert mm.cached_items == 2
    update = mm.prompt_update(first)
    assert mm.prompt_update(random_image(1, 64, 32)) is update, "an equal image is served from the cache"
    mm.prompt_update(third)  # evicts the least recently used: second
    assert mm.cached_items == 2 and mm.prompt_update(first) is update


def test_options_that_change_the_encoder_inputs_change_the_hash():
    image = random_image(5, 64, 64)
    default = processor().process([IMAGE], [image]).items[0]
    finer = processor(patch_size=8).process([IMAGE], [image]).items[0]
    assert default.hash != finer.hash and default.num_embeddings != finer.num_embeddings
    assert processor(cache_size=3).process([IMAGE], [image]).items[0].hash == default.hash  # the cache is no input


def test_a_checkpoint_without_a_vision_encoder_is_refused_saying_so():
    with pytest.raises(ValueError, match="declares no vision encoder .*'vision_config'"):
        DeepseekV4MMProcessor(None, MMProcessorConfig("DeepseekV4ForCausalLM", {"architectures": ["x"]}))


class TestDeepseekV4MMProcessor(MMProcessorContract):
    plugin_name = "dsv4"
    hf_config = VISION
    image_sizes = ((32, 32), (96, 40), (17, 93))


def test_a_data_url_image_from_a_chat_message_reaches_the_stream():
    import asyncio
    import base64
    import io

    from PIL import Image

    from weft.serve.media import ImageLoader, image_parts

    buffer = io.BytesIO()
    Image.new("RGB", (70, 30), (200, 10, 10)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    items = asyncio.run(ImageLoader().load_all(image_parts(messages)))
    processed = processor().process([3, IMAGE, 4], items)
    assert processed.items[0].ranges[0].length == 1 * (2 + 1) + 2  # 70x30 pixels: h = 1, w = 2
    assert processed.items[0].encoder_inputs["pixels"].to_numpy()[0, 0].tolist() == [200, 10, 10]
