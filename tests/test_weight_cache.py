"""weft-weight-cache: the frame protocol, every safety rule, the daemon's answers, the engine's fallback, a real
`weft weights serve` daemon serving a `weft generate` process whose checkpoint no longer holds the weights, and two
daemons on loopback as the two nodes of TP=2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from conftest import free_port, make_tiny_model
from weft.builtins.safetensors_loader import SafetensorsLoader
from weft.contracts.loader import LoadConfig
from weft_weight_cache.client import WeightCacheClient
from weft_weight_cache.daemon import WeightCacheServer, load_resident
from weft_weight_cache.key import cache_key, device_identity, socket_name
from weft_weight_cache.loader import WeightCacheLoader, WeightCacheOptions
from weft_weight_cache.protocol import (
    CacheKey,
    Error,
    FrameError,
    GetState,
    Mismatch,
    Ok,
    TensorEntry,
    TensorPart,
    decode_request,
    recv_frame,
    send_frame,
)
from weft_weight_cache.reads import ResidentSlice, whole_tensors
from weft_weight_cache.safety import (
    DeviceLock,
    SafetyError,
    check_peer,
    check_socket,
    check_socket_dir,
    prepare_socket_dir,
)
from weft_weight_cache.storage import ResidentWeights, map_arena, part_views

IS_ROOT = os.geteuid() == 0
NOBODY = 65534
KEY = CacheKey(
    fingerprint="f" * 64,
    architecture="LlamaForCausalLM",
    model_config="c" * 64,
    tensor_parallel_size=1,
    tensor_parallel_rank=0,
    pipeline_parallel_size=1,
    pipeline_parallel_rank=0,
    dtype="float32",
    quantization="none",
    revision="r",
    weft_version="1.2.0",
)
IDENTITY = device_identity("cpu", 0)


@pytest.fixture
def short_dir():
    """A socket folder with a short path (AF_UNIX paths stop at 107 bytes), 0700."""
    folder = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(5, 7, generator=generator)),
        ("b.bias", torch.randn(3, generator=generator).to(torch.bfloat16)),
        ("table", torch.randint(0, 9, (4, 2), generator=generator)),
        ("scalar", torch.tensor(2.5)),
    ]


class Served:
    """An in-process daemon serving :func:`weights` under :data:`KEY` on the CPU slot 0."""

    def __init__(self, folder: Path, **kwargs) -> None:
        self.resident = ResidentWeights(whole_tensors(weights()), "cpu")
        self.server = WeightCacheServer(KEY, self.resident, IDENTITY, folder / socket_name(IDENTITY), **kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def path(self) -> Path:
        return self.server.socket_path

    def close(self) -> None:
        self.server.close()
        self.thread.join(timeout=10)
        self.resident.close()


def whole_views(block: torch.Tensor, reply: Ok) -> dict[str, torch.Tensor]:
    """The mapped tensors of a daemon that holds each one whole."""
    assert all(len(entry.parts) == 1 and entry.parts[0].narrow is None for entry in reply.tensors)
    return {entry.name: views[0] for entry, views in part_views(block, reply.tensors)}


@pytest.fixture
def served(short_dir):
    daemon = Served(short_dir)
    yield daemon
    daemon.close()


# Frames.


def test_a_frame_round_trips_with_its_descriptors():
    left, right = socket.socketpair(socket.AF_UNIX)
    read_end, write_end = os.pipe()
    send_frame(left, GetState(KEY, IDENTITY), (write_end,))
    payload, fds = recv_frame(right)
    assert decode_request(payload) == GetState(KEY, IDENTITY) and len(fds) == 1
    os.write(fds[0], b"x")
    assert os.read(read_end, 1) == b"x", "the descriptor received is the one sent"
    for fd in (read_end, write_end, *fds):
        os.close(fd)
    left.close()
    assert recv_frame(right) is None, "end of stream between frames is a clean close"


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x00\x00\x00", r"ended inside a frame's length \(3 of 8 bytes\)"),
        (struct.pack(">Q", 10) + b"abc", r"ended inside a frame \(3 of 10 bytes\)"),
        (struct.pack(">Q", 1 << 40), r"a frame of 1099511627776 bytes exceeds the limit of 65536 bytes"),
    ],
)
def test_bad_frames_are_errors(data, message):
    left, right = socket.socketpair(socket.AF_UNIX)
    left.sendall(data)
    left.close()
    with pytest.raises(FrameError, match=message):
        recv_frame(right, max_bytes=65536)


def test_a_payload_that_is_no_request_is_an_error():
    with pytest.raises(FrameError, match="not a weight-cache request"):
        decode_request(msgspec.msgpack.encode({"type": "load_everything"}))
    with pytest.raises(FrameError, match="not a weight-cache request"):
        decode_request(b"\xc1garbage")


# Safety rules.


def test_the_socket_folder_is_created_0700_and_must_stay_private(short_dir):
    folder = prepare_socket_dir(short_dir / "sockets")
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o755)
    with pytest.raises(SafetyError, match=r"mode 0755; it must be 0700"):
        check_socket_dir(folder)


def test_a_symlinked_socket_folder_or_socket_is_refused(served, short_dir):
    link = short_dir / "link"
    link.symlink_to(short_dir)
    with pytest.raises(SafetyError, match="is a symlink"):
        check_socket_dir(link)
    socket_link = short_dir / "other.sock"
    socket_link.symlink_to(served.path)
    with pytest.raises(SafetyError, match=r"other.sock is a symlink"):
        check_socket(socket_link)
    check_socket(served.path)
    assert served.path.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(not IS_ROOT, reason="giving a folder to another owner needs root")
def test_a_folder_or_socket_of_another_owner_is_refused(served, short_dir):
    os.chown(served.path, NOBODY, -1)
    with pytest.raises(SafetyError, match=f"belongs to uid {NOBODY}, not to you"):
        check_socket(served.path)
    os.chown(served.path, 0, -1)
    os.chown(short_dir, NOBODY, -1)
    with pytest.raises(SafetyError, match=f"belongs to uid {NOBODY}"):
        check_socket(served.path)


def test_the_peer_uid_comes_from_the_kernel():
    left, right = socket.socketpair(socket.AF_UNIX)
    check_peer(right)
    with pytest.raises(
        SafetyError, match=f"uid {os.geteuid()} connected; this daemon serves uid {os.geteuid() + 1} only"
    ):
        check_peer(right, os.geteuid() + 1)
    left.close()
    right.close()


@pytest.mark.skipif(not IS_ROOT, reason="connecting as another user needs root")
def test_the_daemon_refuses_another_users_process(served, short_dir):
    short_dir.chmod(0o755)  # let the other user reach the socket: the peer check alone must stop it
    served.path.chmod(0o666)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the other user: a forked child that gives up root, then connects
        try:
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(served.path))
            payload, fds = recv_frame(sock)
            os.write(write_end, payload + bytes([len(fds)]))
        finally:
            os._exit(0)
    os.close(write_end)
    answer = b""
    while chunk := os.read(read_end, 4096):
        answer += chunk
    os.close(read_end)
    os.waitpid(child, 0)
    reply = msgspec.msgpack.decode(answer[:-1], type=Error)
    assert reply.message == f"a process of uid {NOBODY} connected; this daemon serves uid {os.geteuid()} only"
    assert answer[-1] == 0, "no descriptor reaches it"
    assert served.server.served == 0


def test_one_daemon_per_device(short_dir):
    first = DeviceLock(short_dir, "cpu0")
    with pytest.raises(
        SafetyError, match=rf"another weight-cache daemon \(pid {os.getpid()}\) already serves device cpu0"
    ):
        DeviceLock(short_dir, "cpu0")
    DeviceLock(short_dir, "cpu1").close()
    first.close()
    DeviceLock(short_dir, "cpu0").close()


# The daemon's answers.


def test_ok_maps_the_weights_copy_on_write_and_release_ends_the_lease(served):
    client = WeightCacheClient(served.path)
    reply, fds = client.get_state(KEY, IDENTITY)
    assert isinstance(reply, Ok) and len(fds) == 1
    with pytest.raises(PermissionError):
        os.write(fds[0], b"overwrite")  # the arena is sealed against writes
    block = map_arena(reply.arena, fds, "cpu")
    os.close(fds[0])
    mapped = whole_views(block, reply)
    for name, tensor in weights():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    mapped["a.weight"].fill_(7)  # a private copy: the daemon's arena is untouched
    assert served.server.leases
    client.release(reply.lease)
    assert not served.server.leases
    again, fds = client.get_state(KEY, IDENTITY)
    assert torch.equal(whole_views(map_arena(again.arena, fds, "cpu"), again)["a.weight"], weights()[0][1])
    os.close(fds[0])
    client.close()
    deadline = time.monotonic() + 10
    while served.server.leases and time.monotonic() < deadline:  # a closed connection drops its leases
        time.sleep(0.05)
    assert not served.server.leases


def test_a_key_mismatch_names_the_fields_and_a_device_mismatch_is_an_error(served):
    client = WeightCacheClient(served.path)
    other = msgspec.structs.replace(KEY, tensor_parallel_rank=1, tensor_parallel_size=2, dtype="bfloat16")
    reply, fds = client.get_state(other, IDENTITY)
    assert isinstance(reply, Mismatch) and fds == []
    assert reply.fields == ["tensor_parallel_size", "tensor_parallel_rank", "dtype"] and reply.served == KEY
    reply, _ = client.get_state(KEY, "cuda-GPU-0000")
    assert isinstance(reply, Error) and "device mismatch" in reply.message and IDENTITY in reply.message
    client.close()
    assert served.server.served == 0


@pytest.mark.parametrize("data", [struct.pack(">Q", 1 << 30), struct.pack(">Q", 3) + b"\xc1\xc1\xc1"])
def test_the_daemon_answers_a_bad_frame_with_an_error_and_keeps_serving(short_dir, data):
    daemon = Served(short_dir, max_frame_bytes=1 << 20)
    try:
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(daemon.path))
        raw.sendall(data)
        payload, _ = recv_frame(raw)
        assert b"protocol error" in payload
        assert recv_frame(raw) is None, "the daemon closes the connection"
        cut = socket.socket(socket.AF_UNIX)  # a client that dies mid-frame
        cut.connect(str(daemon.path))
        cut.sendall(struct.pack(">Q", 100) + b"abc")
        cut.close()
        reply, fds = WeightCacheClient(daemon.path).get_state(KEY, IDENTITY)
        assert isinstance(reply, Ok)
        os.close(fds[0])
    finally:
        daemon.close()


# The engine's loader.


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("wc") / "model", "llama", tokenizer_files)


def disk_weights(checkpoint: Path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    loader = SafetensorsLoader()
    return dict(loader.iter_weights(loader.resolve(str(checkpoint)), dtype))


def cache_loader(folder: Path, **load) -> WeightCacheLoader:
    return WeightCacheLoader.for_load(
        WeightCacheOptions(socket_dir=str(folder)), LoadConfig(loader="weight-cache", **load)
    )


def test_the_engine_maps_a_matching_key_and_falls_back_to_disk_on_anything_else(checkpoint, short_dir, caplog):
    loader = cache_loader(short_dir)
    source = loader.resolve(str(checkpoint))
    expected = disk_weights(checkpoint)
    with_nothing = dict(loader.iter_weights(source, "float32"))
    assert "no daemon serves" in caplog.text and "loading from disk with the 'safetensors' loader" in caplog.text
    assert all(torch.equal(with_nothing[name], expected[name]) for name in expected)

    key = cache_key(source, loader.load_config, "float32")
    resident = ResidentWeights(
        whole_tensors((name, tensor + 1) for name, tensor in expected.items()), "cpu"
    )  # tell them apart
    server = WeightCacheServer(key, resident, IDENTITY, short_dir / socket_name(IDENTITY))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        caplog.clear()
        mapped = dict(loader.iter_weights(source, "float32"))
        assert all(torch.equal(mapped[name], expected[name] + 1) for name in expected), "from the daemon, not the disk"
        assert not server.leases, "released once the weights were taken"
        caplog.clear()
        bf16 = dict(loader.iter_weights(source, "bfloat16"))
        assert "holds other weights: dtype (asked 'bfloat16', served 'float32')" in caplog.text
        assert all(torch.equal(bf16[name], expected[name].to(torch.bfloat16)) for name in expected)
        caplog.clear()
        other_rank = dict(
            cache_loader(short_dir, tensor_parallel_size=2, tensor_parallel_rank=1).iter_weights(source, "float32")
        )
        assert "tensor_parallel_size (asked 2, served 1), tensor_parallel_rank (asked 1, served 0)" in caplog.text
        assert all(torch.equal(other_rank[name], expected[name]) for name in expected)
        caplog.clear()
        (short_dir / "elsewhere.sock").symlink_to(short_dir / socket_name(IDENTITY))
        os.replace(short_dir / socket_name(IDENTITY), short_dir / "real.sock")
        (short_dir / socket_name(IDENTITY)).symlink_to(short_dir / "real.sock")
        dict(loader.iter_weights(source, "float32"))
        assert "is a symlink" in caplog.text and "loading from disk" in caplog.text
    finally:
        server.close()
        resident.close()


def test_a_daemon_holds_only_its_ranks_parts_and_the_rank_loads_what_it_would_read_from_disk(
    checkpoint, short_dir, caplog
):
    """Under TP=2 each daemon holds the parts its rank's model family reads (heads, columns, vocabulary rows;
    norms whole); a rank loading from it gets the parameters and reads it gets from disk. A PP=2 stage holds
    no part of the other stage's layers."""
    from test_distributed import _load_rank
    from weft.config import load_config
    from weft.models.llama import LlamaFamily
    from weft.resolve import load_config_for

    whole = disk_weights(checkpoint)
    config = load_config(None, {"model": str(checkpoint), "engine.tensor_parallel_size": 2})
    held_bytes = []
    for rank in (0, 1):
        key, resident = load_resident(config, load_config_for(config, "cpu", tensor_parallel_rank=rank), "safetensors")
        entries = {entry.name: entry for entry in resident.entries}
        assert entries.keys() == whole.keys()
        query = entries["model.layers.0.self_attn.q_proj.weight"]  # 4 heads of 16: two per rank
        assert query.shape == [64, 64] and [part.narrow for part in query.parts] == [[0, 32 * rank, 32]]
        assert [part.narrow for part in entries["model.layers.0.mlp.down_proj.weight"].parts] == [[1, 64 * rank, 64]]
        assert [part.narrow for part in entries["model.norm.weight"].parts] == [None]
        held_bytes.append(resident.nbytes)

        server = WeightCacheServer(key, resident, IDENTITY, short_dir / socket_name(IDENTITY))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            caplog.clear()
            engine = cache_loader(short_dir, tensor_parallel_size=2, tensor_parallel_rank=rank)
            cached, cached_reads = _load_rank(checkpoint, LlamaFamily(), rank, loader=engine)
            assert "loading from disk" not in caplog.text and not server.leases
            from_disk, disk_reads = _load_rank(checkpoint, LlamaFamily(), rank)
            assert cached_reads == disk_reads
            disk_parameters = dict(from_disk.named_parameters())
            for name, parameter in cached.named_parameters():
                assert torch.equal(parameter, disk_parameters[name]), name

            caplog.clear()  # a family that reads whole tensors cannot use parts: the disk
            assert dict(engine.iter_weights(engine.resolve(str(checkpoint)), "float32")).keys() == whole.keys()
            assert "holds parts of tensors, and this model family reads whole tensors" in caplog.text
        finally:
            server.close()
            resident.close()
    whole_bytes = sum(tensor.numel() * tensor.element_size() for tensor in whole.values())
    assert max(held_bytes) < 0.55 * whole_bytes, (held_bytes, whole_bytes)

    stages = load_config(None, {"model": str(checkpoint), "engine.pipeline_parallel_size": 2})
    _, last = load_resident(
        stages, load_config_for(stages, "cpu", pipeline_parallel_size=2, pipeline_parallel_rank=1), "safetensors"
    )
    held = {entry.name for entry in last.entries if entry.parts}
    last.close()
    assert held and not any(name.startswith(("model.layers.0.", "model.embed_tokens")) for name in held), held

    rows = ResidentSlice(TensorEntry("w", [4, 2], [TensorPart([0, 2, 2], "float32", [2, 2], 0)]), [torch.ones(2, 2)])
    assert torch.equal(rows.narrow(0, 2, 2), torch.ones(2, 2))
    with pytest.raises(
        ValueError,
        match=r"holds 2..3 along dim 0 of 'w' for this rank, and the model reads 0..1 along "
        r"dim 0: the daemon was started with other settings",
    ):
        rows.narrow(0, 0, 2)


