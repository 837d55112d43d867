"""Distributed execution on CPU: gloo, fp32, tiny random checkpoints, real worker processes.

Every parallel layout must give the greedy tokens of one device: tensor parallelism on
the shapes it has to handle (a vocabulary two ranks do not divide, one key/value head
for two ranks, a sliding window), pipeline stages with an explicit partition, both
together on four processes, two launchers on one host, ``weft serve`` with two tensor
ranks through the official client. A killed worker ends the engine with an error that
names its rank; impossible layouts are refused before any worker starts. Pipeline stages
are timed working on different micro-batches at once; expert parallelism's token exchange is
checked on uneven token counts, rank by rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port, make_tiny_model, start_weft_serve
from weft import LLM, SamplingParams
from weft.contracts.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 300], list(range(100, 140)), [7] * 12]
"""Token ids below 1,001; the third is longer than the Mistral window."""

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_tokens(model: Path, sections: dict | None = None, **engine: object) -> tuple[list[list[int]], list[int]]:
    """The greedy tokens of every prompt, and the engine's KV blocks per group (``sections``: ``use``, ``plugins``)."""
    llm = LLM(model=str(model), engine={"cpu_kv_cache_bytes": 1 << 20, **engine}, **(sections or {}))
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        return [output.outputs[0].token_ids for output in outputs], llm.engine.core.num_blocks
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_files):
    """``checkpoint(kind, **sizes)``: a tiny random checkpoint, made once per module."""
    made: dict[tuple, Path] = {}

    def get(kind: str, **sizes: object) -> Path:
        key = (kind, tuple(sorted(sizes.items())))
        if key not in made:
            name = "-".join([kind, *(f"{k}{v}" for k, v in sorted(sizes.items()))])
            made[key] = make_tiny_model(tmp_path_factory.mktemp("distributed") / name, kind, tokenizer_files, **sizes)
        return made[key]

    return get


@pytest.mark.parametrize(
    ("kind", "sizes", "layout"),
    [
        ("llama", {"vocab_size": 1001}, {"tensor_parallel_size": 2}),
        ("qwen3", {"num_key_value_heads": 1}, {"tensor_parallel_size": 2}),
        ("mistral-window", {}, {"tensor_parallel_size": 2}),
        ("llama", {"num_hidden_layers": 3}, {"pipeline_parallel_size": 2, "pipeline_partition": [2, 1]}),
        ("llama3-rope", {}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ],
    ids=[
        "tp2-vocab-1001",
        "tp2-qwen3-one-kv-head",
        "tp2-mistral-window",
        "pp2-partition-2-1",
        "tp2-pp2-tied-embeddings",
    ],
)
def test_a_parallel_layout_gives_the_greedy_tokens_of_one_device(checkpoint, kind, sizes, layout):
    model = checkpoint(kind, **sizes)
    expected, blocks_one = greedy_tokens(model)
    got, blocks_parallel = greedy_tokens(model, **layout)
    assert got == expected
    vocab = sizes.get("vocab_size", 49152)
    assert all(0 <= token < vocab for tokens in got for token in tokens)  # padded rows never sampled
    # The KV cache is sized per rank: each rank holds its key/value heads (one replicated head when the
    # ranks outnumber them) and its stage's layers, in the same cpu_kv_cache_bytes.
    kv_heads = sizes.get("num_key_value_heads", 2)
    share = max(1, kv_heads // layout.get("tensor_parallel_size", 1)) / kv_heads
    layers = sizes.get("num_hidden_layers", 2)
    most_layers = max(layout.get("pipeline_partition") or [layers // layout.get("pipeline_parallel_size", 1)])
    assert abs(blocks_parallel[0] - blocks_one[0] * layers / most_layers / share) <= 1


def test_structured_outputs_over_two_tensor_ranks_equal_transformers(checkpoint):
    """The mp executor carries each step's bitmask to both ranks; its handles cannot tell whether the tokens
    arrived, so the core launches the forward before accepting them, then fills the mask on its thread while
    it schedules the next step. Constrained greedy equals transformers under xgrammar's own logits processor."""
    from test_xgrammar_backend import TOOL_CALL, hf_constrained_greedy
    from weft.contracts.structured_output import StructuredOutputsParams

    model = checkpoint("llama")
    prompts = [[1, 5, 9, 200 + index, 31] for index in range(3)]
    expected = hf_constrained_greedy(model, prompts, TOOL_CALL, 24)
    llm = LLM(
        model=str(model), engine={"cpu_kv_cache_bytes": 1 << 22, "tensor_parallel_size": 2, "async_scheduling": True}
    )
    try:
        assert llm.engine.core.async_scheduling and llm.engine.core.executor.name == "mp"
        params = SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=TOOL_CALL)
        )
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    for output, reference in zip(outputs, expected, strict=False):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)] and (len(tokens) == 24 or len(reference) - len(tokens) <= 1)


