"""The Hugging Face transformers side of ``weft verify`` (:mod:`weft.verify`): the reference model of a
family, its greedy continuation of each prompt with its own KV cache, its logits over the prompt and that
continuation from one full forward, and its own rounding noise; and :func:`logit_scale`, what both sides'
errors and bounds are relative to.

transformers is optional: :func:`import_transformers` imports it when a verification starts.
"""

from __future__ import annotations

import gc
import inspect
from pathlib import Path
from typing import Any

import msgspec
import torch

from weft.contracts.loader import ModelSource
from weft.contracts.model import ModelFamily


def logit_scale(logits: torch.Tensor) -> torch.Tensor:
    """``max(1, max |logit|)`` of each row: what a relative error or bound is relative to."""
    return logits.abs().amax(-1).clamp_min(1.0)


class ReferenceRun(msgspec.Struct, frozen=True):
    tokens: list[int]
    """The reference's greedy continuation of the prompt."""
    logits: torch.Tensor
    """Its logits (float32, on the CPU) at every position of the prompt and that continuation (its last
    token excluded), from one full forward."""
    noise: float
    """The largest relative difference between its cached-decode logits and ``logits`` at the same positions."""


def reference_runs(
    reference_class: Any,
    family: ModelFamily,
    source: ModelSource,
    dtype: str,
    device: torch.device,
    prompts: list[list[int]],
    max_tokens: int,
) -> list[ReferenceRun]:
    """The reference's greedy continuation of each prompt and its logits over them."""
    model = _load_reference(reference_class, source, dtype).to(device).eval()
    runs = []
    with torch.inference_mode(), family.hf_reference_context():
        for prompt in prompts:
            tokens, decoded = _reference_greedy(model, prompt, max_tokens)
            logits = model(torch.tensor([prompt + tokens[:-1]], device=device)).logits[0].float().cpu()
            full = logits[len(prompt) - 1 :]
            noise = float(((decoded - full).abs().amax(-1) / logit_scale(full)).max())
            runs.append(ReferenceRun(tokens, logits, noise))
    del model
    gc.collect()  # the reference's weights, before the engine loads
    return runs


def _load_reference(reference_class: Any, source: ModelSource, dtype: str) -> Any:
    options = {"dtype": getattr(torch, dtype), "attn_implementation": "eager"}
    if source.format == "gguf":
        path = Path(source.path)  # dequantized in memory, as Weft's gguf loader does
        return reference_class.from_pretrained(str(path.parent), gguf_file=path.name, **options)
    return reference_class.from_pretrained(source.path, **options)


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ValueError(
            f"weft verify compares against Hugging Face transformers, which is not installed ({error}); "
            f"pip install transformers"
        ) from None
    return transformers


def reference_class(transformers: Any, family: ModelFamily, architecture: str) -> Any:
    name = family.hf_architecture(architecture)
    found = getattr(transformers, name, None)
    if found is None:
        named = (
            f"{name!r}"
            if name == architecture
            else f"{name!r} (which {type(family).__name__} names for {architecture!r})"
        )
        raise ValueError(
            f"transformers {transformers.__version__} has no class {named}, the reference for this model; "
            f"upgrade transformers, or, for a family registered under a name of its own, return the transformers "
            f"class it reproduces from ModelFamily.hf_architecture"
        )
    return found


def _reference_greedy(model: Any, prompt: list[int], count: int) -> tuple[list[int], torch.Tensor]:
    """``count`` greedy tokens, the argmax of the reference's logits at each step with its own KV cache;
    and those logits (float32, on the CPU)."""
    # transformers 5.24 names the KV cache `cache`; earlier releases `past_key_values`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    output = model(torch.tensor([prompt], device=model.device), use_cache=True)
    rows = [output.logits[0, -1].float().cpu()]
    while len(rows) < count:
        step = torch.tensor([[int(rows[-1].argmax())]], device=model.device)
        output = model(step, use_cache=True, **{name: getattr(output, name)})
        rows.append(output.logits[0, -1].float().cpu())
    logits = torch.stack(rows)
    return logits.argmax(-1).tolist(), logits
