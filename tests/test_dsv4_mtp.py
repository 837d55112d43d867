"""DeepSeek V4's MTP layers as the ``mtp`` speculator (weft-dsv4), on tiny random checkpoints with ``mtp.0.*``.

The proposals are checked against an independent reference: Hugging Face's ``DeepseekV4ForCausalLM`` gives the
target's residual streams (before ``hc_head``) of a whole sequence in one forward, the MTP layer's input is
combined from the checkpoint's tensors in plain torch (``e_proj(enorm(embed(t[p+1]))) + h_proj(hnorm(h[p]))``),
and a one-layer transformers model holding the MTP block, its ``hc_head`` and ``norm`` and the target's LM head
runs it, no cache, every position at once. Every proposal the engine made, first and chained, must be that
reference's argmax. Greedy output is identical with speculation off and on (k = 1 and k = 2), in mixed batches
with n = 2, stop strings and prefix caching; under EP=2 (gloo) it equals EP=1's, and the layers are built with
the target's layout through ``draft_parallel_config`` (each rank reads only its experts of the MTP block).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("weft_dsv4")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV4ForCausalLM (needs >= 5.17; CI pins 5.24)", allow_module_level=True)

from weft import LLM, SamplingParams  # noqa: E402
from weft_dsv4.config import CSA, HCA, SLIDING  # noqa: E402
from weft_dsv4.mtp import MtpSpeculator  # noqa: E402
from weft_dsv4.reference import stable_topk  # noqa: E402
from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": 24}
PROMPT_LENGTHS = (5, 23, 41)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config([HCA, CSA, SLIDING, CSA], hc_mult=2, index_topk=3, num_nextn_predict_layers=1)
    return write_checkpoint(tmp_path_factory.mktemp("dsv4mtp"), config, seed=7)


def prompts(seed: int = 5, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (length,), generator=generator).tolist() for length in lengths]


def tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def spec_counts(llm) -> tuple[int, int]:
    stats = llm.engine.core.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def generate(folder, params, engine=None, speculative=None, batch=None):
    settings = {**ENGINE, **(engine or {})}
    if speculative is not None:
        settings["speculative"] = speculative
    with LLM(model=str(folder), engine=settings) as llm:
        outputs = llm.generate(batch or prompts(), params)
        counts = spec_counts(llm) if speculative is not None else (0, 0)
    return outputs, counts


@pytest.fixture(scope="module")
def plain(checkpoint):
    outputs, _ = generate(checkpoint, GREEDY)
    return tokens(outputs)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_output_is_identical_with_mtp_proposals(checkpoint, plain, k):
    outputs, (drafted, accepted) = generate(
        checkpoint, GREEDY, speculative={"method": "mtp", "num_speculative_tokens": k}
    )
    assert tokens(outputs) == plain
    assert drafted > 0  # it did speculate (random weights: few proposals are accepted)
    assert 0 <= accepted <= drafted


class Reference:
    """Hugging Face's target and a one-layer transformers model holding the MTP layer (module docstring)."""

    def __init__(self, folder, tmp_path) -> None:
        from safetensors.torch import load_file, save_file

        self.target = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        stored = load_file(str(folder / "model.safetensors"))
        self.mtp = {name[len("mtp.0.") :]: tensor for name, tensor in stored.items() if name.startswith("mtp.0.")}
        config = json.loads((folder / "config.json").read_text())
        config.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
        own = {"norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
        block = {
            f"model.layers.0.{name}": tensor
            for name, tensor in self.mtp.items()
            if name not in own and not name.startswith(("enorm", "hnorm", "e_proj", "h_proj"))
        }
        block.update(
            {
                "model.embed_tokens.weight": stored["model.embed_tokens.weight"],
                "head.weight": stored["head.weight"],
                "model.norm.weight": self.mtp["norm.weight"],
                "model.hc_head.hc_fn": self.mtp["hc_head_fn"],
                "model.hc_head.hc_base": self.mtp["hc_head_base"],
                "model.hc_head.hc_scale": self.mtp["hc_head_scale"],
            }
        )
        folder = tmp_path / "mtp-reference"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(block, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.block = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.embed = stored["model.embed_tokens.weight"]

    @staticmethod
    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def combine(self, next_tokens: list[int], streams: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input streams ``[S, hc, H]`` from the next tokens and the streams before them."""
        e = self.rms(self.embed[next_tokens], self.mtp["enorm.weight"]) @ self.mtp["e_proj.weight"].T
        h = self.rms(streams, self.mtp["hnorm.weight"]) @ self.mtp["h_proj.weight"].T
        return e.unsqueeze(1) + h

    def block_forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output streams and the logits at every entry, ``inputs`` put in place of the embedding."""
        captured = {}

        def replace(module, args, kwargs):
            return (inputs.unsqueeze(0), *args[1:]), kwargs

        def keep(module, args, output):
            captured["streams"] = args[0][0]

        layer = self.block.model.layers[0]
        hooks = [
            layer.register_forward_pre_hook(replace, with_kwargs=True),
            self.block.model.hc_head.register_forward_hook(keep),
        ]
        try:
            logits = self.block(inputs_embeds=torch.zeros(1, inputs.shape[0], inputs.shape[-1])).logits[0]
        finally:
            for hook in hooks:
                hook.remove()
        return captured["streams"], logits

    @torch.no_grad()
    def proposals(self, sequence: list[int], count: int) -> list[int]:
        """The greedy chain of ``count`` proposals after ``sequence`` (its last token the target's newest)."""
        captured = {}
        hook = self.target.model.hc_head.register_forward_hook(lambda m, args, out: captured.update(s=args[0][0]))
        try:
            with stable_topk():
                self.target(torch.tensor([sequence[:-1]]))
        finally:
            hook.remove()
        inputs = self.combine(sequence[1:], captured["s"])
        made = []
        for _ in range(count):
            streams, logits = self.block_forward(inputs)
            made.append(int(logits[-1].argmax()))
            inputs = torch.cat([inputs, self.combine([made[-1]], streams[-1:])])
        return made


def test_every_proposal_is_the_reference_mtp_layer_s_argmax(checkpoint, tmp_path, monkeypatch):
    """Proposals of k = 2 (the second chained on the first's streams), in a batch of chunked prefills and
    decodes, against the one-shot reference over each request's tokens at the time."""
    made = []
    propose = MtpSpeculator.propose

    def recording(self, step):
        result = propose(self, step)
        for request_id, proposed in zip(step.request_ids, result.token_ids, strict=True):
            if proposed:
                made.append((list(self.requests[request_id].token_ids), list(proposed)))
        return result

    monkeypatch.setattr(MtpSpeculator, "propose", recording)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    generate(checkpoint, params, speculative={"method": "mtp", "num_speculative_tokens": 2})
    assert len(made) >= 12
    reference = Reference(checkpoint, tmp_path)
    chained = 0
    for sequence, proposed in made:
        assert proposed == reference.proposals(sequence, len(proposed)), f"after {len(sequence)} tokens"
        chained += len(proposed) == 2
    assert chained > 0


def test_mixed_batch_with_n_2_stop_strings_and_prefix_caching(checkpoint):
    batch = prompts(seed=9, lengths=(17, 30, 9, 30))
    batch[3] = batch[1][:24] + batch[3][24:]  # shares a cached prefix with the second prompt
    params = [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    engine = {"enable_prefix_caching": True}
    expected, _ = generate(checkpoint, params, engine, batch=batch)
    got, (drafted, _) = generate(
        checkpoint, params, engine, speculative={"method": "mtp", "num_speculative_tokens": 2}, batch=batch
    )
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert drafted > 0
    text = expected[0].outputs[0].text
    if len(text) > 6:
        stop = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, stop=[text[3:6]])
        plain_stop, _ = generate(checkpoint, stop, batch=batch[:1])
        spec_stop, _ = generate(
            checkpoint, stop, speculative={"method": "mtp", "num_speculative_tokens": 2}, batch=batch[:1]
        )
        assert spec_stop[0].outputs[0].text == plain_stop[0].outputs[0].text


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    from weft.config import ConfigError

    folder = write_checkpoint(tmp_path / "plain", tiny_config([SLIDING, CSA], hc_mult=2), seed=3)
    with pytest.raises((ConfigError, ValueError), match="num_nextn_predict_layers is 0"):
        LLM(model=str(folder), engine={**ENGINE, "speculative": {"method": "mtp", "num_speculative_tokens": 1}})


@pytest.mark.parametrize("rejected", [1, 3])
def test_rejected_proposals_leave_no_trace_in_the_compressor_state(checkpoint, rejected):
    """A step that computes proposals the next step rolls back (their positions are computed again): every
    position's logits equal plain decoding's, wherever the rejected tokens fall in the compressed windows (CSA
    m = 4, HCA m = 8). The compressors' state rings keep ``num_lookahead_tokens`` more positions for it: a rejected
    token at the next window's start once overwrote a position the current window still pools."""
    from weft_dsv4.reference import Driver

    prompt, continuation = prompts(seed=3, lengths=(23, 18))

    def run(rejected_at=None):
        driver = Driver(checkpoint, block_size=8, num_lookahead_tokens=rejected)
        rows = [driver.step([("r", prompt)])[0][-1]]
        for index, token in enumerate(continuation):
            if index == rejected_at:
                rows.append(driver.step([("r", [token, *[7] * rejected])])[0][0])
                driver.roll_back("r", rejected)
            else:
                rows.append(driver.step([("r", [token])])[0][-1])
        return torch.stack(rows)

    plain = run()
    for index in range(len(continuation) - 1):
        torch.testing.assert_close(run(index), plain, atol=1e-4, rtol=1e-4, msg=f"rejected after position {23 + index}")


def test_expert_parallel_over_two_ranks_with_mtp_gives_the_greedy_tokens_of_one_device(checkpoint):
    """EP=2 over gloo (the mp executor): each rank holds half of the routed experts of the target and of the MTP
    block, both ranks propose alike; greedy output equals one device's, with and without the MTP layers."""
    batch = prompts(seed=13, lengths=(9, 30))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    speculative = {"method": "mtp", "num_speculative_tokens": 2}
    one, _ = generate(checkpoint, params, speculative=speculative, batch=batch)
    plain_one, _ = generate(checkpoint, params, batch=batch)
    assert tokens(one) == tokens(plain_one)
    two, (drafted, _) = generate(
        checkpoint,
        params,
        {"tensor_parallel_size": 2, "enable_expert_parallel": True},
        speculative=speculative,
        batch=batch,
    )
    assert tokens(two) == tokens(one)
    assert drafted > 0


def test_the_mtp_layers_are_built_from_the_target_s_layout_through_draft_parallel_config(checkpoint, monkeypatch):
    """The speculator's own build (rank 1 of TP=2 with expert parallelism, in this process): it derives the layers'
    layout with ``draft_parallel_config`` from the target's ``ModelConfig.parallel`` (expert parallelism passed
    through), and its MoE block holds the rank's half of the checkpoint's ``mtp.0`` experts."""
    from safetensors.torch import load_file

    import weft_dsv4.mtp as mtp
    from weft.api import SafetensorsLoader
    from weft.contracts.model import ModelConfig
    from weft.contracts.parallel import Communicator, ParallelLayout
    from weft.contracts.speculator import DraftModel, DraftModelLoader, SpeculatorConfig
    from weft.distributed.state import ParallelGroups, using_parallel
    from weft_dsv4.model import DeepseekV4Family
    from weft_dsv4.parallel import draft_parallel_config

    cpu = torch.device("cpu")
    layout = ParallelLayout(tensor_parallel_size=2, enable_expert_parallel=True, rank=1)
    tensor = Communicator(None, cpu)
    tensor.size, tensor.rank = 2, 1
    groups = ParallelGroups(layout, tensor, cpu)
    loader = SafetensorsLoader()
    source = loader.resolve(str(checkpoint))
    family = DeepseekV4Family()
    config = ModelConfig(
        architecture="DeepseekV4ForCausalLM",
        hf_config=source.hf_config,
        dtype="float32",
        block_size=8,
        max_model_len=256,
        parallel=layout,
        num_lookahead_tokens=2,
    )
    with using_parallel(groups):
        target = family.build(config, cpu)

    class Models(DraftModelLoader):
        def load(self, source: str) -> DraftModel:
            raise AssertionError("the mtp speculator loads no other model")

        @property
        def target(self) -> DraftModel:
            return DraftModel(model=target, family=family, config=config, backend=None, device=cpu)

        def building(self):
            return using_parallel(groups)

        def weights(self, dtype, source_name=None):
            return loader.iter_weight_slices(source, dtype)

    derived = []

    def spying(*args, **kwargs):
        derived.append((args, kwargs))
        return draft_parallel_config(*args, **kwargs)

    monkeypatch.setattr(mtp, "draft_parallel_config", spying)
    speculator = mtp.MtpSpeculator(
        None, SpeculatorConfig(num_speculative_tokens=2, vocab_size=512, max_model_len=256, block_size=8)
    )
    speculator.load(Models())
    assert len(derived) == 1 and derived[0][0][0] is layout  # the target's layout object, copied whole
    assert speculator.layout == layout and speculator.layout.enable_expert_parallel
    experts = speculator.layers[0].block.mlp.experts
    assert (experts.held.first, experts.held.count) == (4, 4)
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert experts.down_proj[1].equal(stored["mtp.0.ffn.experts.5.w2.weight"])
    assert target.model.keep_streams  # the target keeps its streams for the speculator from now on


def test_draft_parallel_config_of_core_s_layout_drops_only_what_the_stage_count_changes():
    from weft.contracts.parallel import ParallelLayout
    from weft_dsv4.parallel import draft_parallel_config

    target = ParallelLayout(
        tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_partition=(3, 1), enable_expert_parallel=True, rank=3
    )
    draft = draft_parallel_config(target, tensor_parallel_size=2)
    assert draft == ParallelLayout(tensor_parallel_size=2, enable_expert_parallel=True, rank=3)
    assert draft.world_size == 2 and draft.expert_parallel_size == 2
    dense = draft_parallel_config(target, tensor_parallel_size=2, pipeline_parallel_size=2, draft_is_moe=False)
    assert dense.pipeline_partition == (3, 1) and not dense.enable_expert_parallel
