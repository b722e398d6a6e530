"""kernels.serving.server: the OpenAI-compatible server, started as ``python -m kernels.serving.server`` on
127.0.0.1, driven by the official ``openai`` client (concurrent, streaming and not) and by httpx for
malformed requests and a client that disconnects mid-stream. Streamed text must equal offline greedy
generation, bad requests must get clear 400s, and every page must come back (allocator counts to 0).
Every call has a timeout, and the server is always shut down."""
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kernels.model.data import decode, encode
from kernels.model.gpt import load_pretrained
from kernels.serving.engine import reference_generate
from kernels.serving.server import chat_prompt

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kernels.serving.server", "--port", str(port), "--num-pages", "64",
                             "--page-size", "8", "--max-tokens-per-step", "64", "--chunk", "16"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy within 120 s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    torch.set_num_threads(1)
    model = load_pretrained()

    def generate(prompt: str, n: int) -> str:
        return decode(reference_generate(model, encode(prompt).tolist(), n)[0])
    return generate


def _stats(base):
    return httpx.get(base + "/stats", timeout=10.0).json()


def _wait_idle(base, seconds=20.0):
    deadline = time.monotonic() + seconds
    while True:
        s = _stats(base)
        if s["pages_used"] == 0 and s["pages_held_by_requests"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not returned: {s}")
        time.sleep(0.1)


PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING LEAR:\nBlow, winds", "O",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n", "HAMLET:\nWho's there?\n"]


def test_concurrent_requests_equal_offline_greedy(server, client, offline):
    def completion(i):
        p = PROMPTS[i % len(PROMPTS)]
        n = 10 + 3 * i
        if i % 3 == 0:
            r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=n)
            return r.choices[0].text, offline(p, n), r.usage.completion_tokens == n
        if i % 3 == 1:
            stream = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=n, stream=True)
            return "".join(c.choices[0].text for c in stream), offline(p, n), True
        messages = [{"role": "user", "content": p}]
        stream = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=n, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return text, offline(chat_prompt(messages), n), True

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(completion, range(9), timeout=3 * TIMEOUT))
    for got, want, usage_ok in results:
        assert got == want and usage_ok
    _wait_idle(server)


def test_chat_without_streaming(server, client, offline):
    messages = [{"role": "system", "content": "Speak in verse."}, {"role": "user", "content": "Good morrow."}]
    r = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=12)
    assert r.choices[0].message.content == offline(chat_prompt(messages), 12)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt="", max_tokens=4), "prompt is empty"),
    (dict(prompt="x" * 200, max_tokens=4), "exceed the model's context of 128"),
    (dict(prompt="ROMEO:", max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(prompt="ROMEO:", max_tokens=4, temperature=0.7), "only greedy decoding"),
])
def test_bad_requests_get_clear_400s(server, client, kwargs, match):
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.completions.create(model="tiny-gpt", **kwargs)
    assert err.value.status_code == 400
    _wait_idle(server)


def test_malformed_bodies(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", timeout=10.0,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []}, timeout=10.0)
    assert r.status_code == 400 and "messages must be a non-empty list" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json=[1, 2], timeout=10.0)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    _wait_idle(server)


def test_disconnect_mid_stream_frees_pages(server):
    body = {"model": "tiny-gpt", "prompt": PROMPTS[4], "max_tokens": 60, "stream": True}
    with httpx.Client(timeout=10.0) as c:
        with c.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    events += 1
                if events == 3:
                    break                                # close the connection with most tokens unsent
        busy = _stats(server)
    assert busy["pages_used"] > 0 or busy["steps"] > 0
    idle = _wait_idle(server)
    assert idle["pages_used"] == 0 and idle["pages_held_by_requests"] == 0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-gpt"]
    assert httpx.get(server + "/health", timeout=10.0).json() == {"status": "ok"}
