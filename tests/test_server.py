"""kernels.serving.server: the OpenAI-compatible server, started as ``python -m kernels.serving.server`` on
127.0.0.1, driven by the official ``openai`` client (concurrent, streaming and not) and by httpx.
Greedy text equals offline generation; sampled text equals the offline draw with the same seed;
stop strings across token boundaries never leak; log-probs are the model's; every OpenAI field is
served or refused by name; unknown model 404, busy 429 (with Retry-After), timeout 504, engine failure
500; a request that poisons the engine fails alone; tiny temperatures are greedy; nested, oversized
and cut-off bodies, unknown routes and methods all answer in OpenAI's error shape; clients that go
away (streaming or not) are aborted; shutdown drains, or aborts past its drain time; every page comes
back; and a property-based fuzz of request bodies never gets a 5xx or disturbs a greedy request
running beside it. Every call has a timeout, and every server is shut down."""
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kernels.model.data import decode, encode
from kernels.model.gpt import load_pretrained
from kernels.serving import server as srv
from kernels.serving.engine import EngineConfig, reference_generate
from kernels.serving.sampling import SamplingParams
from kernels.serving.server import chat_prompt

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0
SMALL = ["--num-pages", "64", "--page-size", "8", "--max-tokens-per-step", "64", "--chunk", "16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kernels.serving.server`` in a subprocess on 127.0.0.1."""

    def __init__(self, *args):
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kernels.serving.server", "--port", str(self.port), *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become healthy within 120 s")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server():
    s = Server(*SMALL)
    try:
        yield s.base
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_pretrained()


@pytest.fixture(scope="module")
def offline(model):
    def generate(prompt: str, n: int, params: SamplingParams | None = None, seed: int = 0, choice: int = 0) -> str:
        return decode(reference_generate(model, encode(prompt).tolist(), n, params=params, seed=seed, choice=choice)[0])
    return generate


def _stats(base):
    return httpx.get(base + "/stats", timeout=10.0).json()


def _wait_idle(base, seconds=20.0):
    deadline = time.monotonic() + seconds
    while True:
        s = _stats(base)
        if s["pages_used"] == s["cached_pages"] and s["pages_held_by_requests"] == 0 and s["running"] == 0 \
                and s["waiting"] == 0 and s["in_flight"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"requests not finished or pages not returned: {s}")
        time.sleep(0.05)


PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING LEAR:\nBlow, winds", "O",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n", "HAMLET:\nWho's there?\n"]


def test_concurrent_requests_equal_offline_greedy(server, client, offline):
    def completion(i):
        p = PROMPTS[i % len(PROMPTS)]
        n = 10 + 3 * i
        if i % 3 == 0:
            r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=n, temperature=0)
            return r.choices[0].text, offline(p, n), r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
        if i % 3 == 1:
            stream = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=n, stream=True, temperature=0)
            return "".join(c.choices[0].text for c in stream), offline(p, n), True
        messages = [{"role": "user", "content": p}]
        stream = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=n, stream=True,
                                                temperature=0)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return text, offline(chat_prompt(messages), n), True

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(completion, range(9), timeout=3 * TIMEOUT))
    for got, want, ok in results:
        assert got == want and ok
    _wait_idle(server)


def test_chat_without_streaming_and_text_parts(server, client, offline):
    messages = [{"role": "system", "content": "Speak in verse."}, {"role": "user", "content": "Good morrow."}]
    r = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == offline(chat_prompt(messages), 12)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Good "}, {"type": "text", "text": "morrow."}],
              "name": "Romeo"}]
    r = client.chat.completions.create(model="tiny-gpt", messages=parts, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == offline("ROMEO:\nGood morrow.\n\nASSISTANT:\n", 8)


def test_seeded_sampling_and_n_choices_equal_offline_draws(server, client, offline):
    p = PROMPTS[2]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, n=3, seed=11)
    r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=14, n=3, seed=11, temperature=0.9,
                                  top_p=0.95, extra_body={"top_k": 40, "min_p": 0.02})
    got = sorted((c.index, c.text) for c in r.choices)
    assert [i for i, _ in got] == [0, 1, 2] and r.usage.completion_tokens == 3 * 14
    for i, text in got:
        assert text == offline(p, 14, params, seed=11, choice=i)
    again = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=14, n=3, seed=11, temperature=0.9,
                                      top_p=0.95, extra_body={"top_k": 40, "min_p": 0.02})
    assert sorted((c.index, c.text) for c in again.choices) == got
    assert len({t for _, t in got}) == 3
    _wait_idle(server)