def test_one_mp_worker_gives_the_greedy_tokens_of_the_in_process_worker(checkpoint):
    """``distributed_executor_backend = "mp"`` on one device: the model in a worker process of its own, the core
    scheduling and filling grammar masks in its process (so the fill shares no GIL with the forward's launch).
    With asynchronous scheduling, a batch of free and JSON-schema requests gives uniproc's greedy tokens, and the
    constrained ones are transformers' under xgrammar's own logits processor."""
    from test_xgrammar_backend import TOOL_CALL, hf_constrained_greedy

    model = checkpoint("llama")
    constrained_prompts = [[1, 5, 9, 200 + index, 31] for index in range(3)]
    expected_constrained = hf_constrained_greedy(model, constrained_prompts, TOOL_CALL, 24)
    schema = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    prompts = PROMPTS + constrained_prompts
    params = [GREEDY] * len(PROMPTS) + [schema] * len(constrained_prompts)
    tokens = {}
    for executor in ("uniproc", "mp"):
        with LLM(
            model=str(model),
            engine={"cpu_kv_cache_bytes": 1 << 22, "async_scheduling": True, "distributed_executor_backend": executor},
        ) as llm:
            assert llm.engine.core.executor.name == executor and llm.engine.core.async_scheduling
            tokens[executor] = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert tokens["mp"] == tokens["uniproc"]
    for got, reference in zip(tokens["mp"][len(PROMPTS) :], expected_constrained, strict=False):
        assert got == reference[: len(got)] and (len(got) == 24 or len(reference) - len(got) <= 1)  # HF keeps the EOS


