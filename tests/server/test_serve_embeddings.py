"""``optimum-ipu serve`` on the packaged all-MiniLM-L6-v2 (emulator), a real process on a loopback port,
against the CPU ORTModel: concurrent clients through httpx, the endpoints' errors, a fuzzed request body, an
engine fault, and the graceful drain at shutdown. One server process for the module."""

from __future__ import annotations

import asyncio
import base64
import signal
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, metric

from optimum_ipu_backend.conformance.zoo import CORPUS, minilm_dir

pytestmark = pytest.mark.xdist_group("serve-minilm")

CLIENTS = 16
REQUESTS_PER_CLIENT = 50
#: A token id no text of the tests produces ("[unused4]"): steps holding it fail in the server (a double).
FAULT_TOKEN = 5
#: The compiled sizes the server uses: a user's choice, made here to bound compile time in the test.
SERVER_OPTIONS = ("-o", "sequence_lengths=32,128", "-o", "batch_size=1,4", "-o", "max_queue_delay_ms=5")
WORDS = " ".join(CORPUS).split()


def corpus_texts(count: int, seed: int) -> list[str]:
    """Texts of corpus-like lengths: log-normal word counts (median 16 words, up to 100)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(16), 0.7, count).astype(int), 2, 100)
    starts = rng.integers(0, len(WORDS), count)
    return [" ".join(np.resize(np.roll(WORDS, -s), n)) for s, n in zip(starts, lengths, strict=True)]


@pytest.fixture(scope="module")
def minilm_export(zoo):
    return zoo.onnx("minilm", "feature-extraction")


@pytest.fixture(scope="module")
def started_server(minilm_export):
    # The export has no sentence-transformers folder: its pooling (mean, the checkpoint's 1_Pooling) is given.
    process = ServerProcess(minilm_export, "--pooling", "mean", *SERVER_OPTIONS, fault_token=FAULT_TOKEN)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server(started_server, cpu_embed):
    return started_server.wait_ready()


@pytest.fixture(scope="module")
def cpu_embed(started_server, minilm_export):
    """The reference: the CPU ORTModel, one text per call, mean-pooled and normalized."""
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoTokenizer

    model = ORTModelForFeatureExtraction.from_pretrained(minilm_export, provider="CPUExecutionProvider")
    tokenizer = AutoTokenizer.from_pretrained(minilm_export)
    cache: dict[str, np.ndarray] = {}

    def embed(text: str) -> np.ndarray:
        if text not in cache:
            batch = tokenizer([text], return_tensors="np")
            hidden = model(**batch).last_hidden_state[0]
            pooled = hidden.mean(axis=0)
            cache[text] = pooled / np.linalg.norm(pooled)
        return cache[text]

    return embed


def test_the_packaged_checkpoint_s_pooling_is_read():
    from optimum_ipu_backend.server.models import _read_pooling

    assert _read_pooling(minilm_dir()) == "mean"


def test_sixteen_clients_get_the_cpu_embeddings_in_batched_device_steps(server, cpu_embed):
    texts = corpus_texts(160, seed=38)
    # Request r of client c: one text, every 7th request three texts.
    plans = [
        [
            [texts[(c * 31 + r * 7 + k) % len(texts)] for k in range(3 if r % 7 == 3 else 1)]
            for r in range(REQUESTS_PER_CLIENT)
        ]
        for c in range(CLIENTS)
    ]
    before = httpx.get(f"{server.url}/metrics", timeout=120).text

    async def client(plan: list[list[str]]) -> list[tuple[list[str], int, object]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            results = []
            for inputs in plan:
                response = await http.post("/embed", json={"inputs": inputs})
                results.append((inputs, response.status_code, response.json()))
            return results

    async def all_clients():
        return await asyncio.gather(*(client(plan) for plan in plans))

    started = time.perf_counter()
    answers = [answer for per_client in asyncio.run(all_clients()) for answer in per_client]
    seconds = time.perf_counter() - started
    assert len(answers) == CLIENTS * REQUESTS_PER_CLIENT
    worst = 0.0
    for inputs, status, body in answers:
        assert status == 200, body
        got = np.asarray(body, dtype=np.float64)
        assert got.shape == (len(inputs), 384)
        for text, row in zip(inputs, got, strict=True):
            worst = max(worst, float(np.abs(row - cpu_embed(text)).max()))
    assert worst <= 1e-5, worst

    after = httpx.get(f"{server.url}/metrics", timeout=120).text
    served = metric(after, "optimum_ipu_requests_total", endpoint="/embed", status="200") - metric(
        before, "optimum_ipu_requests_total", endpoint="/embed", status="200"
    )
    steps = metric(after, "optimum_ipu_device_steps_total") - metric(before, "optimum_ipu_device_steps_total")
    assert served == len(answers)  # every request answered, none lost or counted twice
    assert 0 < steps < len(answers), (steps, len(answers))
    fill = metric(after, "optimum_ipu_batch_fill")
    assert 0 < fill <= 1
    print(
        f"{len(answers)} requests in {seconds:.1f} s, {int(steps)} device steps, batch fill {fill:.2f}, "
        f"worst |served - cpu| {worst:.1e}"
    )


def test_openai_embeddings_match_embed(server, cpu_embed):
    text = corpus_texts(1, seed=1)[0]
    body = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": [text, "water"], "model": "m"}, timeout=120
    ).json()
    assert [entry["index"] for entry in body["data"]] == [0, 1]
    assert np.abs(np.asarray(body["data"][0]["embedding"]) - cpu_embed(text)).max() <= 1e-5
    packed = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": "water", "encoding_format": "base64"}, timeout=120
    ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - cpu_embed("water")).max() <= 1e-5
    assert body["usage"]["prompt_tokens"] > 0


LONG_TEXT = " ".join(np.resize(WORDS, 600))
# (endpoint, body, status, the words the error must name)
BAD_REQUESTS = [
    ("/embed", b"{not json", 400, ["not valid JSON"]),
    ("/embed", b"", 400, ["no body"]),
    ("/embed", b"[1, 2]", 422, ["JSON object"]),
    ("/embed", {}, 422, ["inputs", "required"]),
    ("/embed", {"inputs": 3}, 422, ["inputs", "string"]),
    ("/embed", {"inputs": ["a", 5]}, 422, ["inputs[1]", "string"]),
    ("/embed", {"inputs": ""}, 422, ["inputs", "at least 1 character"]),
    ("/embed", {"inputs": []}, 422, ["inputs", "at least 1 item"]),
    ("/embed", {"inputs": ["ok", ""]}, 422, ["inputs[1]", "at least 1 character"]),
    ("/embed", {"inputs": "x", "normalize": "yes"}, 422, ["normalize", "boolean"]),
    ("/embed", {"inputs": "x", "truncate": True}, 422, ["truncate"]),
    ("/embed", {"inputs": "x", "colour": 1}, 422, ["colour", "unknown field"]),
    ("/embed", {"inputs": LONG_TEXT}, 413, ["inputs", "tokens", "128"]),
    ("/embed", {"inputs": ["ok", LONG_TEXT]}, 413, ["inputs[1]", "128"]),
    ("/embed", {"inputs": ["a"] * 33}, 413, ["inputs", "33 inputs", "32"]),
    ("/v1/embeddings", {"input": 1.5}, 422, ["input"]),
    ("/v1/embeddings", {"input": [[101, -3, 102]]}, 422, ["input[0][1]"]),
    ("/v1/embeddings", {"input": [101, 99999, 102]}, 422, ["input[0][1]", "vocabulary", "30522"]),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 422, ["encoding_format"]),
    ("/v1/embeddings", {"input": "x", "dimensions": 7}, 422, ["dimensions", "384"]),
    ("/v1/embeddings", {"input": LONG_TEXT}, 413, ["input", "128"]),
    ("/v1/completions", {"prompt": "x"}, 404, ["feature-extraction", "/embed"]),
    ("/predict", {"inputs": "x"}, 404, ["text-classification"]),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "named"), BAD_REQUESTS)
def test_a_bad_request_gets_a_4xx_naming_the_problem(server, endpoint, body, status, named):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(
        f"{server.url}{endpoint}", headers={"content-type": "application/json"}, **kwargs, timeout=120
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    message = error["message"] if endpoint.startswith("/v1/") else error
    for word in named:
        assert word in message, (word, message)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
EMBED_FIELDS = st.sampled_from(["inputs", "normalize", "truncate", "input", "x"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(EMBED_FIELDS, JSON_VALUES, max_size=3) | JSON_VALUES)
def test_fuzzed_embed_bodies_get_an_answer_or_a_4xx_naming_a_field(server, body):
    response = httpx.post(f"{server.url}/embed", json=body, timeout=60)
    if response.status_code == 200:
        inputs = body["inputs"]
        assert len(response.json()) == (1 if isinstance(inputs, str) else len(inputs))
        return
    assert 400 <= response.status_code < 500, response.text
    error = response.json()
    field = error["field"] or ""
    named = field.split("[")[0].split(".")[0]
    # the field named is one the body holds, the required "inputs", or the body itself
    assert named in {"body", "inputs", *(body if isinstance(body, dict) else ())}, error
    assert error["error"].startswith(field) or field == "body", error


def test_an_engine_fault_fails_only_its_request(server, cpu_embed):
    texts = corpus_texts(8, seed=7)

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            faulty = http.post("/v1/embeddings", json={"input": [101, FAULT_TOKEN, 102]})
            good = [http.post("/embed", json={"inputs": text}) for text in texts]
            return await asyncio.gather(faulty, *good)

    faulty, *good = asyncio.run(burst())
    assert faulty.status_code == 500, faulty.text
    assert "engine fault" in faulty.json()["error"]["message"]
    assert "injected device fault" in faulty.json()["error"]["message"]
    for text, response in zip(texts, good, strict=True):
        assert response.status_code == 200
        assert np.abs(np.asarray(response.json()[0]) - cpu_embed(text)).max() <= 1e-5
    after = httpx.post(f"{server.url}/embed", json={"inputs": texts[0]}, timeout=120)
    assert after.status_code == 200  # the server keeps serving
    page = httpx.get(f"{server.url}/metrics", timeout=120).text
    assert metric(page, "optimum_ipu_request_errors_total", endpoint="/v1/embeddings", kind="backend") >= 1


def test_health_and_info_describe_the_served_model(server):
    assert httpx.get(f"{server.url}/health", timeout=120).json() == {"status": "ready"}
    info = httpx.get(f"{server.url}/info", timeout=120).json()
    assert info["task"] == "feature-extraction"
    assert info["pooling"] == "mean"
    assert info["max_input_tokens"] == 128
    options = info["provider_options"][0]["IPUExecutionProvider"]
    assert options["device"] == "emulator"
    assert options["sequence_lengths"] == "32,128"
    assert info["executables"], "the earlier requests compiled executables"


def test_shutdown_drains_the_requests_in_flight(server, cpu_embed):
    """SIGTERM while requests are queued: each is answered, correctly, before the process exits. The last
    test of the module: it stops the module's server."""
    texts = corpus_texts(24, seed=12)

    def received(page: str) -> float:
        """/embed requests the server has taken in: answered (with any status) and in flight."""
        samples = [sample for family in text_string_to_metric_families(page) for sample in family.samples]
        answered = sum(
            s.value
            for s in samples
            if s.name == "optimum_ipu_requests_total" and s.labels["endpoint"] == "/embed"
        )
        return answered + metric(page, "optimum_ipu_requests_in_flight")

    async def send_then_stop():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            before = received((await http.get("/metrics")).text)
            pending = [
                asyncio.ensure_future(http.post("/embed", json={"inputs": [t, t[:40]] * 4})) for t in texts
            ]
            # SIGTERM once the server holds every request: one still in the listen backlog is not in flight
            # (uvicorn closes the socket on it), so a fixed sleep would make this test depend on the load
            deadline = time.monotonic() + 60
            while True:
                page = (await http.get("/metrics")).text
                if received(page) - before >= len(texts) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.005)
            in_flight = metric(page, "optimum_ipu_requests_in_flight")
            stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
            responses = await asyncio.gather(*pending)
            return responses, await stopping, received(page) - before, in_flight

    logged_before = len(server.log())
    responses, status, taken_in, in_flight = asyncio.run(send_then_stop())
    assert taken_in == len(texts), taken_in
    assert in_flight >= 1, in_flight  # some requests were still being served when SIGTERM came
    assert [r.status_code for r in responses] == [200] * len(texts)
    for text, response in zip(texts, responses, strict=True):
        assert np.abs(np.asarray(response.json()[0]) - cpu_embed(text)).max() <= 1e-5
    assert status in (0, -signal.SIGTERM), server.log()
    assert "Traceback" not in server.log()[logged_before:], server.log()[logged_before:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