def _greedy_text(offline, prompt, n=40):
    return offline(prompt, n)


def test_stop_strings_across_tokens_never_leak(server, client, offline):
    p = PROMPTS[4]
    full = _greedy_text(offline, p)
    stop = full[9:12]                                             # three tokens: spans token boundaries
    assert len(stop.encode()) == 3 and stop not in full[:9]
    want = full[:full.index(stop)]
    r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.encode()) + 3    # through the stop's last token
    stream = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=40, temperature=0, stop=stop,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want and all(stop not in t for t in texts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.encode()) + 3
    assert all(c.usage is None for c in chunks[:-1])
    _wait_idle(server)


def test_stop_token_and_length(server, client, offline):
    p = PROMPTS[4]
    full = _greedy_text(offline, p)
    assert "\n" in full
    r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=40, temperature=0,
                                  extra_body={"stop_token_ids": [10]})
    assert r.choices[0].text == full[:full.index("\n")] and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": p}], max_tokens=5,
                                       temperature=0, stop="qqq")
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content.encode()) == 5


def test_logprobs_are_the_model_log_softmax(server, client, model):
    p = PROMPTS[1]
    r = client.completions.create(model="tiny-gpt", prompt=p, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    _, _, logits = reference_generate(model, encode(p).tolist(), 8)
    ref = torch.log_softmax(logits, -1)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == list(range(8))
    for t, (tok, val, top) in enumerate(zip(encode(r.choices[0].text).tolist(), lp.token_logprobs, lp.top_logprobs)):
        assert abs(val - float(ref[t, tok])) < 1e-4 and len(top) == 2 and chr(tok) in top
    c = client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": p}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 and e.bytes == [ord(e.token)] for e in content)


# every refused field with a value that asks for something; the 400 must name the last key of each
REFUSALS = [
    ("completions", {"echo": True}), ("completions", {"suffix": "end"}), ("completions", {"best_of": 2}),
    ("completions", {"frequency_penalty": 0.5}), ("completions", {"presence_penalty": -1}),
    ("completions", {"logit_bias": {"10": 5}}), ("completions", {"logprobs": 6}), ("completions", {"n": 9}),
    ("completions", {"prompt": ["a", "b"]}), ("completions", {"temperature": 3}), ("completions", {"top_p": 0}),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}), ("completions", {"stream_options": {"include_usage": True}}),
    ("completions", {"stream": True, "stream_options": {"include_obfuscation": True}}),
    ("completions", {"user": 5}), ("completions", {"tools": []}), ("completions", {"max_tokens": 0}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}), ("chat", {"tool_choice": "auto"}),
    ("chat", {"functions": [{"name": "f"}]}), ("chat", {"function_call": "auto"}), ("chat", {"parallel_tool_calls": True}),
    ("chat", {"response_format": {"type": "json_object"}}), ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("chat", {"modalities": ["text", "audio"]}), ("chat", {"prediction": {"type": "content", "content": "x"}}),
    ("chat", {"reasoning_effort": "low"}), ("chat", {"verbosity": "low"}), ("chat", {"web_search_options": {}}),
    ("chat", {"metadata": {"a": "b"}}), ("chat", {"store": True}), ("chat", {"service_tier": "flex"}),
    ("chat", {"moderation": {"model": "m"}}), ("chat", {"prompt_cache_key": "k"}),
    ("chat", {"prompt_cache_retention": "24h"}), ("chat", {"prompt_cache_options": {"mode": "implicit"}}),
    ("chat", {"top_logprobs": 2}), ("chat", {"logprobs": True, "top_logprobs": 21}),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 4}), ("chat", {"seed": -1}), ("chat", {"suffix": "x"}),
    ("chat", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
    ("chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}),
]


def test_every_unsupported_field_is_refused_by_name(server):
    for endpoint, extra in REFUSALS:
        body = {"model": "tiny-gpt", "max_tokens": 4, **({"prompt": "ROMEO:"} if endpoint == "completions" else
                                                        {"messages": [{"role": "user", "content": "Hi"}]}), **extra}
        url = server + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
        r = httpx.post(url, json=body, timeout=10.0)
        err = r.json()["error"]
        field = list(extra)[-1]                           # e.g. top_logprobs in {logprobs: true, top_logprobs: 21}
        assert r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error", (extra, err)
        assert field in err["message"] or field in ("messages", "prompt"), (extra, err)
    _wait_idle(server)


def test_the_field_table_covers_both_openai_schemas():
    """Every field of openai-python's request schemas is in FIELDS, served or refused."""
    from typing import get_type_hints

    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp
    for params, table in ((cp.CompletionCreateParamsBase, srv.COMPLETION_FIELDS),
                          (ccp.CompletionCreateParamsBase, srv.CHAT_FIELDS)):
        names = set(get_type_hints(params)) | {"stream"}
        assert names <= set(table), sorted(names - set(table))
    statuses = {f.status for t in srv.FIELDS.values() for f in t.values()}
    assert statuses == {srv.SERVED, srv.DEFAULT_ONLY, srv.REFUSED, srv.IDENTIFIER}


def test_defaults_of_refused_fields_are_accepted(server, client):
    r = client.completions.create(model="tiny-gpt", prompt="O", max_tokens=2, temperature=0, echo=False,
                                  frequency_penalty=0, presence_penalty=0.0, logit_bias={}, best_of=1, suffix=None,
                                  user="someone")
    assert r.choices[0].finish_reason == "length"


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as err:
        client.completions.create(model="gpt-4o", prompt="O", max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt="", max_tokens=4), "prompt is empty"),
    (dict(prompt="x" * 200, max_tokens=4), "exceed the model's context of 128"),
    (dict(prompt="ROMEO:", max_tokens=0), "max_tokens must be an integer"),
    (dict(prompt="ROMEO:", max_tokens=4, temperature=2.5), "temperature must be a number in"),
])
def test_bad_requests_get_clear_400s(server, client, kwargs, match):
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.completions.create(model="tiny-gpt", **kwargs)
    assert err.value.status_code == 400
    _wait_idle(server)