def test_micro_batches_split_the_requests_by_tokens():
    from weft.runner.pipeline import micro_batches

    assert micro_batches([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert micro_batches([100, 1, 1], 2) == [range(0, 1), range(1, 3)]
    assert micro_batches([1, 1, 100], 2) == [range(0, 2), range(2, 3)]
    assert micro_batches([5], 4) == [range(0, 1)]
    assert micro_batches([1] * 5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]


def test_impossible_layouts_are_refused_with_the_numbers_and_the_fix(checkpoint, monkeypatch):
    from weft.config import ConfigError, load_config

    model = str(checkpoint("llama"))
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size = 3 does not divide the model's 4 attention heads; "
        r"use a tensor_parallel_size among 1, 2, 4",
    ):
        LLM(model=model, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size = 3 is more stages than the model's 2 layers"):
        LLM(model=model, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"pipeline_partition = \[2, 1\] gives 3 layers, but the model has 2"):
        LLM(model=model, pipeline_parallel_size=2, pipeline_partition=[2, 1])
    with pytest.raises(ConfigError, match=r"'uniproc' runs one worker .* 2 x 1 = 2 ranks; use 'mp'"):
        load_config(None, {"engine.tensor_parallel_size": 2, "engine.distributed_executor_backend": "uniproc"})
    with pytest.raises(
        ConfigError, match=r"pipeline_partition = \[2\] lists 1 stages but engine.pipeline_parallel_size = 2"
    ):
        load_config(None, {"engine.pipeline_parallel_size": 2, "engine.pipeline_partition": [2]})
    with pytest.raises(ConfigError, match=r"node_rank = 2 but engine.distributed.nnodes = 2"):
        load_config(None, {"engine.tensor_parallel_size": 2, "engine.distributed": {"nnodes": 2, "node_rank": 2}})
    with pytest.raises(ValueError, match=r"enable_expert_parallel: LlamaForCausalLM has no experts"):
        LLM(model=model, tensor_parallel_size=2, enable_expert_parallel=True)

    # More ranks than devices: a node that sees one accelerator.
    import weft.plugins.selection as selection
    from weft.contracts.platform import PlatformProbe
    from weft_cuda.platform import CudaPlatform

    monkeypatch.setattr(
        selection, "select_platform", lambda registry, name: (CudaPlatform, PlatformProbe(True, "one GPU", 100, 1))
    )
    with pytest.raises(
        ValueError, match=r"needs 2 devices on each of 1 node\(s\), but this node has 1 visible cuda device"
    ):
        LLM(model=model, tensor_parallel_size=2)


def test_torchrun_variables_place_the_launcher():
    from weft.config import ConfigError, load_config
    from weft.distributed.placement import placement

    config = load_config(None, {"engine.tensor_parallel_size": 4})
    torchrun = {
        "GROUP_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    where = placement(config, torchrun)
    assert (where.nnodes, where.node_rank, where.master_addr, where.master_port) == (2, 1, "10.0.0.7", 29500)
    assert where.agent_store and where.node_ranks() == range(2, 4) and where.run_id == "weft/job7/0"
    explicit = load_config(
        None, {"engine.tensor_parallel_size": 4, "engine.distributed": {"node_rank": 0, "master_port": 4000}}
    )
    assert (placement(explicit, torchrun).node_rank, placement(explicit, torchrun).master_port) == (0, 4000)
    with pytest.raises(ConfigError, match="run torchrun with --nproc-per-node 1"):
        placement(config, {**torchrun, "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(
        ConfigError,
        match=r"3 ranks \(tensor_parallel_size x pipeline_parallel_size\) cannot be spread evenly over 2 nodes",
    ):
        placement(load_config(None, {"engine.pipeline_parallel_size": 3, "engine.distributed": {"nnodes": 2}}), {})
    with pytest.raises(ConfigError, match=r"2 nodes need a rendezvous port .* set engine.distributed.master_port"):
        placement(load_config(None, {"engine.tensor_parallel_size": 2, "engine.distributed": {"nnodes": 2}}), {})


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("WEFT_", "MASTER_", "TORCHELASTIC"))}


def two_launchers(
    model: Path, node1_args: tuple[str, ...] = (), sections: dict | None = None, node1_env: dict[str, str] | None = None
) -> tuple[list[list[int]], str]:
    """The greedy tokens of a TP=2 engine started as two launchers on 127.0.0.1 (node 0 in this process, node 1 a
    ``weft serve`` given ``node1_args`` and ``node1_env``; ``sections`` for both), and node 1's log."""
    port = free_port()
    common = [
        "--model",
        str(model),
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--set",
        "engine.cpu_kv_cache_bytes=1048576",
        "--set",
        "engine.distributed.worker_timeout=120",
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "weft.cli", "serve", *common, "--node-rank", "1", *node1_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_environment(), **(node1_env or {})},
    )
    try:
        got, _ = greedy_tokens(
            model,
            sections,
            tensor_parallel_size=2,
            distributed={
                "nnodes": 2,
                "node_rank": 0,
                "master_addr": "127.0.0.1",
                "master_port": port,
                "worker_timeout": 120,
            },
        )
        status = node1.wait(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
        log = node1.stdout.read()
    assert status == 0, log
    return got, log


def test_two_launchers_on_one_host_give_the_greedy_tokens_of_one_device(checkpoint):
    model = checkpoint("llama")
    expected, _ = greedy_tokens(model)
    got, log = two_launchers(model)
    assert got == expected
    assert "node 1 of 2: ranks 1-1" in log


def test_weft_serve_with_two_tensor_ranks_and_a_worker_killed(checkpoint, tokenizer_files):
    """The official client against `weft serve` with tensor_parallel_size = 2; then one worker is killed
    mid-stream: the stream ends with an error naming its rank and the server exits non-zero."""
    from openai import OpenAI

    model = checkpoint("llama")
    offline = LLM(model=str(model), engine={"cpu_kv_cache_bytes": 1 << 20})
    completion_expected = offline.generate(["The capital of France is"], GREEDY)[0].outputs[0].text
    chat = [{"role": "user", "content": "Name three colours."}]
    chat_expected = offline.chat(chat, GREEDY)[0].outputs[0].text
    offline.engine.close()

    port = free_port()
    server, log = start_weft_serve(
        ["--model", str(model), "--tensor-parallel-size", "2", "--set", "engine.cpu_kv_cache_bytes=1048576"],
        port,
        _environment(),
        timeout=240,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        completion = client.completions.create(
            model=model.name,
            prompt="The capital of France is",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].text == completion_expected
        streamed = client.chat.completions.create(
            model=model.name, messages=chat, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == chat_expected

        pids = {
            int(pid): int(rank) for rank, pid in re.findall(r"worker rank (\d+) \(pid (\d+)\) joined", "".join(log))
        }
        victim = next(pid for pid, rank in pids.items() if rank == 1)
        received: list[str] = []

        def stream() -> None:
            try:
                for chunk in client.completions.create(
                    model=model.name, prompt="Once", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
                ):
                    received.append(chunk.choices[0].text if chunk.choices else "")
            except Exception as error:  # noqa: BLE001 - the error the stream ends with
                received.append(f"ERROR {error}")

        caller = threading.Thread(target=stream)
        caller.start()
        while len(received) < 3:
            assert caller.is_alive(), received
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit after a worker died:\n" + "".join(log))
        stopped = time.monotonic() - killed
        caller.join(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = "".join(log)
    assert code != 0, output
    assert stopped < 30
    assert f"worker rank 1 (pid {victim}) killed by SIGKILL" in output
    assert "worker rank 1" in received[-1], received[-3:]


def test_two_tensor_parallel_engines_share_prefixes_through_mooncake(checkpoint, tmp_path):
    """Each rank stores its own heads' blocks under its rank's keys; a second TP=2 engine loads them."""
    from weft.engine.core.kv_cache_manager import block_hashes
    from weft_mooncake.local import LocalMooncake
    from weft_mooncake.system import missing_library_problem

    problem = missing_library_problem()
    if problem is not None:
        pytest.skip(problem)
    from mooncake.store import MooncakeDistributedStore

    model = checkpoint("llama")
    shared = [(7 * i + 3) % 4000 + 10 for i in range(70)]  # four full blocks of 16, and 6 tokens
    first_prompt, second_prompt = shared + [11, 12], shared + [21, 22, 23]
    reference = LLM(model=str(model), engine={"num_kv_blocks": 96})
    expected = [output.outputs[0].token_ids for output in reference.generate([first_prompt, second_prompt], GREEDY)]
    reference.engine.close()
    engine = {"num_kv_blocks": 96, "tensor_parallel_size": 2}
    with LocalMooncake(segment_size=64 << 20, log_dir=tmp_path) as store:
        options = {"use": {"kv_connector": "mooncake"}, "plugins": {"mooncake": store.options()}}
        with LLM(model=str(model), engine=engine, **options) as first:
            assert first.generate([first_prompt], GREEDY)[0].outputs[0].token_ids == expected[0]
            model_identity = first.engine.kv_connector.scheduler_side.context.model
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", store.metadata_server, 0, 0, "tcp", "", store.master_server_address) == 0
        try:
            for rank in (0, 1):
                prefix = f"weft/{model_identity}/float32/tp{rank}of2/pp0of1/attention/16/"
                keys = [prefix + block_hash.hex() for block_hash in block_hashes(first_prompt, 16)]
                assert client.batch_is_exist(keys) == [1, 1, 1, 1], rank
        finally:
            client.close()
        with LLM(model=str(model), engine=engine, **options) as second:
            assert second.generate([second_prompt], GREEDY)[0].outputs[0].token_ids == expected[1]
            stats = second.engine.kv_connector.stats
            assert (stats.hits, stats.hit_tokens, stats.failed_load_tokens) == (1, 64, 0)


def test_deepseek_v4_with_expert_parallelism_gives_the_greedy_tokens_of_one_device(tmp_path):
    """EP=2: each rank holds half of the routed experts, the dense parts split over both; 4 prompts, 32 tokens."""
    pytest.importorskip("weft_dsv4")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV4ForCausalLM")
    from weft_dsv4.config import CSA, HCA, SLIDING
    from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint

    folder = write_checkpoint(tmp_path / "dsv4", tiny_config([HCA, CSA, SLIDING, CSA], hc_mult=2, index_topk=3), seed=7)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (length,), generator=generator).tolist() for length in (5, 23, 41, 12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": 24}
    with LLM(model=str(folder), engine=engine) as one:
        expected = [output.outputs[0].token_ids for output in one.generate(prompts, params)]
    with LLM(model=str(folder), engine={**engine, "tensor_parallel_size": 2, "enable_expert_parallel": True}) as two:
        assert [output.outputs[0].token_ids for output in two.generate(prompts, params)] == expected


@pytest.mark.parametrize(
    "layout", [{"enable_expert_parallel": True}, {"enable_expert_parallel": False}], ids=["ep2", "tp2-expert-columns"]
)
def test_qwen3_moe_over_two_ranks_gives_the_greedy_tokens_of_one_device(tmp_path, tokenizer_files, layout):
    """EP=2: each rank holds 8 of the 16 experts, routes its half of the rows and gets the others' routing;
    without expert parallelism each rank holds half of every expert's columns."""
    from test_moe_families import make_moe_model

    folder = make_moe_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer_files)
    expected, _ = greedy_tokens(folder)
    got, _ = greedy_tokens(folder, tensor_parallel_size=2, **layout)
    assert got == expected


def test_gpt_oss_with_expert_parallelism_gives_the_greedy_tokens_of_one_device(tmp_path, tokenizer_files):
    """gpt-oss shares Qwen3-MoE's block (as Mixtral does, which adds nothing to it): EP=2 exchanges its tokens
    too, with its router and expert biases, its attention sinks split with the heads, and a prompt longer than
    its sliding window (12)."""
    from test_moe_families import make_moe_model

    folder = make_moe_model(tmp_path / "gpt_oss", "gpt_oss", tokenizer_files)
    expected, _ = greedy_tokens(folder)
    got, _ = greedy_tokens(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    assert got == expected


def test_expert_parallel_ranks_read_only_their_experts(tmp_path, tokenizer_files):
    from safetensors.torch import load_file

    from test_moe_families import make_moe_model
    from weft.models.qwen3_moe import Qwen3MoeFamily

    folder = make_moe_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer_files)  # 16 experts; layer 1 dense
    module, reads = _load_rank(folder, Qwen3MoeFamily(), rank=1, enable_expert_parallel=True)
    experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name, *_ in reads if ".experts." in name}
    assert experts_read == set(range(8, 16))
    stored = load_file(str(folder / "model.safetensors"))
    experts = module.model.layers[2].mlp.experts
    assert experts.down_proj[3].equal(stored["model.layers.2.mlp.experts.11.down_proj.weight"])
    assert experts.gate_up_proj[3, 32:].equal(stored["model.layers.2.mlp.experts.11.up_proj.weight"])


class _Recording:
    """Wraps a loader's WeightSlice and records what is read of it."""

    def __init__(self, name: str, stored, reads: list) -> None:
        self.name, self.stored, self.reads = name, stored, reads
        self.shape = stored.shape

    def narrow(self, dim: int, start: int, length: int):
        self.reads.append((self.name, dim, start, length))
        return self.stored.narrow(dim, start, length)

    def load(self):
        self.reads.append((self.name, "whole"))
        return self.stored.load()


def _load_rank(folder: Path, family, rank: int, loader=None, **layout: object):
    """Build and load ``family``'s model as ``rank`` of two tensor ranks (no process group: no forward runs)
    through ``loader`` (default: the plain safetensors loader)."""
    from weft.builtins.safetensors_loader import SafetensorsLoader
    from weft.contracts.loader import WeightSlice
    from weft.contracts.model import ModelConfig
    from weft.contracts.parallel import Communicator, ParallelLayout
    from weft.distributed.state import ParallelGroups, using_parallel

    class Recording(_Recording, WeightSlice):
        pass

    parallel_layout = ParallelLayout(tensor_parallel_size=2, rank=rank, **layout)
    tensor = Communicator(None, torch.device("cpu"))
    tensor.size, tensor.rank = 2, rank
    loader = loader or SafetensorsLoader()
    source = loader.resolve(str(folder))
    config = ModelConfig(
        architecture=source.hf_config["architectures"][0],
        hf_config=source.hf_config,
        dtype="float32",
        block_size=16,
        max_model_len=256,
        parallel=parallel_layout,
    )
    with using_parallel(ParallelGroups(parallel_layout, tensor, torch.device("cpu"))):
        module = family.build(config, torch.device("cpu"))
    reads: list = []
    family.load_weights(
        module, ((name, Recording(name, part, reads)) for name, part in loader.iter_weight_slices(source, "float32"))
    )
    return module, reads


def test_each_rank_reads_only_its_part_of_the_checkpoint(checkpoint, tmp_path):
    from safetensors.torch import load_file

    from weft.models.llama import LlamaFamily

    folder = checkpoint("llama", vocab_size=1001)  # 4 heads of 16, 2 KV heads, MLP 128, vocabulary 1,001
    stored = load_file(str(folder / "model.safetensors"))
    module, reads = _load_rank(folder, LlamaFamily(), rank=1)
    read = {(name, *rest) for name, *rest in reads}
    layer = "model.layers.0"
    assert (f"{layer}.self_attn.q_proj.weight", 0, 32, 32) in read  # query heads 2-3
    assert (f"{layer}.self_attn.k_proj.weight", 0, 16, 16) in read  # key/value head 1
    assert (f"{layer}.self_attn.o_proj.weight", 1, 32, 32) in read  # the input columns of heads 2-3
    assert (f"{layer}.mlp.down_proj.weight", 1, 64, 64) in read
    assert ("model.embed_tokens.weight", 0, 501, 500) in read  # rows 501-1000, one padding row
    whole = {name for name, *rest in reads if rest == ["whole"]}
    assert all(name.endswith("norm.weight") for name in whole), whole
    attention = module.model.layers[0].self_attn
    expected = torch.cat(
        [
            stored[f"{layer}.self_attn.q_proj.weight"][32:],
            stored[f"{layer}.self_attn.k_proj.weight"][16:],
            stored[f"{layer}.self_attn.v_proj.weight"][16:],
        ]
    )
    assert attention.qkv_proj.weight.equal(expected)
    embedding = module.model.embed_tokens.weight
    assert embedding[:500].equal(stored["model.embed_tokens.weight"][501:]) and not embedding[500].any()

    pytest.importorskip("weft_dsv4")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        return
    from weft_dsv4.config import CSA, HCA
    from weft_dsv4.model import DeepseekV4Family
    from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint

    dsv4 = write_checkpoint(tmp_path / "dsv4", tiny_config([HCA, CSA]), seed=7)  # 8 routed experts
    module, reads = _load_rank(dsv4, DeepseekV4Family(), rank=1, enable_expert_parallel=True)
    experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name, *_ in reads if ".experts." in name}
    assert experts_read == {4, 5, 6, 7}
    stored = load_file(str(next(dsv4.glob("*.safetensors"))))
    routed = module.model.layers[1].mlp.experts
    down = next(name for name in stored if ".1.ffn.experts.5.w2" in name or "layers.1.mlp.experts.5.down_proj" in name)
    assert routed.down_proj[1].equal(stored[down])


def test_the_ray_executor_on_a_local_ray_cluster_gives_the_greedy_tokens_of_one_device(checkpoint, site, tmp_path):
    """`weft generate` joins a running Ray cluster (plugins.ray.address) and places two ranks as actors; an actor
    whose machine lacks a plugin of the engine's lock refuses to start, naming its rank and the difference."""
    import json
    import socket

    from weft.plugins.lock import freeze

    ray = pytest.importorskip("ray")
    model = checkpoint("llama")
    prompts = ["The capital of France is", "Once upon a time"]
    with LLM(model=str(model), engine={"cpu_kv_cache_bytes": 1 << 20}) as one:
        expected = [output.outputs[0].token_ids for output in one.generate(prompts, GREEDY)]
    cluster = ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, namespace="weft-test", log_to_driver=False
    )
    try:
        address = cluster.address_info["gcs_address"]
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "weft.cli",
                "generate",
                "--json",
                "--no-chat",
                "--model",
                str(model),
                "--max-tokens",
                "16",
                "--ignore-eos",
                "--tensor-parallel-size",
                "2",
                "--distributed-executor-backend",
                "ray",
                "--set",
                f'plugins.ray.address="{address}"',
                "--set",
                "engine.cpu_kv_cache_bytes=1048576",
                *(argument for prompt in prompts for argument in ("--prompt", prompt)),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=_environment(),
        )
        # Structured outputs through the actors: the forward, then the sampling with the bitmask.
        constrained = SamplingParams(
            temperature=0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(choice=["yes, certainly", "no, never", "maybe later"]),
        )
        with LLM(model=str(model), engine={"cpu_kv_cache_bytes": 1 << 20}) as one:
            expected_choice = [output.outputs[0].text for output in one.generate(prompts, constrained)]
        with LLM(
            model=str(model),
            engine={"cpu_kv_cache_bytes": 1 << 20},
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            plugins={"ray": {"address": address}},
        ) as spread:
            chosen = [output.outputs[0].text for output in spread.generate(prompts, constrained)]
        # The engine's process sees one more plugin (its own site folder) than the cluster's actors do.
        site.add_distribution(
            "weft-alpha", entry_points={"weft.hooks": {"alpha": "weft_alpha"}}, modules={"weft_alpha": ""}
        )
        lock = tmp_path / "weft.lock"
        lock.write_text(site.weft("plugins", "freeze").stdout)
        assert "weft-alpha" in lock.read_text() and "weft-alpha" not in freeze()
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "weft.cli",
                "generate",
                "--model",
                str(model),
                "--max-tokens",
                "2",
                "--prompt",
                "hi",
                "--tensor-parallel-size",
                "2",
                "--distributed-executor-backend",
                "ray",
                "--set",
                f'plugins.ray.address="{address}"',
                "--set",
                "engine.cpu_kv_cache_bytes=1048576",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**_environment(), "PYTHONPATH": site.env()["PYTHONPATH"], "WEFT_PLUGINS_LOCK": str(lock)},
        )
    finally:
        ray.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert [result["outputs"][0]["token_ids"] for result in results] == expected
    # The ranks ran as Ray actors (their start-up lines come through Ray's log forwarding, which folds identical
    # lines of the two ranks into one; rank 1 took part: tensor parallelism's all-reduce needs it for any token).
    assert "(RayWorker pid=" in run.stderr
    assert chosen == expected_choice and set(chosen) <= {"yes, certainly", "no, never", "maybe later"}
    assert refused.returncode == 1
    assert re.search(
        rf"weft: error: the installed plugins on {re.escape(socket.gethostname())} \(Ray worker rank \d\) "
        rf"differ from the lock {re.escape(str(lock))} \(named by WEFT_PLUGINS_LOCK\):\n"
        rf"  - weft-alpha 0.1.0 removed: locked, but not installed\n",
        refused.stderr,
    ), refused.stderr[-3000:]


