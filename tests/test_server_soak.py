"""A bounded soak of ``python -m kernels.serving.server`` on 127.0.0.1 (issue 22).

A small cache (24 pages of 8 tokens, prefix caching on, chunked prefill, 8 seats, 8 queued) is
driven by 12 concurrent asyncio clients (openai.AsyncOpenAI and httpx) through 160 requests drawn
from a seeded mix: greedy answers checked against offline generation, sampled n=2 answers with
stop strings, chat streams with usage, streams the client drops after a few events, plain requests
the client abandons (read timeout), requests cancelled mid-flight (asyncio task cancellation), and
bad requests (a refused field, an unknown model, broken JSON). Every outcome is one the server
promises (200 with the right text, 400/404 naming the problem, 429 when full); the run is bounded
to 160 requests and 120 s. Afterwards no request is stuck, every page is back (only the prefix
cache's remain, and they are evictable), the engine never failed, the server still answers
correctly, and while idle it uses no CPU (< 2 % of one core over 2 s: the engine thread sleeps on an
event, it does not poll).
"""
import asyncio
import collections
import os
import random
import time

import httpx
import openai
import pytest
import torch

from kernels.model.data import decode, encode
from kernels.model.gpt import load_pretrained
from kernels.serving.engine import reference_generate
from kernels.serving.server import chat_prompt
from test_server import Server, _wait_idle

ARGS = ["--num-pages", "24", "--page-size", "8", "--max-tokens-per-step", "48", "--chunk", "16",
        "--max-seqs", "8", "--max-queue", "8", "--prefix-cache"]
REQUESTS, CLIENTS, BOUND_S = 160, 12, 120.0
CONTEXT = 128                                                             # the tiny GPT's block size
SYSTEM = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"     # shared by many prompts
PROMPTS = [SYSTEM + "ROMEO:\n", SYSTEM + "JULIET:\n", "KING LEAR:\nBlow, winds", "O", SYSTEM, "HAMLET:\nWho's there?\n"]
KINDS = ["greedy", "sampled", "chat_stream", "drop_stream", "abandon", "cancel", "bad"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def offline():
    torch.set_num_threads(1)
    model = load_pretrained()
    cache = {}

    def greedy(prompt: str, n: int) -> str:
        if (prompt, n) not in cache:
            cache[prompt, n] = decode(reference_generate(model, encode(prompt).tolist(), n)[0])
        return cache[prompt, n]
    return greedy


async def one(kind: str, rng: random.Random, base: str, client: openai.AsyncOpenAI, http: httpx.AsyncClient,
              offline) -> str:
    """Send one request of ``kind``; returns its outcome label, asserting that the outcome is allowed."""
    prompt = rng.choice(PROMPTS)
    room = CONTEXT - len(encode(chat_prompt([{"role": "user", "content": prompt}]) if kind == "chat_stream" else prompt))
    n_tok = min(rng.randint(4, 40), room)
    long = min(60, room)                                   # the requests a client gives up on
    try:
        if kind == "greedy":
            r = await client.completions.create(model="tiny-gpt", prompt=prompt, max_tokens=n_tok, temperature=0)
            assert r.choices[0].text == offline(prompt, n_tok) and r.usage.completion_tokens == n_tok
            return "ok"
        if kind == "sampled":
            r = await client.completions.create(model="tiny-gpt", prompt=prompt, max_tokens=n_tok, n=2,
                                                temperature=0.9, top_p=0.9, seed=rng.randrange(2 ** 31),
                                                stop=["\n\n", "th"])
            for c in r.choices:
                assert "th" not in c.text and "\n\n" not in c.text and c.finish_reason in ("stop", "length")
            return "ok"
        if kind == "chat_stream":
            stream = await client.chat.completions.create(
                model="tiny-gpt", messages=[{"role": "user", "content": prompt}], max_tokens=n_tok, stream=True,
                temperature=0.7, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert chunks[-1].usage.completion_tokens == n_tok and chunks[-1].choices == []
            return "ok"
        if kind == "drop_stream":
            body = {"model": "tiny-gpt", "prompt": prompt, "max_tokens": long, "stream": True}
            async with http.stream("POST", base + "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    return "429"
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= rng.randint(1, 5):
                        return "dropped"                    # leaving the block closes the connection
            return "ok"
        if kind == "abandon":
            body = {"model": "tiny-gpt", "prompt": prompt, "max_tokens": long}
            try:
                r = await http.post(base + "/v1/completions", json=body,
                                    timeout=httpx.Timeout(10.0, read=rng.uniform(0.01, 0.2)))
                return "429" if r.status_code == 429 else "ok"
            except httpx.ReadTimeout:
                return "abandoned"
        if kind == "cancel":
            task = asyncio.ensure_future(client.completions.create(model="tiny-gpt", prompt=prompt, max_tokens=long,
                                                                   stream=rng.random() < 0.5))
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            task.cancel()
            try:
                await task
                return "ok"
            except asyncio.CancelledError:
                return "cancelled"
        bad = rng.choice([{"logit_bias": {"1": 3}}, {"model": "gpt-4o"}, {"echo": True}, {"tools": []}, "json"])
        if bad == "json":
            r = await http.post(base + "/v1/completions", content=b'{"model": "tiny-gpt", "prompt": ',
                                headers={"content-type": "application/json"})
            assert r.status_code == 400
            return "400"
        r = await http.post(base + "/v1/completions", json={"model": "tiny-gpt", "prompt": prompt, "max_tokens": 4,
                                                             **bad})
        assert r.status_code == (404 if "model" in bad else 400) and r.json()["error"]["param"] in bad, r.text
        return str(r.status_code)
    except openai.RateLimitError:
        return "429"


async def soak(base: str, offline) -> collections.Counter:
    rng = random.Random(22)
    plan = [(k, random.Random(rng.randrange(2 ** 32))) for k in rng.choices(KINDS, k=REQUESTS)]
    outcomes = collections.Counter()
    queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    async with httpx.AsyncClient(timeout=60.0) as http:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=60.0, max_retries=0)

        async def worker():
            while not queue.empty():
                kind, r = queue.get_nowait()
                outcomes[kind, await one(kind, r, base, client, http, offline)] += 1
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), BOUND_S)
        await client.close()
    return outcomes


def test_soak(offline):
    s = Server(*ARGS)
    try:
        t0 = time.monotonic()
        outcomes = asyncio.run(soak(s.base, offline))
        assert sum(outcomes.values()) == REQUESTS and time.monotonic() - t0 < BOUND_S
        for label in (("greedy", "ok"), ("drop_stream", "dropped"), ("abandon", "abandoned"), ("cancel", "cancelled")):
            assert outcomes[label] > 0, (label, outcomes)          # each disruption really happened
        idle = _wait_idle(s.base, seconds=30.0)                     # nothing stuck, every page back
        assert idle["engine_errors"] == 0 and idle["pages_used"] == idle["cached_pages"], idle
        assert idle["preemptions"] > 0, idle                        # the small pool really ran out of pages
        before = cpu_seconds(s.proc.pid)
        time.sleep(2.0)
        idle_cpu = cpu_seconds(s.proc.pid) - before
        assert idle_cpu < 0.04, f"idle server used {idle_cpu:.3f} s of CPU in 2 s"
        r = httpx.post(s.base + "/v1/completions", json={"model": "tiny-gpt", "prompt": PROMPTS[0], "max_tokens": 12,
                                                          "temperature": 0}, timeout=30.0)
        assert r.json()["choices"][0]["text"] == offline(PROMPTS[0], 12)
    finally:
        s.stop()