def _openai_error(r: httpx.Response, status: int, param=None) -> dict:
    """The response is ``status`` with OpenAI's error body; returns its ``error`` object."""
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


def _post(base, path, body, **kwargs) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30.0, **kwargs)


def test_context_overflow_names_the_field_at_fault(server):
    """prompt + max_tokens past the context: max_tokens is at fault when the prompt alone fits (the probe's
    {max_tokens: 1000000} blamed the prompt), the prompt (messages, in chat) when it leaves no room."""
    for body, param in (({"prompt": "ROMEO:\n", "max_tokens": 10 ** 6}, "max_tokens"),
                        ({"prompt": "x" * 100, "max_tokens": 29}, "max_tokens"),
                        ({"prompt": "x" * 128, "max_tokens": 1}, "prompt")):
        err = _openai_error(_post(server, "/v1/completions", {"model": "tiny-gpt", **body}), 400, param)
        assert err["code"] == "context_length_exceeded" and "exceed the model's context of 128" in err["message"]
    chat = {"model": "tiny-gpt", "messages": [{"role": "user", "content": "Hi"}]}
    _openai_error(_post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 500}), 400,
                  "max_completion_tokens")
    _openai_error(_post(server, "/v1/chat/completions", {**chat, "max_tokens": 500}), 400, "max_tokens")
    _openai_error(_post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 200}]}),
                  400, "messages")