def test_a_gguf_model_is_read_in_slices():
    """The embedded GGUF model's tensors come as slices of its dequantized cache: a rank reads its part."""
    from conftest import smollm2_gguf
    from weft.plugins import PluginRegistry

    loader = PluginRegistry().load("loader", "gguf")()
    source = loader.resolve(str(smollm2_gguf()))
    whole = dict(loader.iter_weights(source, "float32"))
    name, part = next(
        (name, part) for name, part in loader.iter_weight_slices(source, "float32") if name.endswith("q_proj.weight")
    )
    assert part.narrow(0, 64, 64).equal(whole[name][64:128]) and part.narrow(1, 5, 7).equal(whole[name][:, 5:12])


def _random_moe(settings, index: int, seed: int, hash_to: list[int] | None = None):
    """DeepSeek V4's MoE layer ``index`` on one device with random weights (``hash_to``: every token's experts)."""
    from weft_dsv4.moe import MoE

    generator = torch.Generator().manual_seed(seed)
    layer = MoE(settings, index)
    for parameter in layer.parameters():
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    if layer.gate.hashed:
        table = torch.randint(
            0, settings.num_experts, (settings.vocab_size, settings.experts_per_token), generator=generator
        )
        # Distinct picks per token, as a real table has them.
        table[:, 1] = (table[:, 0] + 1 + table[:, 1] % (settings.num_experts - 1)) % settings.num_experts
        layer.gate.tid2eid.copy_(torch.tensor([hash_to] * settings.vocab_size) if hash_to else table)
    else:
        layer.gate.e_score_correction_bias.copy_(torch.randn(settings.num_experts, generator=generator) * 0.1)
    return layer


