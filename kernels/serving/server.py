"""An OpenAI-compatible HTTP server for the engine: ``python -m kernels.serving.server --port 8000``.

POST /v1/completions and /v1/chat/completions (``stream: true`` answers with server-sent events,
``data: {json}`` per chunk and ``data: [DONE]`` at the end, as the OpenAI API does), GET /v1/models,
/health, and /stats (the allocator's page counts: how a test sees that a request freed its pages).

The request path: the handler parses and validates the JSON (a clear 400 otherwise), tokenizes
(UTF-8 bytes), and hands the request to the engine thread, which runs continuous batching steps
and pushes each sampled token back to the request's asyncio queue; the handler detokenizes
incrementally (a byte-level token may be half of a UTF-8 character) and streams. When a client
goes away mid-stream, the response generator is closed and the request is aborted: its pages go
back at once.
"""
from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import json
import queue
import threading
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kernels.model.data import encode
from kernels.model.gpt import GPT, load_pretrained
from kernels.serving.engine import Engine, EngineConfig

MODEL_NAME = "tiny-gpt"
DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the server refuses; becomes a 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def chat_prompt(messages) -> str:
    """The chat template of a byte-level model trained on plays: each message a speech under its
    speaker's name, then the assistant's name to speak next."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest("each message needs a string role and a string content", "messages")
        parts.append(f"{m['role'].upper()}:\n{m['content']}\n\n")
    return "".join(parts) + "ASSISTANT:\n"


def parse_request(body, chat: bool) -> tuple[list[int], int, bool]:
    """Validate a request body; returns (prompt token ids, max_tokens, stream)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
        text = chat_prompt(body.get("messages"))
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise BadRequest("prompt must be a string", "prompt")
        if not text:
            raise BadRequest("prompt is empty: at least one token is needed", "prompt")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise BadRequest("only greedy decoding is served: temperature must be 0 or absent", "temperature")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    return encode(text).tolist(), max_tokens, stream


class Handle:
    """One request inside the engine thread: its sink (an asyncio queue on the server's loop)."""

    def __init__(self, prompt: list[int], max_tokens: int, loop: asyncio.AbstractEventLoop):
        self.prompt, self.max_tokens, self.loop = prompt, max_tokens, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq = None
        self.aborted = False
        self.times: dict[str, float] = {"received": time.perf_counter()}

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineThread:
    """Runs engine steps in a background thread while there is work; requests enter through a queue."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.Queue[Handle] = queue.Queue()
        self.active: dict[int, Handle] = {}
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()            # held while the engine steps; /stats reads under it
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, handle: Handle) -> None:
        self.engine.check_request(handle.prompt, handle.max_tokens)      # raises ValueError: a 400
        self.inbox.put(handle)
        self.wake.set()

    def abort(self, handle: Handle) -> None:
        handle.aborted = True
        self.wake.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                while not self.inbox.empty():
                    h = self.inbox.get()
                    h.seq = self.engine.add(h.prompt, h.max_tokens)
                    self.active[h.seq.id] = h
                for sid, h in list(self.active.items()):
                    if h.aborted:
                        self.engine.abort(h.seq)
                        del self.active[sid]
                busy = self.engine.scheduler.has_work()
                if busy:
                    try:
                        out = self.engine.step()
                    except Exception as err:                             # fail the requests, not the server
                        for h in self.active.values():
                            self.engine.abort(h.seq)
                            h.push(("error", f"engine error: {err}"))
                        self.active.clear()
                        continue
                    for seq, token in out:
                        h = self.active.get(seq.id)
                        if h is None:
                            continue
                        h.times.setdefault("first_token", time.perf_counter())
                        h.push(("token", token))
                        if seq.finished:
                            h.push(("done", "length"))
                            del self.active[seq.id]
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def stats(self) -> dict:
        with self.lock:
            e = self.engine
            return {"pages_total": e.allocator.num_pages, "pages_used": e.allocator.num_used,
                    "pages_held_by_requests": e.pages_held_by_requests(),
                    "cached_pages": e.cache.cached_pages if e.cache is not None else 0,
                    "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                    "steps": e.times.steps, "preemptions": e.scheduler.preemptions}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


def create_app(model: GPT | None = None, config: EngineConfig = EngineConfig()) -> FastAPI:
    """The FastAPI app with its engine thread (started with the app, stopped at shutdown)."""
    engine = EngineThread(Engine(model if model is not None else load_pretrained(), config, record_history=False))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop.set()
        engine.wake.set()

    app = FastAPI(title="tiny-gpt OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/stats")
    def stats():
        return engine.stats()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "course"}]}

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not valid JSON: {err}")
        try:
            prompt, max_tokens, stream = parse_request(body, chat)
            h = Handle(prompt, max_tokens, asyncio.get_running_loop())
            engine.submit(h)
        except BadRequest as err:
            return _error(400, str(err), err.param)
        except ValueError as err:                                        # the engine's own checks
            return _error(400, str(err), "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            return StreamingResponse(_stream(engine, h, rid, created, chat), media_type="text/event-stream")
        return await _whole(engine, h, rid, created, chat, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _usage(h: Handle, n: int) -> dict:
    return {"prompt_tokens": len(h.prompt), "completion_tokens": n, "total_tokens": len(h.prompt) + n}


async def _whole(engine: EngineThread, h: Handle, rid: str, created: int, chat: bool, request: Request):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, n, reason = [], 0, "length"
    try:
        while True:
            kind, value = await h.queue.get()
            if kind == "token":
                text.append(decoder.decode(bytes([value])))
                n += 1
            elif kind == "error":
                return _error(500, value)
            else:
                reason = value
                break
    except asyncio.CancelledError:
        engine.abort(h)
        raise
    text.append(decoder.decode(b"", final=True))
    out = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": reason} if chat
              else {"index": 0, "text": out, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": MODEL_NAME, "choices": [choice], "usage": _usage(h, n)}


def sse(payload) -> str:
    """One server-sent event: a data line and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(engine: EngineThread, h: Handle, rid: str, created: int, chat: bool):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": kind_name, "created": created, "model": MODEL_NAME, "choices": [choice]}

    finished = False
    try:
        if chat:
            yield sse(chunk(None, None, first=True))
        while True:
            kind, value = await h.queue.get()
            if kind == "token":
                piece = decoder.decode(bytes([value]))
                if piece:
                    yield sse(chunk(piece, None))
            elif kind == "error":
                yield sse({"error": {"message": value, "type": "server_error"}})
                break
            else:
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield sse(chunk(tail, None))
                yield sse(chunk(None if chat else "", value))
                finished = True
                break
        yield sse("[DONE]")
    finally:
        if not finished:
            engine.abort(h)                   # the client went away (or an error): free the pages now


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="Serve the tiny GPT with an OpenAI-compatible API.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-tokens-per-step", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--prefix-cache", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny model is latency bound)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = EngineConfig(num_pages=args.num_pages, page_size=args.page_size, max_tokens=args.max_tokens_per_step,
                          max_seqs=args.max_seqs, chunk=args.chunk, prefix_cache=args.prefix_cache)
    uvicorn.run(create_app(config=config), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