def test_sampling_fields_are_held_to_what_the_kernels_hold(server, offline):
    """top_k is an int32 in the sampler: 2**31 is a 400 naming it (it was a 500 for every request in the
    step), 2**31 - 1 is served. A temperature below 1e-5 is greedy (1e-39 answered twenty NUL bytes)."""
    base = {"model": "tiny-gpt", "prompt": "ROMEO:\n", "max_tokens": 12}
    err = _openai_error(_post(server, "/v1/completions", {**base, "top_k": 2 ** 31}), 400, "top_k")
    assert "2147483647" in err["message"]
    assert _post(server, "/v1/completions", {**base, "top_k": 2 ** 31 - 1, "seed": 1}).status_code == 200
    greedy = offline("ROMEO:\n", 12)
    for t in (1e-39, 5e-324, 1e-38, 3e-38, 9e-6):
        r = _post(server, "/v1/completions", {**base, "temperature": t, "seed": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (t, r.text)
    _wait_idle(server)


def test_nested_oversized_and_misrouted_requests_answer_in_the_api_shape(server):
    """1000 nested brackets (a RecursionError in json.loads: a text/plain 500 before) and a prompt nested
    40 deep are 400s; a 5 MB prompt is a 413 refused by its Content-Length, and a chunked 100 KB body
    (no Content-Length) while it streams in; an unknown route is a 404 and a wrong method a 405 (with
    Allow), both in OpenAI's shape instead of FastAPI's {"detail": ...}."""
    url = server + "/v1/completions"
    r = httpx.post(url, content=b"[" * 1000 + b"]" * 1000, timeout=10.0, headers={"content-type": "application/json"})
    assert "nests deeper than 32" in _openai_error(r, 400)["message"]
    deep = {"model": "tiny-gpt", "prompt": json.loads("[" * 40 + "]" * 40)}
    assert "nests deeper" in _openai_error(_post(server, "/v1/completions", deep), 400)["message"]
    t0 = time.monotonic()
    big = {"model": "tiny-gpt", "prompt": "x" * 5_000_000}
    err = _openai_error(_post(server, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and "65536 bytes" in err["message"]
    assert time.monotonic() - t0 < 10.0
    chunks = (b'{"model": "tiny-gpt", "prompt": "' + b"y" * 1000 for _ in range(100))
    _openai_error(httpx.post(url, content=chunks, timeout=10.0), 413)
    err = _openai_error(_post(server, "/v1/embeddings", {"model": "tiny-gpt", "input": "x"}), 404)
    assert err["code"] == "not_found" and "/v1/embeddings" in err["message"]
    r = httpx.get(url, timeout=10.0)
    assert _openai_error(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    _wait_idle(server)


def test_malformed_bodies(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", timeout=10.0,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny-gpt", "messages": []}, timeout=10.0)
    assert r.status_code == 400 and "messages must be a non-empty list" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json=[1, 2], timeout=10.0)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"prompt": "x"}, timeout=10.0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
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
    idle = _wait_idle(server)
    assert idle["pages_held_by_requests"] == 0


def test_models_and_health(server, client):
    (m,) = client.models.list().data
    assert m.id == "tiny-gpt" and isinstance(m.created, int) and abs(m.created - time.time()) < 3600
    assert client.models.retrieve("tiny-gpt").id == "tiny-gpt"
    assert httpx.get(server + "/health", timeout=10.0).json() == {"status": "ok"}


# ---------------------------------------------------------------- admission, timeouts, failures, shutdown
# These run the app in this process with uvicorn on a thread, so a test can slow the engine's
# forward down (STEP seconds per step): a 120-token request then takes 120 * STEP seconds whatever
# the machine, and a timeout, a disconnect or a drain deadline is crossed for certain, not by a race.

STEP = 0.02


@contextlib.contextmanager
def serving(model, config=EngineConfig(num_pages=32, page_size=8), *, step_delay=0.0, drain=30.0, **app_args):
    """The app on 127.0.0.1 in this process; yields (app, base url). Afterwards the server has exited
    and the engine thread is joined."""
    import uvicorn

    app = srv.create_app(model, config, **app_args)
    if step_delay:
        runner = app.state.engine.engine.runner
        forward = runner.forward

        def slow(works):
            time.sleep(step_delay)
            return forward(works)
        runner.forward = slow
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=drain))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    app.state.server = server
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True                                # what uvicorn's SIGTERM handler sets
        thread.join(drain + 30)
        app.state.engine.thread.join(10)
    assert not thread.is_alive() and not app.state.engine.thread.is_alive()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def test_disconnect_without_streaming_aborts(model):
    """A plain (non-streaming) request whose client gives up after 0.3 s: the server notices the
    disconnect and aborts it; the engine stops stepping long before the 120 tokens (2.4 s) are done."""
    with serving(model, step_delay=STEP) as (app, base):
        body = {"model": "tiny-gpt", "prompt": "O", "max_tokens": 120, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.3))
        idle = _wait_idle(base)
        assert idle["steps"] < 60, f"the request ran {idle['steps']} steps: it was not aborted"


