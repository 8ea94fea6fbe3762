"""The HTTP routes of `finetune serve` (FastAPI): OpenAI's endpoints, vLLM's adapter endpoints, errors as JSON.

Routes (all but /health need `Authorization: Bearer KEY` when the server has an API key):
    GET  /v1/models                 the base and every adapter (merged mode: the merged adapter)
    GET  /v1/models/{id}            one of them
    POST /v1/completions            text prompt(s); `stream: true` sends server-sent events
    POST /v1/chat/completions       messages through the tokenizer's chat template; streams too
    POST /v1/load_lora_adapter      {"lora_name", "lora_path"}; in merged mode: swap it in (exact)
    POST /v1/unload_lora_adapter    {"lora_name"}
    GET  /stats                     forward passes, rows per forward, models per forward, queue
    GET  /health                    200 when up

Every error, whatever raised it, is OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`,
with 400 for a bad body or parameter, 401 without the key, 404 for an unknown model, 429 when too
much is pending, 500 when generation failed (the server keeps serving).

Example:
    app = create_app(batcher, max_tokens_limit=1024, api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from finetune.errors import FinetuneError, ServeError
from finetune.serve import protocol
from finetune.serve.batcher import Batcher, Event, Failed, Finished, Piece, Sequence, internal_error
from finetune.serve.engine import Engine
from finetune.serve.replies import Reply
from finetune.serve.sampling import SamplingParams

logger = logging.getLogger("finetune.serve")

MAX_BODY_BYTES = 16 * 2**20
OPEN_PATHS = ("/health",)


@dataclass(frozen=True)
class _State:
    """What every route needs, kept on `app.state.serve`."""

    batcher: Batcher
    max_tokens_limit: int
    api_key: str | None

    @property
    def engine(self) -> Engine:
        return self.batcher.engine


def create_app(batcher: Batcher, *, max_tokens_limit: int, api_key: str | None) -> FastAPI:
    """The ASGI application over a started `Batcher`."""
    app = FastAPI(
        title="finetune serve", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(_require_key)]
    )
    app.state.serve = _State(batcher, max_tokens_limit, api_key)
    _add_error_handlers(app)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/stats", stats, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    return app


def _state(request: Request) -> _State:
    return request.app.state.serve


def _require_key(request: Request) -> None:
    api_key = _state(request).api_key
    if api_key is None or request.url.path in OPEN_PATHS:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ServeError(
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            status=401,
            code="invalid_api_key",
        )


async def health() -> PlainTextResponse:
    return PlainTextResponse("ok")


async def stats(request: Request) -> JSONResponse:
    batcher = _state(request).batcher
    return JSONResponse({**batcher.stats.snapshot(), **batcher.load(), "max_batch_size": batcher.max_batch_size})


async def models(request: Request) -> JSONResponse:
    engine = _state(request).engine
    return JSONResponse(protocol.models_body(engine.models(), engine.created, engine.max_model_len))


async def model(request: Request, model: str) -> JSONResponse:
    """One model's card (`client.models.retrieve`); a 404 naming what is served for any other id."""
    engine = _state(request).engine
    engine.check_model(model)
    body = protocol.models_body(engine.models(), engine.created, engine.max_model_len)
    return JSONResponse(next(card for card in body["data"] if card["id"] == model))


async def completions(request: Request):
    engine = _state(request).engine
    body = protocol.parse_body(protocol.CompletionRequest, await _read_body(request))
    engine.check_model(body.model)
    prompts = await run_in_threadpool(lambda: [engine.encode_completion(p, body.model) for p in body.prompts()])
    return await _generate(request, body, prompts, chat=False)


async def chat_completions(request: Request):
    engine = _state(request).engine
    body = protocol.parse_body(protocol.ChatCompletionRequest, await _read_body(request))
    engine.check_model(body.model)
    messages = [message.as_record_message() for message in body.messages]
    prompt = await run_in_threadpool(engine.encode_chat, messages, body.record_tools(), body.model)
    return await _generate(request, body, [prompt], chat=True)


