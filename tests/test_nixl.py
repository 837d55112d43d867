"""weft-nixl on its own: the conformance kit, the side channel's handshake, the options.

End to end (two engines, the proxy) is tests/test_disagg.py.
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("weft_nixl")

from conftest import make_tiny_model  # noqa: E402
from weft.testing import KVConnectorContract  # noqa: E402
from weft_nixl.side_channel import (  # noqa: E402
    ConsumerChannel,
    EngineDescription,
    GroupDescription,
    Hello,
    Notice,
    ProducerChannel,
    Register,
    mismatch,
)
from weft_nixl.transfer import Region  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine(block_size: int = 16, tp_size: int = 1, model: str = "llama@abc") -> EngineDescription:
    return EngineDescription(
        model,
        tp_size,
        0,
        (GroupDescription("attention", "FullAttentionSpec", block_size, "float32", block_size * 128),),
    )


def test_mismatched_engines_are_named_with_both_values():
    assert mismatch(engine(), engine()) is None
    message = mismatch(engine(16, 1), engine(32, 2))
    assert "tensor_parallel_size: prefill 1, decode 2" in message
    assert "block_size of group 'attention': prefill 16, decode 32" in message
    assert "engine.block_size" in message  # the fix


def poll_until(channel: ConsumerChannel, timeout: float = 10) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = channel.poll()
        if events:
            return events
        time.sleep(0.01)
    raise AssertionError("no answer on the side channel")


def hello(description: EngineDescription) -> Hello:
    return Hello("decode-agent", b"metadata", description, [[Region(0, description.groups[0].block_bytes, 8)]], 0)


def test_the_producer_refuses_a_decode_engine_with_another_block_size_or_tp_size_at_handshake():
    address = f"127.0.0.1:{free_port()}"
    producer = ProducerChannel(address, engine(16, 1), [[Region(0, 16 * 128, 8)]], ended_ttl=60)
    consumer = ConsumerChannel(hello(engine(32, 2)))
    try:
        assert consumer.register(address, Register("t1", "decode-agent", [0], [[1, 2]], 30.0)) is None
        ((where, event),) = poll_until(consumer)
        assert where == address and event.startswith("refused: ")
        assert "block_size of group 'attention': prefill 16, decode 32" in event
        assert "tensor_parallel_size: prefill 1, decode 2" in event
        # Later registrations with that producer fail at once, with the same reason.
        assert "prefill 16, decode 32" in consumer.register(address, Register("t2", "decode-agent", [0], [[3]], 30.0))
        assert producer.take("t1") is None and producer.take("t2") is None
    finally:
        consumer.close()
        producer.close()


def test_a_registration_for_a_transfer_the_producer_ended_gets_a_notice_and_an_accepted_one_is_handed_out():
    address = f"127.0.0.1:{free_port()}"
    producer = ProducerChannel(address, engine(), [[Region(0, 16 * 128, 8)]], ended_ttl=60)
    consumer = ConsumerChannel(hello(engine()))
    try:
        producer.end("gone", "the prefill request ended before its prefill completed")
        consumer.register(address, Register("gone", "decode-agent", [0], [[1]], 30.0))
        consumer.register(address, Register("kept", "decode-agent", [1], [[4, 5]], 30.0))
        ((_, notice),) = poll_until(consumer)
        assert notice == Notice("gone", "the prefill request ended before its prefill completed")
        deadline = time.monotonic() + 10
        while (taken := producer.take("kept")) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert taken[1] == Register("kept", "decode-agent", [1], [[4, 5]], 30.0)
    finally:
        consumer.close()
        producer.close()


def test_a_producer_that_refuses_connections_fails_its_transfers_after_the_connect_timeout():
    consumer = ConsumerChannel(hello(engine()))
    address = f"127.0.0.1:{free_port()}"  # nothing listens
    try:
        consumer.register(address, Register("t", "decode-agent", [0], [[1]], 30.0))
        assert poll_until(consumer, timeout=20) == [(address, "unreachable")]
    finally:
        consumer.close()


def test_options_are_checked_with_errors_naming_the_key():
    from weft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="plugins.nixl.role: expected one of 'kv_producer', 'kv_consumer', 'kv_both'"):
        load_config(None, {"use": {"kv_connector": "nixl"}, "plugins": {"nixl": {"role": "prefill"}}})
    with pytest.raises(ConfigError, match=r"plugins.nixl.transfer_timeout: expected float > 0.0, got int 0"):
        load_config(None, {"use": {"kv_connector": "nixl"}, "plugins": {"nixl": {"transfer_timeout": 0}}})


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files)


class TestNixlConnectorContract(KVConnectorContract):
    """Without kv_transfer_params a request is computed as usual: the kit's cases check that nothing else changes."""

    plugin_name = "nixl"
    stores_prefixes = False

    @pytest.fixture
    def connector_options(self):
        return {"side_channel_port": free_port()}

    @pytest.fixture
    def model_source(self, llama):
        return str(llama)