def test_the_key_holds_the_stage_s_layers_and_expert_parallelism(tmp_path, tokenizer_files, served):
    """Two layouts that read other tensors never share a key: the stage's layers (an explicit
    ``engine.pipeline_partition`` equal to the even split is the same key; another partition is not) and
    ``engine.enable_expert_parallel``; the daemon names the field that differs."""
    from weft.config import load_config
    from weft.resolve import load_config_for
    from weft_weight_cache.protocol import mismatched_fields

    model = make_tiny_model(tmp_path / "three", "llama", tokenizer_files, num_hidden_layers=3)
    source = SafetensorsLoader().resolve(str(model))

    def key(rank: int = 1, **engine) -> CacheKey:
        config = load_config(None, {"model": str(model), **{f"engine.{name}": value for name, value in engine.items()}})
        size = engine.get("pipeline_parallel_size", 1)
        return cache_key(
            source,
            load_config_for(config, "cpu", pipeline_parallel_size=size, pipeline_parallel_rank=rank % size),
            "float32",
        )

    even = key(pipeline_parallel_size=2)
    assert even.stage_layers == (2, 1) and key(0, pipeline_parallel_size=2).stage_layers == (0, 2)
    assert key(pipeline_parallel_size=2, pipeline_partition=[2, 1]) == even
    other = key(pipeline_parallel_size=2, pipeline_partition=[1, 2])
    assert other.stage_layers == (1, 2) and mismatched_fields(other, even) == ["stage_layers"]
    assert key().stage_layers is None and not key().expert_parallel
    assert mismatched_fields(key(enable_expert_parallel=True), key()) == ["expert_parallel"]

    client = WeightCacheClient(served.path)
    reply, fds = client.get_state(msgspec.structs.replace(KEY, stage_layers=(1, 2)), IDENTITY)
    assert isinstance(reply, Mismatch) and reply.fields == ["stage_layers"] and fds == []
    reply, _ = client.get_state(msgspec.structs.replace(KEY, expert_parallel=True), IDENTITY)
    assert isinstance(reply, Mismatch) and reply.fields == ["expert_parallel"]
    client.close()


