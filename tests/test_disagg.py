"""Prefill/decode disaggregation end to end: two prefill instances and a decode instance (``weft serve``
with weft-nixl, UCX over the loopback, host-memory KV caches) behind ``weft proxy pd``, all real
processes, talked to with the official ``openai`` client.

The decode instance runs without prefix caching, so its direct answers (the single-instance
reference) compute every prompt themselves, and every proxied request must move all its prompt
tokens but the last through NIXL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("weft_nixl")
pytest.importorskip("weft_disagg")
openai = pytest.importorskip("openai")

from conftest import make_tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from pd import scrape_metrics, wait_healthy  # noqa: E402

try:
    from weft_nixl.transfer import import_nixl

    import_nixl()
except ImportError as error:  # pragma: no cover - depends on the machine
    pytest.skip(f"NIXL is not installed: {error}", allow_module_level=True)

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time there was a little fox who",
    "Write a haiku about the sea, the wind, and the long grey evening light over the harbour walls",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "图片🌍 and more pictures of the world",
    "A" * 40,
    "Explain why the sky is blue in one sentence.",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "Translate to German: good morning, how did you sleep?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Q: What is 2 + 2?\nA:",
    "In 1492,",
    "Roses are red, violets are blue,",
    "Lorem ipsum dolor sit amet, consectetur",
    "Tell me a story about a robot who learns to paint, in exactly three short paragraphs please.",
]
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A ``weft`` command in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], log_folder: Path) -> None:
        self.name = name
        self.log = log_folder / f"{name}.log"
        env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "weft.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def wait_until_healthy(self, url: str, timeout: float = 300) -> None:
        try:
            wait_healthy(url, self.process, timeout)
        except RuntimeError as error:
            pytest.fail(f"{self.name}: {error}:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """Prefill instances ``prefill1``.. (fault injection on), a decode instance (without prefix caching unless
    ``decode_prefix_caching``), the proxy."""

    def __init__(
        self, model: Path, folder: Path, prefill_instances: int = 2, decode_prefix_caching: bool = False
    ) -> None:
        self.model, self.folder = model, folder
        self.ports: dict[str, int] = {}
        self.urls: dict[str, str] = {}
        self.processes: dict[str, Process] = {}
        prefills = [f"prefill{index + 1}" for index in range(prefill_instances)]
        for name in prefills:
            self.serve(
                name,
                'plugins.nixl.role="kv_producer"',
                f"plugins.nixl.side_channel_port={free_port()}",
                "plugins.nixl.fault_injection=true",
            )
        self.serve(
            "decode",
            'plugins.nixl.role="kv_consumer"',
            f"engine.enable_prefix_caching={str(decode_prefix_caching).lower()}",
        )
        for name in (*prefills, "decode"):
            self.processes[name].wait_until_healthy(self.urls[name])
        self._start(
            "proxy",
            [
                "proxy",
                "pd",
                "--prefill",
                *(self.urls[name] for name in prefills),
                "--decode",
                self.urls["decode"],
                "--health-interval",
                "0.5",
                "--log-level",
                "warning",
            ],
        )
        self.processes["proxy"].wait_until_healthy(self.urls["proxy"])
        self.model_name = httpx.get(f"{self.urls['decode']}/v1/models").json()["data"][0]["id"]

    def serve(self, name: str, *settings: str) -> Process:
        """Start ``weft serve`` of the model with weft-nixl and ``--set`` ``settings`` of its own (a later one wins)."""
        common = [
            "serve",
            "--model",
            str(self.model),
            "--kv-connector",
            "nixl",
            "--max-model-len",
            "512",
            "--set",
            "engine.cpu_kv_cache_bytes=33554432",
            "--set",
            "plugins.nixl.transfer_timeout=30.0",
        ]
        return self._start(name, [*common, *(part for setting in settings for part in ("--set", setting))])

    def _start(self, name: str, args: list[str]) -> Process:
        self.ports[name] = free_port()
        self.urls[name] = f"http://127.0.0.1:{self.ports[name]}"
        self.processes[name] = Process(name, [*args, "--port", str(self.ports[name])], self.folder)
        return self.processes[name]

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[name]}/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self, name: str) -> dict[str, float]:
        return scrape_metrics(self.urls[name])

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tokenizer_files):
    model = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files)
    running = Cluster(model, tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


def ask(
    client: openai.OpenAI, model: str, api: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS, **extra
) -> tuple[str, int | None]:
    """The greedy answer's text and completion token count (None when a stream reports no usage)."""
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=stream, extra_body=extra or None)
    if stream:
        common["stream_options"] = {"include_usage": True}
    chat = api == "chat"
    if chat:
        reply = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        reply = client.completions.create(prompt=prompt, **common)
    if not stream:
        return (reply.choices[0].message.content if chat else reply.choices[0].text), reply.usage.completion_tokens
    text, tokens = "", None
    for chunk in reply:
        if chunk.choices:
            text += (chunk.choices[0].delta.content or "") if chat else chunk.choices[0].text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens


def prompt_lengths(cluster: Cluster, api: str) -> list[int]:
    lengths = []
    for prompt in PROMPTS:
        body = {"messages": [{"role": "user", "content": prompt}]} if api == "chat" else {"prompt": prompt}
        lengths.append(httpx.post(f"{cluster.urls['decode']}/tokenize", json=body, timeout=30).json()["count"])
    return lengths


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_greedy_output_through_the_proxy_equals_a_single_instance_and_decode_computes_only_the_last_token(
    cluster, api, stream
):
    before = cluster.metrics("decode")
    with ThreadPoolExecutor(16) as pool:
        proxied = list(
            pool.map(lambda prompt: ask(cluster.client("proxy"), cluster.model_name, api, prompt, stream), PROMPTS)
        )
    after = cluster.metrics("decode")
    with ThreadPoolExecutor(16) as pool:
        alone = list(
            pool.map(lambda prompt: ask(cluster.client("decode"), cluster.model_name, api, prompt, stream), PROMPTS)
        )
    assert proxied == alone
    assert all(tokens for _, tokens in proxied)
    # Every prompt token but the last arrived through NIXL: the decode instance computed one per request.
    lengths = prompt_lengths(cluster, api)
    expected = sum(length - 1 for length in lengths)
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert delta["weft_external_prefix_cache_hits_total"] == expected
    assert delta["weft_kv_connector_failed_load_tokens_total"] == 0
    assert delta["weft_kv_connector_receive_failures_total"] == 0
    # A one-token prompt has nothing to move (its decode leg releases the prefill instance's lease).
    assert delta["weft_kv_connector_receive_started_total"] == sum(1 for length in lengths if length > 1)
    assert delta["weft_kv_connector_receive_bytes_total"] > 0


@pytest.fixture(scope="module")
def speculating(cluster):
    """A decode instance that speculates (``ngram``, k = 3) behind a proxy of its own, with prefill1: the names of
    both."""
    cluster.serve(
        "speculating",
        'plugins.nixl.role="kv_consumer"',
        "engine.enable_prefix_caching=false",
        'engine.speculative.method="ngram"',
        "engine.speculative.num_speculative_tokens=3",
        "engine.speculative.prompt_lookup_min=1",
        "engine.speculative.prompt_lookup_max=3",
    ).wait_until_healthy(cluster.urls["speculating"])
    proxy = ["proxy", "pd", "--prefill", cluster.urls["prefill1"], "--decode", cluster.urls["speculating"]]
    cluster._start("speculating_proxy", [*proxy, "--health-interval", "0.5", "--log-level", "warning"])
    cluster.processes["speculating_proxy"].wait_until_healthy(cluster.urls["speculating_proxy"])
    return "speculating", "speculating_proxy"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_instance_that_speculates_gives_the_greedy_output_of_one_that_does_not(cluster, speculating, stream):
    """P/D where the decode instance speculates (issue 44): its first steps run on KV that came through NIXL, then it
    verifies its proposals; the greedy text equals the plain decode instance's, and proposals were verified."""
    decode, proxy = speculating
    before = cluster.metrics(decode)
    with ThreadPoolExecutor(8) as pool:
        proxied = list(
            pool.map(
                lambda prompt: ask(cluster.client(proxy), cluster.model_name, "completions", prompt, stream, 24),
                PROMPTS,
            )
        )
    after = cluster.metrics(decode)
    plain = [ask(cluster.client("decode"), cluster.model_name, "completions", prompt, stream, 24) for prompt in PROMPTS]
    assert proxied == plain
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    lengths = prompt_lengths(cluster, "completions")
    assert delta["weft_external_prefix_cache_hits_total"] == sum(length - 1 for length in lengths)
    assert delta["weft_kv_connector_failed_load_tokens_total"] == 0
    assert delta["weft_spec_decode_num_draft_tokens_total"] > 0


