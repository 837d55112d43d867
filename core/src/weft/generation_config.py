"""The model's sampling defaults: what ``engine.generation_config`` takes from a generation config.

A request's sampling value comes from, in decreasing precedence: the request
itself, the model's generation config, then Weft's default (the
:class:`~weft.sampling_params.SamplingParams` field defaults, OpenAI's:
temperature 1, top_p 1, no top-k, min-p or repetition penalty).
``engine.generation_config`` picks the middle layer, with vLLM's semantics:

- ``"auto"``: the model's own, :attr:`ModelSource.generation_config
  <weft.contracts.loader.ModelSource.generation_config>` (a Hugging Face
  folder's ``generation_config.json``; what a GGUF file or its plugin declares);
- ``"none"``: none, Weft's defaults apply;
- a folder: the ``generation_config.json`` in it.

The six fields vLLM reads are taken, under Hugging Face's names; every other
key (``do_sample``, ``max_length``...) is ignored, as vLLM does. End-of-sequence
ids are the tokenizer's business (:func:`weft.builtins.hf_tokenizer.eos_ids_of`).
A value a request could not carry either (``temperature = -1``) stops the start
with the file, the key and the fix, instead of failing every request later.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from weft.contracts.loader import ModelSource
from weft.sampling_params import SamplingParams

logger = logging.getLogger("weft.generation_config")

SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> the SamplingParams field it sets by default."""


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The ``generation_config.json`` of ``folder`` as a dict; {} when there is none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        contents = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read as JSON ({error}); fix or remove the file") from None
    if not isinstance(contents, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(contents).__name__}; fix or remove the file")
    return contents


def load_model_sampling_defaults(source: ModelSource, setting: str) -> dict[str, Any]:
    """The SamplingParams fields that ``setting`` (``engine.generation_config``) sets for ``source``, validated.

    Called once per engine start; logs which defaults came from the model.
    """
    if setting == "none":
        return {}
    if setting == "auto":
        generation_config = source.generation_config
        origin = f"the generation config of model {source.name!r} ({source.path})"
    else:
        folder = Path(setting).expanduser()
        origin = str(folder / "generation_config.json")
        if not (folder / "generation_config.json").is_file():
            raise ValueError(
                f"engine.generation_config = {setting!r}: {origin} does not exist; "
                f"give 'auto', 'none' or a folder holding a generation_config.json"
            )
        generation_config = read_generation_config(folder)
    defaults = {}
    for key, field in SAMPLING_FIELDS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            msgspec.convert({field: value}, SamplingParams)
        except msgspec.ValidationError as error:
            reason = str(error).partition(" - at `")[0].replace("`", "")
            reason = reason.partition(": ")[2] if reason.startswith("SamplingParams.") else reason.lower()
            raise ValueError(
                f"{origin}: {key} = {value!r}: {reason}; correct it there, or set engine.generation_config to 'none' "
                f"(Weft's defaults) or to a folder holding a corrected generation_config.json"
            ) from None
        defaults[field] = value
    if defaults:  # the startup summary shows them too (weft.progress)
        logger.debug(
            "default sampling parameters from %s: %s (a request's own values take precedence; "
            "engine.generation_config = 'none' uses Weft's defaults)",
            origin,
            ", ".join(f"{key}={value}" for key, value in defaults.items()),
        )
    return defaults
