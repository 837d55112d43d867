"""``weft verify``: a model family against its Hugging Face transformers reference, on the same weights.

Three runs over the same prompts, as token ids from Weft's tokenizer:

1. Weft's engine, through the public API: every prompt in one ``LLM.generate`` call, greedy,
   ``max_tokens`` new tokens, the top two log-probabilities of each. The step budget is half
   the longest prompt, so prompts are prefilled in chunks batched with other prompts' decodes.
2. The reference: the transformers class the family names (:meth:`ModelFamily.hf_architecture`)
   loaded from the same checkpoint folder in the same dtype, eager attention, run inside the
   family's :meth:`ModelFamily.hf_reference_context`. It generates greedily with its own KV
   cache, then gives its logits at every position of the prompt and its continuation.
3. Teacher forcing: the family's module built through the contracts alone (plain torch layers,
   the ``torch`` attention backend), fed that same sequence as one prefill. Its logits at every
   position are compared with the reference's: the relative error of a position is the largest
   absolute difference over the vocabulary divided by the reference's largest absolute logit.

A prompt *matches* when Weft's tokens equal the reference's. Otherwise its first divergence is
a *near-tie* when the two tokens are each other's runner-up within :func:`tie_threshold` on both
sides: Weft's second choice is the reference's token and Weft's top-1/top-2 gap is within the
threshold, and so is the reference's margin of its token over Weft's. The continuations differ
from there on, so nothing after a tie is compared. Any other divergence is a failure.

transformers is optional; it is imported when a verification starts.
"""

from __future__ import annotations

import gc
import inspect
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from weft.config import EngineConfig
from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.loader import ModelSource, WeightLoader
from weft.contracts.model import ModelConfig, ModelFamily
from weft.layers.attention import Attention, ForwardContext
from weft.outputs import CompletionOutput, Logprob
from weft.plugins import PluginRegistry
from weft.plugins.selection import select_platform

DTYPES = tuple(name for name in typing.get_args(typing.get_type_hints(EngineConfig)["dtype"]) if name != "auto")
"""The dtypes both sides can run in: ``engine.dtype``'s explicit choices."""

REFERENCES = ("hf",)
"""References ``weft verify`` compares against: Hugging Face transformers."""

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 1, 2, 3, 5, 8, 13,",
)

TIE_ULPS = 16
"""A near-tie is a logit gap of at most this many machine epsilons of the dtype, relative to the
position's largest logit (:func:`tie_threshold`)."""


def tie_threshold(dtype: str, logits: torch.Tensor) -> float:
    """The largest logit gap that is a near-tie in ``dtype`` at a position with these reference logits.

    ``TIE_ULPS * eps(dtype) * max(1, max |logit|)``, where ``eps`` is the dtype's machine epsilon
    (float32 1.2e-7, float16 9.8e-4, bfloat16 7.8e-3): a gap within what rounding alone moves a
    logit of that size when two correct implementations sum in different orders (on the tiny test
    models Weft's logits differ from transformers' by about 8 eps in float32 and 3 in bfloat16).
    With logits near 10 the threshold is 2e-5 in float32 and 1.25 in bfloat16.
    """
    scale = max(1.0, float(logits.abs().max()))
    return TIE_ULPS * torch.finfo(getattr(torch, dtype)).eps * scale


class Divergence(msgspec.Struct, frozen=True):
    """The first generated token where Weft and the reference differ."""

    step: int
    """Index of the generated token (0 is the first token after the prompt)."""
    weft_token: int
    reference_token: int
    weft_text: str
    reference_text: str
    weft_gap: float
    """Weft's top-1 minus top-2 log-probability at this step (equal to its logit gap)."""
    reference_gap: float
    """The reference's logit of its token minus its logit of Weft's token (its top-1/top-2 gap
    when Weft's token is its second choice)."""
    threshold: float
    """:func:`tie_threshold` at this position."""
    tie: bool


class PromptResult(msgspec.Struct, frozen=True):
    prompt: str
    prompt_token_ids: list[int]
    weft_token_ids: list[int]
    reference_token_ids: list[int]
    divergence: Divergence | None
    max_relative_error: float
    """Largest relative logit error over every teacher-forced position (see the module docstring)."""

    @property
    def status(self) -> str:
        """``match``, ``tie`` (diverged at a near-tie) or ``diverged``."""
        if self.divergence is None:
            return "match"
        return "tie" if self.divergence.tie else "diverged"


