"""A worker's image encoder outputs: encoded when a step asks, kept by item hash, laid over each step's flat batch.

The scheduler's encoder cache (:mod:`weft.engine.core.encoder_cache`) decides; a step's
``freed_encoder_hashes`` are dropped first, then the items its ``encoder_inputs`` name are encoded in one
``ModelFamily.encode`` call (each item's :class:`~weft.contracts.mm_processor.TensorData` inputs moved to the
device) and kept under their hashes. :meth:`EncoderRunner.batch` then gathers, for every request of the step, the
rows of its items that its scheduled positions cover, with its multi-axis positions and extras where it has them:
the step's :class:`~weft.layers.multimodal.MultimodalBatch`. A step that needs one runs eagerly
(:meth:`EncoderRunner.needed`): decode graphs are captured for text.

An encoder connector (:mod:`weft.contracts.encoder_connector`, ``use.encoder_connector``: a shared folder, a
Mooncake store) hands encoder outputs between instances, E/P/D's encode leg to its prefill leg: an item the
connector holds is loaded, not encoded; what is encoded is saved through it, as a safetensors file of one
``embeddings`` tensor. The item hash covers the pixels and the processor's options, so a saved output is valid for
any prompt holding the item. One that does not parse or has the wrong number of rows (another model's) is ignored,
encoded again and overwritten.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy
import torch

from weft.layers.multimodal import MultimodalBatch

if TYPE_CHECKING:
    from weft.contracts.encoder_connector import EncoderConnector
    from weft.contracts.executor import SchedulerOutput
    from weft.contracts.mm_processor import ProcessedItem
    from weft.contracts.model import ModelFamily
    from weft.runner.request_state import RequestState

logger = logging.getLogger("weft.runner")


class EncoderRunner:
    """Encodes a step's items with the model family and keeps the outputs by item hash (module docstring)."""

    def __init__(
        self,
        family: ModelFamily,
        model: torch.nn.Module,
        device: torch.device,
        connector: EncoderConnector | None = None,
    ) -> None:
        """``connector``: the instance's encoder connector (module docstring), None for none."""
        self.family = family
        self.model = model
        self.device = device
        self.outputs: dict[str, torch.Tensor] = {}
        """Item hash -> its encoder output, ``[num_embeddings, hidden]`` on the device."""
        self.connector = connector
        self.store_reads = 0
        """Items loaded through the connector instead of encoded."""

    def update(self, step: SchedulerOutput, requests: dict[str, RequestState]) -> None:
        """Drop what the step frees, then encode what it asks for (after its new requests were taken in)."""
        for item_hash in step.freed_encoder_hashes:
            self.outputs.pop(item_hash, None)
        items = {}
        for request_id, indices in step.encoder_inputs.items():
            multimodal = requests[request_id].multimodal
            assert multimodal is not None, f"request {request_id!r} has no images to encode"
            for index in indices:
                item = multimodal.items[index]
                if item.hash not in self.outputs:
                    items[item.hash] = item
        for item_hash in [item_hash for item_hash in items if self._read(item_hash, items[item_hash])]:
            del items[item_hash]
        if not items:
            return
        inputs = [
            {name: tensor.to_torch().to(self.device, non_blocking=True) for name, tensor in item.encoder_inputs.items()}
            for item in items.values()
        ]
        outputs = self.family.encode(self.model, inputs)
        if len(outputs) != len(items):
            raise RuntimeError(
                f"{type(self.family).__name__}.encode returned {len(outputs)} outputs for {len(items)} items"
            )
        for (item_hash, item), output in zip(items.items(), outputs, strict=True):
            if output.dim() != 2 or output.shape[0] != item.num_embeddings:
                raise RuntimeError(
                    f"{type(self.family).__name__}.encode returned a {tuple(output.shape)} output for an item with "
                    f"{item.num_embeddings} placeholder positions; it must be [{item.num_embeddings}, hidden]"
                )
            self.outputs[item_hash] = output
            self._write(item_hash, output)

    def _read(self, item_hash: str, item: ProcessedItem) -> bool:
        """Take the item's output from the connector where it holds one with the right number of rows."""
        if self.connector is None:
            return False
        data = self.connector.load(item_hash)
        if data is None:
            return False
        from safetensors.torch import load

        try:
            output = load(data)["embeddings"].to(self.device)
        except Exception as error:  # noqa: BLE001 - a damaged value is encoded again, and overwritten
            logger.warning(
                "encoder connector %r: the output of item %s is unreadable (%s); encoding the item again",
                self.connector.name,
                item_hash[:12],
                error,
            )
            return False
        if output.dim() != 2 or output.shape[0] != item.num_embeddings:
            logger.warning(
                "encoder connector %r: item %s has a %s output, the item needs [%d, hidden] (another model's?); "
                "encoding it again",
                self.connector.name,
                item_hash[:12],
                tuple(output.shape),
                item.num_embeddings,
            )
            return False
        self.outputs[item_hash] = output
        self.store_reads += 1
        return True

    def _write(self, item_hash: str, output: torch.Tensor) -> None:
        if self.connector is None or not self.connector.context.saves:
            return
        from safetensors.torch import save

        self.connector.save(item_hash, save({"embeddings": output.detach().to("cpu").contiguous()}))

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    @staticmethod
    def needed(states: list[RequestState], counts: list[int]) -> bool:
        """Whether the step needs a :class:`MultimodalBatch`: a request covers placeholder positions, or carries
        positions or extras of its own."""
        for state, count in zip(states, counts, strict=False):
            multimodal = state.multimodal
            if multimodal is None:
                continue
            if multimodal.positions is not None or multimodal.extras:
                return True
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            if any(span_start < end and span_end > start for span_start, span_end, _, _ in multimodal.spans()):
                return True
        return False

    def batch(self, states: list[RequestState], counts: list[int], query_start: list[int]) -> MultimodalBatch | None:
        """The step's encoder rows, positions and extras (``query_start``: where each request's rows begin); None
        when it needs none."""
        if not self.needed(states, counts):
            return None
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for state, count, first in zip(states, counts, query_start, strict=False):
            multimodal = state.multimodal
            if multimodal is None:
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            for span_start, span_end, index, first_row in multimodal.spans():
                low, high = max(span_start, start), min(span_end, end)
                if low >= high:
                    continue
                item_hash = multimodal.items[index].hash
                output = self.outputs.get(item_hash)
                if output is None:
                    raise RuntimeError(
                        f"request {state.request_id!r}: the encoder output of item {index} ({item_hash[:12]}) is not "
                        f"held by this worker, but the step covers its positions {low}..{high - 1}"
                    )
                rows.extend(range(first + low - start, first + high - start))
                offset = first_row + low - span_start
                embeds.append(output[offset : offset + high - low])
        total = query_start[len(counts)]
        hidden = embeds[0].shape[1] if embeds else 0
        positions = _positions(states, counts, total)
        return MultimodalBatch(
            rows=torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True),
            embeds=torch.cat(embeds) if embeds else torch.empty(0, hidden, device=self.device),
            positions=positions.to(self.device, non_blocking=True) if positions is not None else None,
            extras={
                name: values.to(self.device, non_blocking=True)
                for name, values in _extras(states, counts, total).items()
            },
        )


