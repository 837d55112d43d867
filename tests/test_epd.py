"""Encode/prefill/decode disaggregation end to end on a tiny LLaVA 1.5: an encode instance and a prefill instance
handing encoder outputs over through an encoder connector (a shared ``engine.encoder_store`` folder, or a real
Mooncake master and storage node), a decode instance (weft-nixl, KV from the prefill instance), behind
``weft proxy epd``, all real processes, talked to with the official ``openai`` client. The decode instance runs
without prefix caching and without a connector, so its direct answers (the single-instance reference) compute every
prompt and encode every image themselves."""

from __future__ import annotations

import base64
import io
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("weft_vision")
pytest.importorskip("PIL")

from test_disagg import Process, free_port, openai, scrape_metrics  # noqa: E402  (skips without NIXL)
from test_vision_llava import image, make_tiny_llava  # noqa: E402

MAX_TOKENS = 6


def data_url(array) -> dict:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
    }


PICTURES = [image(40, 56, 1), image(64, 48, 2), image(33, 33, 3), image(50, 30, 4), image(32, 32, 5)]
PROMPTS = [
    [{"type": "text", "text": "What is this?"}, data_url(PICTURES[0])],
    [data_url(PICTURES[1]), {"type": "text", "text": "Describe it in one word."}],
    [
        {"type": "text", "text": "Compare"},
        data_url(PICTURES[2]),
        {"type": "text", "text": "and"},
        data_url(PICTURES[3]),
    ],
    [{"type": "text", "text": "Again, what is this?"}, data_url(PICTURES[0])],  # an image seen before
    [data_url(PICTURES[4])],
    [{"type": "text", "text": "图片🌍 colours?"}, data_url(PICTURES[1])],
    [data_url(PICTURES[3]), data_url(PICTURES[4]), {"type": "text", "text": "Which is brighter?"}],
    [{"type": "text", "text": "Count the shapes"}, data_url(PICTURES[2])],
]


class FolderHandover:
    """``use.encoder_connector = "folder"`` (``auto`` with ``engine.encoder_store``) on the encode and prefill
    instances."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def settings(self, role: str) -> list[str]:
        return [f"engine.encoder_store={self.folder}"]

    def check(self) -> None:
        """The encode instance wrote one output per distinct image."""
        assert len(list(self.folder.glob("*.safetensors"))) == len(PICTURES)


class MooncakeHandover:
    """``use.encoder_connector = "mooncake"``: the encode instance only saves (``role = "producer"``), the prefill
    instance only loads (``"consumer"``); the master's own metrics are the witness."""

    def __init__(self, store) -> None:
        self.store = store

    def settings(self, role: str) -> list[str]:
        options = self.store.options(role="producer" if role == "encode" else "consumer")
        return [
            'use.encoder_connector="mooncake"',
            *(f'plugins.mooncake.{key}="{value}"' for key, value in options.items() if isinstance(value, str)),
        ]

    def check(self) -> None:
        """The encode instance saved one object per distinct image; the prefill instance loaded from the store and
        never missed (a miss: it would have encoded the image itself)."""
        page = urllib.request.urlopen(f"http://127.0.0.1:{self.store.metrics_port}/metrics", timeout=10).read()
        master = {
            name: float(value)
            for name, _, value in (line.partition(" ") for line in page.decode().splitlines())
            if name and not name.startswith("#")
        }
        assert master["master_key_count"] == len(PICTURES)
        assert master["master_get_replica_list_requests_total"] > 0
        assert master["master_get_replica_list_failures_total"] == 0


class Cluster:
    def __init__(self, model, folder, handover) -> None:
        self.urls: dict[str, str] = {}
        self.processes: dict[str, Process] = {}
        common = ["serve", "--model", str(model), "--max-model-len", "512"]
        common += ["--set", "engine.quantization=none", "--set", "engine.dtype=float32"]
        nixl = ["--kv-connector", "nixl", "--set", "plugins.nixl.transfer_timeout=30.0"]
        nixl += ["--set", "engine.cpu_kv_cache_bytes=33554432"]
        encode = [part for key in handover.settings("encode") for part in ("--set", key)]
        self._start(folder, "encode", [*common, *encode])
        self._start(
            folder,
            "prefill",
            [
                *common,
                *nixl,
                "--set",
                'plugins.nixl.role="kv_producer"',
                "--set",
                f"plugins.nixl.side_channel_port={free_port()}",
                *(part for key in handover.settings("prefill") for part in ("--set", key)),
            ],
        )
        decode = ["--set", 'plugins.nixl.role="kv_consumer"', "--set", "engine.enable_prefix_caching=false"]
        self._start(folder, "decode", [*common, *nixl, *decode])
        for name in ("encode", "prefill", "decode"):
            self.processes[name].wait_until_healthy(self.urls[name])
        proxy = ["proxy", "epd", "--encode", self.urls["encode"], "--prefill", self.urls["prefill"]]
        proxy += ["--decode", self.urls["decode"], "--health-interval", "0.5", "--log-level", "warning"]
        self._start(folder, "proxy", proxy)
        self.processes["proxy"].wait_until_healthy(self.urls["proxy"])
        self.model_name = self.client("decode").models.list().data[0].id

    def _start(self, folder, name: str, args: list[str]) -> None:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        self.processes[name] = Process(name, [*args, "--port", str(port)], folder)

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[name]}/v1", api_key="unused", max_retries=0, timeout=180)

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


@pytest.fixture(scope="module", params=["folder", "mooncake"])
def handover(request, tmp_path_factory):
    if request.param == "folder":
        yield FolderHandover(tmp_path_factory.mktemp("encoder-store"))
        return
    pytest.importorskip("weft_mooncake")
    from weft_mooncake.local import LocalMooncake
    from weft_mooncake.system import missing_library_problem

    problem = missing_library_problem()
    if problem is not None:
        pytest.skip(problem)
    with LocalMooncake(segment_size=64 << 20, log_dir=tmp_path_factory.mktemp("mooncake")) as store:
        yield MooncakeHandover(store)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tokenizer_files, handover):
    model = make_tiny_llava(tmp_path_factory.mktemp("llava"), tokenizer_files)
    running = Cluster(model, tmp_path_factory.mktemp("logs"), handover)
    yield running
    running.stop()


def ask(client: openai.OpenAI, model: str, parts: list[dict], stream: bool) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return reply.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_eight_image_prompts_through_the_proxy_equal_a_single_instance(cluster, handover, stream):
    before = scrape_metrics(cluster.urls["decode"])
    with ThreadPoolExecutor(8) as pool:
        proxied = list(pool.map(lambda parts: ask(cluster.client("proxy"), cluster.model_name, parts, stream), PROMPTS))
    after = scrape_metrics(cluster.urls["decode"])
    direct = [ask(cluster.client("decode"), cluster.model_name, parts, stream) for parts in PROMPTS]
    assert proxied == direct
    handover.check()
    # The decode instance loaded the prompts' KV.
    loaded = after.get("weft_external_prefix_cache_hits_total", 0) - before.get(
        "weft_external_prefix_cache_hits_total", 0
    )
    assert loaded > 0
    proxy = scrape_metrics(cluster.urls["proxy"])
    assert not [key for key, value in proxy.items() if key.startswith("weft_proxy_leg_failures_total") and value]
    images = sum(1 for parts in PROMPTS for part in parts if part["type"] == "image_url")
    assert proxy['weft_proxy_leg_seconds_count{leg="encode"}'] >= images
