"""The ``moe`` op: its torch reference against a plain per-token loop, and the conformance kit on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft.builtins.moe import MoETorch
from weft.layers.moe import MoEActivation, MoERouting
from weft.testing import OpContract


class TestMoeReference(OpContract):
    plugin_name = "moe.torch"


def naive_moe(
    hidden,
    router_logits,
    w13,
    w2,
    routing,
    *,
    activation=MoEActivation(),
    correction_bias=None,
    w13_bias=None,
    w2_bias=None,
    topk=None,
    first_expert=0,
    shared_w13=None,
    shared_w2=None,
):
    """One token and one chosen expert at a time, in float64, routing written out from the definitions."""
    tokens, hidden_size = hidden.shape
    output = torch.zeros(tokens, hidden_size, dtype=torch.float64)
    for t in range(tokens):
        if topk is not None:
            chosen, weights = topk[0][t].tolist(), topk[1][t].double().tolist()
        else:
            logits = router_logits[t].double()
            scores = {
                "softmax": logits.softmax(-1),
                "sigmoid": logits.sigmoid(),
                "sqrtsoftplus": F.softplus(logits).sqrt(),
            }[routing.scoring]
            biased = scores + (correction_bias.double() if correction_bias is not None else 0)
            allowed = list(range(len(scores)))
            if routing.num_groups > 1:
                size = len(scores) // routing.num_groups
                group_score = [
                    sorted(biased[g * size : (g + 1) * size].tolist())[-2:] for g in range(routing.num_groups)
                ]
                best = sorted(range(routing.num_groups), key=lambda g: -sum(group_score[g]))[: routing.topk_groups]
                allowed = [e for e in allowed if e // size in best]
            chosen = sorted(allowed, key=lambda e: -biased[e].item())[: routing.top_k]
            weights = [scores[e].item() for e in chosen]
            if routing.renormalize:
                weights = [w / sum(weights) for w in weights]
            weights = [w * routing.scaling for w in weights]
        x = hidden[t].double()
        for expert, weight in zip(chosen, weights, strict=False):
            local = expert - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate_up = w13[local].double() @ x + (w13_bias[local].double() if w13_bias is not None else 0)
            gate, up = gate_up.chunk(2)
            if activation.limit is not None:
                gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit, activation.limit)
            if activation.kind == "silu":
                act = F.silu(gate) * up
            else:
                act = (up + 1) * gate * torch.sigmoid(gate * activation.alpha)
            down = w2[local].double() @ act + (w2_bias[local].double() if w2_bias is not None else 0)
            output[t] += weight * down
        if shared_w13 is not None:
            gate, up = (shared_w13.double() @ x).chunk(2)
            if activation.limit is not None:
                gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit, activation.limit)
            output[t] += shared_w2.double() @ (F.silu(gate) * up)
    return output


def test_reference_equals_a_per_token_loop():
    reference = MoETorch(None)
    for args, kwargs in MoETorch.example_inputs("cpu"):
        actual = reference(*args, **kwargs)
        expected = naive_moe(*args, **kwargs)
        assert actual.dtype == args[0].dtype and actual.shape == args[0].shape
        if args[0].dtype == torch.float32:
            torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-4)
        else:  # the bf16 inputs round inside the grouped GEMMs: compare against the loop's magnitude
            scale = expected.abs().max().item() + 1e-6
            assert (actual.double() - expected).abs().max().item() <= 0.03 * scale


def test_grouped_routing_chooses_within_the_best_groups():
    from weft.layers.moe import select_experts

    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0, 6.0, 0.5, 0.2]])
    experts, weights = select_experts(logits, MoERouting(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=1))
    # Group scores (sums of the two sigmoids): {0,1} 1.49, {2,3} 1.94, {4,5} 1.27, {6,7} 1.17: group 1 wins,
    # so expert 5, the best single score, is not chosen.
    assert sorted(experts[0].tolist()) == [2, 3]
    assert torch.allclose(weights.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="scoring"):
        MoERouting(top_k=2, scoring="relu")