# A real daemon process and engine processes.


def weft(*args: str) -> list[str]:
    return [sys.executable, "-m", "weft.cli", *args]


def start_daemon(*args: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        weft("weights", "serve", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = process.stdout.readline()
    if not line.startswith("weft weights: serving"):
        process.kill()
        raise AssertionError(f"the daemon did not start: {line}{process.stderr.read()}")
    return process, line


def stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    return stderr


def zero_weights_keeping_headers_and_times(checkpoint: Path) -> None:
    """Overwrite every tensor byte of the shards with zeros, keeping the headers, sizes and modification times:
    the cache key cannot tell, so only an engine that reads the data would notice."""
    for shard in checkpoint.glob("*.safetensors"):
        info = shard.stat()
        with open(shard, "r+b") as handle:
            header = int.from_bytes(handle.read(8), "little")
            handle.seek(8 + header)
            handle.write(bytes(info.st_size - 8 - header))
        os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))


def generate(checkpoint: Path, folder: Path, *extra: str) -> dict:
    result = subprocess.run(
        weft(
            "generate",
            "The weather today",
            "--model",
            str(checkpoint),
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--set",
            f'plugins.weight-cache.socket_dir="{folder}"',
            *extra,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return {"output": json.loads(result.stdout.strip().splitlines()[-1])[0], "log": result.stderr}


def test_a_daemon_serves_an_engine_process_that_never_reads_the_checkpoint(checkpoint, tmp_path, short_dir):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    daemon, line = start_daemon("--model", str(model), "--socket-dir", str(short_dir))
    try:
        assert f"on {IDENTITY} at {short_dir / 'cpu0.sock'}" in line and "rank 0 of 1" in line
        second = subprocess.run(
            weft("weights", "serve", "--model", str(model), "--socket-dir", str(short_dir)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 1 and f"(pid {daemon.pid}) already serves device cpu0" in second.stderr

        reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        with torch.no_grad():  # transformers maps the shards: take the values before they are overwritten
            for parameter in reference.parameters():
                parameter.data = parameter.data.clone()
        zero_weights_keeping_headers_and_times(model)
        served = generate(model, short_dir, "--loader", "weight-cache")
        prompt = served["output"]["prompt_token_ids"]
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert served["output"]["outputs"][0]["token_ids"] == expected[0, len(prompt) :].tolist(), served["log"]
        assert "loading from disk" not in served["log"]

        from_disk = generate(model, short_dir)  # the plain loader reads the zeroed shards: the test can tell
        assert from_disk["output"]["outputs"][0]["token_ids"] != served["output"]["outputs"][0]["token_ids"]
    finally:
        log = stop(daemon)
    assert "lease" in log and not (short_dir / "cpu0.sock").exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_tp2_engine_of_two_launchers_on_loopback_maps_its_ranks_from_two_daemons(checkpoint, tmp_path, monkeypatch):
    """Two nodes on 127.0.0.1, each with its own runtime folder (so its own default socket folder), its daemon and
    its launcher of a TP=2 engine: each daemon holds its rank's parts; with the shards' data zeroed, the engine
    gives the greedy tokens TP=1 read from disk before, and each daemon leased its weights to the engine."""
    from test_distributed import greedy_tokens, two_launchers

    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    expected, _ = greedy_tokens(model)
    port = free_port()
    runtime = [tempfile.mkdtemp(prefix=f"wc{node}", dir="/tmp") for node in (0, 1)]
    folders = [Path(folder) / "weft-weight-cache" for folder in runtime]
    daemons = [
        subprocess.Popen(
            weft(
                "weights",
                "serve",
                "--model",
                str(model),
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rendezvous-port",
                str(port),
                "--tensor-parallel-size",
                "2",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "XDG_RUNTIME_DIR": runtime[node]},
        )
        for node in (0, 1)
    ]
    try:
        lines = [daemon.stdout.readline() for daemon in daemons]
        for node, line in enumerate(lines):
            assert f"for rank {node} of 2 (tp {node}/2, pp 0/1)" in line, line + daemons[node].stderr.read()
        source = SafetensorsLoader().resolve(str(model))
        expected_weights = disk_weights(model)
        for node in (0, 1):
            rank = LoadConfig(tensor_parallel_size=2, tensor_parallel_rank=node)
            client = WeightCacheClient(folders[node] / "cpu0.sock")
            reply, fds = client.get_state(cache_key(source, rank, "float32"), IDENTITY)
            assert isinstance(reply, Ok), reply
            block = map_arena(reply.arena, fds, "cpu")
            os.close(fds[0])
            mapped = {entry.name: (entry, views) for entry, views in part_views(block, reply.tensors)}
            assert mapped.keys() == expected_weights.keys()
            for name, (entry, views) in mapped.items():  # this rank's parts only, as read from disk
                whole = expected_weights[name]
                assert entry.parts, name
                for part, view in zip(entry.parts, views, strict=False):
                    assert torch.equal(view, whole if part.narrow is None else whole.narrow(*part.narrow)), name
            query = mapped["model.layers.0.self_attn.q_proj.weight"][0]
            assert [part.narrow for part in query.parts] == [[0, 32 * node, 32]]
            wrong = LoadConfig(tensor_parallel_size=2, tensor_parallel_rank=1 - node)
            reply, _ = client.get_state(cache_key(source, wrong, "float32"), IDENTITY)
            assert isinstance(reply, Mismatch) and reply.fields == ["tensor_parallel_rank"]
            client.close()

        zero_weights_keeping_headers_and_times(model)
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime[0])  # node 0's engine: this process and its workers
        got, node1_log = two_launchers(
            model, ("--loader", "weight-cache"), {"use": {"loader": "weight-cache"}}, {"XDG_RUNTIME_DIR": runtime[1]}
        )
        assert got == expected, node1_log
        assert "loading from disk" not in node1_log
    finally:
        logs = [stop(daemon) for daemon in daemons]
        for folder in runtime:
            shutil.rmtree(folder, ignore_errors=True)
    for log in logs:  # the test's client above, then the engine's rank
        assert log.count("weight cache: lease") == 2, log


def test_a_tp2_engine_of_one_launcher_maps_each_rank_from_its_cpu_slot_s_daemon(checkpoint, tmp_path, short_dir):
    """One `weft weights serve --tensor-parallel-size 2 --devices 0,1` serves the CPU slots 0 and 1; a TP=2 engine
    of one launcher, its two workers on those slots, maps each rank's weights from its slot's daemon: with the
    shards' data zeroed it gives the greedy tokens TP=1 read from disk before, and each daemon leased once."""
    from test_distributed import greedy_tokens

    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    expected, _ = greedy_tokens(model)
    daemon = subprocess.Popen(
        weft(
            "weights",
            "serve",
            "--model",
            str(model),
            "--socket-dir",
            str(short_dir),
            "--tensor-parallel-size",
            "2",
            "--devices",
            "0,1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = sorted(daemon.stdout.readline() for _ in range(2))
        for slot, line in enumerate(lines):
            assert f"for rank {slot} of 2 (tp {slot}/2, pp 0/1)" in line and f"cpu{slot}.sock" in line, lines
        zero_weights_keeping_headers_and_times(model)
        sections = {"use": {"loader": "weight-cache"}, "plugins": {"weight-cache": {"socket_dir": str(short_dir)}}}
        got, _ = greedy_tokens(model, sections, tensor_parallel_size=2)
        assert got == expected
    finally:
        log = stop(daemon)
    assert log.count("weight cache: lease") == 2, log  # one lease per slot: rank 0 from cpu0, rank 1 from cpu1


def test_the_daemons_port_must_not_be_the_engines(checkpoint, short_dir):
    result = subprocess.run(
        weft(
            "weights",
            "serve",
            "--model",
            str(checkpoint),
            "--socket-dir",
            str(short_dir),
            "--nnodes",
            "2",
            "--tensor-parallel-size",
            "2",
            "--rendezvous-port",
            "29500",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MASTER_PORT": "29500"},
    )
    assert result.returncode == 1 and "--rendezvous-port 29500 is the engine's MASTER_PORT" in result.stderr
