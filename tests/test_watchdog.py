"""The engine core's watchdog and the liveness of an instance's two processes (``weft serve``'s API process and its
engine core): a stuck step fails its requests and names its phase, a stopped core turns ``/health`` to 503, and a
core whose API process was killed exits at once (:mod:`weft.engine.core.watchdog`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from conftest import free_port, make_tiny_model, start_weft_serve
from weft.engine.core.api_clients import ApiClients
from weft.engine.core.watchdog import CoreWatchdog
from weft.engine.messages import CoreStats, FromCore, StepOutputs


def _stuck_in_a_step(seconds: float) -> None:
    time.sleep(seconds)


def test_a_step_past_its_timeout_fails_the_held_requests_and_names_where_it_is_stuck(caplog):
    context = zmq.Context()
    address = f"ipc:///tmp/weft-watchdog-test-{os.getpid()}"
    receiver = context.socket(zmq.PULL)
    receiver.bind(address)
    held = ["a", "b"]
    clients = ApiClients(context, [address])
    watchdog = CoreWatchdog(os.getppid(), 0.5, lambda: held, clients)
    watchdog.last_stats = CoreStats(running=2, num_steps=7)
    watchdog.start()
    try:
        with caplog.at_level(logging.ERROR, logger="weft.engine"):
            watchdog.step_began()
            _stuck_in_a_step(0.2)  # within the limit: nothing happens
            assert watchdog.step_ended() == []
            assert not receiver.poll(400)
            watchdog.step_began()
            _stuck_in_a_step(1.5)
            failed = watchdog.step_ended()
        assert failed == held
        assert receiver.poll(1000)
        message = msgspec.msgpack.decode(receiver.recv(), type=FromCore)
        assert isinstance(message, StepOutputs)
        assert set(message.failed) == set(held)
        assert "engine.step_timeout (0.5 s)" in message.failed["a"]
        assert message.stuck  # the innermost frame of Weft's, or of the thread
        assert message.stats.num_steps == 7  # the last stats: counters never go back
        assert not receiver.poll(500)  # failed once per step
        assert "_stuck_in_a_step" in caplog.text  # the main thread's stack is logged
    finally:
        watchdog.stop()
        clients.close(linger=0)
        receiver.close(linger=0)
        context.term()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files, max_position_embeddings=8192)


def _serve(model, *settings: str):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    arguments = ["--model", str(model)]
    for setting in settings:
        arguments += ["--set", setting]
    process, log = start_weft_serve(arguments, port, env)
    return process, log, f"http://127.0.0.1:{port}"


def _core_process(api_pid: int) -> psutil.Process:
    """The engine core: the API process's child started by multiprocessing's spawn (not its resource tracker)."""
    for child in psutil.Process(api_pid).children():
        command = " ".join(child.cmdline())
        if "spawn_main" in command and "resource_tracker" not in command:
            return child
    raise AssertionError("no engine core process among the API process's children")


def _alive(process: psutil.Process) -> bool:
    """Running, and not a zombie (an exited process its new parent has not reaped)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stream_forever(url: str, stop: threading.Event) -> None:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_bytes():
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass


def test_health_answers_503_within_5_s_of_a_stopped_core_and_200_once_it_runs_again(long_model):
    process, log, url = _serve(long_model)
    stop = threading.Event()
    try:
        thread = threading.Thread(target=_stream_forever, args=(url, stop), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/metrics").text.count("weft_requests_running 1.0") == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.1)
        core = _core_process(process.pid)
        core.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while (response := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
                assert time.monotonic() - stopped < 5 + 1, "/health still answers 200"  # 1 s: polling and load
                time.sleep(0.1)
            assert response.status_code == 503
            assert "server.health_stall_timeout" in response.text
        finally:
            core.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "/health stayed 503 once the core ran again"
            time.sleep(0.1)
    finally:
        stop.set()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def test_a_core_whose_api_process_is_killed_exits_within_2_s(long_model):
    process, log, url = _serve(long_model)
    stop = threading.Event()
    threads = [threading.Thread(target=_stream_forever, args=(url, stop), daemon=True) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while "weft_requests_running 4.0" not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.1)
        core = _core_process(process.pid)
        process.kill()
        killed = time.monotonic()
        while _alive(core):
            assert time.monotonic() - killed < 2, "the core outlived its API process by 2 s"
            time.sleep(0.05)
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
        process.wait()