EXCHANGE_CASES = [(1, 1, None), (0, 5, None), (1, 8, None), (0, 7, [0, 1]), (1, 3, None)]
"""``(layer, tokens, hash_to)``: layer 0 hash-routed, layer 1 scored. One token leaves rank 1 no row of its own;
five and seven split 3 + 2 and 4 + 3 (padded); every pick on rank 0's experts leaves rank 1's GEMMs no row."""


def _exchange_config() -> dict:
    from weft_dsv4.config import CSA, HCA
    from weft_dsv4.tiny_checkpoint import tiny_config

    return tiny_config([HCA, CSA], num_hash_layers=1)


def _expert_parallel_rank(rank: int, world: int, port: int, results) -> None:
    """One rank of an EP=2 MoE, its weights sliced from :func:`_random_moe`'s: what its router, its expert GEMMs
    and its collectives saw, and its output, for every case of ``EXCHANGE_CASES``."""
    import torch.distributed as dist

    from weft.contracts.parallel import Communicator, ParallelLayout
    from weft.distributed.state import ParallelGroups, using_parallel
    from weft_dsv4 import moe
    from weft_dsv4.config import DeepseekV4Settings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    seen: dict[str, list] = {"collectives": [], "router_rows": [], "gemm_rows": []}

    class Recording(Communicator):
        def all_reduce(self, tensor):
            seen["collectives"].append(("all_reduce", tuple(tensor.shape)))
            return super().all_reduce(tensor)

        def all_gather(self, tensor, dim=-1):
            seen["collectives"].append(("all_gather", tuple(tensor.shape)))
            return super().all_gather(tensor, dim)

        def reduce_scatter(self, tensor):
            seen["collectives"].append(("reduce_scatter", tuple(tensor.shape)))
            return super().reduce_scatter(tensor)

    from weft.layers import moe as core_moe

    grouped_matmul = core_moe.grouped_matmul

    def counting(rows, weights, ends):
        seen["gemm_rows"].append(int(ends[-1]))  # the rows the GEMMs compute: those of this rank's experts
        return grouped_matmul(rows, weights, ends)

    core_moe.grouped_matmul = counting
    config = _exchange_config()
    layout = ParallelLayout(tensor_parallel_size=world, enable_expert_parallel=True, rank=rank)
    settings = DeepseekV4Settings(config, layout)
    reports = []
    for index, tokens, hash_to in EXCHANGE_CASES:
        whole = _random_moe(DeepseekV4Settings(config), index, seed=index, hash_to=hash_to)
        with using_parallel(
            ParallelGroups(layout, Recording(dist.group.WORLD, torch.device("cpu")), torch.device("cpu"))
        ):
            layer = moe.MoE(settings, index)
        layer.gate.load_state_dict(whole.gate.state_dict())
        for name, part in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            layer.experts.load_stacked(part, getattr(whole.experts, name).data, name)
        columns = slice(rank * settings.shared_intermediate, (rank + 1) * settings.shared_intermediate)
        for name in ("gate_proj", "up_proj"):
            getattr(layer.shared_experts, name).weight.data.copy_(
                getattr(whole.shared_experts, name).weight.data[columns]
            )
        layer.shared_experts.down_proj.weight.data.copy_(whole.shared_experts.down_proj.weight.data[:, columns])
        layer.gate.register_forward_pre_hook(lambda module, inputs: seen["router_rows"].append(inputs[0].shape[0]))
        generator = torch.Generator().manual_seed(100 + tokens)
        hidden = torch.randn(tokens, settings.hidden_size, generator=generator)
        input_ids = torch.randint(0, settings.vocab_size, (tokens,), generator=generator)
        for key in seen:
            seen[key].clear()
        with torch.no_grad():
            output = layer(hidden, input_ids)
        # Plain lists: a tensor would travel as shared memory this process must outlive the reading of.
        reports.append({**{key: list(value) for key, value in seen.items()}, "output": output.tolist()})
    results.put((rank, reports))
    dist.destroy_process_group()