def test_busy_is_429_and_slow_is_504(model):
    config = EngineConfig(num_pages=32, page_size=8, max_seqs=1)
    with serving(model, config, step_delay=STEP, max_queue=1, request_timeout=0.5) as (app, base):
        c = _client(base)

        def call(_):
            try:
                c.completions.create(model="tiny-gpt", prompt="O", max_tokens=120, temperature=0)
                return "ok"
            except openai.RateLimitError as err:
                assert "at capacity" in str(err) and err.status_code == 429
                assert err.response.headers["retry-after"] == str(srv.RETRY_AFTER_S)
                return 429
            except openai.APIStatusError as err:
                assert err.status_code == 504 and "did not finish within 0.5 s" in str(err)
                return 504
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(call, range(4), timeout=TIMEOUT))
        assert "ok" not in codes and codes.count(429) >= 1 and codes.count(504) >= 1, codes
        _wait_idle(base)                                         # the aborts reach the engine thread a step later
        stream = c.completions.create(model="tiny-gpt", prompt="O", max_tokens=120, temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="did not finish within"):
            list(stream)
        _wait_idle(base)


def test_engine_failure_is_500_server_error_and_the_server_carries_on(model):
    with serving(model) as (app, base):
        runner = app.state.engine.engine.runner
        forward = runner.forward

        def broken(works):
            raise RuntimeError("a kernel fault")
        runner.forward = broken
        c = _client(base)
        with pytest.raises(openai.InternalServerError, match="a kernel fault") as err:
            c.completions.create(model="tiny-gpt", prompt="O", max_tokens=4)
        assert err.value.status_code == 500 and err.value.body["type"] == "server_error"
        with pytest.raises(openai.APIError, match="a kernel fault"):
            list(c.completions.create(model="tiny-gpt", prompt="O", max_tokens=4, stream=True))
        runner.forward = forward
        assert c.completions.create(model="tiny-gpt", prompt="O", max_tokens=4).usage.completion_tokens == 4
        assert _wait_idle(base)["engine_errors"] == 2


def test_a_poisoned_request_fails_alone_and_the_batch_goes_on(model, offline, monkeypatch):
    """The probe's attack with the server's validation bypassed, so that the engine itself is tested: a
    request whose top_k (2**31) overflows the sampler's int32 arrives while three greedy requests run
    (two streaming). It alone gets the 500; the three complete with their offline text."""
    parse = srv.parse_request

    def poisoning(body, chat, context=128):
        req = parse(body, chat, context)
        if body.get("prompt") == "POISON":
            object.__setattr__(req.params, "top_k", 2 ** 31)
        return req
    monkeypatch.setattr(srv, "parse_request", poisoning)
    with serving(model, step_delay=STEP) as (app, base):
        c = _client(base)
        started = threading.Event()

        def healthy(i):
            p = PROMPTS[i]
            if i == 0:
                return c.completions.create(model="tiny-gpt", prompt=p, max_tokens=40, temperature=0).choices[0].text, p
            stream = c.completions.create(model="tiny-gpt", prompt=p, max_tokens=40, temperature=0, stream=True)
            text = ""
            for chunk in stream:
                text += chunk.choices[0].text
                started.set()
            return text, p
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(healthy, i) for i in range(3)]
            assert started.wait(TIMEOUT)
            with pytest.raises(openai.InternalServerError, match="engine error: RuntimeError: .*int32") as err:
                c.completions.create(model="tiny-gpt", prompt="POISON", max_tokens=5, temperature=1.0, seed=1)
            assert err.value.body["type"] == "server_error"
            for a in answers:
                text, p = a.result(timeout=TIMEOUT)
                assert text == offline(p, 40)
        stats = _wait_idle(base)
        assert stats["engine_errors"] == 1 and stats["steps"] >= 40


