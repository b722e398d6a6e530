"""An OpenAI-compatible HTTP server for the engine: ``python -m kernels.serving.server --port 8000``.

POST /v1/completions and /v1/chat/completions (``stream: true`` answers with server-sent events,
``data: {json}`` per chunk and ``data: [DONE]`` at the end, as the OpenAI API does), GET /v1/models,
/health, and /stats (the allocator's page counts: how a test sees that a request freed its pages).

The request path: the handler parses the JSON and checks every field against :data:`FIELDS` (a field
the server does not implement is refused with a 400 that names it, never accepted and ignored; an
unknown model is a 404), tokenizes (UTF-8 bytes), and hands the request to the engine thread. That
thread runs continuous-batching steps while there is work and sleeps on an event when there is none
(no polling: an idle server uses no CPU), and pushes each sampled token to the request's asyncio
queue. The handler detokenizes incrementally with the request's stop strings
(kernels.serving.detokenizer), frames the text, and finishes a choice when a stop string completes.

Admission and failure: at most ``max_seqs + max_queue`` requests are in flight; one more gets a
429 with ``Retry-After``. A body longer than ``max_body`` bytes is refused (413) before it is parsed,
one nested deeper than :data:`MAX_DEPTH` before it is validated. A request that has not finished
after ``request_timeout`` seconds is aborted (504, or an error event in a stream). A request that
makes an engine stage raise fails alone with a 500 ``server_error`` and the batch goes on
(kernels.serving.engine, "Failures"); a step that fails where no request can be singled out fails
every request in flight, and the engine carries on. Every error, unknown routes (404) and methods
(405) included, has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, ``param``
naming the request field at fault where there is one. A client that goes away is noticed both when
streaming (the response generator is closed) and when not: the handler races the answer against
the ASGI ``http.disconnect`` message (Starlette does not cancel a plain handler when its client
leaves; vLLM added ``with_cancellation`` for the same reason). Either way the request is aborted
and its pages go back at once. At shutdown (SIGTERM) uvicorn stops accepting connections and lets
the open ones finish for ``drain_timeout`` seconds; requests still running then are aborted, and
the engine thread is stopped and joined.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kernels.model.data import encode
from kernels.model.gpt import GPT, load_pretrained
from kernels.serving.detokenizer import Detokenizer
from kernels.serving.engine import Engine, EngineConfig, RequestInvalid
from kernels.serving.sampling import GREEDY_BELOW, TOP_K_MAX, SamplingParams

MODEL_NAME = "tiny-gpt"
DEFAULT_MAX_TOKENS = 16               # OpenAI's default for /v1/completions
MAX_STOP = 4                          # OpenAI accepts up to 4 stop strings
MAX_N = 8
COMPLETION_LOGPROBS = 5               # /v1/completions: logprobs in 0..5; chat top_logprobs in 0..20
CHAT_TOP_LOGPROBS = 20
MAX_BODY = 64 * 1024                  # bytes: a request that fits the 128-token context is a few KiB of JSON
MAX_DEPTH = 32                        # JSON nesting: the deepest a valid body goes (a chat content part) is 5
RETRY_AFTER_S = 1                     # a 429's Retry-After: a request's step takes milliseconds, the queue drains


class BadRequest(ValueError):
    """A request the server refuses; becomes an error response with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


# ----------------------------------------------------------------------------------------------
# The fields of the two OpenAI request schemas (openai-python 3.51: types/completion_create_params.py,
# types/chat/completion_create_params.py), each served or refused. "default only" accepts the value
# that asks for nothing (null, 0, false, {}) and refuses any other.

SERVED, DEFAULT_ONLY, REFUSED, IDENTIFIER = "served", "default only", "refused", "accepted (an identifier)"


@dataclass(frozen=True)
class Field:
    status: str
    note: str
    defaults: tuple = ()              # for DEFAULT_ONLY: the accepted values besides null
    accept: object = None             # or a test accept(value, body) -> bool


