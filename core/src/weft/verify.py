"""``weft verify``: a model family against its Hugging Face transformers reference, on the same weights.

Two implementations over the same prompts, as token ids from Weft's tokenizer:

1. The reference (:mod:`weft.verify_reference`): the transformers class the family names
   (:meth:`ModelFamily.hf_architecture`) on the same checkpoint (a folder of config.json and
   ``*.safetensors``, or a GGUF file, which transformers dequantizes in memory as Weft's gguf loader
   does), in the same dtype, eager attention, run inside the family's
   :meth:`ModelFamily.hf_reference_context`. It generates greedily with its own KV cache, then gives
   its logits at every position of the prompt and its continuation from one full forward.
2. Weft's engine, through the public API, in one ``LLM.generate`` call: every prompt greedy,
   ``max_tokens`` new tokens with the top two log-probabilities of each; and beside them every
   prompt followed by the reference's continuation, with its prompt log-probabilities
   (teacher forcing). The step budget is half the longest prompt, so prompts are prefilled in
   chunks batched with other requests' decodes; the teacher-forced log-probabilities come from
   the same engine, kernels, attention backend, batching and chunked prefill as the greedy tokens.

The engine reports log-probabilities, not logits: at each position the next token's and its top
:data:`~weft.sampling_params.MAX_LOGPROBS`. The *teacher-forced error* of a position is the
largest difference between Weft's log-probability of one of those tokens and the reference's
(log-softmax of its logits), divided by the reference's logit scale there,
``max(1, max |logit|)``. Two tokens' log-probability gap is their logit gap, so a gap between any
two of those tokens moves by at most twice this error (times the scale) from one side to the other.

A prompt *matches* when Weft's tokens equal the reference's. Otherwise its first divergence is a
*near-tie* when Weft's second choice is the reference's token and both gaps, Weft's top-1/top-2 and
the reference's margin of its token over Weft's, are within :func:`near_tie_bound` times the
position's logit scale::

    bound = max(TIE_ULPS x eps(dtype), TIE_SAFETY x noise)

``noise`` is what rounding is measured to move this model's logits in this run
(:func:`rounding_noise`): the larger of ``R``, the reference's own rounding noise (its cached-decode
logits against its full forward at the same positions: the same math summed in another order, and
the reference chooses its tokens by the one and is scored by the other), and the run's largest
teacher-forced error, which counts only up to ``NOISE_FACTOR x max(R, eps)``: an error beyond that
is a defect, not rounding, and excuses no divergence.
The continuations differ after a divergence, so nothing after it is compared. Any other divergence
is a failure.

transformers is optional; it is imported when a verification starts.
"""

from __future__ import annotations

import gc
import json
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from weft import verify_reference
from weft.config import EngineConfig, WeftConfig
from weft.contracts.loader import ModelSource
from weft.outputs import CompletionOutput, Logprob, RequestOutput
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.plugins.selection import select_platform
from weft.resolve import missing_path
from weft.sampling_params import MAX_LOGPROBS
from weft.verify_reference import logit_scale

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

TIE_ULPS = 2
"""The near-tie bound's floor, in machine epsilons of the dtype (relative to the logit scale): the dtype's
resolution, since each side's logits are rounded to it (float32 2.4e-7, bfloat16 1.6e-2)."""
TIE_SAFETY = 4
"""The near-tie bound over the measured noise: a gap moves by up to twice the largest log-probability
error, and the greedy requests ran in other batches than the teacher-forced ones."""
NOISE_FACTOR = 16
"""How far Weft's teacher-forced error may exceed the reference's own rounding noise (or one eps, when that
is smaller) and still count as rounding. Measured: SmolLM2-135M in float32, 1.3e-6 against the reference's
2.8e-6; the tiny test checkpoints in bfloat16, up to 1.7e-2 (2.2 eps); a rope base ten times too large,
0.2 to 0.7 in either dtype."""


def rounding_noise(teacher_forced_error: float, reference_noise: float, dtype: str) -> float:
    """What rounding moves the logits by in this run (relative): the reference's own noise, or the
    teacher-forced error when that is larger but within :func:`noise_ceiling`."""
    if teacher_forced_error <= noise_ceiling(reference_noise, dtype):
        return max(reference_noise, teacher_forced_error)
    return reference_noise


