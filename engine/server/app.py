"""The FastAPI app of `kvstash serve`: OpenAI-compatible completions and chat
completions (streaming with server-sent events), `/v1/models`, `/health` and
`/metrics`.

`create_app(async_engine, served_model_name)` builds one app per engine; the app's
lifespan starts and stops the engine thread and the tokenizer threads. Every error
answers with the OpenAI error shape: 400 for bad input (including what the engine
rejects), 401 without the API key (when one is set), 404 for an unknown model or
route, 413 for a body over the size limit, 500 for a request whose engine step failed
(the server goes on), 503 when the engine thread has stopped.

Tokenizing, applying the chat template and detokenizing streamed text run on a small
thread pool, never on the event loop: a long prompt must not hold up `/health` or the
other clients' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from connector.direct_offer import DIRECT_TIER
from engine.config import SamplingParams, SamplingParamsError
from engine.metrics import CONTENT_TYPE
from engine.prompts import ChatTemplateError, chat_token_ids, encode
from engine.request import RequestOutput
from engine.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyMiddleware, BodySizeLimitMiddleware
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.server.responses import IncrementalText, ResponseBuilder, error_body, sse
from storage_backends.thread_pools import started_thread_pool

#: how often a non-streaming request checks whether its client went away
DISCONNECT_POLL_S = 0.5
#: threads that tokenize, apply chat templates and detokenize (Hugging Face fast
#: tokenizers release the GIL while they work, so these run beside the event loop)
DEFAULT_NUM_TOKENIZER_THREADS = 4

_T = TypeVar("_T")


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


def create_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    num_tokenizer_threads: int = DEFAULT_NUM_TOKENIZER_THREADS,
    kv_role: str = "both",
) -> FastAPI:
    """One app serving `async_engine` under the model name `served_model_name`. With
    `api_key`, every `/v1` route and `/metrics` need `Authorization: Bearer <api_key>`;
    bodies over `max_request_bytes` get 413. A `kv_role` "producer" answers once its
    prompt's KV is handed over (offered by the direct path, or durable in the shared tier),
    with `kv_transfer_params` saying what is where: in the body, or in the final chunk of a
    streamed answer (docs/serving.md, "Disaggregated prefill/decode")."""
    if num_tokenizer_threads < 1:
        raise ValueError(f"num_tokenizer_threads must be >= 1, got {num_tokenizer_threads}")
    tokenizer = async_engine.tokenizer
    if tokenizer is None:
        raise ValueError("serving needs a model folder with a tokenizer")
    engine = async_engine.engine
    max_model_len = engine.max_model_len
    # a chat without max_tokens may run to the end of the context or of the KV pool
    context_limit = min(max_model_len, engine.block_manager.num_blocks * engine.block_size)

    tokenizer_pool = started_thread_pool(num_tokenizer_threads, "kvstash-tokenizer")

    async def off_loop(function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)` on the tokenizer threads (CPU-heavy work off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(
            tokenizer_pool, functools.partial(function, *args)
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvstash", lifespan=lifespan)
    # Starlette runs the middleware added last first: the key check comes before the size check.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

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
        code = "request_too_large" if error.status_code == 413 else None
        return JSONResponse(
            error_body(str(error.detail), error_type, code=code), status_code=error.status_code
        )

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
        except SamplingParamsError as error:
            raise bad_request(str(error), body.field_param(error.field)) from error
        except ValueError as error:
            raise bad_request(str(error)) from error

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        check_request(body)
        try:
            prompt = body.single_prompt()
        except ValueError as error:
            raise bad_request(str(error), "prompt") from error
        params = sampling_params(body, default_max_tokens=16)
        prompt_token_ids = (
            await off_loop(encode, tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        )
        builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", served_model_name, chat=False)
        return await respond(body, http_request, builder, prompt_token_ids, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        check_request(body)
        prompt_token_ids = await off_loop(chat_prompt_token_ids, tokenizer, body)
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
            outputs = await async_engine.add_request(
                request_id, prompt_token_ids, params, body.cache_salt, body.kv_transfer_params
            )
        except ValueError as error:
            raise bad_request(str(error)) from error
        except EngineDeadError as error:
            raise OpenAIError(503, str(error), "server_error") from error
        text = IncrementalText(tokenizer, params.stop_strings)
        stream = async_engine.stream_outputs(request_id, outputs)

        async def hand_over(final: RequestOutput) -> dict | None:
            """A producer's `kv_transfer_params` for a request that ended well, else None."""
            if kv_role != "producer" or final.finish_reason not in ("stop", "length"):
                return None
            handed_over = await async_engine.durable_transfer_params(
                request_id, prompt_token_ids, body.cache_salt
            )
            if handed_over is not None:
                async_engine.metrics.pd_handed_over_tokens.inc(handed_over["num_tokens"])
                path = "direct" if handed_over["tier"] == DIRECT_TIER else "shared"
                async_engine.metrics.pd_handoffs.labels(path=path).inc()
            return handed_over

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            handing_over = hand_over if kv_role == "producer" else None
            return StreamingResponse(
                stream_events(stream, builder, text, include_usage, off_loop, handing_over),
                media_type="text/event-stream",
            )
        final = await last_output(stream, http_request, async_engine, request_id)
        response = builder.full(final, final.text)
        if kv_role == "producer":
            response["kv_transfer_params"] = await hand_over(final)
        return JSONResponse(response)

    return app


def chat_prompt_token_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt (`engine.prompts.chat_token_ids`); a refused template is a 400."""
    try:
        return chat_token_ids(tokenizer, body.message_dicts())
    except ChatTemplateError as error:
        raise bad_request(str(error), "messages") from error


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
    stream: AsyncIterator[RequestOutput],
    builder: ResponseBuilder,
    text: IncrementalText,
    include_usage: bool,
    off_loop: Callable,
    hand_over: Callable[[RequestOutput], Awaitable[dict | None]] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. A client
    disconnect cancels this generator, which closes `stream` and so aborts the request.
    Text deltas are decoded through `off_loop` (the tokenizer threads). A producer's
    `hand_over` gives the final chunk (the one with the finish reason) its
    `kv_transfer_params`, as vLLM's streamed answers carry them."""
    if builder.chat:
        yield sse(builder.chunk("", None, first=True))
    last = None
    try:
        async for output in stream:
            last = output
            delta = await off_loop(text.delta, output)
            if output.finished:
                final_chunk = builder.chunk(delta, output.finish_reason)
                if hand_over is not None:
                    final_chunk["kv_transfer_params"] = await hand_over(output)
                yield sse(final_chunk)
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