class VerifyReport(msgspec.Struct, frozen=True):
    model: str
    architecture: str
    family: str
    """The family's implementation, ``module:Class``."""
    reference: str
    """The reference, e.g. ``transformers 5.24.0 LlamaForCausalLM``."""
    dtype: str
    max_tokens: int
    step_budget: int
    """The engine's ``max_num_batched_tokens`` during the greedy run."""
    results: list[PromptResult]

    @property
    def passed(self) -> bool:
        """Whether every prompt matched or diverged only at a near-tie."""
        return all(result.status != "diverged" for result in self.results)

    @property
    def first_failure(self) -> tuple[int, PromptResult] | None:
        """The first prompt (index, result) that diverged beyond a near-tie."""
        return next(((i, r) for i, r in enumerate(self.results) if r.status == "diverged"), None)

    def table(self) -> str:
        lines = [
            f"model        {self.model}",
            f"family       {self.architecture} ({self.family})",
            f"reference    {self.reference}",
            f"run          {self.dtype}, {len(self.results)} prompts in one batch, {self.max_tokens} greedy tokens each, "
            f"chunked prefill with a {self.step_budget}-token step budget",
            "",
        ]
        header = ("PROMPT", "TOKENS", "GREEDY (SAME TOKENS)", "FIRST DIVERGENCE (STEP: WEFT vs REFERENCE)", "GAP WEFT", "GAP REF", "MAX REL ERR")
        rows = []
        for index, result in enumerate(self.results):
            divergence = result.divergence
            if divergence is None:
                where, weft_gap, reference_gap = "-", "-", "-"
            else:
                where = (f"{divergence.step}: {divergence.weft_token} {divergence.weft_text!r} vs "
                         f"{divergence.reference_token} {divergence.reference_text!r}")
                weft_gap, reference_gap = f"{divergence.weft_gap:.3g}", f"{divergence.reference_gap:.3g}"
            matched = self.max_tokens if divergence is None else divergence.step
            status = f"{result.status} {matched}/{self.max_tokens}"
            rows.append((f"{index} {_preview(result.prompt)}", str(len(result.prompt_token_ids)), status, where,
                         weft_gap, reference_gap, f"{result.max_relative_error:.2e}"))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        counts = {status: sum(r.status == status for r in self.results) for status in ("match", "tie", "diverged")}
        worst = max(result.max_relative_error for result in self.results)
        lines += [
            "",
            f"{counts['match']}/{len(self.results)} prompts matched, {counts['tie']} diverged at a near-tie, "
            f"{counts['diverged']} diverged; max relative logit error {worst:.2e} (teacher-forced, every position)",
            f"near-tie: both tokens each other's runner-up within {TIE_ULPS} x eps({self.dtype}) x max(1, max |logit|)",
        ]
        return "\n".join(lines)

    def failure_message(self) -> str | None:
        """One line naming the first divergence beyond a near-tie; None when the report passed."""
        failure = self.first_failure
        if failure is None:
            return None
        index, result = failure
        d = result.divergence
        assert d is not None
        message = (
            f"prompt {index} ({_preview(result.prompt)}) diverged at step {d.step}: weft {d.weft_token} {d.weft_text!r} "
            f"vs reference {d.reference_token} {d.reference_text!r}; reference margin {d.reference_gap:.3g}, "
            f"weft top-1/top-2 gap {d.weft_gap:.3g}, near-tie threshold {d.threshold:.3g} ({self.dtype})"
        )
        if d.reference_gap < 0:
            message += (
                "; the reference's own full forward prefers Weft's token here, so its cached decode and its prefill "
                "disagree: if the reference makes a choice the model leaves open (a tie order), the family's "
                "hf_reference_context can fix it"
            )
        return message