def remote_prefill(cluster: Cluster, producer: str, transfer_id: str) -> dict:
    """A decode leg's ``kv_transfer_params``: the KV of ``transfer_id`` comes from ``producer``."""
    side_channel = httpx.get(f"{cluster.urls[producer]}/kv_transfer").json()
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": side_channel["side_channel_host"],
        "remote_port": side_channel["side_channel_port"],
    }


def test_a_transfer_failure_injected_on_the_producer_makes_decode_compute_the_prompt_with_the_same_output(cluster):
    prompt = "A failed transfer must not change a single token of this answer"
    before = {name: cluster.metrics(name) for name in ("decode", "prefill1", "prefill2")}
    failed = ask(
        cluster.client("proxy"),
        cluster.model_name,
        "completions",
        prompt,
        False,
        kv_transfer_params={"inject_failure": True},
    )
    after = {name: cluster.metrics(name) for name in ("decode", "prefill1", "prefill2")}
    assert failed == ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)
    length = httpx.post(f"{cluster.urls['decode']}/tokenize", json={"prompt": prompt}).json()["count"]
    decode_delta = {key: after["decode"][key] - before["decode"].get(key, 0) for key in after["decode"]}
    assert decode_delta["weft_kv_connector_receive_failures_total"] == 1
    assert decode_delta["weft_kv_connector_failed_load_tokens_total"] == length - 1
    producers = sum(
        after[name]["weft_kv_connector_send_failures_total"] - before[name]["weft_kv_connector_send_failures_total"]
        for name in ("prefill1", "prefill2")
    )
    assert producers == 1


def test_an_abandoned_transfer_makes_decode_compute_the_prompt_at_once(cluster):
    """``POST /kv_transfer/abandon`` on the prefill instance (the proxy's call when a prefill leg fails before
    its engine saw it): the decode leg hears at once, well before its transfer_timeout (30 s here)."""
    prompt = "Nobody will prefill this prompt for the decode instance"
    assert httpx.post(
        f"{cluster.urls['prefill1']}/kv_transfer/abandon", json={"transfer_id": "t-abandoned"}
    ).json() == {"abandoned": "t-abandoned"}
    before = cluster.metrics("decode")["weft_kv_connector_receive_failures_total"]
    started = time.monotonic()
    answer = ask(
        cluster.client("decode"),
        cluster.model_name,
        "completions",
        prompt,
        False,
        kv_transfer_params=remote_prefill(cluster, "prefill1", "t-abandoned"),
    )
    assert time.monotonic() - started < 25  # a notice, not the 30 s transfer_timeout
    assert answer == ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)
    assert cluster.metrics("decode")["weft_kv_connector_receive_failures_total"] == before + 1


DRILL_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def drill(cluster):
    """One more instance, ``kv_both`` with short ``transfer_timeout`` and ``lease_timeout`` (``DRILL_TIMEOUT``),
    for the failures that only come from waiting; the cluster stops it with the others."""
    name = "drill"
    cluster.serve(
        name,
        'plugins.nixl.role="kv_both"',
        f"plugins.nixl.side_channel_port={free_port()}",
        f"plugins.nixl.transfer_timeout={DRILL_TIMEOUT}",
        f"plugins.nixl.lease_timeout={DRILL_TIMEOUT}",
        "engine.enable_prefix_caching=false",
    ).wait_until_healthy(cluster.urls[name])
    return name


def test_a_transfer_that_times_out_makes_decode_compute_the_prompt_with_the_same_output(cluster, drill):
    """The drill registers its blocks with prefill1, which never prefills that transfer: after transfer_timeout
    the drill computes the prompt itself."""
    prompt = "This prompt waits for a prefill that never comes, then is computed where it is"
    length = httpx.post(f"{cluster.urls['decode']}/tokenize", json={"prompt": prompt}).json()["count"]
    before = {name: cluster.metrics(name) for name in (drill, "prefill1")}
    started = time.monotonic()
    answer = ask(
        cluster.client(drill),
        cluster.model_name,
        "completions",
        prompt,
        False,
        kv_transfer_params=remote_prefill(cluster, "prefill1", "t-timeout"),
    )
    assert time.monotonic() - started >= DRILL_TIMEOUT
    assert answer == ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)
    after = {name: cluster.metrics(name) for name in (drill, "prefill1")}
    delta = {key: after[drill][key] - before[drill].get(key, 0) for key in after[drill]}
    assert delta["weft_kv_connector_receive_started_total"] == 1
    assert delta["weft_kv_connector_receive_failures_total"] == 1
    assert delta["weft_kv_connector_failed_load_tokens_total"] == length - 1
    assert (
        after["prefill1"]["weft_kv_connector_send_started_total"]
        == before["prefill1"]["weft_kv_connector_send_started_total"]
    )


