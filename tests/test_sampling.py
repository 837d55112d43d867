"""The batched sampler against plain per-row references: filters, edits, logprobs, the distribution of its
draws, seeded reproducibility whatever the batch, health per row, and no reads back from the device."""

from __future__ import annotations

import contextlib
import math

import msgspec
import pytest
import torch

from weft import SamplingParams
from weft.runner.penalties import TokenCounts, needs_penalties
from weft.runner.sampler import (
    NO_TOKEN_ALLOWED,
    NON_FINITE_LOGITS,
    RowParams,
    Sampler,
    edited_logits,
    filter_logits,
)


class Row:
    """The sampler's view of one request (what the runner's RequestState offers it)."""

    def __init__(
        self, params: SamplingParams, output: tuple[int, ...] = (), prompt: tuple[int, ...] = (1, 2, 3)
    ) -> None:
        self.request_id = f"r{id(self)}"
        self.params = params
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.eos_token_ids = frozenset({0})
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)


def reference_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row, in float64, as the sampling parameters document them."""
    logits = logits.double() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = sorted(logits.tolist(), reverse=True)[params.top_k - 1]
        logits = torch.where(logits >= kth, logits, -math.inf)
    if params.top_p < 1:
        probs = logits.softmax(-1).tolist()
        order = sorted(range(vocab), key=lambda token: -probs[token])
        cumulative = 0.0
        for position, token in enumerate(order):
            if position and cumulative >= params.top_p:
                logits[token] = -math.inf
            cumulative += probs[token]
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = torch.where(probs >= params.min_p * probs.max(), logits, -math.inf)
    return logits


def random_params(generator: torch.Generator, vocab: int) -> SamplingParams:
    def pick(*choices):
        return choices[int(torch.randint(len(choices), (), generator=generator))]

    uniform = float(torch.rand((), generator=generator))
    return SamplingParams(
        temperature=pick(1e-5, 0.3, 1.0, 2.0, 0.05 + 3 * uniform),
        top_k=pick(0, -1, 1, 7, vocab - 1, vocab, vocab + 5),
        top_p=pick(1.0, 0.5, 0.9, 0.05 + 0.9 * uniform),
        min_p=pick(0.0, 0.05, 0.3, 0.2 * uniform),
    )


def test_the_batched_filter_keeps_what_a_per_row_reference_keeps():
    generator = torch.Generator().manual_seed(0)
    vocab = 97
    for _ in range(10):
        params = [random_params(generator, vocab) for _ in range(16)]
        logits = torch.randn(16, vocab, generator=generator) * 4
        ours = filter_logits(logits, RowParams(params, vocab, logits.device))
        for row, row_params in enumerate(params):
            expected = reference_filter(logits[row], row_params)
            assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(expected)), row_params
            torch.testing.assert_close(ours[row].softmax(-1).double(), expected.softmax(-1), atol=1e-6, rtol=1e-4)
            assert torch.isfinite(ours[row]).any()


def test_tiny_temperatures_and_huge_logits_stay_finite():
    logits = torch.tensor([[3e38, -3e38, 1.0, 2.9e38], [-1e30, 5.0, -1e30, 4.99999]])
    params = [SamplingParams(temperature=1e-5), SamplingParams(temperature=1e-5, top_p=0.5, min_p=0.1)]
    filtered = filter_logits(logits, RowParams(params, 4, logits.device))
    assert not filtered.isnan().any() and not (filtered == math.inf).any()
    probs = filtered.softmax(-1)
    assert probs[0].argmax() == 0 and probs[1].argmax() == 1 and torch.isfinite(probs).all()
    tokens = Sampler()(logits, [Row(p) for p in params])
    assert [token.token_id for token in tokens] == [0, 1]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05),
    ],
)
def test_draws_follow_the_filtered_softmax(params):
    """20,000 draws over 8 tokens against softmax(filtered logits / T): the chi-square statistic (at most 7
    degrees of freedom) stays under 30, which a true sampler exceeds with probability below 1e-4; the seed
    is fixed, so the outcome is too."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    expected = reference_filter(logits, params).softmax(-1)
    sampler = Sampler(seed=1)
    counts = torch.zeros(8, dtype=torch.float64)
    for _ in range(5):
        tokens = sampler(logits.expand(4000, 8), [Row(params)] * 4000)
        counts += torch.bincount(torch.tensor([token.token_id for token in tokens]), minlength=8)
    assert counts[expected == 0].sum() == 0  # never a removed token
    assert chi_square(counts, expected) < 30, (counts / counts.sum(), expected)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch():
    generator = torch.Generator().manual_seed(3)
    steps = [torch.randn(6, 50, generator=generator) * 2 for _ in range(12)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def draws(seed: int, company: list[SamplingParams] | None, engine_seed: int) -> list[int]:
        sampler, row = Sampler(engine_seed), Row(msgspec.structs.replace(seeded, seed=seed))
        others = [Row(params) for params in company or []]
        tokens = []
        for logits in steps:
            batch = [*others[:2], row, *others[2:]]
            sampled = sampler(logits[: len(batch)] if company else logits[2:3], batch)
            tokens.append(sampled[2 if company else 0].token_id)
        return tokens

    company = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=3, logprobs=2),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=5),
    ]
    alone = draws(1234, None, 0)
    assert draws(1234, company, 7) == alone
    assert draws(1234, company[1:], 0) == alone
    assert draws(99, None, 0) != alone


