"""weft.contracts.mm_processor's data and helpers, and ModelFamily.encode's default."""

from __future__ import annotations

import msgspec
import numpy
import pytest
import torch

from weft.contracts.mm_processor import (
    ImageItem,
    PromptUpdate,
    TensorData,
    apply_prompt_updates,
    item_hash,
)


def test_tensor_data_crosses_msgpack_and_becomes_the_same_tensor():
    array = numpy.arange(24, dtype=numpy.float32).reshape(2, 3, 4)[:, ::-1]  # not contiguous
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(TensorData.from_array(array)), type=TensorData)
    assert (data.dtype, data.shape) == ("float32", (2, 3, 4))
    assert torch.equal(data.to_torch(), torch.from_numpy(array.copy()))


def test_image_items_check_their_bytes_and_hash_size_and_salt():
    with pytest.raises(ValueError, match="2x2 RGB needs 12 bytes of pixels, got 11"):
        ImageItem(2, 2, bytes(11))
    pixels = bytes(range(12))
    assert item_hash(ImageItem(2, 2, pixels)) == item_hash(
        ImageItem.from_array(numpy.frombuffer(pixels, numpy.uint8).reshape(2, 2, 3))
    )
    assert item_hash(ImageItem(2, 2, pixels)) != item_hash(ImageItem(4, 1, pixels))
    assert item_hash(ImageItem(2, 2, pixels)) != item_hash(ImageItem(2, 2, pixels), b"other options")


def test_apply_prompt_updates_places_ranges_and_extras():
    first = PromptUpdate("a", (9, 9, 9), {}, {"kind": (1, 2, 1)})
    second = PromptUpdate("b", (9,), {})
    processed = apply_prompt_updates([5, 9, 6, 9], 9, [first, second], {"kind": 0}, "int8")
    assert processed.token_ids == [5, 9, 9, 9, 6, 9]
    assert [(r.offset, r.length) for item in processed.items for r in item.ranges] == [(1, 3), (5, 1)]
    assert processed.extras["kind"].to_numpy().tolist() == [0, 1, 2, 1, 0, 0]
    with pytest.raises(ValueError, match=r"the prompt holds 1 image placeholder\(s\) \(token 9\) but 2 image\(s\)"):
        apply_prompt_updates([5, 9], 9, [first, second], {"kind": 0})
    with pytest.raises(ValueError, match=r"carries extras \['kind'\] that text_extras does not name"):
        apply_prompt_updates([9], 9, [first])


def test_a_family_without_a_vision_encoder_refuses_to_encode():
    from weft.models.llama import LlamaFamily

    with pytest.raises(NotImplementedError, match="LlamaFamily has no vision encoder: it reads text only"):
        LlamaFamily().encode(torch.nn.Identity(), [{"pixels": torch.zeros(1)}])
