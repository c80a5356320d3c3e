"""An OpenAI-compatible server: concurrent requests decode together as lossless tree batches.

    mamba-draft serve --target smollm2 --drafter smollm2 [--host 127.0.0.1] [--port 8000] [--max-batch 8]

Endpoints: POST /v1/chat/completions and /v1/completions (a prompt as text or token ids; streamed as server-sent
events with "stream": true), GET /v1/models, GET /health and GET /metrics. Sampling as the OpenAI API names it:
max_tokens (or max_completion_tokens), temperature, top_p, seed, stop, frequency_penalty, presence_penalty,
logit_bias, logprobs; `usage` counts tokens; an extra "speculative" field (τ, rounds, batch size) that OpenAI clients
ignore. Parameters the engine cannot honour (tools, n > 1, ...) are refused by name with an OpenAI-style error object.
Requests waiting when the engine is free decode as one batch (`tree_search.batcher`); a greedy request's output is
the one `mamba-draft generate` gives for it, whatever else runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import uuid

try:
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.exceptions import HTTPException
except ImportError as err:  # an optional extra: the rest of the package runs without it
    raise ImportError(f"mamba-draft serve needs FastAPI, uvicorn and prometheus-client: pip install "
                      f"'mamba-draft[serve]' ({err})") from None

from mamba_draft.targets.facts import max_positions, target_vocab_size
from tree_search.batcher import BATCH_WAIT, Batcher, QueueFull, Request
from tree_search.metrics import ServerMetrics

MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256  # when a request names none (and the context leaves room)
MAX_STOPS = 4
# accepted, and meaningless here (the server keeps no users or stored completions)
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options"}
SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
            "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs"}
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (the legacy completions' logprobs: 5)
# refused unless absent, null or their no-op value
UNSUPPORTED = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none", "parallel_tool_calls": None,
               "response_format": {"type": "text"}, "echo": False, "best_of": 1, "suffix": None, "modalities": None,
               "audio": None, "prediction": None, "reasoning_effort": None, "web_search_options": None}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the parameter at fault and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def create_app(generator, model: str, *, max_batch: int = 8, max_queue: int = 64, batch_wait: float = BATCH_WAIT):
    """The ASGI app serving `generator` (a SpeculativeGenerator) as `model`; app.state.batcher runs the engine."""
    app = FastAPI(title="mamba-draft", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = app.state.metrics = ServerMetrics(model, queue_length=lambda: len(app.state.batcher.queue),
                                                running_rows=lambda: app.state.batcher.running)
    batcher = app.state.batcher = Batcher(generator, max_batch=max_batch, max_queue=max_queue, metrics=metrics,
                                          batch_wait=batch_wait)
    context = max_positions(generator.target)
    app.router.on_shutdown.append(batcher.close)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):  # unknown paths, wrong methods: the same error object
        return JSONResponse(ApiError(err.status_code, str(err.detail), code=str(err.status_code)).body(),
                            status_code=err.status_code)

    @app.get("/health")
    async def health():
        with batcher.wake:
            return {"status": "ok", "waiting": len(batcher.queue), "running": batcher.running,
                    "served": batcher.served, "batches": batcher.batches}

    @app.get("/metrics")
    async def prometheus():  # Prometheus' text format (`tree_search.metrics`)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "mamba-draft"}]}

    async def read(http: HttpRequest) -> dict:
        size = http.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        if body.get("model") != model:
            if "model" not in body:
                raise ApiError(400, "you must provide a model parameter", "model", "missing_required_parameter")
            raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves {model!r}", "model",
                           "model_not_found")
        return body

    async def complete(http: HttpRequest, chat: bool):
        body = await read(http)
        allowed = {"model", "messages" if chat else "prompt", *SAMPLING, *IGNORED, *UNSUPPORTED}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0],
                           "unknown_parameter")
        ids = prompt_ids(generator, body, chat)
        request = sampling_request(body, ids, context, chat)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be true or false", "stream", "invalid_type")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options", "invalid_type")
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model}
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()  # the streamed text, then None: the request has finished
        if stream:
            request.on_text = lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text)
        request.on_done = lambda: loop.call_soon_threadsafe(pieces.put_nowait, None)
        try:
            batcher.submit(request)
        except QueueFull as err:
            request.cancelled = True
            raise ApiError(503, str(err), code="server_overloaded", kind="server_error") from None
        if stream:
            return StreamingResponse(events(request, pieces, chat, head, bool(options.get("include_usage"))),
                                     media_type="text/event-stream")
        done = asyncio.ensure_future(pieces.get())
        while not done.done():  # a client that leaves frees its row at the next round
            await asyncio.wait({done}, timeout=0.25)
            if not done.done() and await http.is_disconnected():
                request.cancelled = True
        if request.finish_reason == "error":
            raise engine_error(request)
        choice = {"index": 0, "finish_reason": finish(request),
                  "logprobs": logprobs_object(generator.tokenizer, request, request.token_logprobs, chat)}
        choice |= {"message": {"role": "assistant", "content": request.text}} if chat else {"text": request.text}
        return {**head, "choices": [choice], "usage": usage(request), "speculative": request.stats}

    async def events(request: Request, pieces: asyncio.Queue, chat: bool, head: dict, include_usage: bool):
        if chat:
            head = {**head, "object": "chat.completion.chunk"}

        def chunk(choice: dict, **extra) -> str:
            return "data: " + json.dumps({**head, "choices": [choice] if choice else [], **extra}) + "\n\n"

        def piece(text: str, reason: str | None = None) -> dict:
            content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
            taken = request.token_logprobs[request.logprobs_sent:]  # the tokens' since the last piece
            request.logprobs_sent += len(taken)
            return {"index": 0, **content, "logprobs": logprobs_object(generator.tokenizer, request, taken, chat),
                    "finish_reason": reason}

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            while (text := await pieces.get()) is not None:
                yield chunk(piece(text))
            if request.finish_reason == "error":
                yield "data: " + json.dumps(engine_error(request).body()) + "\n\n"
            else:
                yield chunk(piece("", finish(request)), speculative=request.stats)
                if include_usage:
                    yield chunk({}, usage=usage(request))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): the row leaves the batch at the next round
            request.cancelled = True

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, chat=False)

    return app


def prompt_ids(generator, body: dict, chat: bool) -> list[int]:
    """The prompt's token ids: chat messages through the chat template, or a completion prompt as plain text."""
    from tree_search.generator import ROLES

    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = target_vocab_size(generator.target)
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt", "invalid_prompt")
            return list(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string or token id array (one prompt per request)",
                           "prompt", "invalid_prompt")
        return generator.encode(prompt, chat_template=False)
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "you must provide a messages parameter", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages", "invalid_type")
    plain = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and ("tool_calls" in message or message.get("role") == "tool"):
            raise ApiError(400, "tool calls are not supported by this server", f"messages[{i}]", "unsupported")
        if not isinstance(message, dict) or message.get("role") not in (*ROLES, "developer"):
            raise ApiError(400, f"messages[{i}] needs a role: one of system, developer, user, assistant",
                           f"messages[{i}].role", "invalid_value")
        content = message.get("content")
        if isinstance(content, list):  # text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                               "unsupported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content", "invalid_type")
        plain.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    try:
        return generator.encode(plain)
    except ValueError as err:
        raise ApiError(400, str(err), "messages", "invalid_value") from None


