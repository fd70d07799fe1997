"""The FastAPI app of `kvstash serve`: OpenAI-compatible completions and chat
completions (streaming with server-sent events), `/v1/models`, `/health` and
`/metrics`.

`create_app(async_engine, served_model_name)` builds one app per engine; the app's
lifespan starts and stops the engine thread. Every error answers with the OpenAI
error shape: 400 for bad input (including what the engine rejects), 404 for an
unknown model or route, 500 for a request whose engine step failed (the server goes
on), 503 when the engine thread has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import SamplingParams
from engine.metrics import CONTENT_TYPE
from engine.request import RequestOutput
from engine.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.server.responses import IncrementalText, ResponseBuilder, error_body, sse

#: how often a non-streaming request checks whether its client went away
DISCONNECT_POLL_S = 0.5


class OpenAIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(
        self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, error_type, param, code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def create_app(async_engine: AsyncEngine, served_model_name: str) -> FastAPI:
    """One app serving `async_engine` under the model name `served_model_name`."""
    tokenizer = async_engine.tokenizer
    if tokenizer is None:
        raise ValueError("serving needs a model folder with a tokenizer")
    engine = async_engine.engine
    max_model_len = engine.max_model_len
    # a chat without max_tokens may run to the end of the context or of the KV pool
    context_limit = min(max_model_len, engine.block_manager.num_blocks * engine.block_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="kvstash", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        # field names only: a JSON syntax error's location is a character offset
        location = [part for part in first.get("loc", ()) if isinstance(part, str) and part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in problems
        )
        body = error_body(message or "invalid request", "invalid_request_error", ".".join(location) or None)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), error_type), status_code=error.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine has stopped", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvstash",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check_request(body: SamplingFields) -> None:
        if body.model != served_model_name:
            raise OpenAIError(
                404,
                f"model {body.model!r} does not exist; this server serves {served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        problem = body.unsupported()
        if problem is not None:
            raise bad_request(problem[1], problem[0])

    def sampling_params(body: SamplingFields, default_max_tokens: int) -> SamplingParams:
        try:
            return body.sampling_params(default_max_tokens)
        except ValueError as error:
            raise bad_request(str(error)) from error

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        check_request(body)
        try:
            prompt = body.single_prompt()
        except ValueError as error:
            raise bad_request(str(error), "prompt") from error
        prompt_token_ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        params = sampling_params(body, default_max_tokens=16)
        builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", served_model_name, chat=False)
        return await respond(body, http_request, builder, prompt_token_ids, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        check_request(body)
        prompt_token_ids = chat_prompt_token_ids(tokenizer, body)
        params = sampling_params(body, default_max_tokens=max(1, context_limit - len(prompt_token_ids)))
        builder = ResponseBuilder(f"chatcmpl-{uuid.uuid4().hex}", served_model_name, chat=True)
        return await respond(body, http_request, builder, prompt_token_ids, params)

    async def respond(
        body: SamplingFields,
        http_request: Request,
        builder: ResponseBuilder,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> Response:
        request_id = builder.response_id
        try:
            outputs = await async_engine.add_request(request_id, prompt_token_ids, params, body.cache_salt)
        except ValueError as error:
            raise bad_request(str(error)) from error
        except EngineDeadError as error:
            raise OpenAIError(503, str(error), "server_error") from error
        text = IncrementalText(tokenizer, params.stop_strings)
        stream = async_engine.stream_outputs(request_id, outputs)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                stream_events(stream, builder, text, include_usage), media_type="text/event-stream"
            )
        final = await last_output(stream, http_request, async_engine, request_id)
        return JSONResponse(builder.full(final, final.text))

    return app


def chat_prompt_token_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The model's chat template when it has one; otherwise `role: content` lines and
    an `assistant:` cue."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # a template may reject a conversation (e.g. role order)
            raise bad_request(
                f"the model's chat template rejected the messages: {error}", "messages"
            ) from error
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer.encode(text))


async def last_output(
    stream: AsyncIterator[RequestOutput], http_request: Request, async_engine: AsyncEngine, request_id: str
) -> RequestOutput:
    """Run a non-streaming request to its end, aborting it if the client disconnects."""

    async def consume() -> RequestOutput:
        last = None
        async for output in stream:
            last = output
        return last

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except EngineDeadError as error:
                    raise OpenAIError(503, str(error), "server_error") from error
                except RequestFailedError as error:
                    raise OpenAIError(500, str(error), "server_error") from error
            if await http_request.is_disconnected():
                async_engine.abort(request_id)
                raise OpenAIError(499, "the client closed the connection", "invalid_request_error")
    finally:
        if not task.done():
            task.cancel()


async def stream_events(
    stream: AsyncIterator[RequestOutput], builder: ResponseBuilder, text: IncrementalText, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. A client
    disconnect cancels this generator, which closes `stream` and so aborts the request."""
    if builder.chat:
        yield sse(builder.chunk("", None, first=True))
    last = None
    try:
        async for output in stream:
            last = output
            delta = text.delta(output)
            if output.finished:
                yield sse(builder.chunk(delta, output.finish_reason))
            elif delta:
                yield sse(builder.chunk(delta, None))
    except (EngineDeadError, RequestFailedError) as error:
        yield sse(error_body(str(error), "server_error"))
    else:
        if include_usage and last is not None:
            yield sse(builder.usage_chunk(last))
    finally:
        await stream.aclose()
    yield sse("[DONE]")