COMMON = {
    "model": Field(SERVED, f"must be {MODEL_NAME!r}; any other name is a 404 (model_not_found)"),
    "max_tokens": Field(SERVED, "integer >= 1; prompt + max_tokens must fit the 128-token context"),
    "n": Field(SERVED, f"1..{MAX_N} choices; the prompt is prefilled once and forked, its pages shared copy-on-write"),
    "seed": Field(SERVED, "integer in [0, 2**63): the same seed gives the same answer, in any batch"),
    "stop": Field(SERVED, f"a string or up to {MAX_STOP}; checked on decoded text across tokens, never sent"),
    "stream": Field(SERVED, "server-sent events, data: [DONE] at the end"),
    "stream_options": Field(SERVED, "include_usage: a last chunk with usage (choices []); include_obfuscation refused"),
    "temperature": Field(SERVED, f"0..2; 0 is greedy (exact argmax), and so is any T < {GREEDY_BELOW:g} "
                                 "(1/T would overflow fp32)"),
    "top_p": Field(SERVED, "(0, 1]: nucleus on the temperature-scaled distribution"),
    "frequency_penalty": Field(DEFAULT_ONLY, "penalties are not implemented", (0, 0.0)),
    "presence_penalty": Field(DEFAULT_ONLY, "penalties are not implemented", (0, 0.0)),
    "logit_bias": Field(DEFAULT_ONLY, "not implemented", ({},)),
    "user": Field(IDENTIFIER, "a string naming the end user; it changes nothing in the answer"),
    # vLLM's extensions (vllm/entrypoints/openai/protocol.py), not in OpenAI's schema
    "top_k": Field(SERVED, f"vLLM extension: keep the k most likely (ties kept); 0 or -1: off; at most {TOP_K_MAX} "
                           "(an int32 in the sampler)"),
    "min_p": Field(SERVED, "vLLM extension: keep p >= min_p * p_max"),
    "stop_token_ids": Field(SERVED, "vLLM extension: token ids that end a choice (not sent)"),
}
COMPLETION_FIELDS = {
    "prompt": Field(SERVED, "a string, a list of one string, or a list of token ids; several prompts refused"),
    "logprobs": Field(SERVED, f"0..{COMPLETION_LOGPROBS}: the chosen token's log-prob and the k most likely, "
                              "log_softmax of the raw logits"),
    "best_of": Field(DEFAULT_ONLY, "only best_of = n (or null): ranking choices by log-prob is not implemented",
                     accept=lambda v, body: type(v) is int and v == (body.get("n") or 1)),
    "echo": Field(DEFAULT_ONLY, "not implemented", (False,)),
    "suffix": Field(DEFAULT_ONLY, "insertion (fill in the middle) is not implemented", ("",)),
    **COMMON,
}
CHAT_FIELDS = {
    "messages": Field(SERVED, "roles system, developer, user, assistant; content a string or text parts; "
                              "name becomes the speaker; images, audio, files, tool calls refused"),
    "max_completion_tokens": Field(SERVED, "as max_tokens (give one of the two)"),
    "logprobs": Field(SERVED, "true: log-prob of each chosen token (log_softmax of the raw logits)"),
    "top_logprobs": Field(SERVED, f"0..{CHAT_TOP_LOGPROBS} most likely tokens per position; needs logprobs: true"),
    "audio": Field(REFUSED, "text only"),
    "modalities": Field(DEFAULT_ONLY, 'text only: ["text"]', (["text"],)),
    "functions": Field(REFUSED, "function calling is not implemented"),
    "function_call": Field(DEFAULT_ONLY, "function calling is not implemented", ("none",)),
    "tools": Field(REFUSED, "tool calling is not implemented"),
    "tool_choice": Field(DEFAULT_ONLY, "tool calling is not implemented", ("none",)),
    "parallel_tool_calls": Field(REFUSED, "tool calling is not implemented"),
    "response_format": Field(DEFAULT_ONLY, 'structured output is not implemented: {"type": "text"} only',
                             ({"type": "text"},)),
    "prediction": Field(REFUSED, "predicted outputs are not implemented"),
    "reasoning_effort": Field(REFUSED, "not a reasoning model"),
    "verbosity": Field(REFUSED, "not implemented"),
    "web_search_options": Field(REFUSED, "no web search"),
    "metadata": Field(REFUSED, "nothing is stored"),
    "store": Field(DEFAULT_ONLY, "nothing is stored", (False,)),
    "service_tier": Field(DEFAULT_ONLY, "one tier", ("auto", "default")),
    "moderation": Field(REFUSED, "no moderation"),
    "prompt_cache_key": Field(REFUSED, "the prefix cache (--prefix-cache) matches prompts by content, not by key"),
    "prompt_cache_options": Field(REFUSED, "see prompt_cache_key"),
    "prompt_cache_retention": Field(REFUSED, "see prompt_cache_key"),
    "safety_identifier": Field(IDENTIFIER, "a string naming the end user; it changes nothing in the answer"),
    **COMMON,
}
FIELDS = {"completions": COMPLETION_FIELDS, "chat.completions": CHAT_FIELDS}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse, by name, every field that is not in the schema or that the server does not implement."""
    schema = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        rule = schema.get(name)
        if rule is None:
            raise BadRequest(f"unrecognized request field {name!r}", name)
        if value is None or rule.status in (SERVED,):
            continue
        if rule.status == IDENTIFIER:
            if not isinstance(value, str):
                raise BadRequest(f"{name} must be a string", name)
            continue
        if rule.status == DEFAULT_ONLY and (any(type(value) is type(d) and value == d for d in rule.defaults)
                                            or (rule.accept is not None and rule.accept(value, body))):
            continue
        raise BadRequest(f"{name} is not supported by this server ({rule.note}); got {value!r}", name)


# ----------------------------------------------------------------------------------------------
# Parsing


def _speaker(m: dict, i: int) -> str:
    allowed = {"role", "content", "name"}
    extra = sorted(set(m) - allowed)
    if extra:
        raise BadRequest(f"messages[{i}] has field {extra[0]!r}, which is not supported (tool calls, audio and "
                         f"refusals are not implemented)", "messages")
    if m.get("role") not in ("system", "developer", "user", "assistant"):
        raise BadRequest(f"messages[{i}].role must be system, developer, user or assistant, got {m.get('role')!r}",
                         "messages")
    name = m.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise BadRequest(f"messages[{i}].name must be a non-empty string", "messages")
    return (name or m["role"]).upper()


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{i}].content[{j}] has type {kind!r}: only text parts are supported",
                                 "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"messages[{i}].content must be a string or a non-empty list of text parts", "messages")


def chat_prompt(messages) -> str:
    """The chat template of a byte-level model trained on plays: each message a speech under its
    speaker's name (``name`` if given, else the role), then the assistant's name to speak next."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with a role and a content", "messages")
        parts.append(f"{_speaker(m, i)}:\n{_content(m, i)}\n\n")
    return "".join(parts) + "ASSISTANT:\n"


