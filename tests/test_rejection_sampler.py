"""The rejection sampler against plain decoding: greedy longest prefixes, the sampled distribution (chi-square
over first and second tokens with an adversarial draft), per-position edits equal to decoding one token at a
time with the plain sampler, seeded reproducibility and ragged batches."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from test_sampling import no_synchronizing_calls
from weft import SamplingParams
from weft.runner.penalties import TokenCounts
from weft.runner.rejection_sampler import RejectionSampler
from weft.runner.sampler import NON_FINITE_LOGITS, SAMPLING_FAILED, Sampler, draw_seed

VOCAB = 12


class Row:
    """The sampler's view of one request (what the runner's RequestState offers it)."""

    def __init__(
        self,
        params: SamplingParams,
        output: tuple[int, ...] = (),
        prompt: tuple[int, ...] = (1, 2, 3),
        device: str = "cpu",
    ) -> None:
        self.request_id = f"r{id(self)}"
        self.params = params
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.eos_token_ids = frozenset({0})
        self.generator = None if params.seed is None else torch.Generator(device=device)


def peaked(best: int, vocab: int = VOCAB) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[best] = 5.0
    return logits


def tokens_of(batch) -> list[list[int]]:
    return [[token.token_id for token in tokens] for tokens in batch.to_host().verified_tokens()]


def test_greedy_keeps_the_longest_matching_prefix_then_the_targets_token():
    greedy = SamplingParams(temperature=0)
    requests = [Row(greedy) for _ in range(5)]
    targets = [[4, 5, 6, 7], [4, 5, 6], [2], [8, 9, 10], [3, 3]]  # the target's argmax at each position
    proposals = [[4, 5, 1], [4, 5], [], [1, 9], [3]]
    logits = torch.stack([peaked(token) for row in targets for token in row])
    batch = RejectionSampler(Sampler()).verify(logits, requests, proposals, [3] * 5)
    assert tokens_of(batch) == [[4, 5, 6], [4, 5, 6], [2], [8], [3, 3]]
    assert batch.num_tokens.tolist() == [3, 3, 1, 1, 2]
    assert batch.last_tokens().tolist() == [6, 6, 2, 8, 3]


def test_greedy_rows_with_edits_and_logprobs_and_a_mixed_batch():
    greedy_logprobs = SamplingParams(temperature=0, logprobs=2, logit_bias={7: -100.0})
    sampled = SamplingParams(temperature=1.0, seed=3)
    requests = [Row(greedy_logprobs), Row(sampled)]
    # Row 0: the bias bans 7, so its target picks 5 at position 1 and rejects the proposal 7.
    first = torch.stack([peaked(4), peaked(7) + 0.5 * peaked(5), peaked(1)])
    second = torch.stack([peaked(2) * 4, peaked(9) * 4])
    batch = RejectionSampler(Sampler()).verify(torch.cat([first, second]), requests, [[4, 7], [2]], [3, 3])
    verified = batch.to_host().verified_tokens()
    assert [token.token_id for token in verified[0]] == [4, 5]
    raw = first.log_softmax(-1)
    assert [token.logprob for token in verified[0]] == pytest.approx([raw[0, 4].item(), raw[1, 5].item()])
    assert verified[0][1].rank == 2 and verified[0][1].top_logprobs[0][0] == 7  # raw logprobs: before the bias
    assert len(verified[1]) in (1, 2) and verified[1][0].logprob is None


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The target's distribution at temperature 1 with top-p, in float64 (the plain sampler's documented rule)."""
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    total = 0.0
    for token in order.tolist():
        if total >= top_p:
            break
        kept[token] = True
        total += probs[token].item()
    probs = torch.where(kept, probs, 0)
    return probs / probs.sum()


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    total = observed.sum()
    assert int(observed[expected_probs == 0].sum()) == 0, "tokens the target's top-p removes were output"
    cells = expected_probs > 0
    expected = expected_probs[cells] * total
    statistic = ((observed[cells] - expected) ** 2 / expected).sum()
    degrees = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("drawn_proposals", [True, False], ids=["draft-probs", "one-hot"])
