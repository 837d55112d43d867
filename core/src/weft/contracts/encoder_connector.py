"""The encoder-connector slot: image encoder outputs handed between instances by item hash (E/P/D).

In encode/prefill/decode disaggregation an encode instance computes an image's encoder output and the prefill
instance that later gets a prompt holding the image reads it instead of encoding the image again.
``use.encoder_connector`` names what carries the outputs: ``folder`` (core: files in a folder on one machine or
a shared file system, ``engine.encoder_store``), or a plugin's (``mooncake``: Mooncake's distributed store,
weft-mooncake); ``auto``, the default, is ``folder`` where ``engine.encoder_store`` names a folder, else none.

Keys are item hashes (:attr:`weft.contracts.mm_processor.ProcessedItem.hash`): they depend on the image's pixels
and the processor's options, never on the prompt around the image, so what one instance saved serves any prompt
holding the item on any instance of the same model. A connector shared by several models keeps them apart with
:attr:`EncoderConnectorContext.model`. Values are opaque bytes: core saves a safetensors file holding one
``embeddings`` tensor ``[num_embeddings, hidden]`` and checks what it loads (a value that does not parse or has
the wrong number of rows, another model's, is ignored and the item encoded), so a connector never looks inside.

Where each call happens: in every worker of an instance that uses a connector, on the thread that runs the steps,
in the step whose positions need the item (under tensor parallelism every rank loads; rank 0 alone saves):

* Once, when the worker's model is loaded: ``EncoderConnector(options, context)`` with an
  :class:`EncoderConnectorContext`.
* :meth:`EncoderConnector.load` for each item the step needs and the worker does not hold: the bytes saved under
  its hash, or None.
* :meth:`EncoderConnector.save` for each item the worker encoded, when ``context.saves``.
* :meth:`EncoderConnector.close` when the worker shuts down.

A connector that fails (its store is unreachable, full, or the value is gone) answers None and drops saves, logging
why, and never raises for it: the instance encodes the item itself, and the output is the same either way, only
slower. A save must be visible whole or not at all to a concurrent load (the folder writes a temporary name and
renames it).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import msgspec

from weft.contracts.plugin import PluginBase


class EncoderConnectorContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker tells its encoder connector when it builds it."""

    model: str
    """The model's identity: its name and a digest of its configuration (the KV connector's
    :attr:`~weft.contracts.kv_connector.ConnectorContext.model`)."""
    folder: str = ""
    """``engine.encoder_store``: the folder the ``folder`` connector keeps files in (others ignore it)."""
    saves: bool = True
    """Whether this worker saves what it encodes (rank 0 of its instance)."""


class EncoderConnector(PluginBase):
    """Loads and saves encoder outputs by item hash: the module docstring."""

    name: str = ""
    """The entry-point name (``use.encoder_connector``)."""

    def __init__(self, options: Any, context: EncoderConnectorContext) -> None:
        self.options = options
        self.context = context

    @abstractmethod
    def load(self, item_hash: str) -> bytes | None:
        """The bytes saved under ``item_hash`` for this model; None when there are none (or the store failed)."""

    @abstractmethod
    def save(self, item_hash: str, data: bytes) -> None:
        """Keep ``data`` under ``item_hash`` for this model, replacing what is there; a failure is logged, not
        raised."""

    def close(self) -> None:
        """Release connections and threads (called once, when the worker shuts down)."""