def test_an_unexpected_error_is_a_500_in_the_api_shape(model, monkeypatch):
    """A bug in the handler (here parse_request raising KeyError) still answers in OpenAI's error shape,
    not Starlette's text/plain "Internal Server Error"; the server serves on."""
    parse = srv.parse_request

    def buggy(body, chat, context=128):
        if body.get("prompt") == "BUG":
            raise KeyError("a bug")
        return parse(body, chat, context)
    monkeypatch.setattr(srv, "parse_request", buggy)
    logging.getLogger("uvicorn.error").disabled = True                  # the traceback it logs is expected here
    try:
        with serving(model) as (app, base):
            err = _openai_error(_post(base, "/v1/completions", {"model": "tiny-gpt", "prompt": "BUG"}), 500)
            assert err["type"] == "server_error" and "KeyError" in err["message"]
            r = _post(base, "/v1/completions", {"model": "tiny-gpt", "prompt": "O", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        logging.getLogger("uvicorn.error").disabled = False


def test_a_client_that_leaves_before_its_body_is_read_logs_nothing(model):
    """Headers promise 1000 bytes, 10 arrive, the socket closes: the handler sees ClientDisconnect and returns
    (uvicorn logged "Exception in ASGI application" with a traceback before); the server serves on."""
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    with serving(model) as (app, base):
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            port = int(base.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"model\": ")
                time.sleep(0.3)
            time.sleep(0.5)
            r = _client(base).completions.create(model="tiny-gpt", prompt="O", max_tokens=3, temperature=0)
            assert r.usage.completion_tokens == 3
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
        assert _wait_idle(base)["in_flight"] == 0
    assert not records, [r.getMessage() for r in records]


def _stream_lines(base, body, after_first=None):
    """POST a streaming request; call ``after_first`` once the first event arrived; returns the data lines."""
    lines = []
    with httpx.Client(timeout=30.0) as c:
        try:
            with c.stream("POST", base + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1 and after_first:
                            after_first()
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass                                              # the server closed the connection
    return lines


def test_sigterm_drains_open_requests(offline):
    """The real process: SIGTERM while a stream is open; the stream completes, then the server exits."""
    s = Server(*SMALL, "--drain-timeout", "30")
    body = {"model": "tiny-gpt", "prompt": "O", "max_tokens": 100, "temperature": 0, "stream": True}
    lines = _stream_lines(s.base, body, after_first=lambda: s.proc.send_signal(signal.SIGTERM))
    code = s.stop()
    assert lines[-1] == "[DONE]" and "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == offline("O", 100)
    assert code in (0, -signal.SIGTERM)                      # uvicorn re-raises the signal it handled


def test_shutdown_past_its_drain_time_aborts(model):
    """Shutdown with a 0.2 s drain while a 120-token stream (2.4 s) is open: the stream is cut, the
    request aborted, its pages returned, and the server and engine threads exit."""
    with serving(model, step_delay=STEP, drain=0.2) as (app, base):
        body = {"model": "tiny-gpt", "prompt": "O", "max_tokens": 120, "temperature": 0, "stream": True}
        t0 = time.monotonic()
        lines = _stream_lines(base, body, after_first=lambda: setattr(app.state.server, "should_exit", True))
        assert time.monotonic() - t0 < 2.0 and "[DONE]" not in lines and len(lines) < 60
        engine = app.state.engine
        deadline = time.monotonic() + 10
        while engine.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.engine.pages_held_by_requests() == 0 and not engine.active and engine.in_flight == 0


# ---------------------------------------------------------------- a fuzzed server
# Request bodies drawn by hypothesis (the course profile derandomizes them: the same bodies on every
# machine) against the real server process on 127.0.0.1, while a greedy request runs beside them.

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 65, 2 ** 65), st.floats(width=64),
                         st.text(max_size=12), st.sampled_from(["\ud800", "☕" * 3, "\x00", ""]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
EDGES = st.sampled_from([0, -1, 2 ** 31, 2 ** 63, 1e-39, 2.5, 1e308, float("nan"), float("inf"), True, "1", None,
                         [], {}])
RAW_BODIES = st.sampled_from([b"[" * 1000 + b"]" * 1000, b'{"model": "tiny-gpt", "prompt": ' + b"[" * 1000,
                              b"\xff\xfe{}", b'{"model": "tiny', b"", b"1" * 5000, b"null", b'"x"'])
WEIRD_PROMPTS = st.one_of(st.text(min_size=120, max_size=140), st.lists(st.integers(-3, 300), max_size=12),
                          st.sampled_from(["", "\ud83d", "z" * 70_000, [[1, 2]], ["a", "b"], [True]]))


def _field(small, *edges):
    """A field's values: mostly small valid ones (a request the engine serves costs a few steps), else
    the values at and just past the ends of its range."""
    return st.one_of(small, small, small, st.sampled_from(edges))


VALID = {
    "max_tokens": _field(st.integers(1, 6), 0, 2 ** 31, 10 ** 6, 121),
    "n": _field(st.integers(1, 3), 0, 8, 9),
    "seed": _field(st.integers(0, 2 ** 40), -1, 2 ** 63 - 1, 2 ** 63),
    "temperature": _field(st.floats(0, 2), -0.0, 1e-39, 5e-324, 3e-38, 1e-5, 2.0000001, -1e-300),
    "top_p": _field(st.floats(0, 1, exclude_min=True), 0, 5e-324, 1.0000001),
    "top_k": _field(st.integers(-1, 300), -2, 2 ** 31 - 1, 2 ** 31, 2 ** 63),
    "min_p": _field(st.floats(0, 1), -5e-324, 1.5),
    "stop": _field(st.one_of(st.text(min_size=1, max_size=2), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
                   "", [""], ["a"] * 5, "\ud800", [1]),
    "stop_token_ids": _field(st.lists(st.integers(0, 255), max_size=2), [-1], [256], [True]),
    "stream": _field(st.booleans(), 1, "yes"),
    "user": _field(st.text(max_size=5), 5),
    "frequency_penalty": _field(st.just(0), 0.5, -2),
}
VALID_COMPLETION = {**VALID, "logprobs": _field(st.integers(0, 5), -1, 6, True), "echo": _field(st.just(False), True),
                    "suffix": _field(st.just(""), "x"), "best_of": _field(st.just(1), 0, 2)}
VALID_CHAT = {**VALID, "logprobs": _field(st.booleans(), 1), "top_logprobs": _field(st.integers(0, 20), -1, 21),
              "max_completion_tokens": _field(st.integers(1, 6), 0, 2 ** 31), "store": _field(st.just(False), True),
              "response_format": _field(st.just({"type": "text"}), {"type": "json_object"})}
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                           "content": st.text(max_size=8)}, optional={"name": st.text(min_size=1,
                                                                                                     max_size=4)}),
                    min_size=1, max_size=2)


@st.composite
def request_bodies(draw):
    """(chat, body): a request (the model, a short prompt or messages, a few fields each at a small valid
    value or at an end of its range) with 0 to 2 mutations: a field replaced by an edge value or any JSON
    (nested, unicode, lone surrogates), an unknown field, a field removed, a prompt or messages that break
    a rule. Now and then not an object, or not JSON at all (bytes: 1000 nested brackets, cut off, not UTF-8)."""
    chat = draw(st.booleans())
    if draw(st.integers(0, 14)) == 0:
        return chat, draw(st.one_of(RAW_BODIES, JSON_VALUES))
    valid = VALID_CHAT if chat else VALID_COMPLETION
    body = {"model": "tiny-gpt", "max_tokens": draw(st.integers(1, 6))}
    if chat:
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=24), st.lists(st.integers(0, 255), min_size=1,
                                                                                    max_size=8)))
    for name in draw(st.permutations(sorted(valid)))[:draw(st.integers(0, 4))]:
        body[name] = draw(valid[name])
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["replace", "unknown", "remove", "prompt"]))
        if kind == "replace":
            body[draw(st.sampled_from(sorted(valid) + ["model", "messages" if chat else "prompt"]))] = \
                draw(st.one_of(EDGES, JSON_VALUES))
        elif kind == "unknown":
            body[draw(st.sampled_from(["foo", "max_new_tokens", "repetition_penalty", "tools", "logit_bias"]))] = \
                draw(JSON_VALUES)
        elif kind == "remove":
            body.pop(draw(st.sampled_from(sorted(body))))
        elif chat:
            body["messages"] = draw(st.lists(st.one_of(JSON_VALUES, st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "tool", "bogus"]), "content": JSON_VALUES})), max_size=2))
        else:
            body["prompt"] = draw(WEIRD_PROMPTS)
    return chat, body


