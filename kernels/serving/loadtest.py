"""Load test of the CPU server: tokens/s and time to first token at several client concurrencies.

    python -m kernels.serving.loadtest --clients 1 4 16 64 --requests 128 --max-tokens 32 --json out.json

starts ``python -m kernels.serving.server`` on a free port of 127.0.0.1 (or uses ``--url``), then for
each concurrency c runs c client threads that send streaming completions with the official openai
client until ``--requests`` have completed, and prints requests/s, tokens/s and the time to first
token (from sending the request to the first streamed text chunk; p50 and p99 by nearest rank).
Every request asks for ``--max-tokens`` tokens and has no stop condition, so it generates exactly
that many: tokens/s = requests * max_tokens / wall seconds. The prompts are the first 60 characters
of speeches from the course's Shakespeare text. Numbers are wall-clock on this CPU and move with
whatever else runs on the machine; ``--json`` writes them with the command, the machine, its load
average and the date.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from kernels.model.data import load_text
from kernels.serving.simulate import percentile

ROOT = Path(__file__).resolve().parents[2]


def prompts(n: int) -> list[str]:
    speeches = [s for s in load_text().split("\n\n") if s.strip()]
    return [s[:60] for s in speeches[:n]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], *, cwd: Path = ROOT, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m kernels.serving.server`` on a free port of 127.0.0.1; waits until /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kernels.serving.server", "--port", str(port), *extra],
                            cwd=cwd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start within 120 s")


def run_level(url: str, clients: int, n_requests: int, max_tokens: int, texts: list[str],
              temperature: float | None = None) -> dict:
    """``clients`` threads send ``n_requests`` streaming completions in all; wall time and TTFTs.
    ``temperature`` None leaves the field out (the server's default: 1, sampled)."""
    extra = {} if temperature is None else {"temperature": temperature}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300.0, max_retries=0)
    ttft, lock = [], threading.Lock()
    counter = iter(range(n_requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            first = None
            for chunk in client.completions.create(model="tiny-gpt", prompt=texts[i % len(texts)],
                                                   max_tokens=max_tokens, stream=True, **extra):
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - t0
            with lock:
                ttft.append(first if first is not None else float("nan"))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": n_requests, "max_tokens": max_tokens, "temperature": temperature,
            "seconds": wall,
            "requests_per_s": n_requests / wall, "tokens_per_s": n_requests * max_tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def machine() -> dict:
    """The CPU the numbers were measured on, and how busy it was."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "load_average": list(os.getloadavg()),
            "python": platform.python_version()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=None, help="sent with every request (default: not sent)")
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--server-args", default="", help="extra arguments for the server it starts")
    ap.add_argument("--json", default=None, help="write the rows and their provenance to this file")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args.split())
    rows = []
    try:
        texts = prompts(64)
        run_level(url, 1, 2, 4, texts, args.temperature)                 # warm up
        print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9}")
        for c in args.clients:
            r = run_level(url, c, args.requests, args.max_tokens, texts, args.temperature)
            rows.append(r)
            print(f"{c:7} {r['requests']:8} {r['requests_per_s']:7.2f} {r['tokens_per_s']:7.1f} "
                  f"{r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p99_s'] * 1e3:7.0f}ms", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        info = {"command": "python -m kernels.serving.loadtest " + " ".join(sys.argv[1:] if argv is None else argv),
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"provenance": info, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
