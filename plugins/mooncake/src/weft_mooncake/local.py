"""A Mooncake master and storage node on free loopback ports: for tests, benchmarks and trying the connector.

The master runs with its HTTP metadata server; the storage node is a standalone
``mooncake_client`` that contributes ``segment_size`` bytes, so stored objects
outlive the engines (which contribute none)::

    with LocalMooncake(segment_size=1 << 30) as store:
        llm = LLM(model, use={"kv_connector": "mooncake"}, plugins={"mooncake": store.options()})

Both binaries ship in Mooncake's wheel. Production deployments start the same two
commands (``store.master_command()``, ``store.storage_command()``) under their
own supervisor.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def mooncake_binary(name: str) -> str:
    """The path of ``mooncake_master`` or ``mooncake_client`` from Mooncake's wheel (or PATH)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / name
            if candidate.is_file():
                if not os.access(candidate, os.X_OK):
                    candidate.chmod(candidate.stat().st_mode | 0o111)
                return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install 'weft-mooncake[cpu]' (it ships in Mooncake's wheel)")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalMooncake:
    """``mooncake_master`` and one ``mooncake_client`` storage node, as child processes on 127.0.0.1."""

    def __init__(self, segment_size: int = 256 << 20, log_dir: str | Path | None = None) -> None:
        self.segment_size = segment_size
        self.rpc_port, self.metadata_port, self.metrics_port, self.storage_port = (free_port() for _ in range(4))
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="weft-mooncake-"))
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None

    @property
    def master_server_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def options(self, **overrides: Any) -> dict[str, Any]:
        """The ``[plugins.mooncake]`` table of an engine that uses this store and contributes no memory."""
        return {
            "master_server_address": self.master_server_address,
            "metadata_server": self.metadata_server,
            "global_segment_size": 0,
            "protocol": "tcp",
            **overrides,
        }

    def master_command(self) -> list[str]:
        return [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}",
        ]

    def storage_command(self) -> list[str]:
        return [
            mooncake_binary("mooncake_client"),
            f"--global_segment_size={self.segment_size}",
            f"--master_server_address={self.master_server_address}",
            f"--metadata_server={self.metadata_server}",
            "--host=127.0.0.1",
            f"--port={self.storage_port}",
            "--protocol=tcp",
        ]

    def start(self, timeout: float = 60.0) -> LocalMooncake:
        self.start_master(timeout)
        self.storage = self._spawn(self.storage_command(), "storage.log")
        self.wait_for_segment(timeout)
        return self

    def start_master(self, timeout: float = 60.0) -> None:
        """Start (or restart) the master; returns once its metadata server answers and its RPC port accepts.

        The ports were free when chosen, but another process may take one before the master binds
        it (the choice comes from the kernel's ephemeral range). A first start that does not come
        up therefore tries again on fresh ports; a restart keeps its ports, which clients know.
        """
        first_start = self.master is None
        for attempt in range(3 if first_start else 1):
            if attempt:
                self.rpc_port, self.metadata_port, self.metrics_port = (free_port() for _ in range(3))
            self.master = self._spawn(self.master_command(), "master.log")
            if self._wait_for_master(timeout if attempt == 2 or not first_start else min(timeout, 20.0)):
                return
            self.master.kill()
            self.master.wait()
        from weft_mooncake.system import missing_library_problem

        problem = missing_library_problem() or f"see {self.log_dir / 'master.log'}"
        raise RuntimeError(f"mooncake_master did not start: {problem}")

    def _wait_for_master(self, timeout: float) -> bool:
        """Whether the master's metadata server answers and its RPC port accepts within ``timeout``
        (the two come up separately: on a loaded machine the metadata server can answer first)."""
        import socket

        deadline = time.monotonic() + timeout
        while self.master.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.metadata_server}?key=weft-ready", timeout=1)
            except urllib.error.HTTPError:  # it answers (404: no such key)
                pass
            except OSError:
                time.sleep(0.1)
                continue
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def wait_for_segment(self, timeout: float = 60.0) -> None:
        """Block until the store accepts a put: the storage node's segment is mounted on the current master.

        (After a master restart the storage node remounts its segment on its own within a few seconds.)
        """
        from weft_mooncake.store import import_store_class

        client = import_store_class()()
        if client.setup("127.0.0.1", self.metadata_server, 0, 1 << 20, "tcp", "", self.master_server_address) != 0:
            raise RuntimeError(f"cannot reach mooncake_master at {self.master_server_address}; see {self.log_dir}")
        try:
            deadline = time.monotonic() + timeout
            while client.put("weft/segment-probe", b"\0" * 64) != 0:
                if self.storage is not None and self.storage.poll() is not None:
                    raise RuntimeError(f"the mooncake_client storage node exited; see {self.log_dir / 'storage.log'}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the storage node's segment was not mounted; see {self.log_dir}")
                time.sleep(0.2)
            client.remove("weft/segment-probe")
        finally:
            client.close()

    def kill_master(self) -> None:
        """Kill the master abruptly (SIGKILL), as a crash would."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()
            os.replace(self.log_dir / "master.log", self.log_dir / f"master.{time.monotonic_ns()}.log")

    def stop(self) -> None:
        for process in (self.storage, self.master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / log_name, "wb")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.log_dir)
        finally:
            log.close()

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