def _check_ok(r: httpx.Response, chat: bool, body: dict) -> None:
    """A 200 is a complete, well-formed answer: the openai package's own models parse it, every choice is
    there and finished, and a stream ends with [DONE] and carries no error event."""
    n = body.get("n") or 1
    if not body.get("stream"):
        out = (openai.types.chat.ChatCompletion if chat else openai.types.Completion).model_validate(r.json())
        assert sorted(c.index for c in out.choices) == list(range(n))
        assert all(c.finish_reason in ("stop", "length") for c in out.choices) and out.usage.total_tokens > 0
        return
    lines = [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-300:]
    kind = openai.types.chat.ChatCompletionChunk if chat else openai.types.Completion
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all("error" not in c for c in chunks), r.text[-300:]
    finished = {c.index for x in chunks for c in kind.model_validate(x).choices if c.finish_reason}
    assert finished == set(range(n))


def _check_refusal(r: httpx.Response, body) -> None:
    """A refusal is a 4xx in OpenAI's shape; a JSON object that parsed gets the field at fault named."""
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    sized = isinstance(body, dict) and len(json.dumps(body)) <= srv.MAX_BODY and srv.json_depth(body) <= srv.MAX_DEPTH
    if sized:
        assert err["param"] in set(body) | {"model", "prompt", "messages", "max_tokens"}, (err, body)