def sampling_request(body: dict, ids: list[int], context: int | None, chat: bool = True) -> Request:
    """The engine's request from the OpenAI sampling parameters; what it cannot honour is refused by name."""
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    n = body.get("n", 1)
    if n != 1 and n is not None:
        raise ApiError(400, "n must be 1: this server returns one choice per request", "n", "unsupported_value")
    room = math.inf if context is None else context - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; the model's context is {context}", "messages",
                       "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, name, "a positive integer", lambda n: n >= 1, int)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) + {name} ({max_tokens}) exceed the model's context of "
                       f"{context} tokens", name, "context_length_exceeded")
    temperature = number(body, "temperature", "a number in [0, 2]", lambda t: 0 <= t <= 2)
    top_p = number(body, "top_p", "a number in (0, 1]", lambda p: 0 < p <= 1)
    seed = number(body, "seed", "a non-negative integer", lambda s: s >= 0, int)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop",
                       "invalid_value")
    return Request(ids, max_tokens, None if temperature is None else float(temperature),
                   None if top_p is None else float(top_p), seed, tuple(stops), shaping=logits_shaping(body),
                   logprobs=logprobs_asked(body, chat))


def number(body: dict, name: str, what: str, within, kind: type | tuple = (int, float)):
    """body[name] (None: absent or null), refused unless a `kind` (never a bool) for which `within` holds."""
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or not within(value)):
        raise ApiError(400, f"{name} must be {what}, got {value!r}", name, "invalid_value")
    return value


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many top alternatives a request wants per token (None: no log-probabilities): chat's `logprobs: true`
    with `top_logprobs` (0-20), the legacy completions' `logprobs` (0-5)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"logprobs must be true or false, got {value!r}", "logprobs", "invalid_type")
        top = number(body, "top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]",
                     lambda k: 0 <= k <= MAX_TOP_LOGPROBS, int)
        if top and not value:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return (top or 0) if value else None
    return None if value is False else number(body, "logprobs", "an integer in [0, 5]", lambda k: 0 <= k <= 5, int)