def _positions(states: list[RequestState], counts: list[int], total: int) -> torch.Tensor | None:
    """``[axes, total]`` positions where a request of the step has its own (module docstring of
    :mod:`weft.layers.multimodal`); None: none has."""
    axes = next(
        (
            state.multimodal.positions.shape[0] if len(state.multimodal.positions.shape) == 2 else 1
            for state in states
            if state.multimodal is not None and state.multimodal.positions is not None
        ),
        None,
    )
    if axes is None:
        return None
    positions = numpy.empty((axes, total), dtype=numpy.int64)
    column = 0
    for state, count in zip(states, counts, strict=False):
        start = state.num_computed_tokens
        plain = numpy.arange(start, start + count, dtype=numpy.int64)
        given = state.multimodal.positions if state.multimodal is not None else None
        if given is None:
            positions[:, column : column + count] = plain
        else:
            own = given.to_numpy().reshape(-1, given.shape[-1])
            prompt = own.shape[1]
            inside = plain[plain < prompt]
            positions[:, column : column + len(inside)] = own[:, inside]
            # Output tokens continue from the prompt's largest position, one per token, on every axis.
            after = plain[len(inside) :]
            positions[:, column + len(inside) : column + count] = own.max() + 1 + (after - prompt)
        column += count
    return torch.from_numpy(positions)


def _extras(states: list[RequestState], counts: list[int], total: int) -> dict[str, torch.Tensor]:
    """Each extra a request of the step carries, at the step's positions (0 elsewhere)."""
    extras: dict[str, numpy.ndarray] = {}
    column = 0
    for state, count in zip(states, counts, strict=False):
        multimodal = state.multimodal
        for name, tensor in (multimodal.extras if multimodal is not None else {}).items():
            values = tensor.to_numpy()
            if name not in extras:
                extras[name] = numpy.zeros((*values.shape[:-1], total), dtype=values.dtype)
            start = state.num_computed_tokens
            stop = min(start + count, values.shape[-1])
            if stop > start:
                extras[name][..., column : column + stop - start] = values[..., start:stop]
        column += count
    return {name: torch.from_numpy(values) for name, values in extras.items()}
