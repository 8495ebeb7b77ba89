"""``optimum-ipu serve`` on the zoo's GPT-2 (emulator): OpenAI ``/v1/completions`` against CPU ``generate()``,
greedy and seeded sampling, streamed (server-sent events) and not; its errors and a fuzzed body; an
unsupported task refused at start-up. One server process for the module."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess, metric

from optimum_ipu_backend.conformance.zoo import CORPUS

pytestmark = pytest.mark.xdist_group("serve-gpt2")

TASK = "text-generation-with-past"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gpt2_export(zoo):
    return zoo.onnx("gpt2", TASK)


@pytest.fixture(scope="module")
def started_server(gpt2_export):
    process = ServerProcess(gpt2_export)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def cpu(started_server, gpt2_export):
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoTokenizer

    model = ORTModelForCausalLM.from_pretrained(gpt2_export, provider="CPUExecutionProvider")
    return model, AutoTokenizer.from_pretrained(gpt2_export)


@pytest.fixture(scope="module")
def server(started_server, cpu):
    return started_server.wait_ready()


def cpu_tokens(cpu, prompt: str, max_tokens: int, seed: int | None = None, **sampling) -> list[int]:
    model, tokenizer = cpu
    ids = tokenizer([prompt], return_tensors="pt")
    settings = {"do_sample": True, "top_k": 0, **sampling} if sampling else {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        **ids, max_new_tokens=max_tokens, num_beams=1, pad_token_id=tokenizer.eos_token_id, **settings
    )
    return out[0, ids["input_ids"].shape[1] :].tolist()


def complete(server, **body) -> dict:
    response = httpx.post(
        f"{server.url}/v1/completions", json={"return_token_ids": True, **body}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, **body) -> tuple[list[int], str, str | None]:
    """The streamed tokens, text and finish reason; checks the event stream's framing."""
    tokens, text, finish = [], "", None
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"return_token_ids": True, "stream": True, **body},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        assert "error" not in choice
        tokens += choice["token_ids"]
        text += choice["text"]
        finish = choice["finish_reason"] or finish
    return tokens, text, finish


@pytest.mark.parametrize("prompt", [CORPUS[0], CORPUS[15] + " " + CORPUS[3]])
def test_greedy_completions_are_the_cpu_generate_tokens_streamed_and_not(server, cpu, prompt):
    expected = cpu_tokens(cpu, prompt, NEW_TOKENS)
    body = complete(server, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["text"] == cpu[1].decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == ("length" if len(expected) == NEW_TOKENS else "stop")
    assert body["usage"]["completion_tokens"] == len(expected)
    streamed, _, finish = stream(server, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert streamed == expected
    assert finish == choice["finish_reason"]
    assert len(set(expected)) >= 3  # a real continuation, not one repeated token


def test_seeded_sampling_repeats_and_matches_cpu_sampling_with_that_seed(server, cpu):
    prompt = CORPUS[7]
    settings = {"temperature": 0.9, "top_p": 0.95}
    first = complete(server, prompt=prompt, max_tokens=16, seed=1234, **settings)["choices"][0]["token_ids"]
    again = complete(server, prompt=prompt, max_tokens=16, seed=1234, **settings)["choices"][0]["token_ids"]
    other = complete(server, prompt=prompt, max_tokens=16, seed=99, **settings)["choices"][0]["token_ids"]
    assert first == again
    assert first != other
    assert first == cpu_tokens(cpu, prompt, 16, seed=1234, **settings)
    streamed, _, _ = stream(server, prompt=prompt, max_tokens=16, seed=1234, **settings)
    assert streamed == first


def test_concurrent_completions_each_get_their_own_tokens(server, cpu):
    prompts = list(CORPUS[8:12])
    expected = [cpu_tokens(cpu, prompt, 12) for prompt in prompts]

    async def all_clients():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        "/v1/completions",
                        json={"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
                    )
                    for p in prompts
                )
            )

    responses = asyncio.run(all_clients())
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == expected
    page = httpx.get(f"{server.url}/metrics", timeout=120).text
    assert metric(page, "optimum_ipu_generated_tokens_total") >= sum(map(len, expected))
    assert metric(page, "optimum_ipu_device_steps_total") > 0


BAD_COMPLETIONS = [
    (b"{", 400, ["not valid JSON"]),
    ({}, 422, ["prompt", "required"]),
    ({"prompt": ""}, 422, ["prompt", "at least 1 character"]),
    ({"prompt": 7}, 422, ["prompt"]),
    ({"prompt": []}, 422, ["prompt", "at least 1 item"]),
    ({"prompt": "x", "max_tokens": "8"}, 422, ["max_tokens", "integer"]),
    ({"prompt": "x", "max_tokens": 0}, 422, ["max_tokens", "greater than or equal to 1"]),
    ({"prompt": "x", "max_tokens": 10_000}, 413, ["max_tokens", "128"]),
    ({"prompt": " ".join(CORPUS * 3)}, 413, ["prompt", "tokens", "128"]),
    ({"prompt": [5, 10**9]}, 422, ["prompt[0][1]", "vocabulary"]),
    ({"prompt": "x", "temperature": 3}, 422, ["temperature", "less than or equal to 2"]),
    ({"prompt": "x", "temperature": "hot"}, 422, ["temperature"]),
    ({"prompt": "x", "top_p": 0}, 422, ["top_p"]),
    ({"prompt": "x", "seed": 1.5}, 422, ["seed"]),
    ({"prompt": "x", "stream": "yes"}, 422, ["stream", "boolean"]),
    ({"prompt": "x", "n": 2}, 422, ["n"]),
    ({"prompt": "x", "stop": ["."]}, 422, ["stop", "unknown field"]),
]


@pytest.mark.parametrize(("body", "status", "named"), BAD_COMPLETIONS)
def test_a_bad_completion_request_gets_a_4xx_naming_the_problem(server, body, status, named):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(
        f"{server.url}/v1/completions", headers={"content-type": "application/json"}, **kwargs, timeout=120
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    for word in named:
        assert word in error["message"], (word, error)


COMPLETION_FIELDS = st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n"])
VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-5, 300)
    | st.floats(-1, 3)
    | st.text(max_size=20)
    | st.lists(st.integers(-2, 60000), max_size=4)
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(COMPLETION_FIELDS, VALUES, max_size=4))
def test_fuzzed_completion_bodies_get_an_answer_or_a_4xx_naming_a_field(server, body):
    tokens = body.get("max_tokens", 2)
    if type(tokens) is int and 8 < tokens <= 128:
        tokens = 8  # a valid length either way; long generations would only cost time
    body = {**body, "max_tokens": tokens}
    if body.get("stream") is True:
        body["stream"] = False  # the streamed answer is checked above; here the status is
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    if response.status_code == 200:
        assert len(response.json()["choices"]) == 1
        return
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"].split("[")[0] in {*body, "prompt"}, error
    assert error["message"].startswith(error["param"]), error


def test_an_unsupported_task_is_refused_at_start_up_with_the_supported_ones(gpt2_export):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimum_ipu_backend.cli.main",
            "serve",
            str(gpt2_export),
            "--task",
            "translation",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "translation" in result.stderr
    assert "feature-extraction, text-classification, text-generation" in result.stderr
