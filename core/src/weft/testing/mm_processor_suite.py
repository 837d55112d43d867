"""The multimodal-processor contract's suite (:mod:`weft.contracts.mm_processor`): any processor, fed images
made here. Imports no torch."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from weft.testing.suites import _Contract, _run_isolated


def random_image(seed: int, width: int, height: int) -> Any:
    """An :class:`~weft.contracts.mm_processor.ImageItem` of random pixels."""
    from weft.contracts.mm_processor import ImageItem

    return ImageItem(width, height, random.Random(seed).randbytes(width * height * 3))


class MMProcessorContract(_Contract):
    """The mm_processor contract. Set :attr:`hf_config` to a config the processor accepts (one declaring its
    vision encoder) and :attr:`image_sizes` to ``(width, height)`` pairs it takes."""

    slot = "mm_processor"
    architecture: ClassVar[str] = ""
    """The checkpoint architecture (default: the processor's first of :attr:`MMProcessor.architectures`)."""
    hf_config: ClassVar[dict[str, Any]] = {}
    options: ClassVar[Any] = None
    """The plugin's Options instance (None: its defaults)."""
    image_sizes: ClassVar[tuple[tuple[int, int], ...]] = ((32, 32), (64, 40), (17, 93))
    text_token_id: ClassVar[int] = 7
    """A token that is not the placeholder, for the text around the images."""

    @pytest.fixture
    def processor(self, plugin):
        from weft.contracts.mm_processor import MMProcessorConfig

        architecture = self.architecture or (plugin.architectures[0] if plugin.architectures else "")
        return plugin(self.options, MMProcessorConfig(architecture, dict(self.hf_config)))

    def _prompt(self, processor: Any, text_before: int, images: int, text_between: int = 3) -> list[int]:
        prompt = [self.text_token_id + index % 5 for index in range(text_before)]
        for _ in range(images):
            prompt += [processor.placeholder_token_id] + [self.text_token_id] * text_between
        assert processor.placeholder_token_id not in range(self.text_token_id, self.text_token_id + 5), (
            "text_token_id collides with the placeholder: set text_token_id in the test class"
        )
        return prompt

    @staticmethod
    def _replacement(processed: Any, index: int) -> tuple[int, int]:
        """``(start, end)`` of item ``index``'s span: from its first range's start to its last range's end."""
        ranges = processed.items[index].ranges
        return ranges[0].offset, ranges[-1].offset + ranges[-1].length

    def test_is_a_processor_named_as_registered(self, plugin):
        from weft.contracts.mm_processor import MMProcessor

        assert issubclass(plugin, MMProcessor), f"{plugin!r} must subclass weft.contracts.mm_processor.MMProcessor"
        assert plugin.name == self.plugin_name, (
            f"{plugin.__name__}.name is {plugin.name!r} but its entry point is {self.plugin_name!r}"
        )

    def test_module_imports_no_torch(self, entry):
        module, _, attribute = entry.target.partition(":")
        result = _run_isolated(
            "import importlib, json, sys\n"
            f"getattr(importlib.import_module({module.strip()!r}), {attribute.strip()!r})\n"
            "print(json.dumps({'torch': 'torch' in sys.modules}))\n"
        )
        assert not result["torch"], f"importing {entry.target} imports torch; the API process must not"

    def test_expansion_is_as_long_as_the_processor_reports(self, processor):
        images = [random_image(seed, width, height) for seed, (width, height) in enumerate(self.image_sizes)]
        prompt = self._prompt(processor, 5, len(images))
        processed = processor.process(prompt, images)
        assert len(processed.items) == len(images), "one processed item per image"
        spans = [self._replacement(processed, index) for index in range(len(images))]
        added = sum(end - start for start, end in spans)
        assert len(processed.token_ids) == len(prompt) - len(images) + added, (
            f"the expanded prompt has {len(processed.token_ids)} ids, but the prompt's {len(prompt) - len(images)} "
            f"text "
            f"ids and the spans the items report ({added} positions) make {len(prompt) - len(images) + added}"
        )
        previous_end = 0
        text = []
        for item, (start, end) in zip(processed.items, spans, strict=True):
            assert previous_end <= start, "item spans are in order and do not overlap"
            assert item.num_embeddings > 0 and all(r.length > 0 for r in item.ranges)
            assert all(start <= r.offset and r.offset + r.length <= end for r in item.ranges)
            text += processed.token_ids[previous_end:start]
            previous_end = end
        text += processed.token_ids[previous_end:]
        assert text == [token for token in prompt if token != processor.placeholder_token_id], (
            "the positions outside the items' spans must keep the prompt's own tokens, in order"
        )
        for name, extra in processed.extras.items():
            assert extra.shape[-1] == len(processed.token_ids), f"extra {name!r}: last axis must be the prompt's length"
        if processed.positions is not None:
            assert processed.positions.shape[-1] == len(processed.token_ids)

    def test_equal_images_hash_equal_and_different_ones_differ(self, processor):
        width, height = self.image_sizes[0]
        first, again = random_image(1, width, height), random_image(1, width, height)
        changed = bytearray(first.pixels)
        changed[len(changed) // 2] ^= 0xFF
        other = type(first)(width, height, bytes(changed))
        hashes = [
            processor.process(self._prompt(processor, 2, 1), [image]).items[0].hash for image in (first, again, other)
        ]
        assert hashes[0] == hashes[1], "the same pixels must give the same item hash"
        assert hashes[0] != hashes[2], "an image differing in one pixel must give another item hash"
        transposed = type(first)(height, width, first.pixels) if width != height else None
        if transposed is not None:
            flipped = processor.process(self._prompt(processor, 2, 1), [transposed]).items[0].hash
            assert flipped != hashes[0], "the same bytes at another size must give another item hash"

    def test_expansion_of_an_item_does_not_depend_on_its_offset(self, processor):
        import msgspec

        image = random_image(3, *self.image_sizes[-1])
        seen = []
        for text_before in (0, 1, 13):
            processed = processor.process(self._prompt(processor, text_before, 1), [image])
            start, end = self._replacement(processed, 0)
            item = processed.items[0]
            extras = {name: extra.to_numpy()[..., start:end].tolist() for name, extra in processed.extras.items()}
            positions = None
            if processed.positions is not None:
                values = processed.positions.to_numpy()[..., start:end]
                positions = (values - values[..., :1]).tolist()
            ranges = [(r.offset - start, r.length) for r in item.ranges]
            seen.append(
                (
                    processed.token_ids[start:end],
                    ranges,
                    item.hash,
                    extras,
                    positions,
                    msgspec.msgpack.encode(item.encoder_inputs),
                )
            )
        assert all(result == seen[0] for result in seen[1:]), (
            "the same image at offsets 0, 1 and 13 must expand to the same ids, ranges, hash, extras and encoder inputs"
        )

    def test_placeholders_and_images_must_agree_in_number(self, processor):
        image = random_image(4, *self.image_sizes[0])
        with pytest.raises(ValueError, match="placeholder"):
            processor.process(self._prompt(processor, 3, 2), [image])
        with pytest.raises(ValueError, match="placeholder"):
            processor.process(self._prompt(processor, 3, 0), [image])

    def test_the_result_crosses_processes_as_msgpack(self, processor):
        import msgspec

        from weft.contracts.mm_processor import ProcessedPrompt

        images = [random_image(seed, width, height) for seed, (width, height) in enumerate(self.image_sizes)]
        processed = processor.process(self._prompt(processor, 4, len(images)), images)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(processed), type=ProcessedPrompt) == processed
