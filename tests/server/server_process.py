"""``optimum-ipu serve`` as a real process on a loopback port, for the server tests.

The process is started with ``--port 0`` (the server binds a free port and prints it), polled on
``/health`` until ready, and stopped with SIGTERM (graceful drain), bounded in time throughout.
Starting does not wait: ``wait_ready()`` does, so that a test prepares its reference meanwhile.
``fault_token`` starts it with the emulator's device step wrapped to raise for any step whose
``input_ids`` hold that token id: an engine fault on demand, in the process under test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")

_FAULT_PRELUDE = """
import numpy as np
from optimum_ipu_backend.engines import emulator

_run_step = emulator.HostEmulatorExecutable.run_step

def run_step(self, feed, *args, **kwargs):
    ids = feed.get("input_ids")
    if ids is not None and (np.asarray(ids) == {token}).any():
        raise RuntimeError("injected device fault (test double)")
    return _run_step(self, feed, *args, **kwargs)

emulator.HostEmulatorExecutable.run_step = run_step
"""


class ServerProcess:
    def __init__(
        self,
        model: str | Path,
        *args: str,
        fault_token: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 240,
    ) -> None:
        prelude = _FAULT_PRELUDE.format(token=fault_token) if fault_token is not None else ""
        code = prelude + textwrap.dedent(
            """
            import sys
            from optimum_ipu_backend.cli.main import main
            sys.exit(main(sys.argv[1:]))
            """
        )
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        full_env["OPTIMUM_IPU_DEVICE"] = "emulator"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, "serve", str(model), "--port", "0", "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self.output: deque[str] = deque(maxlen=400)
        self._url_found = threading.Event()
        self.url = ""
        self.ready_timeout = ready_timeout
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            match = LISTENING.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._url_found.set()

    def log(self) -> str:
        return "".join(self.output)

    def wait_ready(self) -> ServerProcess:
        """Wait until ``/health`` answers 200 (the model is loaded), bounded by ``ready_timeout``."""
        timeout = self.ready_timeout
        deadline = time.monotonic() + timeout
        if not self._url_found.wait(timeout):
            self.stop()
            raise AssertionError(f"the server never said where it listens:\n{self.log()}")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (uvicorn drains the requests in flight), then the exit status (uvicorn re-raises the
        signal once drained: -SIGTERM); killed if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                raise AssertionError(f"the server did not stop in {timeout} s:\n{self.log()}") from None
        return self.process.returncode


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