def test_expert_parallelism_exchanges_each_shard_s_tokens_with_the_ranks_of_their_experts():
    """EP=2 over uneven token counts against the MoE on one device: each rank routes only its own shard of the
    tokens (none when one token leaves it none), its expert GEMMs compute exactly the (token, expert) pairs of
    every shard that land on its experts (none when all land on the other rank's), and the layer's collectives are
    the exchange's (routing all-gathered, outputs reduce-scattered and all-gathered), not an all-reduce."""
    pytest.importorskip("weft_dsv4")
    import math

    import torch.multiprocessing as torch_mp

    from weft_dsv4.config import DeepseekV4Settings

    config = _exchange_config()
    settings = DeepseekV4Settings(config)
    context = torch_mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_expert_parallel_rank, args=(rank, 2, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    reports = {}
    deadline = time.monotonic() + 240
    while len(reports) < 2:
        assert time.monotonic() < deadline, "the ranks did not report within 240 s"
        try:
            rank, report = results.get(timeout=5)
            reports[rank] = report
        except Exception:  # noqa: BLE001 - queue.Empty: check the ranks are alive, then wait on
            dead = [process.exitcode for process in ranks if process.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
    for process in ranks:
        process.join(timeout=60)
    experts_per_rank = settings.num_experts // 2
    k = settings.experts_per_token
    for case, (index, tokens, hash_to) in enumerate(EXCHANGE_CASES):
        whole = _random_moe(settings, index, seed=index, hash_to=hash_to)
        generator = torch.Generator().manual_seed(100 + tokens)
        hidden = torch.randn(tokens, settings.hidden_size, generator=generator)
        input_ids = torch.randint(0, settings.vocab_size, (tokens,), generator=generator)
        with torch.no_grad():
            expected = whole(hidden, input_ids)
            picked, _ = whole.gate(hidden, input_ids)
        shard = math.ceil(tokens / 2)
        width = 4 * math.ceil(2 * k / 4)
        for rank in range(2):
            seen = reports[rank][case]
            label = f"rank {rank}, layer {index}, {tokens} tokens"
            torch.testing.assert_close(
                torch.tensor(seen["output"]).view_as(expected), expected, atol=1e-5, rtol=1e-5, msg=label
            )
            assert seen["router_rows"] == [max(0, min(shard, tokens - rank * shard))], label
            pairs = int(((picked // experts_per_rank) == rank).sum())
            assert seen["gemm_rows"] == [pairs, pairs], label  # gate/up, then down
            assert seen["collectives"] == [
                ("all_gather", (shard, width)),
                ("reduce_scatter", (2 * shard, settings.hidden_size)),
                ("all_gather", (shard, settings.hidden_size)),
            ], label
    assert [reports[1][3]["gemm_rows"], reports[1][0]["router_rows"]] == [[0, 0], [0]]


SLOW_LLAMA = '''
    import time

    from weft.models.llama import LlamaFamily

    RECORD = {record!r}
    SLEEP_SECONDS = {sleep!r}


    class SlowLlamaFamily(LlamaFamily):
        """The Llama family, each forward held {sleep} s longer and its (stage, tokens, start, end) appended to
        RECORD."""

        def build(self, config, device):
            module = super().build(config, device)
            stage, forward = config.parallel.pipeline_rank, module.forward

            def timed(input_ids, *args, **kwargs):
                start = time.monotonic()
                time.sleep(SLEEP_SECONDS)
                output = forward(input_ids, *args, **kwargs)
                end = time.monotonic()
                with open(RECORD, "a") as record:
                    record.write(f"{{stage}} {{input_ids.shape[0]}} {{start!r}} {{end!r}}\\n")
                return output

            module.forward = timed
            return module
'''


def test_pipeline_stages_work_on_different_micro_batches_at_once(checkpoint, site, tmp_path, monkeypatch):
    """PP=2 on a model whose forward is held 0.5 s (a throwaway family in a site both worker processes see): the
    4-prompt prefill is cut into two micro-batches, and stage 1 runs the first (monotonic clock, one host) while
    stage 0 runs the second. The tokens stay those of one device."""
    import json
    import shutil

    record = tmp_path / "forwards.txt"
    site.add_distribution(
        "weft-slow-llama",
        entry_points={"weft.model": {"SlowLlamaForCausalLM": "weft_slow_llama:SlowLlamaFamily"}},
        modules={"weft_slow_llama": SLOW_LLAMA.format(record=str(record), sleep=0.5)},
    )
    monkeypatch.syspath_prepend(str(site.root))
    monkeypatch.setenv("PYTHONPATH", site.env()["PYTHONPATH"])  # the spawned workers find the family too
    model = tmp_path / "slow-llama"
    shutil.copytree(checkpoint("llama"), model)
    hf_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf_config, "architectures": ["SlowLlamaForCausalLM"]}))
    expected, _ = greedy_tokens(checkpoint("llama"))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(model=str(model), engine={"cpu_kv_cache_bytes": 1 << 20, "pipeline_parallel_size": 2}) as llm:
        got = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    assert got == [tokens[:3] for tokens in expected]
    forwards: dict[int, list[tuple[int, float, float]]] = {0: [], 1: []}
    for line in record.read_text().splitlines():
        stage, tokens, start, end = line.split()
        forwards[int(stage)].append((int(tokens), float(start), float(end)))
    prompt_tokens = sum(map(len, PROMPTS))
    # The prefill step (every prompt at once) ran as two micro-batches on both stages, in the same order.
    first_step = [[tokens for tokens, *_ in forwards[stage][:2]] for stage in (0, 1)]
    assert first_step[0] == first_step[1] and sum(first_step[0]) == prompt_tokens and min(first_step[0]) > 0, forwards
    (_, stage1_start, stage1_end), (_, stage0_start, stage0_end) = forwards[1][0], forwards[0][1]
    overlap = min(stage1_end, stage0_end) - max(stage1_start, stage0_start)
    assert overlap > 0, (
        f"stage 1 ran micro-batch 0 over [{stage1_start:.3f}, {stage1_end:.3f}], stage 0 ran "
        f"micro-batch 1 over [{stage0_start:.3f}, {stage0_end:.3f}]: no overlap"
    )