def test_unseeded_draws_depend_only_on_the_engine_seed():
    """Tensor-parallel ranks each hold a sampler made from the engine's seed and sample the same logits."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(8)]
    first, second, other = Sampler(11), Sampler(11), Sampler(12)
    for _ in range(3):
        assert [t.token_id for t in first(logits, rows)] == [t.token_id for t in second(logits, rows)]
    assert [t.token_id for t in first(logits, rows)] != [t.token_id for t in other(logits, rows)]


def reference_edits(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row's allowed tokens, bad words, logit bias, penalties and min_tokens ban, written out token by token."""
    logits = logits.clone().double()
    params, output = row.params, row.output_token_ids
    vocab = logits.shape[-1]
    if params.allowed_token_ids is not None:
        for token in range(vocab):
            if token not in params.allowed_token_ids:
                logits[token] = -math.inf
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or output[-len(prefix) :] == prefix:
            logits[word[-1]] = -math.inf
    for token, value in (params.logit_bias or {}).items():
        if token < vocab:
            logits[token] += value
    if params.repetition_penalty != 1:
        for token in set(row.prompt_token_ids) | set(output):
            value = float(logits[token])
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in row.eos_token_ids | set(params.stop_token_ids):
            logits[token] = -math.inf
    return logits


def edit_rows() -> list[Row]:
    return [
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(repetition_penalty=1.7), output=(4, 9, 9), prompt=(1, 4, 30)),
        Row(SamplingParams(temperature=1.0)),
        Row(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.75), output=(3, 3, 3, 8)),
        Row(SamplingParams(min_tokens=3, stop_token_ids=(5, 7)), output=(2,)),
        Row(SamplingParams(min_tokens=1, stop_token_ids=(5,)), output=(2,)),  # the ban is over
        Row(SamplingParams(logit_bias={3: 5.0, 11: -100.0, 500: 1.0})),
        Row(SamplingParams(allowed_token_ids=(2, 6, 31, 400), logit_bias={6: 2.0})),
        Row(SamplingParams(bad_words_token_ids=((8,), (4, 12), (9, 9, 13), (1, 14))), output=(3, 4, 9, 9)),
        Row(
            SamplingParams(
                temperature=0.5,
                repetition_penalty=0.8,
                presence_penalty=1.0,
                min_tokens=2,
                logit_bias={0: 3.0},
                bad_words_token_ids=((5, 6),),
            ),
            output=(5,),
        ),
    ]


def test_edits_match_a_per_row_reference_and_leave_the_raw_logits_alone():
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(4)) * 3
    rows = edit_rows()
    raw = logits.clone()
    edited = edited_logits(logits, rows)
    assert torch.equal(logits, raw)
    for index, row in enumerate(rows):
        torch.testing.assert_close(edited[index].double(), reference_edits(logits[index], row), rtol=1e-6, atol=1e-5)
    # Only some rows edited: the others come back as they were.
    subset = [rows[0], rows[4], rows[2]]
    edited = edited_logits(logits[:3], subset)
    assert torch.equal(edited[0], logits[0]) and torch.equal(edited[2], logits[2])
    torch.testing.assert_close(edited[1].double(), reference_edits(logits[1], rows[4]))


def test_greedy_tokens_are_the_argmax_before_and_after_edits():
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(5)) * 3
    rows = edit_rows()
    greedy = [Row(SamplingParams(temperature=0, logprobs=None if index % 2 else 1)) for index in range(10)]
    assert [t.token_id for t in Sampler()(logits, greedy)] == logits.argmax(-1).tolist()
    plain = [Row(SamplingParams(temperature=0)) for _ in range(10)]
    assert [t.token_id for t in Sampler()(logits.bfloat16(), plain)] == logits.bfloat16().argmax(-1).tolist()
    sampled = Sampler()(logits, rows)
    for index, row in enumerate(rows):
        if row.params.greedy:
            assert sampled[index].token_id == int(reference_edits(logits[index], row).argmax())


