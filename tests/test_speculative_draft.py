"""The ``draft`` speculator: a model of the target's vocabulary proposes greedily from its own paged KV cache.

Greedy output is identical with speculation off, with a tiny random draft of another size, and with a self-draft
(the target as its own draft, whose greedy proposals the target must accept every time); in mixed batches with n=2
and stop strings too; the draft's blocks come back to the pool when the requests are done. Sampling with a draft
keeps the plain sampler's distribution (a chi-square test against Hugging Face's probabilities).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import make_tiny_model, target_and_small_draft
from test_speculative import ENGINE, GREEDY, repetitive_prompts, spec_counts, token_ids
from weft import LLM, SamplingParams
from weft.config import ConfigError
from weft.contracts.speculator import Proposals, ProposalStep, SpeculationRequest, Speculator


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_files):
    return target_and_small_draft(tmp_path_factory.mktemp("draft"), tokenizer_files)


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(model=str(models[0]), engine=ENGINE)
    yield llm
    llm.close()


def speculating(target, draft, k=3):
    return LLM(
        model=str(target),
        engine={**ENGINE, "speculative": {"method": "draft", "model": str(draft), "num_speculative_tokens": k}},
    )


@pytest.fixture(scope="module")
def self_draft(models):
    llm = speculating(models[0], models[0], k=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def small_draft(models):
    llm = speculating(models[0], models[1])
    yield llm
    llm.close()


def free_blocks(llm):
    return [pool.num_free for pool in llm.engine.core.scheduler.kv_cache.pools]


def test_self_draft_is_identical_and_accepts_every_greedy_proposal(plain, self_draft):
    prompts = repetitive_prompts(count=6)
    expected = token_ids(plain.generate(prompts, GREEDY))
    got = token_ids(self_draft.generate(prompts, GREEDY))
    assert got == expected
    drafted, accepted = spec_counts(self_draft)
    assert drafted > 0 and accepted == drafted


def test_a_smaller_random_draft_leaves_greedy_output_unchanged(plain, small_draft):
    prompts = repetitive_prompts(count=6, seed=11)
    expected = token_ids(plain.generate(prompts, GREEDY))
    got = token_ids(small_draft.generate(prompts, GREEDY))
    assert got == expected
    drafted, _ = spec_counts(small_draft)
    assert drafted > 0


def test_mixed_batch_with_n_2_and_stop_strings(plain, self_draft):
    prompts = repetitive_prompts(count=4, seed=21)
    params = [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    expected = plain.generate(prompts, params)
    got = self_draft.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    text = expected[1].outputs[0].text
    if len(text) > 6:
        stop = text[3:6]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        assert (
            self_draft.generate([prompts[1]], params)[0].outputs[0].text
            == plain.generate([prompts[1]], params)[0].outputs[0].text
        )


def test_the_draft_blocks_come_back(small_draft):
    before = free_blocks(small_draft)
    assert len(before) == 2  # the target's group, then the draft's
    small_draft.generate(repetitive_prompts(count=12, seed=31), SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    assert free_blocks(small_draft) == before


def test_draft_without_a_model_is_refused(models):
    with pytest.raises(ConfigError, match="engine.speculative.model"):
        LLM(model=str(models[0]), engine={**ENGINE, "speculative": {"method": "draft"}})


def _top_p_probs(logits, top_p):
    """Temperature-1 probabilities with top-p applied as vLLM does: the smallest most-likely set whose mass
    reaches ``top_p`` (the token that crosses it included)."""
    probs = torch.softmax(logits.double(), dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    ordered = torch.where(before < top_p, ordered, torch.zeros_like(ordered))
    kept = torch.zeros_like(probs).scatter(-1, order, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def peaked(models, tmp_path_factory):
    """The target with its LM head scaled by 2.3: at temperature 1 and top-p 0.9 a dozen tokens or so hold the mass,
    so (first, second) pairs are frequent enough for a chi-square test to see a wrong rule."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("peaked") / "model"
    shutil.copytree(models[0], folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2.3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_sampled_distribution_matches_the_plain_sampler_chi_square(peaked):
    """Seeded first and second tokens at temperature 1 with top-p, sampled with speculation (the second token of each
    request is verified against the draft's greedy proposal, accepted with its probability), against the distribution
    Hugging Face's forward of the same weights gives: a chi-square goodness-of-fit test over the (first, second)
    pairs."""
    llm = speculating(peaked, peaked, k=2)
    try:
        _assert_distribution_is_the_targets(peaked, llm)
    finally:
        llm.close()


class SampledSpeculator(Speculator):
    """Proposes tokens drawn from a fixed distribution ``q`` over the vocabulary, and returns it: the verification
    must then use the general rule (keep with min(1, p/q), else draw from (p - q)+)."""

    name = "sampled"
    q: torch.Tensor | None = None
    """Set by the test (see there)."""

    def __init__(self, options, config) -> None:  # noqa: ANN001 - the contract's
        super().__init__(options, config)
        assert self.q is not None and self.q.shape == (config.vocab_size,)
        self.lengths: dict[str, int] = {}

    def add_request(self, request: SpeculationRequest) -> None:
        self.lengths[request.request_id] = len(request.prompt_token_ids) + len(request.output_token_ids)

    def on_verified(self, results) -> None:  # noqa: ANN001 - the contract's
        for result in results:
            if result.request_id in self.lengths:
                self.lengths[result.request_id] += len(result.token_ids)

    def remove_request(self, request_id: str) -> None:
        self.lengths.pop(request_id, None)

    def propose(self, step: ProposalStep) -> Proposals:
        proposals = []
        for request_id, most in zip(step.request_ids, step.max_tokens, strict=True):
            if most <= 0:
                proposals.append([])
                continue
            seed = zlib.crc32(f"{request_id}:{self.lengths.get(request_id, 0)}".encode())
            drawn = torch.multinomial(self.q, most, replacement=True, generator=torch.Generator().manual_seed(seed))
            proposals.append(drawn.tolist())
        count = sum(len(tokens) for tokens in proposals)
        return Proposals(proposals, probs=self.q.expand(count, -1).clone())


def test_drawn_proposals_keep_the_distribution_chi_square(peaked):
    """A speculator that samples its proposals and returns their distribution: the general rejection rule keeps the
    target's distribution (the same chi-square test)."""
    from weft.plugins import PluginRegistry
    from weft.plugins.discovery import PluginEntry, discover

    entry = PluginEntry(
        slot="speculator",
        name="sampled",
        target=f"{__name__}:SampledSpeculator",
        distribution="weft-tests",
        version="0",
        core_api="",
        builtin=False,
    )
    reference = _reference(peaked)
    _, first, candidates, second = reference
    # Uniform over the four likeliest second tokens: proposals of tokens more likely than 1/4 are kept, the others
    # often rejected, and a rejection's residual (p - q)+ is far from p (drawing from p there fails the test).
    marginal = (first[candidates].unsqueeze(1) * second).sum(dim=0)
    q = torch.zeros(second.shape[-1])
    q[marginal.topk(4).indices] = 0.25
    SampledSpeculator.q = q
    llm = LLM(
        model=str(peaked),
        registry=PluginRegistry([*discover(), entry]),
        engine={**ENGINE, "speculative": {"method": "sampled", "num_speculative_tokens": 2}},
    )
    try:
        _assert_distribution_is_the_targets(peaked, llm, reference)
    finally:
        llm.close()


TOP_P = 0.9


def _reference(model):
    """The test prompt, Hugging Face's first-token probabilities under top-p, the first tokens it keeps, and the
    second-token probabilities after each of them."""
    from transformers import AutoModelForCausalLM

    prompt = repetitive_prompts(1, seed=13)[0]
    reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        first = _top_p_probs(reference(torch.tensor([prompt])).logits[0, -1], TOP_P)
        candidates = first.nonzero().flatten()
        batch = torch.tensor([[*prompt, int(token)] for token in candidates])
        second = _top_p_probs(reference(batch).logits[:, -1], TOP_P)
    return prompt, first, candidates, second


def _assert_distribution_is_the_targets(model, llm, reference=None, samples=800):
    top_p = TOP_P
    prompt, first, candidates, second = reference or _reference(model)
    expected = {
        (int(a), int(b)): samples * float(first[a] * second[row, b])
        for row, a in enumerate(candidates)
        for b in second[row].nonzero().flatten()
    }
    drafted, accepted = spec_counts(llm)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=seed, max_tokens=3) for seed in range(samples)]
    outputs = llm.generate([prompt] * samples, params)
    drafted, accepted = spec_counts(llm)[0] - drafted, spec_counts(llm)[1] - accepted
    assert 0 < accepted < drafted  # proposals were verified, and both accepted and rejected
    observed: dict[tuple[int, int], int] = {}
    for output in outputs:
        pair = tuple(output.outputs[0].token_ids[:2])
        observed[pair] = observed.get(pair, 0) + 1
    impossible = {pair: count for pair, count in observed.items() if pair not in expected}
    assert not impossible, f"pairs outside top-p's support were sampled: {impossible}"
    # Bins: each pair expected at least 5 times; then, per first token, its other pairs together; then the rest.
    bins, small = [], {}
    for pair, mass in expected.items():
        if mass >= 5:
            bins.append((observed.get(pair, 0), mass))
        else:
            count, total = small.get(pair[0], (0, 0.0))
            small[pair[0]] = (count + observed.get(pair, 0), total + mass)
    rest = [0, 0.0]
    for count, mass in small.values():
        if mass >= 5:
            bins.append((count, mass))
        else:
            rest[0], rest[1] = rest[0] + count, rest[1] + mass
    if rest[1] >= 5:
        bins.append(tuple(rest))
    elif bins:  # too little left for a bin of its own: into the smallest one
        count, mass = bins.pop(min(range(len(bins)), key=lambda index: bins[index][1]))
        bins.append((count + rest[0], mass + rest[1]))
    assert len(bins) >= 5, "the distribution is too peaked for the test to say anything"
    statistic = sum((count - mass) ** 2 / mass for count, mass in bins)
    degrees = len(bins) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(degrees / 2), torch.tensor(statistic / 2)))
    assert p_value > 1e-3, f"chi-square {statistic:.1f} over {degrees} degrees of freedom: p = {p_value:.2e}"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_qwen3_greedy_is_identical(tmp_path_factory, tokenizer_files, method):
    root = tmp_path_factory.mktemp("qwen3")
    target = make_tiny_model(root / "target", "qwen3", tokenizer_files, vocab_size=512)
    draft = make_tiny_model(root / "draft", "qwen3", tokenizer_files, seed=4, vocab_size=512, num_hidden_layers=1)
    speculative = {"method": method, "num_speculative_tokens": 3}
    speculative.update({"model": str(draft)} if method == "draft" else {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompts = repetitive_prompts(count=4, seed=41)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for engine in (ENGINE, {**ENGINE, "speculative": speculative}):
        llm = LLM(model=str(target), engine=engine)
        try:
            results.append(token_ids(llm.generate(prompts, params)))
            counts = spec_counts(llm)
        finally:
            llm.close()
    assert results[1] == results[0]
    assert counts[0] > 0  # it did speculate


def test_two_tensor_ranks_speculate_as_one_device(models, plain):
    """The mp executor with TP=2 (gloo): both ranks' speculators propose the same tokens, rank 0's reach the
    scheduler, and greedy output equals one device's without speculation."""
    prompts = repetitive_prompts(count=4, seed=51)
    expected = token_ids(plain.generate(prompts, GREEDY))
    engine = {
        **ENGINE,
        "tensor_parallel_size": 2,
        "speculative": {"method": "draft", "model": str(models[0]), "num_speculative_tokens": 3},
    }
    llm = LLM(model=str(models[0]), engine=engine)
    try:
        assert llm.engine.core.executor.name == "mp"
        assert token_ids(llm.generate(prompts, GREEDY)) == expected
        drafted, accepted = spec_counts(llm)
    finally:
        llm.close()
    assert drafted > 0 and accepted == drafted  # the self-draft's proposals are the target's greedy tokens