def test_the_first_and_second_tokens_are_distributed_as_the_targets(drawn_proposals):
    """Seeded throughout (a fixed outcome): 8000 requests verify k = 2 proposals drawn from a draft q that
    favours what the target finds unlikely; a request that kept one token verifies a second step."""
    vocab, count, top_p = 6, 8000, 0.8
    generator = torch.Generator().manual_seed(0)
    target = [
        torch.randn(vocab, generator=generator) * 1.5,  # position 0
        torch.randn(vocab, vocab, generator=generator) * 1.5,  # position 1, after token t0
        torch.randn(vocab, vocab, vocab, generator=generator),
    ]  # position 2, after t0 t1
    uniform = torch.full((vocab,), 1 / vocab)
    draft = [0.5 * (-target[0]).softmax(-1) + 0.5 * uniform, 0.5 * (-target[1]).softmax(-1) + 0.5 * uniform]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    requests = [Row(params) for _ in range(count)]
    rejection = RejectionSampler(Sampler(seed=1))

    def verify(logits, proposals, probs):
        batch = rejection.verify(
            logits.reshape(-1, vocab),
            requests[: len(proposals)],
            proposals.tolist(),
            [3] * len(proposals),
            probs.reshape(-1, vocab) if drawn_proposals else None,
        )
        return tokens_of(batch)

    first = torch.multinomial(draft[0], count, replacement=True, generator=generator)
    second = torch.multinomial(draft[1][first], 1, generator=generator).squeeze(1)
    logits = torch.stack([target[0].expand(count, vocab), target[1][first], target[2][first, second]], dim=1)
    probs = torch.stack([draft[0].expand(count, vocab), draft[1][first]], dim=1)
    outputs = verify(logits, torch.stack([first, second], dim=1), probs)
    short = [index for index, output in enumerate(outputs) if len(output) == 1]
    kept = torch.tensor([outputs[index][0] for index in short], dtype=torch.long)
    again = torch.multinomial(draft[1][kept], 1, generator=generator).squeeze(1)
    logits = torch.stack([target[1][kept], target[2][kept, again]], dim=1)
    for index, output in zip(short, verify(logits, again.unsqueeze(1), draft[1][kept].unsqueeze(1)), strict=False):
        outputs[index] = outputs[index] + output[:1]
    assert 0.05 * count < len(short) < 0.95 * count  # the draft is wrong often, and right often
    observed = torch.zeros(vocab, vocab, dtype=torch.float64)
    for output in outputs:
        observed[output[0], output[1]] += 1
    expected = reference_top_p(target[0], top_p).unsqueeze(1) * torch.stack(
        [reference_top_p(target[1][token], top_p) for token in range(vocab)]
    )
    assert chi_square_p_value(observed.sum(1), expected.sum(1)) > 1e-3
    assert chi_square_p_value(observed.flatten(), expected.flatten()) > 1e-3
    # The same test tells the draft's distribution from the target's.
    drafted = torch.zeros(vocab, dtype=torch.float64).index_add_(0, first, torch.ones(count, dtype=torch.float64))
    assert chi_square_p_value(drafted, reference_top_p(target[0], 1.0)) < 1e-6


EDITED = [
    SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.9),
    SamplingParams(temperature=0, min_tokens=4, logit_bias={5: 2.5, 6: -3.0}, bad_words_token_ids=((4, 9), (8,))),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=11, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(
        temperature=1.3,
        min_p=0.05,
        seed=5,
        repetition_penalty=0.6,
        min_tokens=3,
        logprobs=3,
        bad_words_token_ids=((2, 3),),
    ),
]