class Beside:
    """A greedy request sent again and again from a thread while the fuzz runs; ``stop()`` -> its texts."""

    def __init__(self, base: str, prompt: str, max_tokens: int):
        self.body = {"model": "tiny-gpt", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        self.base, self.texts, self.done = base, [], threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        with httpx.Client(timeout=TIMEOUT) as c:
            while not self.done.is_set():
                r = c.post(self.base + "/v1/completions", json=self.body)
                self.texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    def stop(self, at_least: int = 2) -> list[str]:
        deadline = time.monotonic() + TIMEOUT
        while len(self.texts) < at_least and time.monotonic() < deadline:   # when the fuzz was deselected
            time.sleep(0.05)
        self.done.set()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()
        return self.texts


@pytest.fixture(scope="module")
def beside(server):
    b = Beside(server, PROMPTS[4], 24)
    yield b
    b.stop()


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=request_bodies())
@example(case=(False, {"model": "tiny-gpt", "prompt": "x", "top_k": 2 ** 31, "max_tokens": 2}))     # the probe's D1
@example(case=(False, b"[" * 1000 + b"]" * 1000))                                                    # D3
@example(case=(True, {"model": "tiny-gpt", "messages": [{"role": "user", "content": "\ud800"}]}))
def test_fuzzed_bodies_get_an_answer_or_a_named_refusal_never_a_5xx(server, beside, case):
    chat, body = case
    url = server + ("/v1/chat/completions" if chat else "/v1/completions")
    raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")
    r = httpx.post(url, content=raw, timeout=TIMEOUT, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code == 200:
        _check_ok(r, chat, body)
    else:
        assert 400 <= r.status_code < 500 and r.status_code != 429
        _check_refusal(r, body)


def test_the_greedy_request_beside_the_fuzz_was_unchanged(server, beside, offline):
    """Runs after the fuzz (file order): the request beside it completed, every time, with its offline text."""
    texts, want = beside.stop(), offline(PROMPTS[4], 24)
    assert len(texts) >= 2 and all(t == want for t in texts), (want, texts[:3])
    _wait_idle(server)