def noise_ceiling(reference_noise: float, dtype: str) -> float:
    """The largest teacher-forced error that counts as rounding: ``NOISE_FACTOR x max(reference_noise, eps)``."""
    return NOISE_FACTOR * max(reference_noise, torch.finfo(getattr(torch, dtype)).eps)


def near_tie_bound(dtype: str, noise: float) -> float:
    """The largest gap that is a near-tie, relative to the position's logit scale (the module docstring)."""
    return max(TIE_ULPS * torch.finfo(getattr(torch, dtype)).eps, TIE_SAFETY * noise)


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
    """:func:`near_tie_bound` times this position's logit scale."""
    tie: bool


class PromptResult(msgspec.Struct, frozen=True):
    prompt: str
    prompt_token_ids: list[int]
    weft_token_ids: list[int]
    reference_token_ids: list[int]
    divergence: Divergence | None
    teacher_forced_error: float
    """Largest teacher-forced error over every position of the prompt and the reference's continuation
    (the module docstring)."""
    reference_noise: float
    """Largest relative difference between the reference's cached-decode logits and its full forward's."""

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
    """The engine's ``max_num_batched_tokens``."""
    results: list[PromptResult]

    @property
    def passed(self) -> bool:
        """Whether every prompt matched or diverged only at a near-tie."""
        return all(result.status != "diverged" for result in self.results)

    @property
    def first_failure(self) -> tuple[int, PromptResult] | None:
        """The first prompt (index, result) that diverged beyond a near-tie."""
        return next(((i, r) for i, r in enumerate(self.results) if r.status == "diverged"), None)

    @property
    def teacher_forced_error(self) -> float:
        return max(result.teacher_forced_error for result in self.results)

    @property
    def reference_noise(self) -> float:
        return max(result.reference_noise for result in self.results)

    @property
    def noise(self) -> float:
        """:func:`rounding_noise` of this run, which the near-tie bound scales with."""
        return rounding_noise(self.teacher_forced_error, self.reference_noise, self.dtype)

    def table(self) -> str:
        lines = [
            f"model        {self.model}",
            f"family       {self.architecture} ({self.family})",
            f"reference    {self.reference}",
            f"run          {self.dtype}, {len(self.results)} prompts and their teacher-forced twins in one batch, "
            f"{self.max_tokens} greedy tokens each, chunked prefill with a {self.step_budget}-token step budget",
            "",
        ]
        header = (
            "PROMPT",
            "TOKENS",
            "GREEDY (SAME TOKENS)",
            "FIRST DIVERGENCE (STEP: WEFT vs REFERENCE)",
            "GAP WEFT",
            "GAP REF",
            "TIE BOUND",
            "TF ERROR",
        )
        rows = []
        for index, result in enumerate(self.results):
            divergence = result.divergence
            if divergence is None:
                where, weft_gap, reference_gap, threshold = "-", "-", "-", "-"
            else:
                where = (
                    f"{divergence.step}: {divergence.weft_token} {divergence.weft_text!r} vs "
                    f"{divergence.reference_token} {divergence.reference_text!r}"
                )
                weft_gap, reference_gap = f"{divergence.weft_gap:.3g}", f"{divergence.reference_gap:.3g}"
                threshold = f"{divergence.threshold:.3g}"
            matched = self.max_tokens if divergence is None else divergence.step
            status = f"{result.status} {matched}/{self.max_tokens}"
            rows.append(
                (
                    f"{index} {_preview(result.prompt)}",
                    str(len(result.prompt_token_ids)),
                    status,
                    where,
                    weft_gap,
                    reference_gap,
                    threshold,
                    f"{result.teacher_forced_error:.2e}",
                )
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())
        counts = {status: sum(r.status == status for r in self.results) for status in ("match", "tie", "diverged")}
        error, reference_noise = self.teacher_forced_error, self.reference_noise
        ceiling = noise_ceiling(reference_noise, self.dtype)
        counted = "within it" if error <= ceiling else "beyond it (a defect, not rounding)"
        lines += [
            "",
            f"{counts['match']}/{len(self.results)} prompts matched, {counts['tie']} diverged at a near-tie, "
            f"{counts['diverged']} diverged; max teacher-forced error {error:.2e}",
            "TF ERROR   teacher forcing through Weft's engine (each prompt and the reference's continuation, in the "
            "batch",
            "           above): the worst position's largest |Weft log-prob - reference log-prob| over the next token "
            "and",
            f"           Weft's top {MAX_LOGPROBS}, over max(1, max |reference logit|)",
            "TIE BOUND  a divergence is a near-tie when Weft's runner-up is the reference's token and both gaps are "
            "at most",
            f"           max({TIE_ULPS} x eps({self.dtype}), {TIE_SAFETY} x noise) x max(1, max |logit|); noise: the "
            "larger of the reference's",
            f"           own rounding noise R (its cached decode vs its full forward) and the TF error, counted up to "
            f"{NOISE_FACTOR} x max(R, eps);",
            f"           here R {reference_noise:.2e}, ceiling {ceiling:.2e}, TF error {error:.2e} {counted}: "
            f"noise {self.noise:.2e}",
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
            f"prompt {index} ({_preview(result.prompt)}) diverged at step {d.step}: weft {d.weft_token} "
            f"{d.weft_text!r} vs reference {d.reference_token} {d.reference_text!r}; reference margin "
            f"{d.reference_gap:.3g}, weft top-1/top-2 gap {d.weft_gap:.3g}, near-tie bound {d.threshold:.3g} "
            f"({self.dtype})"
        )
        if d.reference_gap < 0:
            message += (
                "; the reference's own full forward prefers Weft's token here, so its cached decode and its prefill "
                "disagree: if the reference makes a choice the model leaves open (a tie order), the family's "
                "hf_reference_context can fix it"
            )
        return message