def decode_one_by_one(params: SamplingParams, output: tuple[int, ...], logits: torch.Tensor, first: int) -> list:
    """The plain sampler, one position at a time (the runner's seeding of each draw), each token appended."""
    row, sampler, tokens = Row(params, output, device=logits.device.type), Sampler(seed=99), []
    for position in range(logits.shape[0]):
        if row.generator is not None:
            row.generator.manual_seed(draw_seed(params.seed, first + position))
        sampled = sampler(logits[position : position + 1], [row])[0]
        tokens.append(sampled)
        row.output_token_ids.append(sampled.token_id)
    return tokens


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize(
    ("device", "device_counts"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=ON_GPU)],
    ids=["host-counts", "device-counts", "cuda"],
)
def test_edits_apply_per_position_as_when_decoding_one_token_at_a_time(device, device_counts):
    """On CUDA the verification runs where a synchronizing call raises: it never waits for the device."""
    generator = torch.Generator().manual_seed(4)
    k = 4
    for case in range(12):
        requests, proposals, rows, expected = [], [], [], []
        for params in EDITED:
            output = tuple(
                torch.randint(VOCAB, (int(torch.randint(3, (), generator=generator)),), generator=generator).tolist()
            )
            # Close logits, so that the edits decide tokens; the same token often best, so that penalties bite.
            logits = torch.randn(k + 1, VOCAB, generator=generator) * 0.6 + 2 * peaked(int(case % VOCAB))
            logits = logits.to(device)
            reference = decode_one_by_one(params, output, logits, 10 + len(output))
            cut = int(torch.randint(k + 1, (), generator=generator))  # proposals agree up to here, then one is wrong
            agreed = [token.token_id for token in reference[:cut]]
            wrong = [] if cut == k else [(reference[cut].token_id + 1) % VOCAB]
            requests.append(Row(params, output, device=device))
            proposals.append(agreed + wrong)
            rows.append(logits[: len(agreed + wrong) + 1])
            expected.append(reference[: cut + 1])
        counts = TokenCounts(torch.device(device)) if device_counts else None
        with no_synchronizing_calls(device):
            batch = (
                RejectionSampler(Sampler(seed=99))
                .verify(
                    torch.cat(rows),
                    requests,
                    proposals,
                    [10 + len(row.output_token_ids) for row in requests],
                    counts=counts,
                )
                .to_host()
            )
        if device == "cuda":
            torch.cuda.synchronize()
        for got, want in zip(batch.verified_tokens(), expected, strict=False):
            assert [token.token_id for token in got] == [token.token_id for token in want]
            for ours, theirs in zip(got, want, strict=False):
                if theirs.logprob is not None:
                    assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
                    assert ours.rank == theirs.rank
                    assert [t for t, _ in ours.top_logprobs] == [t for t, _ in theirs.top_logprobs]


def test_seeded_requests_are_reproducible_whatever_the_batch():
    generator = torch.Generator().manual_seed(8)
    params = [SamplingParams(temperature=1.0, seed=seed, top_k=8) for seed in range(6)]
    proposals = [[int(token) for token in torch.randint(VOCAB, (n,), generator=generator)] for n in (0, 1, 2, 3, 4, 2)]
    logits = [torch.randn(len(row) + 1, VOCAB, generator=generator) for row in proposals]
    draft = [torch.rand(len(row), VOCAB, generator=generator).softmax(-1) for row in proposals]
    first = [7, 30, 2, 9, 100, 41]

    def run(order, seed):
        batch = RejectionSampler(Sampler(seed=seed)).verify(
            torch.cat([logits[i] for i in order]),
            [Row(params[i]) for i in order],
            [proposals[i] for i in order],
            [first[i] for i in order],
            torch.cat([draft[i] for i in order]),
        )
        return dict(zip(order, tokens_of(batch), strict=False))

    together = run(list(range(6)), seed=0)
    assert run([5, 3, 1, 0, 4, 2], seed=1) == together
    assert {index: run([index], seed=2)[index] for index in range(6)} == together
    # Another seed draws differently somewhere.
    other = [msgspec.structs.replace(row, seed=row.seed + 100) for row in params]
    params[:] = other
    assert run(list(range(6)), seed=0) != together


