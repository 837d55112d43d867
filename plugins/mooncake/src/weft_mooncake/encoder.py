"""The Mooncake encoder connector: image encoder outputs in Mooncake's distributed store, by item hash (E/P/D).

``use.encoder_connector = "mooncake"`` on the encode instance and the prefill instance (both connected to the same
``mooncake_master``, ``[plugins.mooncake]``: the table the KV connector reads too) hands each image's encoder output
from the one to the other without a shared file system. One object per item, under::

    weft/encoder/<model>@<config digest>/<item hash>

(:attr:`weft.contracts.encoder_connector.EncoderConnectorContext.model`: only an instance of the same model finds
it), holding the bytes core gives (a safetensors file of the ``[num_embeddings, hidden]`` embeddings). A save
replaces what the key holds (``upsert``). ``role``: ``producer`` saves and never loads, ``consumer`` loads and never
saves, ``both`` (the default) does both. While the master is unreachable, loads find nothing and saves are dropped
(:class:`weft_mooncake.store.StoreClient` probes it and picks it up again): the instance encodes the item itself.
Objects stay until Mooncake evicts them (the storage nodes' segments fill up) or someone removes them.
"""

from __future__ import annotations

import logging

from weft.contracts.encoder_connector import EncoderConnector, EncoderConnectorContext
from weft_mooncake.connector import MooncakeOptions
from weft_mooncake.store import StoreClient

logger = logging.getLogger("weft.mooncake")


def encoder_key(context: EncoderConnectorContext, item_hash: str) -> str:
    """The store key of one item's encoder output (module docstring)."""
    return f"weft/encoder/{context.model}/{item_hash}"


class MooncakeEncoderConnector(EncoderConnector):
    """Image encoder outputs in Mooncake's distributed store (E/P/D across machines)."""

    name = "mooncake"
    Options = MooncakeOptions

    def __init__(self, options: MooncakeOptions, context: EncoderConnectorContext) -> None:
        super().__init__(options, context)
        self.client = StoreClient(
            local_hostname=options.local_hostname,
            metadata_server=options.metadata_server,
            global_segment_size=options.global_segment_size,
            local_buffer_size=options.local_buffer_size,
            protocol=options.protocol,
            device_name=options.device_name,
            master_server_address=options.master_server_address,
        )

    def load(self, item_hash: str) -> bytes | None:
        if self.options.role == "producer":
            return None
        key = encoder_key(self.context, item_hash)
        try:
            data = self.client.call("get", self.client.store.get, key)
        except Exception as error:  # noqa: BLE001 - the contract: a failed load is a miss, logged, never raised
            logger.warning(
                "weft-mooncake: loading %s failed (%s: %s); the image is encoded here", key, type(error).__name__, error
            )
            return None
        return data or None  # Mooncake answers b"" for a key it does not hold

    def save(self, item_hash: str, data: bytes) -> None:
        if self.options.role == "consumer":
            return
        key = encoder_key(self.context, item_hash)
        try:
            status = self.client.call("save", self.client.store.upsert, key, data)
        except Exception as error:  # noqa: BLE001 - the contract: a failed save is logged, never raised
            logger.warning(
                "weft-mooncake: saving the encoder output %s failed (%s: %s); instances that need it encode the "
                "image themselves",
                key,
                type(error).__name__,
                error,
            )
            return
        if status is not None and status != 0:
            logger.warning(
                "weft-mooncake: saving the encoder output %s (%d bytes) failed with status %d; instances that need "
                "it encode the image themselves",
                key,
                len(data),
                status,
            )

    def close(self) -> None:
        self.client.close()
