"""weft-dsv4 on an NVIDIA GPU, against transformers' DeepseekV4ForCausalLM on a larger random config:
fp32 greedy generation through the engine (Triton decode_topk in the indexer) equals generate();
bf16 logits are as close to the fp32 reference as transformers' own bf16 run; decode and prefill attention
in their Triton kernels give the torch path's tokens and compile nothing after warm-up."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

transformers = pytest.importorskip("transformers")
pytest.importorskip("weft_dsv4")
pytest.importorskip("triton")

from weft_dsv4.config import CSA, HCA, SLIDING  # noqa: E402
from weft_dsv4.reference import Driver, stable_topk  # noqa: E402
from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint  # noqa: E402

LARGER = tiny_config(
    [HCA, CSA, CSA, HCA, SLIDING, CSA],
    hc_mult=4,
    vocab_size=4096,
    hidden_size=512,
    num_attention_heads=8,
    head_dim=128,
    q_lora_rank=256,
    moe_intermediate_size=256,
    n_routed_experts=16,
    num_experts_per_tok=4,
    o_groups=4,
    o_lora_rank=128,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=16,
    sliding_window=64,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
)
PROMPT_LENGTHS = (17, 150, 301)


def prompt(length: int) -> list[int]:
    return torch.randint(2, 4096, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dsv4gpu"), LARGER, seed=11)


def hf_model(folder, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def test_fp32_engine_generation_on_gpu_equals_transformers(folder):
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams
    from weft_triton.ops import DecodeTopKTriton

    llm = LLM(
        model=str(folder), engine={"dtype": "float32", "block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024}
    )
    indexers = [
        layer.self_attn.topk_op for layer in llm.engine.worker.model.model.layers if layer.self_attn.indexer is not None
    ]
    assert indexers and all(isinstance(op, DecodeTopKTriton) for op in indexers)
    outputs = llm.generate(
        [prompt(n) for n in PROMPT_LENGTHS], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    )
    hf = hf_model(folder, torch.float32)
    for length, output in zip(PROMPT_LENGTHS, outputs, strict=False):
        with stable_topk(), torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt(length)], device="cuda"), max_new_tokens=64, do_sample=False, pad_token_id=0
            )
        assert list(output.outputs[0].token_ids) == expected[0, length:].tolist(), f"prompt of {length} tokens"


def test_fp32_engine_with_fp8_indexer_keys_equals_transformers_scoring_keys_rounded_alike(folder):
    """``indexer_key_dtype = "fp8_e4m3"`` on the GPU: greedy tokens equal transformers' whose indexer scorer
    reads the same keys rounded to float8 with a scale per key (tests/test_dsv4.py does the same on the CPU)."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams
    from weft_dsv4.reference import fp8_indexer_keys

    llm = LLM(
        model=str(folder),
        engine={"dtype": "float32", "block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024},
        plugins={"DeepseekV4ForCausalLM": {"indexer_key_dtype": "fp8_e4m3"}},
    )
    groups = {group.name: group.spec for group in llm.engine.kv_cache_manager.groups}
    assert groups["indexer_keys"].dtype == "uint8"
    outputs = llm.generate(
        [prompt(n) for n in PROMPT_LENGTHS], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    )
    del llm
    hf = hf_model(folder, torch.float32)
    for length, output in zip(PROMPT_LENGTHS, outputs, strict=False):
        with stable_topk(), fp8_indexer_keys(), torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt(length)], device="cuda"), max_new_tokens=64, do_sample=False, pad_token_id=0
            )
        assert list(output.outputs[0].token_ids) == expected[0, length:].tolist(), f"prompt of {length} tokens"


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(folder):
    from weft_triton.ops import DecodeTopKTriton

    ids = prompt(400)
    with stable_topk(), torch.no_grad():
        reference = hf_model(folder, torch.float32)(torch.tensor([ids], device="cuda")).logits[0].float()
        theirs = hf_model(folder, torch.bfloat16)(torch.tensor([ids], device="cuda")).logits[0].float()
    driver = Driver(
        folder, dtype="bfloat16", device="cuda", block_size=16, max_model_len=1024, topk_op=DecodeTopKTriton(None)
    )
    prefill = driver.step([("a", ids[:300])])[0]
    decoded = torch.cat([driver.step([("a", [token])])[0] for token in ids[300:]])
    ours = torch.cat([prefill, decoded])
    our_error = (ours - reference).abs().mean().item()
    their_error = (theirs - reference).abs().mean().item()
    print(f"bf16 mean |logit error| vs fp32: weft {our_error:.4f}, transformers {their_error:.4f}")
    assert our_error <= 1.5 * their_error + 1e-3
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    their_agreement = (theirs.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"bf16 top-1 agreement with fp32: weft {agreement:.3f}, transformers {their_agreement:.3f}")
    assert agreement >= their_agreement - 0.05