def test_an_unclaimed_lease_expires_and_a_late_decode_leg_hears_at_once(cluster, drill):
    """A prefill leg on the drill that no decode instance registers for: its blocks are leased for lease_timeout,
    then released (a send failure); a decode leg that registers later gets the notice at once and computes the
    prompt, well before its own transfer_timeout (30 s here)."""
    prompt = "Nobody claims the KV of this prefill in time"
    before = cluster.metrics(drill)["weft_kv_connector_send_failures_total"]
    ask(
        cluster.client(drill),
        cluster.model_name,
        "completions",
        prompt,
        False,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-unclaimed"},
    )
    assert held(cluster, drill)[2] > 0  # the finished prefill's blocks are leased
    deadline = time.monotonic() + DRILL_TIMEOUT + 20
    while held(cluster, drill) != (0, 0, 0):
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.1)
    assert cluster.metrics(drill)["weft_kv_connector_send_failures_total"] == before + 1
    failures = cluster.metrics("decode")["weft_kv_connector_receive_failures_total"]
    started = time.monotonic()
    late = ask(
        cluster.client("decode"),
        cluster.model_name,
        "completions",
        prompt,
        False,
        kv_transfer_params=remote_prefill(cluster, drill, "t-unclaimed"),
    )
    assert time.monotonic() - started < 25  # the producer's notice, not the decode instance's 30 s timeout
    assert late == ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)
    assert cluster.metrics("decode")["weft_kv_connector_receive_failures_total"] == failures + 1


def held(cluster: Cluster, name: str) -> tuple[float, float, float]:
    metrics = cluster.metrics(name)
    return metrics["weft_requests_running"], metrics["weft_requests_waiting"], metrics["weft_kv_cache_usage_ratio"]


def test_a_client_disconnect_mid_stream_leaves_no_request_or_block_held(cluster):
    body = {
        "model": cluster.model_name,
        "prompt": "Keep talking for a long while about anything at all",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{cluster.urls['proxy']}/v1/completions", json=body) as response:
            assert response.status_code == 200
            received = b""
            for chunk in response.iter_raw():
                received += chunk
                if received.count(b"data: ") >= 4:
                    break  # leave mid-stream: the connection closes
    assert held(cluster, "decode")[0] >= 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(held(cluster, name) == (0, 0, 0) for name in ("decode", "prefill1", "prefill2")):
            break
        time.sleep(0.2)
    assert {name: held(cluster, name) for name in ("decode", "prefill1", "prefill2")} == {
        name: (0, 0, 0) for name in ("decode", "prefill1", "prefill2")
    }


def test_the_proxy_keeps_serving_when_a_prefill_instance_is_killed_mid_run(cluster):
    """Runs last: it kills prefill2. Its requests in flight are answered all the same (the decode instance
    computes their prompts when the prefill process goes away); later ones go to prefill1."""
    prompts = [f"Request number {index} asks about a prefill instance that dies" for index in range(12)]
    expected = [ask(cluster.client("decode"), cluster.model_name, "completions", prompt, True) for prompt in prompts]
    results: list = [None] * len(prompts)

    def run(index: int) -> None:
        try:
            results[index] = ask(cluster.client("proxy"), cluster.model_name, "completions", prompts[index], True)
        except Exception as error:  # noqa: BLE001 - reported below
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
        if thread is threads[3]:
            cluster.processes["prefill2"].kill()
    for thread in threads:
        thread.join(timeout=120)
    assert results == expected
    deadline = time.monotonic() + 30
    while (
        cluster.metrics("proxy")[f'weft_proxy_instance_healthy{{role="prefill",url="{cluster.urls["prefill2"]}"}}'] != 0
    ):
        assert time.monotonic() < deadline, "the proxy did not take the dead prefill instance out of rotation"
        time.sleep(0.2)
    before = cluster.metrics("prefill1")["weft_kv_connector_send_started_total"]
    after_kill = [
        ask(cluster.client("proxy"), cluster.model_name, "completions", prompt, False) for prompt in prompts[:4]
    ]
    assert [text for text, _ in after_kill] == [
        ask(cluster.client("decode"), cluster.model_name, "completions", prompt, False)[0] for prompt in prompts[:4]
    ]
    assert cluster.metrics("prefill1")["weft_kv_connector_send_started_total"] - before == 4