def test_ragged_batches_of_zero_to_k_proposals_gain_one_to_n_plus_one_tokens():
    generator = torch.Generator().manual_seed(2)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0, presence_penalty=1.0),
    ]
    for trial, drawn in itertools.product(range(4), (False, True)):
        lengths = [int(n) for n in torch.randint(0, 5, (9,), generator=generator)]
        proposals = [[int(t) for t in torch.randint(VOCAB, (n,), generator=generator)] for n in lengths]
        requests = [Row(kinds[(row + trial) % len(kinds)]) for row in range(9)]
        logits = torch.randn(sum(lengths) + 9, VOCAB, generator=generator) * 3
        probs = torch.rand(sum(lengths), VOCAB, generator=generator).softmax(-1) if drawn else None
        batch = RejectionSampler(Sampler()).verify(logits, requests, proposals, [5] * 9, probs)
        for output, proposed in zip(tokens_of(batch), proposals, strict=False):
            assert 1 <= len(output) <= len(proposed) + 1
            assert output[:-1] == proposed[: len(output) - 1]
            assert all(0 <= token < VOCAB for token in output)
    assert RejectionSampler(Sampler()).verify(
        torch.randn(3, VOCAB), [Row(kinds[0])] * 3, [[], [], []], [1, 1, 1]
    ).num_tokens.tolist() == [1, 1, 1]


def test_only_the_positions_a_request_keeps_can_fail_it():
    greedy = SamplingParams(temperature=0)
    logits = torch.stack(
        [
            peaked(4),
            peaked(9),
            torch.full((VOCAB,), float("nan")),  # the NaN is never reached
            peaked(4),
            torch.full((VOCAB,), float("nan")),
        ]
    )  # kept: position 1 of the second
    for params in (greedy, SamplingParams(temperature=0, presence_penalty=0.5)):
        batch = RejectionSampler(Sampler()).verify(logits, [Row(params), Row(params)], [[4, 1], [4]], [3, 3])
        verified = batch.to_host().verified_tokens()
        assert [token.token_id for token in verified[0]] == [4, 9]
        assert verified[1][0].error == NON_FINITE_LOGITS


def test_a_step_without_requests_verifies_nothing():
    assert RejectionSampler(Sampler()).verify(torch.zeros(0, VOCAB), [], [], []).to_host().verified_tokens() == []


def test_the_row_count_must_match_the_proposals():
    with pytest.raises(ValueError, match="4 rows of logits for 3 positions"):
        RejectionSampler(Sampler()).verify(torch.randn(4, VOCAB), [Row(SamplingParams())], [[1, 2]], [0])


class Broken(Row):
    @property
    def output_token_ids(self):
        raise RuntimeError("this request's tokens cannot be read")

    @output_token_ids.setter
    def output_token_ids(self, value):
        pass


def test_a_request_whose_verification_raises_fails_alone():
    params = SamplingParams(temperature=0, min_tokens=2)
    logits = torch.stack([peaked(4), peaked(5), peaked(6), peaked(7), peaked(8)])
    batch = RejectionSampler(Sampler()).verify(
        logits, [Row(params), Broken(params), Row(params)], [[4], [], [7]], [3, 3, 3]
    )
    verified = batch.to_host().verified_tokens()
    assert [token.token_id for token in verified[0]] == [4, 5]
    assert verified[1][0].error == SAMPLING_FAILED
    assert [token.token_id for token in verified[2]] == [7, 8]


def test_verification_reads_nothing_back_from_the_device(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the rejection sampler read a tensor back to the host")

    params = [
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, top_k=10, seed=8, logprobs=3),
        SamplingParams(temperature=0, repetition_penalty=1.2, min_tokens=3, bad_words_token_ids=((1, 2),)),
        SamplingParams(temperature=1.0, frequency_penalty=0.4),
    ]
    proposals = [[1, 2, 3], [], [4, 4]]
    logits, probs = torch.randn(8, VOCAB), torch.rand(5, VOCAB).softmax(-1)
    requests = [Row(row) for row in params]
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    batch = RejectionSampler(Sampler()).verify(
        logits, requests, proposals, [3, 3, 3], probs, TokenCounts(logits.device)
    )
    monkeypatch.undo()
    verified = batch.to_host().verified_tokens()
    assert all(token.error is None for tokens in verified for token in tokens)
    assert len(verified[0][0].top_logprobs) == 3