def read_prompts(path: str | Path) -> tuple[str, ...]:
    """The prompts of a ``--prompts`` file: one per line, or JSON Lines (a ``.jsonl`` name, or a first line
    that is a JSON string or object), each line a JSON string or ``{"prompt": "..."}`` (for prompts of
    several lines). Blank lines are skipped."""
    path = Path(path)
    try:
        lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    except OSError as error:
        raise ValueError(f"--prompts {path}: {error.strerror}") from None
    if not lines:
        raise ValueError(f"--prompts {path}: the file holds no prompt; write one per line, or one JSON string per line")
    if path.suffix != ".jsonl" and not isinstance(_json_or_none(lines[0][1]), str | dict):
        return tuple(line for _, line in lines)
    prompts = []
    for number, line in lines:
        item = _json_or_none(line)
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str) or not item:
            raise ValueError(
                f"{path}:{number}: expected a JSON string or an object with a 'prompt' string (JSON Lines, as the "
                f"file's name or first line says), got {line[:60]!r}"
            )
        prompts.append(item)
    return tuple(prompts)


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def verify(
    model: str,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    dtype: str = "float32",
    max_tokens: int = 16,
    reference: str = "hf",
    registry: PluginRegistry | None = None,
) -> VerifyReport:
    """Compare the installed family of ``model`` (a checkpoint folder, a GGUF file or alias, or a cached HF
    repo id) with its reference.

    Raises ValueError naming the problem when the model, a prompt or an option cannot be verified.
    """
    _check_options(prompts, dtype, max_tokens, reference)
    verify_plugin_lock(WeftConfig())  # WEFT_PLUGINS_LOCK: refuse a different plugin set before importing any
    transformers = verify_reference.import_transformers()
    registry = registry or PluginRegistry()
    source = resolve_checkpoint(model, registry)
    architecture = (source.hf_config.get("architectures") or [None])[0]
    if architecture is None:
        raise ValueError(f"model {model!r}: its config.json names no 'architectures'; cannot choose a model family")
    family = registry.load("model", architecture)()
    reference_class = verify_reference.reference_class(transformers, family, architecture)
    platform_class, _ = select_platform(registry)

    tokenizer = registry.load("tokenizer", source.tokenizer).from_source(source)
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    empty = [prompt for prompt, ids in zip(prompts, encoded, strict=False) if not ids]
    if empty:
        raise ValueError(f"prompt {empty[0]!r} encodes to no tokens; give prompts with text")
    runs = verify_reference.reference_runs(
        reference_class, family, source, dtype, platform_class().device(), encoded, max_tokens
    )
    step_budget = max(2 * len(prompts), (max(len(ids) for ids in encoded) + 1) // 2)
    greedy, forced = _engine_runs(
        model, registry, dtype, step_budget, encoded, [run.tokens for run in runs], max_tokens
    )

    errors = [
        teacher_forced_errors(output.prompt_logprobs or [None], run.logits)
        for output, run in zip(forced, runs, strict=False)
    ]
    noise = rounding_noise(max(float(e.max()) for e in errors), max(run.noise for run in runs), dtype)
    bound = near_tie_bound(dtype, noise)
    results = []
    for prompt, ids, output, run, error in zip(prompts, encoded, greedy, runs, errors, strict=False):
        divergence = first_divergence(
            output.token_ids,
            output.logprobs or [],
            run.tokens,
            run.logits,
            len(ids),
            bound,
            lambda ids: tokenizer.decode(ids, False),
        )
        results.append(
            PromptResult(
                prompt=prompt,
                prompt_token_ids=ids,
                weft_token_ids=list(output.token_ids),
                reference_token_ids=run.tokens,
                divergence=divergence,
                teacher_forced_error=float(error.max()),
                reference_noise=run.noise,
            )
        )
    entry = registry.find("model", architecture)
    return VerifyReport(
        model=model,
        architecture=architecture,
        family=entry.target,
        reference=f"transformers {transformers.__version__} {reference_class.__name__}",
        dtype=dtype,
        max_tokens=max_tokens,
        step_budget=step_budget,
        results=results,
    )


def _check_options(prompts: Sequence[str], dtype: str, max_tokens: int, reference: str) -> None:
    """Raise ValueError naming the option of :func:`verify` that cannot be verified."""
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r} is not supported; choose one of {', '.join(REFERENCES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: must be >= 1")
    if not prompts:
        raise ValueError("no prompts to verify; give at least one")


def resolve_checkpoint(model: str, registry: PluginRegistry) -> ModelSource:
    """The source of ``model``, refused unless transformers can load the same weights from it."""
    loaders = sorted(registry.load_all("loader").items(), key=lambda item: -item[1].priority)
    for name, loader_class in loaders:  # noqa: B007 - the error below names the loader that accepted it
        loader = loader_class()
        if loader.accepts(model):
            source = loader.resolve(model)
            break
    else:
        missing = missing_path(model)
        if missing is not None:
            raise ValueError(f"model {model!r}: {missing}")
        raise ValueError(
            f"model {model!r}: no installed loader accepts it; weft verify needs a folder with config.json "
            f"and *.safetensors, a GGUF file (or a Hugging Face repo id in the local cache)"
        )
    if source.format == "gguf" or (source.format == "safetensors" and (Path(source.path) / "config.json").is_file()):
        return source
    raise ValueError(
        f"model {model!r} is a {source.format} source (loader {name!r}, {source.path}): weft verify compares against "
        f"Hugging Face transformers loading the same weights, which reads a folder with config.json and "
        f"*.safetensors, or a GGUF file; convert the model to one of those and verify that"
    )


def teacher_forced_errors(
    prompt_logprobs: Sequence[dict[int, Logprob] | None], reference_logits: torch.Tensor
) -> torch.Tensor:
    """The teacher-forced error (module docstring) at each row of ``reference_logits``.

    ``prompt_logprobs`` is Weft's for the prompt and the reference's continuation: entry ``i`` (None
    for the first token) scores token ``i`` from the logits at position ``i - 1``.
    """
    entries = prompt_logprobs[1:]
    if len(entries) != len(reference_logits) or None in entries:
        raise ValueError(
            f"the engine scored {sum(entry is not None for entry in entries)} of the {len(reference_logits)} "
            f"teacher-forced positions (prompt_logprobs); weft verify needs every one"
        )
    reference = torch.log_softmax(reference_logits, dim=-1)
    errors = []
    for row, entry in zip(reference, entries, strict=False):
        assert entry is not None
        weft = torch.tensor([logprob.logprob for logprob in entry.values()])
        errors.append((weft - row[list(entry)]).abs().max())
    return torch.stack(errors) / logit_scale(reference_logits)


def first_divergence(
    weft_tokens: Sequence[int],
    weft_logprobs: Sequence[dict[int, Logprob]],
    reference_tokens: Sequence[int],
    reference_logits: torch.Tensor,
    prompt_length: int,
    bound: float,
    decode: Callable[[list[int]], str],
) -> Divergence | None:
    """Where Weft's greedy tokens first leave the reference's, and whether that is a near-tie.

    ``weft_logprobs`` holds Weft's top-2 log-probabilities per generated token (``logprobs=2``);
    ``reference_logits`` the reference's logits at every position of the prompt and its
    continuation, so a generated token's row is ``prompt_length - 1 + step``; ``bound`` is
    :func:`near_tie_bound`, relative to a row's :func:`logit_scale`.
    """
    step = next(
        (i for i, (ours, theirs) in enumerate(zip(weft_tokens, reference_tokens, strict=False)) if ours != theirs), None
    )
    if step is None:
        return None
    weft_token, reference_token = weft_tokens[step], reference_tokens[step]
    ranked = sorted(weft_logprobs[step].items(), key=lambda item: item[1].rank)
    (_, first), (second_token, second) = ranked[0], ranked[1]
    weft_gap = first.logprob - second.logprob
    row = reference_logits[prompt_length - 1 + step]
    reference_gap = float(row[reference_token] - row[weft_token])
    threshold = bound * float(logit_scale(row))
    tie = second_token == reference_token and weft_gap <= threshold and reference_gap <= threshold
    return Divergence(
        step=step,
        weft_token=weft_token,
        reference_token=reference_token,
        weft_text=decode([weft_token]),
        reference_text=decode([reference_token]),
        weft_gap=weft_gap,
        reference_gap=reference_gap,
        threshold=threshold,
        tie=tie,
    )


def _engine_runs(
    model: str,
    registry: PluginRegistry,
    dtype: str,
    step_budget: int,
    prompts: list[list[int]],
    continuations: list[list[int]],
    max_tokens: int,
) -> tuple[list[CompletionOutput], list[RequestOutput]]:
    """Weft's greedy completions with their top-2 log-probabilities, and each prompt followed by its
    continuation with its prompt log-probabilities: all in one ``generate`` call."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    # The reference applies no penalty, whatever the model's generation_config suggests.
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, repetition_penalty=1.0)
    forced = msgspec.structs.replace(greedy, max_tokens=1, logprobs=None, prompt_logprobs=MAX_LOGPROBS)
    requests = [*prompts, *(prompt + tokens for prompt, tokens in zip(prompts, continuations, strict=False))]
    max_model_len = max(len(ids) for ids in requests) + 1
    block_size = EngineConfig().block_size
    engine = {
        "dtype": dtype,
        # The reference multiplies dense weights in dtype, and so does Weft here: a quantization method's own
        # error is its conformance suite's and its documented band's (docs/quantization.md), not the family's.
        "quantization": "none",
        "max_num_batched_tokens": step_budget,
        "max_num_seqs": len(requests),
        "max_model_len": max_model_len,
        # Room for every request at once (each group's blocks cover at least block_size tokens),
        # instead of the engine's default share of the device's memory.
        "num_kv_blocks": len(requests) * -(-max_model_len // block_size),
    }
    with LLM(model=model, registry=registry, engine=engine) as llm:
        outputs = llm.generate(requests, [greedy] * len(prompts) + [forced] * len(prompts))
    del llm
    gc.collect()
    return [output.outputs[0] for output in outputs[: len(prompts)]], outputs[len(prompts) :]


def _preview(prompt: str, width: int = 24) -> str:
    text = repr(prompt)
    return text if len(text) <= width else text[: width - 4] + "...'"