def verify(
    model: str,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    dtype: str = "float32",
    max_tokens: int = 16,
    reference: str = "hf",
    registry: PluginRegistry | None = None,
) -> VerifyReport:
    """Compare the installed family of ``model`` (a checkpoint folder, or a cached HF repo id) with its reference.

    Raises ValueError naming the problem when the model, a prompt or an option cannot be verified.
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r} is not supported; choose one of {', '.join(REFERENCES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: must be >= 1")
    if not prompts:
        raise ValueError("no prompts to verify; give at least one")
    transformers = _import_transformers()
    registry = registry or PluginRegistry()
    loader, source = resolve_checkpoint(model, registry)
    architecture = (source.hf_config.get("architectures") or [None])[0]
    if architecture is None:
        raise ValueError(f"model {model!r}: its config.json names no 'architectures'; cannot choose a model family")
    family = registry.load("model", architecture)()
    reference_class = _reference_class(transformers, family, architecture)
    platform_class, _ = select_platform(registry)
    platform = platform_class()

    block_size = EngineConfig().block_size
    tokenizer = registry.load("tokenizer", source.tokenizer).from_source(source)
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    empty = [prompt for prompt, ids in zip(prompts, encoded) if not ids]
    if empty:
        raise ValueError(f"prompt {empty[0]!r} encodes to no tokens; give prompts with text")
    longest = max(len(ids) for ids in encoded)
    step_budget = max(len(prompts), (longest + 1) // 2)
    max_model_len = longest + max_tokens
    engine = {
        "dtype": dtype, "max_num_batched_tokens": step_budget, "max_num_seqs": len(prompts), "max_model_len": max_model_len,
        # Room for every prompt at once (each group's blocks cover at least block_size tokens),
        # instead of the engine's default share of the device's memory.
        "num_kv_blocks": len(prompts) * -(-max_model_len // block_size),
    }
    outputs = _engine_greedy(model, registry, engine, encoded, max_tokens)
    reference_tokens, reference_logits = _reference_runs(
        reference_class, family, source, dtype, platform.device(), encoded, max_tokens
    )
    forced = TeacherForcedModel(registry, family, loader, source, dtype, platform, max_model_len, block_size)
    results = []
    for prompt, ids, output, tokens, expected in zip(prompts, encoded, outputs, reference_tokens, reference_logits):
        logits = forced.logits(ids + tokens[:-1]).cpu()
        error = (logits - expected).abs().amax(-1) / expected.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        divergence = first_divergence(
            output.token_ids, output.logprobs or [], tokens, expected, len(ids), dtype,
            lambda ids: tokenizer.decode(ids, False),
        )
        results.append(PromptResult(
            prompt=prompt, prompt_token_ids=ids, weft_token_ids=list(output.token_ids), reference_token_ids=tokens,
            divergence=divergence, max_relative_error=float(error.max()),
        ))
    entry = registry.find("model", architecture)
    return VerifyReport(
        model=model, architecture=architecture, family=entry.target,
        reference=f"transformers {transformers.__version__} {reference_class.__name__}", dtype=dtype,
        max_tokens=max_tokens, step_budget=step_budget, results=results,
    )


def resolve_checkpoint(model: str, registry: PluginRegistry) -> tuple[WeightLoader, ModelSource]:
    """The loader and source of ``model``, refused unless transformers can load the same folder."""
    loaders = sorted(registry.load_all("loader").items(), key=lambda item: -item[1].priority)
    for name, loader_class in loaders:
        loader = loader_class()
        if loader.accepts(model):
            source = loader.resolve(model)
            break
    else:
        raise ValueError(
            f"model {model!r}: no installed loader accepts it; weft verify needs a folder with config.json "
            f"and *.safetensors (or a Hugging Face repo id in the local cache)"
        )
    folder = Path(source.path)
    if source.format != "safetensors" or not (folder / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is a {source.format} source (loader {name!r}, {folder}): weft verify compares against "
            f"Hugging Face transformers loading the same weights, which needs a folder with config.json and "
            f"*.safetensors; convert the model to such a folder (for a GGUF: transformers' from_pretrained with "
            f"gguf_file=..., then save_pretrained) and verify that"
        )
    return loader, source


class TeacherForcedModel:
    """A family's module built and loaded through the contracts alone, run over whole sequences.

    Plain torch layers (no op plugins) and the ``torch`` attention backend; each call is one
    request prefilled in one step over fresh KV caches, as the model runner lays a step out.
    """

    def __init__(
        self, registry: PluginRegistry, family: ModelFamily, loader: WeightLoader, source: ModelSource, dtype: str,
        platform: Any, max_model_len: int, block_size: int,
    ) -> None:
        architecture = source.hf_config["architectures"][0]
        self.config = ModelConfig(
            architecture=architecture, hf_config=source.hf_config, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
        )
        self.device = platform.device()
        self.family = family
        self.module = family.build(self.config, self.device)
        family.load_weights(self.module, loader.iter_weights(source, family.load_dtype(dtype)))
        self.backend: AttentionBackend = registry.load("attention", "torch")(None, platform)
        self.backend.prepare([m.spec for m in self.module.modules() if isinstance(m, Attention)], dtype)
        self.groups = family.kv_cache_groups(self.config)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` (float32) at every position of one sequence."""
        count, device = len(token_ids), self.device
        positions = torch.arange(count, device=device)
        query_start = torch.tensor([0, count], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([count], dtype=torch.int32, device=device)
        rows = torch.zeros(count, dtype=torch.long, device=device)
        kv_caches, batches, metadata = {}, [], []
        for group in self.groups:
            spec = group.spec
            blocks = spec.blocks_for_tokens(count)
            shape = self.family.kv_cache_shape(spec, blocks) or self.backend.kv_cache_shape(blocks, spec)
            for layer in group.layer_names:
                kv_caches[layer] = torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=device)
            block_table = torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0)
            batch = AttentionBatch(
                query_start=query_start, seq_lens=seq_lens, block_table=block_table,
                slot_mapping=spec.slot_mapping(block_table, rows, positions).to(torch.int32),
                max_query_len=count, max_seq_len=count, block_size=spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch) if spec.paged_attention else None)
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=kv_caches, batches=batches)
        hidden = self.module(torch.tensor(list(token_ids), device=device), positions, context)
        return self.module.compute_logits(hidden).float()


