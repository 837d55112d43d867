"""``weft serve --api-server-count``: several API processes on one port in front of one engine core.

The core's side (:class:`weft.engine.core.api_clients.ApiClients`: each API process gets its own requests'
outputs) is checked on ZMQ sockets alone; the rest on a real ``weft serve`` with three API processes, the
official ``openai`` client and raw HTTP: connections spread over the processes, every request gets its own
tokens whichever process took it, ``/metrics`` on any process adds up all of them, a SIGTERM drains them all,
and an API process that dies takes the server down.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from conftest import free_port, make_tiny_model, start_weft_serve
from weft.engine.core.api_clients import ApiClients
from weft.engine.messages import CoreStats, EngineCoreOutput, FromCore, StepOutputs


def _receive(socket: zmq.Socket) -> StepOutputs:
    assert socket.poll(2000), "nothing arrived"
    message = msgspec.msgpack.decode(socket.recv(), type=FromCore)
    assert isinstance(message, StepOutputs)
    return message


def test_the_core_sends_each_api_process_its_own_requests_outputs_and_everyone_the_gauges(tmp_path):
    context = zmq.Context()
    addresses = [f"ipc://{tmp_path}/out-{i}" for i in range(3)]
    receivers = []
    for address in addresses:
        receiver = context.socket(zmq.PULL)
        receiver.bind(address)
        receivers.append(receiver)
    clients = ApiClients(context, addresses)
    try:
        clients.added(0, ["a"])
        clients.added(2, ["c1", "c2"])
        with pytest.raises(ValueError, match="AddRequests.client = 3: this core serves 3 API processes"):
            clients.added(3, ["d"])
        stats = CoreStats(running=3, num_steps=5)
        clients.send(
            StepOutputs(
                [EngineCoreOutput("a", [1]), EngineCoreOutput("c1", [2], finish_reason="length")],
                stats,
                refused={"c2": "bad request"},
            )
        )
        first, second, third = (_receive(receiver) for receiver in receivers)
        assert [output.request_id for output in first.outputs] == ["a"]
        assert second.outputs == [] and second.refused == {} and second.failed == {}
        assert [output.request_id for output in third.outputs] == ["c1"]
        assert third.refused == {"c2": "bad request"}
        assert first.stats.num_steps == second.stats.num_steps == third.stats.num_steps == 5
        assert clients.owners == {"a": 0}  # the ended ones are forgotten
        # The watchdog's sibling fails what the core holds without forgetting it: the main loop does, later.
        sibling = clients.sibling()
        sibling.send(StepOutputs([], stats, failed={"a": "stuck"}, stuck="phase"))
        assert _receive(receivers[0]).failed == {"a": "stuck"}
        assert _receive(receivers[1]).stuck == "phase"
        assert _receive(receivers[2]).failed == {}
        assert clients.owners == {"a": 0}
        clients.forget(["a"])
        assert clients.owners == {}
        sibling.close(linger=0)
    finally:
        clients.close(linger=0)
        for receiver in receivers:
            receiver.close(linger=0)
        context.term()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files, max_position_embeddings=4096)


def _serve(model, count: int):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    process, log = start_weft_serve(["--model", str(model), "--api-server-count", str(count)], port, env)
    return process, log, f"http://127.0.0.1:{port}", port


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _api_processes(pid: int) -> list[psutil.Process]:
    """The first API process and the others it started (named weft-api-server-N in their command line's
    multiprocessing arguments is not guaranteed: they are the spawned children that listen on a TCP port)."""
    listening = []
    for process in _tree(pid):
        try:
            if any(c.status == psutil.CONN_LISTEN for c in process.net_connections(kind="tcp")):
                listening.append(process)
        except psutil.NoSuchProcess:
            pass
    return listening


@pytest.fixture(scope="module")
def three(model):
    process, log, url, port = _serve(model, 3)
    yield process, log, url, port
    if process.poll() is None:
        process.kill()
        process.wait(30)


def test_three_api_processes_listen_and_share_the_connections(three):
    process, log, url, port = three
    assert len(_api_processes(process.pid)) == 3, "".join(log)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    streams = []
    try:
        for _ in range(12):  # held open, each on a connection of its own
            client = httpx.Client(timeout=60)
            stream = client.stream("POST", f"{url}/v1/completions", json=body)
            response = stream.__enter__()
            assert response.status_code == 200
            chunks = response.iter_bytes()  # kept: a dropped iterator closes its connection
            next(chunks)  # it runs
            streams.append((client, stream, chunks))
        serving = set()
        for api in _api_processes(process.pid):
            connections = api.net_connections(kind="tcp")
            if any(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in connections):
                serving.add(api.pid)
        assert len(serving) >= 2, f"12 connections all went to one API process of 3 ({serving})"
    finally:
        for client, stream, _ in streams:
            stream.__exit__(None, None, None)
            client.close()


def test_every_request_gets_its_own_tokens_whichever_api_process_took_it(three):
    from openai import OpenAI

    process, log, url, port = three
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    before = _finished(url)

    def one(index: int) -> tuple[int, int, str]:
        lengths = 4 + index  # a length per request: a request given another's tokens shows
        own = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)  # a connection pool of its own
        if index % 2:
            stream = own.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"request {index}"}],
                max_tokens=lengths,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = list(stream)
            return index, chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason
        reply = own.completions.create(
            model=model, prompt=f"request {index}", max_tokens=lengths, extra_body={"ignore_eos": True}
        )
        return index, reply.usage.completion_tokens, reply.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    for index, tokens, finish_reason in results:
        assert (tokens, finish_reason) == (4 + index, "length"), f"request {index}"
    # /metrics on whichever process answers adds up every process's counts.
    for _ in range(6):
        assert _finished(url) - before == 24


def _finished(url: str) -> float:
    """weft_requests_total over every finish reason, from one /metrics answer."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name == "weft_requests":
            total += sum(sample.value for sample in family.samples if sample.name == "weft_requests_total")
    return total


def test_sigterm_drains_every_api_process_then_everything_exits_0(three):
    process, log, url, port = three
    tree = _tree(process.pid)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

    def request() -> tuple[int, str]:
        body = {"model": model, "prompt": "drain", "max_tokens": 40, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return response.status_code, response.json()["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(request) for _ in range(6)]
        time.sleep(0.5)  # in flight, on the several processes
        process.send_signal(signal.SIGTERM)
        results = [future.result() for future in futures]
    assert results == [(200, "length")] * 6, "".join(log)
    assert process.wait(timeout=60) == 0, "".join(log)
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left running: {alive}"


def test_an_api_process_that_dies_takes_the_server_down_with_status_1(model):
    process, log, url, port = _serve(model, 2)
    try:
        tree = _tree(process.pid)
        other = next(api for api in _api_processes(process.pid) if api.pid != process.pid)
        other.kill()
        assert process.wait(timeout=30) == 1, "".join(log)
        assert "API process 1" in "".join(log)
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left running: {alive}"
    finally:
        if process.poll() is None:
            process.kill()
