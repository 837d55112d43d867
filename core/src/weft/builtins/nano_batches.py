"""The ``nano_batches`` op: a decoder's layers over a decode step split in two (:mod:`weft.layers.nano_batches`).

``nano_batches(layers, parts)``: ``layers`` are :class:`~weft.layers.nano_batches.StagedLayer` objects, ``parts``
the :class:`~weft.layers.nano_batches.NanoBatchState` of each nano-batch (its rotary table, hidden states, residual
stream or None before the first layer, and forward context). Returns each part's ``(hidden, residual)`` after the
last layer; the parts given are not changed. Every implementation computes each part as the layers' forward would
compute it alone; only the order of the pieces, and the streams they run on, differ.

- ``nano_batches.torch``, the reference: one part through every layer, then the next.
- ``nano_batches.streams``: layer by layer, the parts interleaved so that a part's attention runs on a second
  stream of the device while the other part's GEMMs run on the current one (events order the two; inside a
  captured graph they become its edges). Where the device has no streams (the CPU: torch's ``torch.cpu`` streams
  and events are no-ops) the same order runs inline.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from weft.contracts.ops import OpImplementation
from weft.layers.nano_batches import NanoBatchState, StagedLayer

Outputs = list[tuple[torch.Tensor, torch.Tensor]]


class NanoBatchesTorch(OpImplementation):
    """The reference: each nano-batch through every layer in turn, on the current stream."""

    op: ClassVar[str] = "nano_batches"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, layers: Sequence[StagedLayer], parts: Sequence[NanoBatchState]) -> Outputs:
        outputs = []
        for part in parts:
            hidden, residual = part.hidden, part.residual
            for layer in layers:
                inputs, residual = layer.attention_inputs(part.rotary, hidden, residual)
                hidden, residual = layer.after_attention(layer.attend(inputs, part.context), residual)
            outputs.append((hidden, residual))
        return outputs

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Decode steps of tiny Llama-family layers over the torch attention backend: two nano-batches of unequal
        size before the first layer (no residual yet), equal halves mid-model, Qwen3's q/k norms, a sliding
        window; random weights and random cached context (rows of 1 to 40 tokens over blocks of 4)."""
        for architecture, extra, rows, layers, first in (
            ("LlamaForCausalLM", {}, 5, 2, True),
            ("Qwen3ForCausalLM", {"head_dim": 16}, 8, 3, False),
            ("MistralForCausalLM", {"sliding_window": 6}, 7, 2, False),
        ):
            yield _example(device, architecture, extra, rows, layers, first, seed=rows), {}


class NanoBatchesStreams(OpImplementation):
    """The parts interleaved layer by layer, each part's attention on a second stream (module docstring)."""

    op: ClassVar[str] = "nano_batches"
    priority: ClassVar[int] = 0

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        self._side_streams: dict[torch.device, Any] = {}

    def __call__(self, layers: Sequence[StagedLayer], parts: Sequence[NanoBatchState]) -> Outputs:
        states = [NanoBatchState(part.rotary, part.hidden, part.residual, part.context) for part in parts]
        device = states[0].hidden.device
        runtime = torch.get_device_module(device)  # torch.cuda, torch.xpu, ...; torch.cpu's streams are no-ops
        main = runtime.current_stream()
        side = self._side_stream(device, runtime)
        side.wait_stream(main)  # the parts' inputs were made on the current stream
        inputs: list[Any] = [None] * len(states)
        attended: list[Any] = [None] * len(states)
        done: list[Any] = [None] * len(states)

        def issue_attention(index: int, layer: StagedLayer) -> None:
            ready = runtime.Event()
            ready.record(main)
            with runtime.stream(side):
                side.wait_event(ready)
                attended[index] = layer.attend(inputs[index], states[index].context)
                done[index] = runtime.Event()
                done[index].record(side)
            # The allocator may hand a freed tensor's memory to its own stream's next kernel at once: the inputs
            # (made on the GEMM stream) stay the attention's until it ran, its output the GEMM stream's likewise.
            _used_on(side, device, inputs[index])
            _used_on(main, device, (attended[index],))

        for index, state in enumerate(states):
            inputs[index], state.residual = layers[0].attention_inputs(state.rotary, state.hidden, state.residual)
            issue_attention(index, layers[0])
        for position, layer in enumerate(layers):
            following = layers[position + 1] if position + 1 < len(layers) else None
            for index, state in enumerate(states):
                main.wait_event(done[index])
                state.hidden, state.residual = layer.after_attention(attended[index], state.residual)
                if following is not None:
                    inputs[index], state.residual = following.attention_inputs(
                        state.rotary, state.hidden, state.residual
                    )
                    issue_attention(index, following)
        main.wait_stream(side)  # a captured graph must join every stream it forked
        return [(state.hidden, state.residual) for state in states]

    def _side_stream(self, device: torch.device, runtime: Any) -> Any:
        """The attention's stream on ``device``: one for the engine's life, so every graph captures the same one."""
        stream = self._side_streams.get(device)
        if stream is None:
            stream = runtime.Stream(device=device) if device.type != "cpu" else runtime.Stream()
            self._side_streams[device] = stream
        return stream


