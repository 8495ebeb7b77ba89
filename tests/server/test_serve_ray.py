"""``optimum-ipu serve --ray`` on a local Ray cluster started by the test (a head and one worker node, each
its own raylet process with one IPU as a Ray custom resource, loopback only, shut down after): two
replicas of the zoo's tiny BERT (emulator), one replica process killed mid-load. No answer is wrong,
each failed request gets a 5xx, the survivor keeps serving, and Ray restarts the replica."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from server_process import LISTENING

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve-ray")]

RAY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def bert_task() -> str:
    return "feature-extraction"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # The raylets' environment is their workers' (the Serve proxy's too): no usage report, and the one
    # proxy spreads requests over both replicas instead of preferring the one on its own node.
    saved = dict(os.environ)
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING="0")
    node = {
        "num_cpus": 1,
        "resources": {"IPU": 1},
        "node_ip_address": "127.0.0.1",
        "include_dashboard": False,
    }
    cluster = Cluster(initialize_head=True, head_node_args={**node, "object_store_memory": 200 * 1024**2})
    try:
        cluster.add_node(**node, object_store_memory=200 * 1024**2)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(ray_cluster, bert):
    port = _free_port()
    env = {**os.environ, "OPTIMUM_IPU_DEVICE": "emulator", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # Ray's driver turns a loopback address into the machine's own address unless told this is a one-host
    # cluster (ray._private.services.get_node_ip_address): the traffic stays on 127.0.0.1.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    process = subprocess.Popen(
        [sys.executable, "-m", "optimum_ipu_backend.cli.main", "serve", str(bert[1]), "--pooling", "mean",
         "--ray", "--ray-address", ray_cluster.address, "--replicas", "2", "--ipus-per-replica", "1",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + RAY_TIMEOUT_S
    try:
        while not any(LISTENING.search(line) for line in lines):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        while True:  # both replicas loaded and routed to
            assert time.monotonic() < deadline, "".join(lines)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200 and len(_pids(url, 12)) == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _pids(url: str, tries: int) -> set[int]:
    """The replica processes seen answering ``/info`` in ``tries`` requests."""
    pids = set()
    for _ in range(tries):
        response = httpx.get(f"{url}/info", timeout=30)
        if response.status_code == 200:
            pids.add(response.json()["pid"])
    return pids


@pytest.fixture(scope="module")
def cpu_embed(bert):
    import onnxruntime
    from transformers import AutoTokenizer

    session = onnxruntime.InferenceSession(str(bert[1] / "model.onnx"), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    tokenizer = AutoTokenizer.from_pretrained(bert[1])

    def embed(text: str) -> np.ndarray:
        feed = {k: v for k, v in tokenizer([text], return_tensors="np").items() if k in names}
        pooled = session.run(None, feed)[0][0].mean(axis=0)
        return pooled / np.linalg.norm(pooled)

    return embed


def test_killing_a_replica_mid_load_fails_only_its_requests_and_ray_restarts_it(ray_server, cpu_embed):
    from optimum_ipu_backend.conformance.zoo import CORPUS

    before = _pids(ray_server, 12)
    assert len(before) == 2
    victim = min(before)
    texts = list(CORPUS)
    expected = {text: cpu_embed(text) for text in texts}
    outcomes: list[tuple[str, int, object]] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        for r in range(30):
            text = texts[(index * 7 + r) % len(texts)]
            try:
                response = await http.post("/embed", json={"inputs": text})
                outcomes.append(
                    (text, response.status_code, response.json() if response.status_code == 200 else None)
                )
            except httpx.TransportError as exc:  # a connection the proxy dropped counts as a failure
                outcomes.append((text, -1, repr(exc)))

    async def load_and_kill() -> None:
        async with httpx.AsyncClient(base_url=ray_server, timeout=60) as http:
            clients = [asyncio.ensure_future(client(i, http)) for i in range(4)]
            while len(outcomes) < 20:
                await asyncio.sleep(0.05)
            os.kill(victim, signal.SIGKILL)  # the replica's process, mid-load
            await asyncio.gather(*clients)

    asyncio.run(load_and_kill())
    assert len(outcomes) == 4 * 30
    served = [(text, body) for text, status, body in outcomes if status == 200]
    failed = [status for _, status, _ in outcomes if status != 200]
    for text, body in served:
        assert np.abs(np.asarray(body[0]) - expected[text]).max() <= 1e-5  # no answer is wrong
    assert all(status >= 500 or status == -1 for status in failed), failed  # failures are errors, not 4xx
    assert len(served) > len(outcomes) // 2, (len(served), failed)  # the survivor kept serving
    print(f"{len(served)} answered, {len(failed)} failed ({sorted(set(failed))}) around the kill")

    deadline = time.monotonic() + RAY_TIMEOUT_S
    while True:  # Ray starts a new replica in place of the killed one
        after = _pids(ray_server, 12)
        if len(after) == 2 and victim not in after:
            break
        assert time.monotonic() < deadline, after
        time.sleep(1)
    response = httpx.post(f"{ray_server}/embed", json={"inputs": texts[0]}, timeout=60)
    assert np.abs(np.asarray(response.json()[0]) - expected[texts[0]]).max() <= 1e-5