async def _generate(request: Request, body, prompts: list[list[int]], *, chat: bool):
    """Queue one sequence per prompt, then answer with JSON or, for `stream`, server-sent events."""
    state = _state(request)
    budget = body.token_budget() if chat else body.max_tokens
    default = None if chat else protocol.COMPLETION_DEFAULT_MAX_TOKENS
    lengths = [state.engine.check_length(len(p), budget, default, state.max_tokens_limit) for p in prompts]
    sampling = SamplingParams(body.temperature, body.top_p, max(body.top_k, 0), body.seed)
    stop = body.stop_sequences()
    events: asyncio.Queue[Event] = asyncio.Queue()
    emit = _threadsafe_put(asyncio.get_running_loop(), events)
    stop_ids = state.engine.stop_ids(body.model, chat)
    sequences = [
        Sequence(body.model, p, n, sampling, emit, stop=stop, stop_ids=stop_ids, index=i, stream=body.stream)
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    state.batcher.submit(sequences)
    reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", body.model, int(time.time()))
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        if chat:
            parse = lambda result: _read_reply(state.engine, result, _reads_tools(body), body.model)
            return _event_stream(reply.chat_chunks(events, sequences, usage, parse), sequences)
        return _event_stream(reply.completion_chunks(events, sequences, usage), sequences)
    try:
        results = await _collect_unless_gone(request, _collect(events, len(sequences)))
        if results is None:  # nobody to answer: the finally below takes the rows out of the batch
            return Response(status_code=499)
    finally:
        for sequence in sequences:  # the client may have gone: stop generating for it
            sequence.cancelled = True
    if chat:
        read = _read_reply(state.engine, results[0], _reads_tools(body), body.model)
        return JSONResponse(
            protocol.chat_body(reply.id, body.model, reply.created, results[0], body.return_token_ids, read)
        )
    return JSONResponse(protocol.completion_body(reply.id, body.model, reply.created, results, body.return_token_ids))


def _reads_tools(body: protocol.ChatCompletionRequest) -> bool:
    """Whether the reply is read for tool calls: only where the request gave tools (as vLLM's `auto`)."""
    return bool(body.tools) and body.tool_choice != "none"


def _read_reply(engine: Engine, result: Finished, tools: bool, model: str | None = None) -> Reply | None:
    """The reply of a chat completion of `model` read as tool calls and reasoning (by its tokenizer), or None
    (its text is the content). A reply cut at `max_tokens` is not read: a call cut short is no call."""
    if result.finish_reason != "stop":
        return None
    ids = result.token_ids
    if ids and (ids[-1] in engine.stop_token_ids or ids[-1] in engine.stop_ids(model, chat=True)):
        text = engine.decode_raw(ids[:-1], model)
    else:  # a stop sequence cut it
        text = _raw_text_as_cut(engine, result, model)
    prompt_end = engine.decode_raw(result.prompt_token_ids[-8:], model)
    return engine.tokens(model).reply_parser.parse(text, prompt_end, tools)


def _raw_text_as_cut(engine: Engine, result: Finished, model: str | None = None) -> str:
    """The text of a reply a stop sequence cut, with its special tokens kept, cut where `result.text` was cut.

    `result.text` skips special tokens (it is the reply as streamed): read as it is, a Mistral reply lost its
    `[TOOL_CALLS]` token, and a call cut off by a stop sequence after it came back as plain text. What the cut
    dropped (the stop sequence and what followed) is the end of the whole decoded text; it is taken off the raw
    text, unless special tokens lie inside it (then the text as cut, as before)."""
    whole = engine.decode_text(result.token_ids, model)
    dropped = whole[len(result.text) :]
    raw = engine.decode_raw(result.token_ids, model)
    if not dropped or not whole.startswith(result.text) or not raw.endswith(dropped):
        return result.text
    return raw[: len(raw) - len(dropped)]


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = _state(request)
    body = protocol.parse_body(protocol.LoadAdapterRequest, await _read_body(request))
    adapter = await run_in_threadpool(state.engine.read_new_adapter, body.lora_name, body.lora_path)
    action = lambda: state.engine.install(body.lora_name, adapter)
    if state.engine.merged is None:  # attaching does not disturb running rows
        future = state.batcher.control(action)
    else:  # swapping the merged weights waits until nothing runs, and holds new rows back
        future = state.batcher.control(action, blocks=lambda model: True, ready=lambda running: not running)
    return PlainTextResponse(await asyncio.wrap_future(future))


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = _state(request)
    name = protocol.parse_body(protocol.UnloadAdapterRequest, await _read_body(request)).lora_name
    state.engine.check_removable(name)
    future = state.batcher.control(
        lambda: state.engine.remove(name), blocks=lambda model: model == name, ready=lambda running: name not in running
    )
    return PlainTextResponse(await asyncio.wrap_future(future))


class _Reply:
    """The id, model and time shared by every chunk of one response."""

    def __init__(self, request_id: str, model: str, created: int):
        self.id, self.model, self.created = request_id, model, created

    async def completion_chunks(self, events, sequences, usage: bool) -> AsyncIterator[dict]:
        results = []
        async for event in _events(events, len(sequences)):
            if isinstance(event, Piece):
                yield protocol.completion_chunk(self.id, self.model, self.created, event.index, event.text, None)
            else:
                results.append(event)
                yield protocol.completion_chunk(self.id, self.model, self.created, event.index, "", event.finish_reason)
        if usage:
            yield protocol.usage_chunk(self.id, self.model, self.created, "text_completion", results)

    async def chat_chunks(self, events, sequences, usage: bool, parse: Callable) -> AsyncIterator[dict]:
        """The text as content deltas as it comes; the last chunk has the reply's tool calls and reasoning
        (read once it is whole) and the finish reason."""
        yield protocol.chat_chunk(self.id, self.model, self.created, {"role": "assistant", "content": ""}, None)
        results = []
        async for event in _events(events, len(sequences)):
            if isinstance(event, Piece):
                yield protocol.chat_chunk(self.id, self.model, self.created, {"content": event.text}, None)
            else:
                results.append(event)
                read = parse(event)
                delta, finish = protocol.final_chat_delta(read), protocol.chat_finish_reason(event, read)
                yield protocol.chat_chunk(self.id, self.model, self.created, delta, finish)
        if usage:
            yield protocol.usage_chunk(self.id, self.model, self.created, "chat.completion.chunk", results)


async def _events(events: asyncio.Queue, count: int) -> AsyncIterator[Piece | Finished]:
    """Events until `count` sequences have finished; the first failure raises its ServeError."""
    finished = 0
    while finished < count:
        event = await events.get()
        if isinstance(event, Failed):
            raise event.error
        finished += isinstance(event, Finished)
        yield event


async def _collect(events: asyncio.Queue, count: int) -> list[Finished]:
    results = [event async for event in _events(events, count) if isinstance(event, Finished)]
    return sorted(results, key=lambda r: r.index)


async def _collect_unless_gone(request: Request, collect):
    """`await collect`, or None as soon as the client disconnects (a non-streamed request's handler is not
    cancelled when its client goes: without this its rows ran on to max_tokens for nobody)."""
    collecting = asyncio.ensure_future(collect)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collecting.done():
            collecting.cancel()
    return collecting.result() if collecting.done() and not collecting.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event_stream(chunks: AsyncIterator[dict], sequences: list[Sequence]) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per chunk, an error chunk if generation fails, `data: [DONE]`."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except ServeError as error:
            yield f"data: {json.dumps(protocol.error_body(error))}\n\n"
        except Exception:
            logger.exception("finetune serve: a streamed response failed")
            yield f"data: {json.dumps(protocol.error_body(internal_error()))}\n\n"
        finally:  # also when the client disconnects: its rows leave the batch at the next step
            for sequence in sequences:
                sequence.cancelled = True
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(lines(), media_type="text/event-stream", headers=headers)


def _threadsafe_put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Event], None]:
    """An `emit` for the worker thread: hands the event to the request's event loop."""

    def put(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    return put


async def _read_body(request: Request) -> bytes:
    """The body, refusing more than MAX_BODY_BYTES (413) before reading it all."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ServeError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(protocol.error_body(error), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, error: ServeError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(FinetuneError)  # AdapterError, ModelError...: the request asked for something wrong
    async def finetune_error(request: Request, error: FinetuneError) -> JSONResponse:
        return _error_response(ServeError(str(error)))

    @app.exception_handler(HTTPException)  # unknown route, wrong method
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return _error_response(
            ServeError(f"{request.method} {request.url.path}: {error.detail}", status=error.status_code, code=code)
        )

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("finetune serve: %s %s failed", request.method, request.url.path)
        return _error_response(internal_error())
