"""The ``folder`` encoder connector: encoder outputs as files in a folder (``engine.encoder_store``).

One file per item, ``<item hash>.safetensors``, in a folder the instances share: on one machine, or on a file
system several machines mount (NFS, a parallel file system). A save writes a temporary name and renames it, so a
load never sees half a file. Nothing is ever removed: bound the folder's size from outside (a tmpfs, a cron job).
The model is not part of the name: instances of different models need different folders (core ignores a file of
the wrong shape and encodes the item again).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from weft.contracts.encoder_connector import EncoderConnector, EncoderConnectorContext
from weft.contracts.plugin import NoOptions

logger = logging.getLogger("weft.runner")


class FolderEncoderConnector(EncoderConnector):
    """Encoder outputs as files in a shared folder (engine.encoder_store)."""

    name = "folder"

    def __init__(self, options: NoOptions, context: EncoderConnectorContext) -> None:
        super().__init__(options, context)
        if not context.folder:
            raise ValueError(
                "use.encoder_connector = 'folder' needs engine.encoder_store, the folder the instances share "
                "(e.g. --encoder-store /srv/encoder-store)"
            )
        self.folder = Path(context.folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def load(self, item_hash: str) -> bytes | None:
        try:
            return (self.folder / f"{item_hash}.safetensors").read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("encoder store: cannot read %s: %s", self.folder / f"{item_hash}.safetensors", error)
            return None

    def save(self, item_hash: str, data: bytes) -> None:
        path = self.folder / f"{item_hash}.safetensors"
        partial = self.folder / f".{item_hash}.{uuid.uuid4().hex}.partial"
        try:
            partial.write_bytes(data)
            os.replace(partial, path)
        except OSError as error:  # a full or read-only folder costs the other instances an encode, nothing else
            logger.warning("encoder store: cannot write %s: %s", path, error)
            partial.unlink(missing_ok=True)