def first_divergence(
    weft_tokens: Sequence[int], weft_logprobs: Sequence[dict[int, Logprob]], reference_tokens: Sequence[int],
    reference_logits: torch.Tensor, prompt_length: int, dtype: str, decode: Callable[[list[int]], str],
) -> Divergence | None:
    """Where Weft's greedy tokens first leave the reference's, and whether that is a near-tie.

    ``weft_logprobs`` holds Weft's top-2 log-probabilities per generated token (``logprobs=2``);
    ``reference_logits`` the reference's logits at every position of the prompt and its
    continuation, so a generated token's row is ``prompt_length - 1 + step``.
    """
    step = next((i for i, (ours, theirs) in enumerate(zip(weft_tokens, reference_tokens)) if ours != theirs), None)
    if step is None:
        return None
    weft_token, reference_token = weft_tokens[step], reference_tokens[step]
    ranked = sorted(weft_logprobs[step].items(), key=lambda item: item[1].rank)
    (_, first), (second_token, second) = ranked[0], ranked[1]
    weft_gap = first.logprob - second.logprob
    row = reference_logits[prompt_length - 1 + step]
    reference_gap = float(row[reference_token] - row[weft_token])
    threshold = tie_threshold(dtype, row)
    tie = second_token == reference_token and weft_gap <= threshold and reference_gap <= threshold
    return Divergence(
        step=step, weft_token=weft_token, reference_token=reference_token,
        weft_text=decode([weft_token]), reference_text=decode([reference_token]),
        weft_gap=weft_gap, reference_gap=reference_gap, threshold=threshold, tie=tie,
    )


def _engine_greedy(
    model: str, registry: PluginRegistry, engine: dict[str, Any], prompts: list[list[int]], max_tokens: int,
) -> list[CompletionOutput]:
    """Weft's greedy completions with their top-2 log-probabilities, every prompt in one ``generate`` call."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    # The reference applies no penalty, whatever the model's generation_config suggests.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, repetition_penalty=1.0)
    with LLM(model=model, registry=registry, engine=engine) as llm:
        outputs = [output.outputs[0] for output in llm.generate(prompts, params)]
    del llm
    gc.collect()  # the engine's weights and KV cache, before the reference loads
    return outputs


def _reference_runs(
    reference_class: Any, family: ModelFamily, source: ModelSource, dtype: str, device: torch.device,
    prompts: list[list[int]], max_tokens: int,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The reference's greedy continuation of each prompt, and its logits (float32, on the CPU) at every
    position of the prompt and that continuation (its last token excluded)."""
    model = reference_class.from_pretrained(source.path, dtype=getattr(torch, dtype), attn_implementation="eager")
    model = model.to(device).eval()
    continuations, logits = [], []
    with torch.inference_mode(), family.hf_reference_context():
        for prompt in prompts:
            tokens = _reference_greedy(model, prompt, max_tokens)
            continuations.append(tokens)
            logits.append(model(torch.tensor([prompt + tokens[:-1]], device=device)).logits[0].float().cpu())
    del model
    gc.collect()
    return continuations, logits


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ValueError(
            f"weft verify compares against Hugging Face transformers, which is not installed ({error}); "
            f"pip install transformers"
        ) from None
    return transformers


def _reference_class(transformers: Any, family: ModelFamily, architecture: str) -> Any:
    name = family.hf_architecture(architecture)
    found = getattr(transformers, name, None)
    if found is None:
        named = f"{name!r}" if name == architecture else f"{name!r} (which {type(family).__name__} names for {architecture!r})"
        raise ValueError(
            f"transformers {transformers.__version__} has no class {named}, the reference for this model; "
            f"upgrade transformers, or, for a family registered under a name of its own, return the transformers "
            f"class it reproduces from ModelFamily.hf_architecture"
        )
    return found


def _reference_greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens: the argmax of the reference's logits at each step, with its own KV cache."""
    # transformers 5.24 names the KV cache `cache`; earlier releases `past_key_values`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    output = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens = [int(output.logits[0, -1].argmax())]
    while len(tokens) < count:
        step = torch.tensor([tokens[-1:]], device=model.device)
        output = model(step, use_cache=True, **{name: getattr(output, name)})
        tokens.append(int(output.logits[0, -1].argmax()))
    return tokens


def _preview(prompt: str, width: int = 24) -> str:
    text = repr(prompt)
    return text if len(text) <= width else text[: width - 4] + "...'"
