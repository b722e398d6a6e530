"""Load test of the CPU server: requests/s and time to first token at several client concurrencies.

    python -m kernels.serving.loadtest --clients 1 4 16 --requests 48 --max-tokens 32

starts ``python -m kernels.serving.server`` on a free port of 127.0.0.1 (or uses ``--url``), then for
each concurrency c runs c client threads that send streaming completions with the official openai
client until ``--requests`` have completed, and prints requests/s, tokens/s and the time to first
token (from sending the request to the first streamed text chunk; p50 and p90). The prompts are
the first lines of speeches from the course's Shakespeare text. Numbers are wall-clock on this CPU
and move with whatever else runs on the machine.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from kernels.model.data import load_text

ROOT = Path(__file__).resolve().parents[2]


def prompts(n: int) -> list[str]:
    speeches = [s for s in load_text().split("\n\n") if s.strip()]
    return [s[:60] for s in speeches[:n]]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kernels.serving.server", "--port", str(port), *extra], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def run_level(url: str, clients: int, n_requests: int, max_tokens: int, texts: list[str]) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    ttft, tokens, lock = [], [0], threading.Lock()
    counter = iter(range(n_requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            first = None
            n = 0
            for chunk in client.completions.create(model="tiny-gpt", prompt=texts[i % len(texts)],
                                                   max_tokens=max_tokens, stream=True):
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - t0
                n += 1
            with lock:
                ttft.append(first if first is not None else float("nan"))
                tokens[0] += max_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft.sort()
    return {"clients": clients, "requests": n_requests, "seconds": wall, "requests_per_s": n_requests / wall,
            "tokens_per_s": tokens[0] / wall, "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--server-args", default="", help="extra arguments for the server it starts")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args.split())
    try:
        texts = prompts(64)
        run_level(url, 1, 2, 4, texts)                                   # warm up
        print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p90':>9}")
        for c in args.clients:
            r = run_level(url, c, args.requests, args.max_tokens, texts)
            print(f"{c:7} {r['requests']:8} {r['requests_per_s']:7.2f} {r['tokens_per_s']:7.1f} "
                  f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p90'] * 1e3:7.0f}ms", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
