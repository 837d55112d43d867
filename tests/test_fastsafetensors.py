"""weft-fastsafetensors: the host path reads what the plain loader reads; reading is split over gloo ranks;
a draft on one pipeline stage falls back to the plain loader through a copied load config."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from weft.builtins.safetensors_loader import SafetensorsLoader
from weft.contracts.loader import LoadConfig
from weft.plugins import PluginRegistry
from weft.resolve import draft_load_config
from weft_fastsafetensors.loader import FastSafetensorsLoader, batches

NUM_SHARDS = 4


def write_checkpoint(folder: Path) -> Path:
    """A 4-shard checkpoint with an index, float32 and bfloat16 tensors and an integer table."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard in range(NUM_SHARDS):
        name = f"model-{shard + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        tensors = {
            f"model.layers.{shard}.mlp.up_proj.weight": torch.randn(24, 16, generator=generator),
            f"model.layers.{shard}.input_layernorm.weight": torch.randn(16, generator=generator).to(torch.bfloat16),
        }
        if shard == 0:
            tensors["model.tid2eid"] = torch.randint(0, 8, (32, 2), generator=generator)
        save_file(tensors, folder / name)
        weight_map |= {tensor: name for tensor in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fst") / "model")


def plain(checkpoint: Path, dtype: str) -> dict[str, torch.Tensor]:
    loader = SafetensorsLoader()
    return dict(loader.iter_weights(loader.resolve(str(checkpoint)), dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_host_path_loads_the_plain_loaders_tensors(checkpoint, dtype):
    loader = FastSafetensorsLoader.for_load(None, LoadConfig(loader="fastsafetensors"))
    names, tensors = [], {}
    for name, tensor in loader.iter_weights(loader.resolve(str(checkpoint)), dtype):
        names.append(name)
        tensors[name] = tensor.clone()
    expected = plain(checkpoint, dtype)
    assert sorted(names) == sorted(expected), "each tensor once"
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert tensors["model.tid2eid"].dtype == torch.int64


def test_the_engine_slice_path_goes_through_fastsafetensors(checkpoint, monkeypatch):
    """Families that read weight slices (tensor parallelism) get this loader's tensors too, never the plain
    reader's partial reads it would inherit from SafetensorsLoader."""
    import weft_fastsafetensors.loader as module

    loader = FastSafetensorsLoader.for_load(None, LoadConfig(loader="fastsafetensors"))
    source = loader.resolve(str(checkpoint))
    read = []
    original = module.FastSafetensorsLoader.iter_weights

    def counted(self, source, dtype):
        for name, tensor in original(self, source, dtype):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(module.FastSafetensorsLoader, "iter_weights", counted)
    sliced = {name: part.narrow(0, 0, 1) for name, part in loader.iter_weight_slices(source, "float32")}
    expected = plain(checkpoint, "float32")
    assert sorted(read) == sorted(expected) == sorted(sliced)
    for name, tensor in expected.items():
        assert torch.equal(sliced[name], tensor.narrow(0, 0, 1)), name


def test_auto_never_picks_it_over_the_plain_reader(checkpoint):
    from weft.config import load_config
    from weft.resolve import resolve_source

    loader, _ = resolve_source(PluginRegistry(), load_config(None, {"model": str(checkpoint)}))
    assert type(loader) is SafetensorsLoader


def test_each_reader_gets_one_shard_per_batch():
    files = [f"s{index}" for index in range(5)]
    assert batches(files, 2) == [{0: ["s0"], 1: ["s1"]}, {0: ["s2"], 1: ["s3"]}, {0: ["s4"]}]
    assert batches(files, 1) == [{0: [file]} for file in files]


def test_a_draft_falls_back_only_under_pipeline_parallelism_and_only_from_a_collective_loader():
    registry = PluginRegistry()
    target = LoadConfig(
        loader="fastsafetensors",
        pipeline_parallel_size=2,
        pipeline_parallel_rank=1,
        tensor_parallel_size=2,
        tensor_parallel_rank=1,
        download_dir="/cache",
        revision="v1",
    )
    draft = draft_load_config(target, registry)
    assert draft is not target and draft.loader == "safetensors"
    assert msgspec.structs.replace(draft, loader="fastsafetensors") == target, "a copy: every other field kept"
    assert target.loader == "fastsafetensors", "the target keeps fastsafetensors"
    one_stage = msgspec.structs.replace(target, pipeline_parallel_size=1, pipeline_parallel_rank=0)
    assert draft_load_config(one_stage, registry) is one_stage
    for loader in ("safetensors", "gguf", "auto"):
        other = msgspec.structs.replace(target, loader=loader)
        assert draft_load_config(other, registry) is other


RANK_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from weft.contracts.loader import LoadConfig
from weft.plugins import PluginRegistry
from weft.resolve import build_loader, draft_load_config
from weft.config import load_config
from weft_fastsafetensors.loader import FastSafetensorsLoader, agree_on_files

rank, world, port, folder, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
report = {}

# The target: every rank loads it collectively, each reading its share of the shards.
loader = FastSafetensorsLoader.for_load(None, LoadConfig(loader="fastsafetensors", pipeline_parallel_size=world,
                                                         pipeline_parallel_rank=rank))
torch.save(dict(loader.iter_weights(loader.resolve(folder), "float32")), f"{out}/target{rank}.pt")

# A subgroup whose first rank is world rank 1: the shard list is broadcast from world rank 1.
subgroup = dist.new_group([1, 2])
if rank in (1, 2):
    mine = ["a", "b"] if rank == 1 else ["a", "other"]
    try:
        agree_on_files(mine, subgroup)
        report["agreed"] = True
    except ValueError as error:
        report["agreed"] = str(error)

# The draft lives on the last stage only: it must load alone, through the plain loader.
if rank == world - 1:
    draft_config = draft_load_config(loader.load_config, PluginRegistry())
    draft = build_loader(PluginRegistry(), load_config(None, {"model": folder}), draft_config.loader, draft_config)
    report["draft_loader"] = type(draft).__name__
    torch.save(dict(draft.iter_weights(draft.resolve(folder), "float32")), f"{out}/draft.pt")
dist.barrier()
json.dump(report, open(f"{out}/report{rank}.json", "w"))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_three_gloo_ranks_load_collectively_and_the_last_stage_draft_loads_alone(checkpoint, tmp_path):
    world, port = 3, free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(RANK_SCRIPT),
                str(rank),
                str(world),
                str(port),
                str(checkpoint),
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output
    expected = plain(checkpoint, "float32")
    for name in [f"target{rank}.pt" for rank in range(world)] + ["draft.pt"]:
        loaded = torch.load(tmp_path / name)
        assert loaded.keys() == expected.keys(), name
        assert all(torch.equal(loaded[key], expected[key]) for key in expected), name
    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in range(world)]
    assert reports[1]["agreed"] is True
    assert "rank 2 sees shards ['a', 'other']" in reports[2]["agreed"] and "world rank 1" in reports[2]["agreed"]
    assert reports[2]["draft_loader"] == "SafetensorsLoader"


def test_the_worker_reads_a_draft_through_the_single_stage_fallback_under_pipeline_parallelism(checkpoint, caplog):
    """The worker's draft loader (``DraftModelLoader.weights``, and ``load`` through the same load config): under
    pipeline parallelism a speculator's checkpoint is read by the plain loader, logged; on one stage by the
    target's fastsafetensors. Both read the same tensors."""
    from types import SimpleNamespace

    from weft.config import load_config
    from weft.contracts.parallel import ParallelLayout
    from weft.runner.worker import _DraftModels

    config = load_config(None, {"model": str(checkpoint), "use.loader": "fastsafetensors"})

    def draft_models(stages: int) -> _DraftModels:
        layout = ParallelLayout(pipeline_parallel_size=stages, rank=stages - 1)
        worker = SimpleNamespace(
            config=config,
            registry=PluginRegistry(),
            device=torch.device("cpu"),
            local_rank=0,
            parallel=SimpleNamespace(layout=layout),
        )
        return _DraftModels(worker)

    with caplog.at_level("INFO", logger="weft.runner"):
        staged = {name: part.load() for name, part in draft_models(2).weights("float32")}
    assert "the draft's weights are read by loader 'safetensors': 'fastsafetensors' loads collectively" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="weft.runner"):
        single = {name: part.load() for name, part in draft_models(1).weights("float32")}
    assert "read by loader" not in caplog.text
    assert staged.keys() == single.keys() and all(staged[name].equal(single[name]) for name in single)