def logits_shaping(body: dict) -> tuple:
    """The OpenAI penalties and logit bias as the engine's logits settings (`tree_search.processors`), as sorted
    (name, value) pairs: requests that shape logits alike decode together."""
    shaping = {}
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0):  # 0 (or false) shapes nothing
            shaping[name] = float(number(body, name, "a number in [-2, 2]", lambda v: -2 <= v <= 2))
    bias = body.get("logit_bias")
    if bias:
        try:  # OpenAI's: {"token id": bias in [-100, 100]}
            pairs = tuple(sorted((int(token), float(value)) for token, value in bias.items()))
        except (AttributeError, TypeError, ValueError):
            pairs = None
        if pairs is None or not all(-100 <= value <= 100 for _, value in pairs):
            raise ApiError(400, "logit_bias must map token ids to numbers in [-100, 100]", "logit_bias",
                           "invalid_value")
        shaping["logit_bias"] = pairs
    return tuple(sorted(shaping.items()))


def logprobs_object(tokenizer, request: Request, taken: list, chat: bool) -> dict | None:
    """OpenAI's logprobs of `taken` TokenLogprobs (None where the request asked for none): chat's `content` list of
    {token, logprob, bytes, top_logprobs}, or the legacy completions' parallel lists."""
    if request.logprobs is None:
        return None

    def text(token: int) -> str:
        return tokenizer.decode([token])

    if chat:
        return {"content": [{"token": text(t.token), "logprob": t.logprob, "bytes": list(text(t.token).encode()),
                             "top_logprobs": [{"token": text(a), "logprob": v, "bytes": list(text(a).encode())}
                                              for a, v in t.top[:request.logprobs]]} for t in taken]}
    return {"tokens": [text(t.token) for t in taken], "token_logprobs": [t.logprob for t in taken],
            "top_logprobs": [{text(a): v for a, v in t.top[:request.logprobs]} for t in taken]}


def engine_error(request: Request) -> ApiError:
    return ApiError(500, f"the engine failed: {request.error}", kind="server_error", code="engine_error")


def finish(request: Request) -> str:
    return "length" if request.finish_reason == "length" else "stop"


def usage(request: Request) -> dict:
    return {"prompt_tokens": len(request.ids), "completion_tokens": len(request.tokens),
            "total_tokens": len(request.ids) + len(request.tokens)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tree_search.cli import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: --target as given)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together at most (default 8)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting at most; more are answered 503 (default 64)")
    parser.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT * 1000,
                        help="how long the idle engine waits after a request for others to decode with it "
                        f"(default {BATCH_WAIT * 1000:g})")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tree_search.cli import load_generator
    from tree_search.sampling import SamplingParams

    if args.max_batch < 1 or args.max_queue < 0 or not 0 <= args.port < 65536 or not 0 <= args.batch_wait_ms <= 10000:
        raise ValueError("--max-batch must be >= 1, --max-queue >= 0, --port in [0, 65535] and --batch-wait-ms in "
                         "[0, 10000]")
    # requests bring their own sampling: the plan is checked for greedy here, and per batch by the engine
    generator = load_generator(args, args.drafter, SamplingParams(temperature=0.0), batched=True, command="serve")
    app = create_app(generator, args.served_model_name or str(args.target), max_batch=args.max_batch,
                     max_queue=args.max_queue, batch_wait=args.batch_wait_ms / 1000)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