def _number(body, name, lo, hi, default, *, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or \
            v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body, name, lo, hi, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _utf8(text: str, param: str) -> list[int]:
    """The token ids (UTF-8 bytes) of ``text``; a lone surrogate (JSON allows "\\ud800") has none."""
    try:
        return encode(text).tolist()
    except UnicodeEncodeError as err:
        raise BadRequest(f"{param} is not valid Unicode text: {err.reason} at index {err.start}", param) from None


def _prompt_ids(body) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise BadRequest("prompt is empty: at least one token is needed", "prompt")
        return _utf8(p, "prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(not 0 <= t < 256 for t in p):
            raise BadRequest("prompt token ids must lie in [0, 256)", "prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise BadRequest(f"prompt is a list of {len(p)} prompts: one prompt per request is supported", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")


@dataclass
class Parsed:
    """A validated request: what the engine needs (prompt, params) and what the response needs."""
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    logprobs: int | None              # None: not asked; k: the chosen token's and the top k


def parse_request(body, chat: bool, context: int = 128) -> Parsed:
    """Validate a request body against :data:`FIELDS`; raises :class:`BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("model is required: a string naming the model", "model")
    if model != MODEL_NAME:
        raise BadRequest(f"The model {model!r} does not exist; this server serves {MODEL_NAME!r}", "model",
                         status=404, code="model_not_found")
    check_fields(body, chat)
    prompt = _utf8(chat_prompt(body.get("messages")), "messages") if chat else _prompt_ids(body)
    if chat and body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = max(1, context - len(prompt)) if chat else DEFAULT_MAX_TOKENS   # chat: up to the context's end
    max_tokens = _int(body, key, 1, 2 ** 31, default)
    n = _int(body, "n", 1, MAX_N, 1)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise BadRequest("stream_options may hold include_usage (and include_obfuscation: false)", "stream_options")
        if options.get("include_obfuscation") not in (None, False):
            raise BadRequest("stream_options.include_obfuscation is not supported by this server", "stream_options")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise BadRequest("stream_options.include_usage must be a boolean", "stream_options")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256
                                                 for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of token ids in [0, 256)", "stop_token_ids")
    if chat:
        want = body.get("logprobs") or False
        if not isinstance(want, bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        top = _int(body, "top_logprobs", 0, CHAT_TOP_LOGPROBS, None)
        if top is not None and not want:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", 0, COMPLETION_LOGPROBS, None)
    top_k = _int(body, "top_k", -1, TOP_K_MAX, 0)
    seed = _int(body, "seed", 0, 2 ** 63 - 1, None)
    params = SamplingParams(temperature=_number(body, "temperature", 0, 2, 1.0),
                            top_p=_number(body, "top_p", 0, 1, 1.0, lo_open=True),
                            min_p=_number(body, "min_p", 0, 1, 0.0), top_k=max(top_k, 0) or None,
                            seed=seed, n=n, max_tokens=max_tokens, stop_token_ids=tuple(stop_ids), logprobs=logprobs)
    return Parsed(prompt, params, stream, include_usage, tuple(stop), logprobs)


# ----------------------------------------------------------------------------------------------
# The engine thread


@dataclass
class Handle:
    """One request inside the server: its sink (an asyncio queue on the server's loop) and its choices."""
    req: Parsed
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: object = None                                    # the engine's first Sequence of the request
    times: dict = field(default_factory=lambda: {"received": time.perf_counter()})

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class ServerBusy(RuntimeError):
    """Too many requests in flight: becomes a 429."""


class EngineThread:
    """Runs engine steps in a background thread while there is work; requests, aborts and stops enter
    through a command queue and an event the thread sleeps on."""

    def __init__(self, engine: Engine, *, max_queue: int = 64):
        self.engine = engine
        self.max_in_flight = engine.config.max_seqs + max_queue
        self.commands: deque = deque()
        self.active: dict[int, Handle] = {}              # engine group id -> handle
        self.in_flight = 0                               # accepted and not yet answered (all threads)
        self.count_lock = threading.Lock()
        self.wake = threading.Event()
        self.closing = False
        self.lock = threading.Lock()                     # held while the engine steps; /stats reads under it
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.errors = 0

    def start(self) -> None:
        self.thread.start()

    def submit(self, h: Handle) -> None:
        """Queue a request; raises RequestInvalid (400) for what the engine could never serve, ServerBusy (429)."""
        self.engine.check_request(h.req.prompt, h.req.params)
        with self.count_lock:
            if self.closing:
                raise ServerBusy("the server is shutting down")
            if self.in_flight >= self.max_in_flight:
                raise ServerBusy(f"the server is at capacity: {self.in_flight} requests in flight (at most "
                                 f"{self.engine.config.max_seqs} running and "
                                 f"{self.max_in_flight - self.engine.config.max_seqs} queued); retry later")
            self.in_flight += 1
        self._command(("add", h))

    def abort(self, h: Handle) -> None:
        self._command(("abort", h))

    def finish_choice(self, h: Handle, choice: int) -> None:
        """A stop string completed in choice ``choice``: end it in the engine (finish_reason "stop")."""
        self._command(("stop", h, choice))

    def _command(self, cmd) -> None:
        self.commands.append(cmd)
        self.wake.set()

    def _done(self, h: Handle) -> None:
        if self.active.pop(h.seq.group, None) is not None:
            with self.count_lock:
                self.in_flight -= 1

    def _apply(self, cmd) -> None:
        kind, h = cmd[0], cmd[1]
        if kind == "add":
            h.seq = self.engine.add(h.req.prompt, params=h.req.params)
            self.active[h.seq.group] = h
        elif h.seq is not None and h.seq.group in self.active:
            if kind == "abort":
                self.engine.abort(h.seq)
                self._done(h)
            else:                                         # "stop": one choice
                for s in [h.seq, *h.seq.children]:
                    if s.choice == cmd[2] and not s.finished:
                        self.engine.finish(s, "stop")
                        h.push(("done", s.choice, "stop"))
                self._check_complete(h)

    def _check_complete(self, h: Handle) -> None:
        choices = [h.seq, *h.seq.children]
        if not h.seq.forks and all(s.finished for s in choices):
            self._done(h)

    def _step(self) -> None:
        try:
            out = self.engine.step()
        except Exception as err:                          # no request to single out: fail them, not the server
            self.errors += 1
            self.engine.take_failures()                   # any singled out before the raise are failed below too
            for h in list(self.active.values()):
                self.engine.abort(h.seq)
                h.push(("error", f"engine error: {type(err).__name__}: {err}"))
                self._done(h)
            return
        failed = self.engine.take_failures()              # requests the engine failed alone; the batch went on
        self.errors += bool(failed)
        for f in failed:
            h = self.active.get(f.group)
            if h is not None:
                h.push(("error", f"engine error: {f.error}"))
                self._done(h)
        touched = {}
        for o in out:
            h = self.active.get(o.seq.group)
            if h is None:
                continue
            h.times.setdefault("first_token", time.perf_counter())
            stop_token = o.token in h.req.params.stop_token_ids
            h.push(("token", o.seq.choice, o.token, o.logprob, o.top_logprobs, stop_token))
            if o.seq.finished:
                h.push(("done", o.seq.choice, o.seq.finish_reason))
            touched[o.seq.group] = h
        for h in touched.values():
            self._check_complete(h)

    def _run(self) -> None:
        while True:
            with self.lock:
                while self.commands:
                    self._apply(self.commands.popleft())
                if self.closing and not self.engine.scheduler.has_work() and not self.commands:
                    return
                busy = self.engine.scheduler.has_work()
                if busy:
                    self._step()
            if not busy:
                self.wake.wait()                          # no timeout: an idle server sleeps until a command
                self.wake.clear()

    def close(self, timeout: float = 10.0) -> None:
        """Abort what is still running, stop the thread and join it."""
        with self.count_lock:
            self.closing = True
        for h in list(self.active.values()):
            h.push(("error", "the server is shutting down"))
            self.abort(h)
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def stats(self) -> dict:
        with self.lock:
            e = self.engine
            return {"pages_total": e.allocator.num_pages, "pages_used": e.allocator.num_used,
                    "pages_held_by_requests": e.pages_held_by_requests(),
                    "cached_pages": e.cache.cached_pages if e.cache is not None else 0,
                    "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                    "in_flight": self.in_flight, "active": len(self.active),
                    "steps": e.times.steps, "preemptions": e.scheduler.preemptions, "engine_errors": self.errors}


# ----------------------------------------------------------------------------------------------
# Responses


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": kind, "param": param, "code": code}})


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (:class:`BodyTooLarge`) as soon as it passes ``limit`` bytes: by its
    Content-Length before a byte is read, or while it streams in (a chunked body has none)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():                  # raises ClientDisconnect if the client leaves
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(value) -> int:
    """Nesting depth of a decoded JSON value: 0 for a scalar, 1 for a flat list or object (no recursion)."""
    depth, level = 0, [value]
    while True:
        level = [x for x in level if isinstance(x, (list, dict))]
        if not level:
            return depth
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)]


def request_field(param: str | None, chat: bool, body: dict) -> str | None:
    """The request's own name for an engine field: the chat prompt is ``messages``, and chat may give
    ``max_completion_tokens`` for max_tokens."""
    if chat and param == "prompt":
        return "messages"
    if chat and param == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return param


def token_text(token: int) -> str:
    """A byte token as text: the character for ASCII, ``bytes:\\xNN`` for a byte of a longer character
    (OpenAI's notation for tokens that are not whole characters)."""
    return chr(token) if token < 128 else f"bytes:\\x{token:02x}"


class Choice:
    """One choice's text, finish reason and log-probs, built as its tokens arrive."""

    def __init__(self, index: int, stop: tuple[str, ...]):
        self.index = index
        self.detok = Detokenizer(stop)
        self.tokens: list[int] = []
        self.lps: list[tuple[float, list]] = []
        self.text = ""
        self.reason: str | None = None
        self.generated = 0
        self.lp_sent = 0                                  # tokens whose log-probs went out with their text

    def token(self, token: int, logprob, top, stop_token: bool) -> tuple[str, bool]:
        """Returns (text to send, whether a stop string completed). Tokens after a stop string (the
        engine may draw one more before the stop reaches it) are not part of the answer or its usage."""
        if self.detok.stopped:
            return "", False
        self.generated += 1
        if stop_token:
            return "", False
        self.tokens.append(token)
        self.lps.append((logprob, top))
        piece, stopped = self.detok.push(token)
        self.text += piece
        return piece, stopped

    def end(self, reason: str) -> str:
        self.reason = self.reason or reason
        tail = self.detok.flush()
        self.text += tail
        return tail

    def returned(self, upto: int | None = None) -> list[int]:
        """Indices of the tokens whose text lies in the first ``upto`` characters sent (all sent text by default)."""
        limit = len(self.text) if upto is None else upto
        return [k for k, e in enumerate(self.detok.ends) if e <= limit]


def _completion_logprobs(c: Choice, ks: list[int]) -> dict:
    starts = [0] + c.detok.ends
    return {"tokens": [token_text(c.tokens[k]) for k in ks], "token_logprobs": [c.lps[k][0] for k in ks],
            "top_logprobs": [{token_text(t): lp for t, lp in c.lps[k][1]} for k in ks],
            "text_offset": [starts[k] for k in ks]}


def _chat_logprobs(c: Choice, ks: list[int]) -> dict:
    def entry(t, lp):
        return {"token": token_text(t), "logprob": lp, "bytes": [t]}
    return {"content": [dict(entry(c.tokens[k], c.lps[k][0]), top_logprobs=[entry(t, lp) for t, lp in c.lps[k][1]])
                        for k in ks], "refusal": None}


def _usage(h: Handle, choices: list[Choice]) -> dict:
    n = sum(c.generated for c in choices)
    return {"prompt_tokens": len(h.req.prompt), "completion_tokens": n, "total_tokens": len(h.req.prompt) + n}


class Answer:
    """Consumes a handle's queue: the events of its choices, as (choice, text piece, log-prob tokens, reason)."""

    def __init__(self, engine: EngineThread, h: Handle):
        self.engine, self.h = engine, h
        self.choices = [Choice(i, h.req.stop) for i in range(h.req.params.n)]

    async def events(self, deadline: float):
        """Yields (choice, text, token indices whose log-probs go with it, finish reason or None) until
        every choice is done; raises RuntimeError with the engine's message on an error, TimeoutError
        once the loop clock passes ``deadline``."""
        open_ = set(range(len(self.choices)))
        loop = asyncio.get_running_loop()
        while open_:
            item = await asyncio.wait_for(self.h.queue.get(), max(0.0, deadline - loop.time()))
            kind = item[0]
            if kind == "error":
                raise RuntimeError(item[1])
            c = self.choices[item[1]]
            if kind == "token":
                if c.index not in open_:
                    continue
                piece, stopped = c.token(*item[2:])
                ks = self._new_logprobs(c)
                if stopped:
                    self.engine.finish_choice(self.h, c.index)
                    c.reason = "stop"
                if piece or ks:
                    yield c, piece, ks, None
            elif kind == "done" and c.index in open_:
                tail = c.end(item[2])
                open_.discard(c.index)
                yield c, tail, self._new_logprobs(c), c.reason

    def _new_logprobs(self, c: Choice) -> list[int]:
        if self.h.req.logprobs is None:
            return []
        ks = [k for k in c.returned() if k >= c.lp_sent]
        c.lp_sent += len(ks)
        return ks


def sse(payload) -> str:
    """One server-sent event: a data line and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _whole(engine: EngineThread, h: Handle, rid: str, created: int, chat: bool, timeout: float):
    ans = Answer(engine, h)
    try:
        async for _ in ans.events(asyncio.get_running_loop().time() + timeout):
            pass
    except TimeoutError:
        engine.abort(h)
        return _error(504, f"the request did not finish within {timeout:g} s and was aborted", kind="timeout_error")
    except RuntimeError as err:
        return _error(500, str(err), kind="server_error")
    out = []
    for c in ans.choices:
        ks = c.returned() if h.req.logprobs is not None else []
        if chat:
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                        "logprobs": _chat_logprobs(c, ks) if h.req.logprobs is not None else None,
                        "finish_reason": c.reason})
        else:
            out.append({"index": c.index, "text": c.text, "finish_reason": c.reason,
                        "logprobs": _completion_logprobs(c, ks) if h.req.logprobs is not None else None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": MODEL_NAME, "choices": out, "usage": _usage(h, ans.choices)}


async def _stream(engine: EngineThread, h: Handle, rid: str, created: int, chat: bool, timeout: float):
    ans = Answer(engine, h)
    kind_name = "chat.completion.chunk" if chat else "text_completion"
    usage = {"usage": None} if h.req.include_usage else {}

    def chunk(choices: list[dict]) -> dict:
        return {"id": rid, "object": kind_name, "created": created, "model": MODEL_NAME, "choices": choices, **usage}

    def choice(c: Choice, text: str | None, ks: list[int], reason: str | None) -> dict:
        lp = None
        if h.req.logprobs is not None and ks:
            lp = _chat_logprobs(c, ks) if chat else _completion_logprobs(c, ks)
        if chat:
            return {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": reason}
        return {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": reason}

    finished = False
    try:
        if chat:
            yield sse(chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in ans.choices]))
        try:
            async for c, text, ks, reason in ans.events(asyncio.get_running_loop().time() + timeout):
                yield sse(chunk([choice(c, text, ks, reason)]))
        except TimeoutError:
            yield sse({"error": {"message": f"the request did not finish within {timeout:g} s and was aborted",
                                 "type": "timeout_error", "param": None, "code": None}})
            return
        except RuntimeError as err:
            yield sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
            return
        finished = True
        if h.req.include_usage:
            yield sse({"id": rid, "object": kind_name, "created": created, "model": MODEL_NAME, "choices": [],
                       "usage": _usage(h, ans.choices)})
        yield sse("[DONE]")
    finally:
        if not finished:
            engine.abort(h)                   # the client went away, a timeout or an error: free the pages now


async def _until_disconnect(request: Request) -> None:
    """Returns when the ASGI server reports that the client has gone (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_disconnect(request: Request, answer, on_disconnect):
    """Await ``answer`` unless the client disconnects first; then cancel it and call ``on_disconnect``."""
    task = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:                        # the server is shutting down past its drain time
        task.cancel()
        watch.cancel()
        on_disconnect()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    on_disconnect()
    return Response(status_code=499)                      # nobody reads it: the client is gone


# ----------------------------------------------------------------------------------------------
# The app


def create_app(model: GPT | None = None, config: EngineConfig = EngineConfig(), *, max_queue: int = 64,
               request_timeout: float = 300.0, max_body: int = MAX_BODY) -> FastAPI:
    """The FastAPI app with its engine thread (started with the app, stopped and joined at shutdown)."""
    model = model if model is not None else load_pretrained()
    engine = EngineThread(Engine(model, config, record_history=False), max_queue=max_queue)
    context = model.config.block_size
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="tiny-gpt OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's error shape."""
        if err.status_code == 404:
            message, code = f"no route {request.method} {request.url.path} on this server", "not_found"
        elif err.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(err.detail), None
        return _error(err.status_code, message, code=code, headers=err.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        """A bug: still an answer in the API's shape (Starlette logs the traceback after sending it)."""
        return _error(500, f"internal error: {type(err).__name__}", kind="server_error")

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/stats")
    def stats():
        return engine.stats()

    def model_card():
        return {"id": MODEL_NAME, "object": "model", "created": started, "owned_by": "course"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    def one_model(name: str):
        if name != MODEL_NAME:
            return _error(404, f"The model {name!r} does not exist", "model", code="model_not_found")
        return model_card()

    async def handle(request: Request, chat: bool):
        try:
            raw = await read_body(request, max_body)
        except BodyTooLarge:
            return _error(413, f"the request body is larger than {max_body} bytes", code="request_too_large",
                          headers={"Connection": "close"})
        except ClientDisconnect:
            return Response(status_code=499)                              # nobody reads it: the client is gone
        try:
            body = json.loads(raw)
        except RecursionError:
            return _error(400, f"the request body nests deeper than {MAX_DEPTH} levels")
        except ValueError as err:                  # JSONDecodeError, UnicodeDecodeError, a 4300-digit integer
            return _error(400, f"the request body is not valid JSON: {err}")
        if json_depth(body) > MAX_DEPTH:
            return _error(400, f"the request body nests deeper than {MAX_DEPTH} levels")
        try:
            req = parse_request(body, chat, context)
            h = Handle(req, asyncio.get_running_loop())
            engine.submit(h)
        except BadRequest as err:
            return _error(err.status, str(err), err.param, err.kind, err.code)
        except ServerBusy as err:
            if engine.closing:
                return _error(503, str(err), kind="server_error")
            return _error(429, str(err), kind="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        except RequestInvalid as err:                                    # the engine's own checks
            return _error(400, str(err), request_field(err.param, chat, body), code=err.code)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_stream(engine, h, rid, created, chat, request_timeout),
                                     media_type="text/event-stream")
        return await with_disconnect(request, _whole(engine, h, rid, created, chat, request_timeout),
                                     lambda: engine.abort(h))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="Serve the tiny GPT with an OpenAI-compatible API.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-tokens-per-step", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=64, help="requests queued beyond max-seqs before a 429")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--prefix-cache", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request is aborted")
    ap.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open requests get at shutdown")
    ap.add_argument("--max-body", type=int, default=MAX_BODY, help="largest request body in bytes (413 above)")
    ap.add_argument("--seed", type=int, default=0, help="draws the seeds of requests that bring none")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny model is latency bound)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = EngineConfig(num_pages=args.num_pages, page_size=args.page_size, max_tokens=args.max_tokens_per_step,
                          max_seqs=args.max_seqs, chunk=args.chunk, prefix_cache=args.prefix_cache, seed=args.seed)
    app = create_app(config=config, max_queue=args.max_queue, request_timeout=args.request_timeout,
                     max_body=args.max_body)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.drain_timeout)


if __name__ == "__main__":
    main()