def test_logprobs_are_the_raw_distributions():
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(6)) * 3
    rows = [
        Row(SamplingParams(**{**dict(temperature=0.9, top_k=4, logprobs=index % 4), **edit}), output=(4, 4))
        for index, edit in enumerate([{}, {"repetition_penalty": 2.0}, {"temperature": 0}, {"logit_bias": {1: 50.0}}])
    ]
    rows.append(Row(SamplingParams(temperature=1.0)))
    sampled = Sampler()(logits[:5], rows)
    reference = logits[:5].double().log_softmax(-1)
    for index, (row, token) in enumerate(zip(rows, sampled, strict=True)):
        if row.params.logprobs is None:
            assert token.logprob is None
            continue
        chosen = float(reference[index, token.token_id])
        assert token.logprob == pytest.approx(chosen, abs=1e-5)
        assert token.rank == 1 + int((reference[index] > chosen + 1e-9).sum())
        best = reference[index].topk(row.params.logprobs)
        assert [t for t, _ in token.top_logprobs] == best.indices.tolist()
        assert [v for _, v in token.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_a_non_finite_row_fails_alone_in_a_mixed_batch():
    logits = torch.randn(10, 32, generator=torch.Generator().manual_seed(7))
    rows = edit_rows()
    rows[5] = Row(SamplingParams(temperature=0.8, seed=3, logprobs=2))
    for poisoned in range(10):
        for poison in (math.nan, math.inf):
            bad = logits.clone()
            bad[poisoned, 13] = poison
            sampled = Sampler()(bad, rows)
            assert sampled[poisoned].error == NON_FINITE_LOGITS and sampled[poisoned].token_id == -1
            assert all(
                token.error is None and 0 <= token.token_id < 32
                for index, token in enumerate(sampled)
                if index != poisoned
            )


def test_a_row_whose_edits_leave_no_token_fails_alone():
    logits = torch.randn(3, 32)
    rows = [
        Row(SamplingParams(temperature=1.0)),
        Row(SamplingParams(allowed_token_ids=(40, 41))),
        Row(SamplingParams(temperature=0, logprobs=1)),
    ]
    sampled = Sampler()(logits, rows)
    assert sampled[1].error == NO_TOKEN_ALLOWED
    assert sampled[0].error is None and sampled[2].error is None and sampled[2].token_id == int(logits[2].argmax())


def test_sampling_reads_nothing_back_from_the_device(monkeypatch):
    """What runs on an accelerator must not wait for it: no tensor is read into Python while sampling."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sampler read a tensor back to the host")

    logits = torch.randn(10, 32)
    rows = edit_rows()
    rows[2] = Row(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, top_k=10, seed=8, logprobs=3))
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    batch = Sampler().sample(logits, rows)
    monkeypatch.undo()
    sampled = batch.to_host().sampled_tokens()
    assert all(token.error is None for token in sampled) and len(sampled[2].top_logprobs) == 3


@contextlib.contextmanager
def no_synchronizing_calls(device: str):
    """On CUDA, any call that waits for the device raises (``torch.cuda.set_sync_debug_mode("error")``)."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_penalties_read_counts_kept_on_the_device_across_steps(device):
    """Over several steps, penalized rows read token counts built once from their token ids and then counted
    on the device from each step's sampled tokens: the edits equal the per-row reference over the outputs so
    far, through a table that grows, a row freed and built again (a preemption) and rows without penalties.
    On CUDA every step (edits, sampling, counting, the copy to the host) runs where a synchronizing call
    raises: a penalized step never waits for the device."""
    rows = edit_rows()
    drawn = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2)
    rows.append(Row(drawn, output=(6, 6), prompt=(6, 7, 7)))
    counts, sampler = TokenCounts(torch.device(device)), Sampler(seed=1)
    generator = torch.Generator().manual_seed(8)
    for step in range(5):
        if step == 2:  # a penalized request joins with outputs: the table grows, the rows held keep their counts
            joining = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.2)
            rows.append(Row(joining, output=(9, 9, 2), prompt=(2, 3)))
        if step == 3:  # a preempted request comes back: its row is built again from its token ids
            counts.free(rows[1].request_id)
        logits = (torch.randn(len(rows), 32, generator=generator) * 3).to(device)
        with no_synchronizing_calls(device):
            edited = edited_logits(logits, rows, counts)
            batch = sampler.sample(logits, rows, counts)
            counts.record(rows, batch.tokens)
            host = batch.to_host()
        if device == "cuda":
            torch.cuda.synchronize()
        for index, row in enumerate(rows):
            torch.testing.assert_close(
                edited[index].cpu().double(), reference_edits(logits[index].cpu(), row), rtol=1e-6, atol=1e-5
            )
        sampled = host.sampled_tokens()
        assert all(token.error is None for token in sampled)
        for row, token in zip(rows, sampled, strict=True):
            row.output_token_ids.append(token.token_id)
    penalized = [row for row in rows if needs_penalties(row.params)]
    assert len(counts.rows) == len(penalized) == 5
    for row in penalized:
        expected = torch.bincount(torch.tensor(row.output_token_ids), minlength=32)
        assert torch.equal(counts.output[counts.rows[row.request_id]].cpu(), expected.int())
    for row in penalized:
        counts.free(row.request_id)
    assert counts.output.numel() == 0  # no penalized request left: the table is released