def test_the_compiled_mhc_kernel_matches_the_torch_reference():
    from weft_dsv4.mhc import mhc_weights
    from weft_dsv4.mhc_kernel import MhcWeightsKernel

    kernel = MhcWeightsKernel()
    for hc_mult in (2, 4):
        generator = torch.Generator().manual_seed(hc_mult)
        width = (2 + hc_mult) * hc_mult
        base, scale = torch.randn(width, generator=generator).cuda(), (1 + torch.rand(3, generator=generator)).cuda()
        for tokens in (1, 37, 1000):
            mixes = (torch.randn(tokens, width, generator=generator) * 3).cuda()
            fused = kernel(mixes=mixes, base=base, scale=scale, eps=1e-6, iterations=20)
            for ours, reference in zip(fused, mhc_weights(mixes, base, scale, 1e-6, 20), strict=False):
                torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


def test_routed_experts_grouped_gemm_in_bf16_matches_a_loop_over_experts():
    from weft.layers.moe import grouped_matmul

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 256, generator=generator).cuda().bfloat16()
    weights = (torch.randn(16, 128, 256, generator=generator) * 0.05).cuda().bfloat16()
    sizes = torch.randint(0, 40, (16,), generator=generator)
    ends = sizes.cumsum(0).clamp(max=300).to(torch.int32).cuda()
    ours = grouped_matmul(rows, weights, ends)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        torch.testing.assert_close(ours[start:end], rows[start:end] @ weights[expert].T, atol=2e-2, rtol=2e-2)
        start = end