def _used_on(stream: Any, device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    """Tell the caching allocator that ``stream`` reads ``tensors`` (nothing to tell on the CPU)."""
    if device.type == "cpu":
        return
    for tensor in tensors:
        tensor.record_stream(stream)


def _example(
    device: str, architecture: str, extra: dict[str, Any], rows: int, num_layers: int, first: bool, seed: int
) -> tuple[list[StagedLayer], list[NanoBatchState]]:
    """One conformance case: ``num_layers`` random layers of a tiny ``architecture`` and a ``rows``-row decode
    step split in two; ``first``: the parts enter the first layer (no residual stream yet)."""
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionBatch
    from weft.layers.attention import ForwardContext
    from weft.layers.nano_batches import decode_nano_batches
    from weft.layers.rotary import RotaryEmbedding
    from weft.models.llama import LlamaDecoderLayer, LlamaSettings

    generator = torch.Generator().manual_seed(seed)
    config = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=64,
        **extra,
    )
    settings = LlamaSettings(config, architecture)
    with torch.device(device):
        layers = [LlamaDecoderLayer(settings, index) for index in range(num_layers)]
    for layer in layers:
        for parameter in layer.parameters():  # Weft's layers skip initialisation: the loader fills them
            parameter.data.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    backend = TorchAttention(None, None)
    backend.prepare([layer.self_attn.attn.spec for layer in layers], "float32")
    block_size, most = 4, 40
    blocks_each = -(-most // block_size)
    kv_caches = {
        layer.self_attn.attn.layer_name: torch.randn(
            2, rows * blocks_each + 1, block_size, settings.num_kv_heads, settings.head_dim, generator=generator
        ).to(device)
        for layer in layers
    }
    seq_lens = torch.randint(1, most + 1, (rows,), generator=generator, dtype=torch.int32)
    block_table = torch.randperm(rows * blocks_each, generator=generator, dtype=torch.int32).view(rows, blocks_each)
    positions = seq_lens.long() - 1
    slots = block_table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1) * block_size
    batch = AttentionBatch(
        query_start=torch.arange(rows + 1, dtype=torch.int32).to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        slot_mapping=(slots + positions % block_size).to(torch.int32).to(device),
        max_query_len=1,
        max_seq_len=most,
        block_size=block_size,
    )
    parts = decode_nano_batches(
        backend,
        [batch],
        [True],
        rows,
        lambda metadata, batches: ForwardContext(backend, metadata, kv_caches, batches),
    )
    rotary_embedding = RotaryEmbedding(settings.head_dim, most, settings.rope).to(device)
    rotary = rotary_embedding.table(positions.to(device), torch.float32)
    hidden = torch.randn(rows, settings.hidden_size, generator=generator).to(device)
    residual = None if first else torch.randn(rows, settings.hidden_size, generator=generator).to(device)
    states = [
        NanoBatchState(
            (rotary[0][part.start : part.stop], rotary[1][part.start : part.stop]),
            hidden[part.start : part.stop],
            None if residual is None else residual[part.start : part.stop],
            part.context,
        )
        for part in parts
    ]
    return layers, states
