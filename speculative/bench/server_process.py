"""A benchmarked HTTP server as a child process: `llama-server`, or our own `speculative serve`."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HEALTH_TIMEOUT = 300.0  # seconds for a server to load its models and answer /health
COMPILE_TIMEOUT = 1800.0  # seconds from its start for a server to compile its graphs (a cold cache)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # Linux: the server gets SIGTERM when the bench's process dies
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class ServerProcess:
    """`command` run as a server on 127.0.0.1:`port`, its output kept in a temporary log. `start`
    returns once GET /health answers 200 without `compiling` (its models compiled: timings are of
    the compiled server); a RuntimeError with the end of the log if the process exits first, does
    not answer within HEALTH_TIMEOUT or does not finish compiling within COMPILE_TIMEOUT. `stop`
    sends SIGTERM, then SIGKILL after `stop_timeout` s. A context manager."""

    command: list[str]
    port: int
    name: str = "server"
    stop_timeout: float = 10.0
    process: subprocess.Popen | None = None
    log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> ServerProcess:
        import httpx

        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        started = time.monotonic()
        deadline, waited_for = started + HEALTH_TIMEOUT, f"answer /health within {HEALTH_TIMEOUT:.0f} s"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                health = httpx.get(f"{self.url}/health", timeout=2.0)
                if health.status_code == 200:
                    json_body = health.headers.get("content-type", "").startswith("application/json")
                    if not (json_body and health.json().get("compiling")):
                        return self
                    deadline = started + COMPILE_TIMEOUT
                    waited_for = f"compile its graphs within {COMPILE_TIMEOUT:.0f} s"
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        tail = self.log_tail()  # before stop, which closes the log
        self.stop()
        raise RuntimeError(f"{self.name} did not {waited_for}:\n{tail}")

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