def test_prefix_cache_hits_and_warmed_kernels_on_gpu_change_no_token(folder):
    """fp32 engine (bf16's rounding differs between a prefix computed in one prefill and the same prefix
    restored from snapshots, which on a random model flips near-tied tokens), kernels warmed up with
    runtime_jit = "error" (a compile after warm-up fails): prompts that share a 256-token prefix give the
    same tokens with prefix caching on and off."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    shared = prompt(256)
    prompts = [shared + prompt(n) for n in (1, 40, 170)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(
            model=str(folder),
            engine={
                "dtype": "float32",
                "block_size": 16,
                "num_kv_blocks": 512,
                "max_model_len": 1024,
                "enable_prefix_caching": caching,
                "runtime_jit": "error",
            },
        )
        first = llm.generate([shared + [5]], params)
        rest = llm.generate(prompts, params)
        results[caching] = [list(output.outputs[0].token_ids) for output in first + rest]
        if caching:
            assert llm.engine.kv_cache_manager.stats.hit_tokens >= 3 * 256
        del llm
    assert results[True] == results[False]


@pytest.mark.parametrize("indexer_key_dtype", ["auto", "fp8_e4m3"])
def test_decode_graphs_on_and_off_give_the_same_tokens(folder, indexer_key_dtype):
    """bf16 engine: decode captured in CUDA graphs (the model-managed groups read from the runner's static
    buffers) against the same engine eager; prompts of several lengths finish at different steps, so replays
    run padded to the captured sizes; prefix caching on, so snapshots are written from inside the graphs.

    Both read the same shapes (decode pads every request's entries to what max_model_len allows), but the
    batch is padded to the captured size in a graph and bf16 rounding can still differ in the last bit; on
    this random model some tokens are near-ties. Measured on one H200 (2026-12-01): 2 of 5 prompts identical
    throughout, 3 identical up to generated tokens 16, 24 and 54, each a near-tie (eager top-2 gap 0.016 to
    0.078, bf16's resolution there). So: identical, or diverging only at a near-tie after 8 identical tokens
    (a wrong state or a wrong slot diverges early and by a wide margin)."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    prompts = [prompt(n) for n in (17, 150, 301, 64, 5)]
    params = [
        SamplingParams(temperature=0, max_tokens=80 - 9 * i, ignore_eos=True, logprobs=2) for i in range(len(prompts))
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            model=str(folder),
            engine={
                "dtype": "bfloat16",
                "block_size": 16,
                "num_kv_blocks": 512,
                "max_model_len": 1024,
                "enable_prefix_caching": True,
                "enforce_eager": eager,
                "max_num_seqs": 8,
            },
            plugins={"DeepseekV4ForCausalLM": {"indexer_key_dtype": indexer_key_dtype}},
        )
        assert bool(llm.engine.runner.graphs) is not eager
        # Decode attention in the Triton kernel on both sides, so the graphs replay it too.
        assert all(
            type(layer.self_attn.decode_kernel).__name__ == "DecodeAttentionKernel"
            for layer in llm.engine.worker.model.model.layers
        )
        outputs = llm.generate(prompts, params)
        results[eager] = [(list(output.outputs[0].token_ids), output.outputs[0].logprobs) for output in outputs]
        del llm
    report = []
    for number, ((graphed, _graphed_logprobs), (eager, eager_logprobs)) in enumerate(
        zip(results[False], results[True], strict=False)
    ):
        first = next((i for i, (a, b) in enumerate(zip(graphed, eager, strict=False)) if a != b), None)
        if first is None:
            report.append(f"prompt {number}: {len(eager)} tokens identical")
            continue
        top = sorted(eager_logprobs[first].values(), key=lambda entry: -entry.logprob)[:2]
        gap = top[0].logprob - top[1].logprob
        report.append(f"prompt {number}: identical up to generated token {first}, eager top-2 gap there {gap:.4f}")
    print("\n".join(report))
    for line in report:
        if "identical up to" in line:
            first, gap = int(line.split("token ")[1].split(",")[0]), float(line.rsplit(" ", 1)[1])
            assert first >= 8 and gap < 0.1, report


def attention_variants() -> dict[str, int]:
    """The compiled variants of each attention kernel's Triton function, by kernel."""
    from weft_dsv4.attention_kernel import _decode_attention_kernel, _prefill_attention_kernel

    return {
        name: sum(len(caches[0]) for caches in function.device_caches.values())
        for name, function in (("decode", _decode_attention_kernel), ("prefill", _prefill_attention_kernel))
    }


def engine(folder, **settings):
    from weft.entrypoints.llm import LLM

    return LLM(model=str(folder), engine={"block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024, **settings})


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_attention_kernel_gives_the_torch_path_s_tokens(folder, monkeypatch, kind):
    """fp32 greedy tokens with decode (or prefill) attention in the Triton kernel (the GPU's default) and in the torch
    path (the kernel chosen away, the other kernel kept), prompts of several lengths finishing at different steps;
    a budget of 64 tokens chunks the long prompts, so prefill steps batch several requests and read the ring. fp32
    decodes eagerly (no grouped GEMM for the experts in fp32, so no graphs); the decode kernel inside graphs is
    covered in bf16 by test_decode_graphs_on_and_off_give_the_same_tokens."""
    from weft.sampling_params import SamplingParams
    from weft_dsv4 import attention_kernel, model

    expected = getattr(attention_kernel, f"{kind.title()}AttentionKernel")
    prompts = [prompt(n) for n in (17, 150, 301, 64, 5)]
    params = [SamplingParams(temperature=0, max_tokens=64 - 9 * i, ignore_eos=True) for i in range(len(prompts))]
    tokens = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(model, f"{kind}_attention_kernel", lambda device, dtype, head_dim: None)
        llm = engine(folder, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
        chosen = {type(getattr(layer.self_attn, f"{kind}_kernel")) for layer in llm.engine.worker.model.model.layers}
        assert chosen == ({expected} if path == "kernel" else {type(None)})
        tokens[path] = [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]
        del llm
    assert tokens["kernel"] == tokens["torch"]


def test_the_decode_and_prefill_attention_kernels_compile_nothing_after_warm_up(folder):
    """bf16 engine under runtime_jit = "error", decode in CUDA graphs and eagerly beside prefill chunks (a budget
    of 64 tokens chunks the long prompts, so prefill steps of one to several requests and many lengths), prefix
    caching on: warm-up compiled each kernel's one variant, serving compiles none (neither a warm-up miss nor a
    Triton specialisation the warm-up did not build)."""
    from weft.sampling_params import SamplingParams

    prompts = [prompt(n) for n in (17, 150, 301, 64, 5, 230)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=40 - 5 * i, ignore_eos=True) for i in range(len(prompts))
    ]
    llm = engine(
        folder,
        dtype="bfloat16",
        runtime_jit="error",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    kernels = [llm.engine.worker.kernels.kernels[f"weft_dsv4.{kind}_attention"] for kind in ("decode", "prefill")]
    assert all(len(kernel.compiled) == 1 for kernel in kernels) and llm.engine.runner.graphs
    before = attention_variants()
    assert min(before.values()) >= 1
    outputs = llm.generate(prompts, params)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [40 - 5 * i for i in range(len(prompts))]
    assert all(kernel.monitor.mode == "error" and kernel.monitor.misses == [] for kernel in kernels)
    assert attention_variants() == before


def test_mtp_speculation_on_gpu_changes_no_token(tmp_path):
    """The ``mtp`` speculator (the checkpoint's MTP layer, k = 2) on the GPU, fp32, kernels warmed up with
    runtime_jit = "error" (the MTP block launches the target's kernels): greedy tokens equal speculation off's
    (which decodes in graphs), and proposals were verified."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    folder = write_checkpoint(tmp_path / "mtp", {**LARGER, "num_nextn_predict_layers": 1}, seed=11)
    prompts = [prompt(n) for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024, "runtime_jit": "error"}
    results = []
    for speculative in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        with LLM(model=str(folder), engine={**engine, **({"speculative": speculative} if speculative else {})}) as llm:
            results.append([list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)])
            drafted = llm.engine.core.stats().spec_decode_num_draft_tokens if speculative else None
    assert results[1] == results[0]
    assert drafted > 0
