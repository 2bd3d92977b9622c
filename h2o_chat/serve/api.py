"""An OpenAI-compatible API beside the UI, and llama.cpp's native routes, as routes for the FastAPI
app Gradio runs on (one process, one model):

    GET  /v1/models, /v1/models/{id}; POST /v1/chat/completions, /v1/completions    (OpenAI's)
    POST /completion, /tokenize, /detokenize; GET /props, /health                  (llama.cpp's)
    POST /api/chat, /api/generate, /api/show; GET /api/tags, /api/ps, /api/version (Ollama's: ollama.py)

Clients resend the whole history with every request; the SessionPool lends each request the
live ChatSession that shares the most of it, so only the unseen rest is computed
(`usage.prompt_tokens_details.cached_tokens` says how much was not). Generation runs in a worker
thread per request; a client that disconnects stops it at the next token, or within one prefill
chunk while its prompt is being read. Bodies are read in requests.py (every field honoured,
ignored or refused), answered in shapes.py's shapes.

Function tools (Open WebUI attaches its built-in ones to every request) are shown to the model
where its chat template has them, and its calls read back into OpenAI's tool_calls
(chat/tools.py); where the template has none, the request is answered as a chat without them,
and the X-H2O-Tools-Ignored header says so. A request without max_tokens runs until the model
stops, bounded by what the machine can hold (chat/limits.py). Every request ends with one log
line (requestlog.py).

Per-request cache settings ride in an extension object, `"h2o": {"policy", "budget",
"n_recent", "n_sink", "score", "positions", "pinned": [message indices]}`; the rest default to the
app's flags.
"""

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import Message, Sampling
from ..chat.limits import Limits
from ..chat.sampler import stop_token_ids
from ..chat.session import ChatSession, GenerationError
from ..chat.template import render, token_ids, tokenize
from ..chat.tools import KnownCalls, ToolCalls, call_prefix, renders_tools
from ..models.compile import Compilation
from ..models.quantize import weights_label
from .pool import MAX_IDLE_KV_MIB, SessionPool, TextSession
from .requestlog import RequestLog
from .requests import (
    LLAMACPP_NAMES,
    ApiError,
    read_chat_request,
    read_native_request,
    read_text_request,
)
from .shapes import Shape, sse, usage

__all__ = ["ApiError", "create_router", "read_chat_request", "read_text_request"]  # what tests import

DISCONNECT_POLL_S = 0.1  # how often a request waiting on its worker checks that its client is still there
MAX_PROMPT_TOKENS = 32_768  # the default --max-prompt-tokens: ~1 min of prefill on a 2-core CPU, seconds on a GPU
BODY_BYTES_PER_TOKEN = 16  # a body may hold this much per prompt token (JSON escapes, the other fields)
NOT_SAVED_HEADER = "X-H2O-Not-Saved"  # on a response whose conversation could not be saved: why
TOOLS_IGNORED_HEADER = "X-H2O-Tools-Ignored"  # on a response to a request whose tools the model was not shown: why
NO_TEMPLATE_TOOLS = "this model's chat template does not show tools to the model"
# Of chat.limits' max new tokens, what a reply without max_tokens may run to: the session checks
# the setting against the memory free when it takes it, and memory moves meanwhile
MACHINE_SHARE = 0.9
UNKNOWN_BOUND = 2**31 - 1  # where the memory free cannot be told (Limits: nothing is bounded but the context)
log = logging.getLogger("h2o_chat")


def create_router(model, tokenizer, cache_defaults, data_dir=None, api_key=None, closed=False, concurrency=1,
                  max_kv_mib=MAX_IDLE_KV_MIB, model_id=None, batcher=None, max_prompt_tokens=MAX_PROMPT_TOKENS,
                  compile=Compilation.compile):
    """The API's routes. api_key: required as `Authorization: Bearer KEY` on every one of them;
    closed (the UI has a login and no key was given): they refuse every request, so the API is
    never open where the UI is not. model None: the model is still loading (503). batcher: the
    app's batch.Batcher, shared with the UI (None: each reply runs the model in its own worker).
    max_prompt_tokens: a longer prompt is refused before any of it is computed. compile: the sessions'
    compiled decode step (models.compile.Compilation)."""
    api = Api(model, tokenizer, cache_defaults, data_dir, api_key, closed, concurrency, max_kv_mib, model_id, batcher,
              max_prompt_tokens, compile)
    router = APIRouter()
    router.pool, router.batcher, router.api = api.pool, batcher, api  # for tests and the bench: what is live
    for path, handler, method, needs_model in (
            ("/health", api.health, "GET", False), ("/v1/health", api.health, "GET", False),
            ("/v1/models", api.models, "GET", True), ("/v1/models/{model_id:path}", api.model_info, "GET", True),
            ("/v1/chat/completions", api.chat_completions, "POST", True),
            ("/v1/completions", api.completions, "POST", True),
            ("/completion", api.native_completion, "POST", True), ("/tokenize", api.tokenize, "POST", True),
            ("/detokenize", api.detokenize, "POST", True), ("/props", api.props, "GET", True)):
        router.add_api_route(path, api.guarded(handler, needs_model), methods=[method])
    router.add_api_route("/v1/{path:path}", api.guarded(api.unknown, False),
                         methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    from .ollama import add_ollama_routes  # here: ollama.py reuses this module's machinery

    router.ollama = add_ollama_routes(router, api)  # Ollama's /api/* on the same port, pool and key
    return router


class Api:
    """What the routes share: the model, the pool of live sessions, the worker slots and the
    access rules. A request is read into a Job, run by worker threads, and answered whole or as
    server-sent events from the workers' events."""

    def __init__(self, model, tokenizer, cache_defaults, data_dir, api_key, closed, concurrency, max_kv_mib,
                 model_id, batcher, max_prompt_tokens=MAX_PROMPT_TOKENS, compile=Compilation.compile):
        self.model, self.tokenizer, self.cache_defaults, self.data_dir = model, tokenizer, cache_defaults, data_dir
        self.compile = compile  # the sessions' compiled decode step (models/compile.py)
        self.api_key, self.closed, self.batcher = api_key, closed, batcher
        self.model_id = model_id or (model is not None and Path(model.name_or_path).name) or "h2o-chat"
        self.concurrency, self.max_prompt_tokens = concurrency, max_prompt_tokens
        self.workers = threading.BoundedSemaphore(concurrency)  # generations at once, as the UI's --concurrency
        self.pool = SessionPool(self.make_session, int(max_kv_mib * 2**20), data_dir, self.open_saved)
        self.stop_ids = stop_token_ids(model, tokenizer) if model is not None else set()
        self.template_tools = tokenizer is not None and renders_tools(tokenizer)
        self.known_calls = KnownCalls()  # the reply text each tool call handed out was read from
        self.said_tools_ignored = False  # the warning that tools are ignored is logged once

    def make_session(self, kind, cache, system_prompt):
        if kind == "text":
            return TextSession(self.model, self.tokenizer, cache=cache, batcher=self.batcher, compile=self.compile)
        return ChatSession(self.model, self.tokenizer, cache=cache, system_prompt=system_prompt,
                           data_dir=self.data_dir, batcher=self.batcher, compile=self.compile)

    def open_saved(self, conversation_id):
        """A saved chat conversation back from disk (the pool dropped it, or the server restarted);
        lazily: the request's first sync loads the saved cache state that shares the most with it."""
        return ChatSession.open(self.model, self.tokenizer, conversation_id, self.data_dir, batcher=self.batcher,
                                lazy=True, compile=self.compile)

    # --- access ----------------------------------------------------------------------------------
    def check_access(self, request):
        if self.closed:
            raise ApiError(401, "this server has a UI login (--auth) and no API key: start it with --api-key "
                                "(or H2O_CHAT_API_KEY) to use the API", code="invalid_api_key")
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")

    def guarded(self, handler, needs_model=True, error_response=ApiError.response):
        """The route: access (and readiness) checked, every ApiError answered by `error_response`
        (OpenAI's shape; Ollama's routes give theirs), and one log line written when the answer (or
        its stream) ends."""
        async def route(request: Request):
            record = request.state.log = RequestLog(f"{request.method} {request.url.path}",
                                                    client_name(request.headers))
            try:
                self.check_access(request)
                if needs_model and self.model is None:
                    raise ApiError(503, "the model is loading; try again shortly")
                response = await handler(request, **request.path_params)
            except ApiError as e:
                record.done(e.status, e.message)
                return error_response(e)
            if isinstance(response, StreamingResponse):
                response.body_iterator = logged(response.body_iterator, record)
            else:
                record.done(getattr(response, "status_code", 200))
            return response
        route.__name__ = handler.__name__
        return route

    async def read_body(self, request, check_model=True):
        """The JSON body, at most max_prompt_tokens * BODY_BYTES_PER_TOKEN bytes (413 past that,
        before anything is parsed). check_model: a model other than this one is a 404 (False:
        the caller checks it, as Ollama's routes do with their own names)."""
        limit, size, chunks = self.max_prompt_tokens * BODY_BYTES_PER_TOKEN, 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 100 * limit:  # no use reading on: the answer is the same
                break
        if size > limit:
            raise ApiError(413, f"the request body is {size:,} bytes or more; this server takes at most {limit:,} "
                                f"(--max-prompt-tokens {self.max_prompt_tokens:,})", code="request_too_large")
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model_name = body.get("model")
        if check_model and model_name not in (None, "", self.model_id):
            raise ApiError(404, f"the model {model_name!r} does not exist; this server has {self.model_id!r}",
                           "model", "model_not_found")
        return body

    # --- OpenAI's routes -------------------------------------------------------------------------
    async def health(self, request):
        if self.model is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": self.model_id}

    async def models(self, request):
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "h2o-chat", "weights": weights_label(self.model)}]}

    async def model_info(self, request, model_id):
        listed = (await self.models(request))["data"]
        found = [m for m in listed if m["id"] == model_id]
        if not found:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {self.model_id!r}",
                           "model", "model_not_found")
        return found[0]

    async def chat_completions(self, request):
        job = read_chat_request(await self.read_body(request), self.cache_defaults)
        self.prepare_tools(job)
        return await self.run(request, job)

    def prepare_tools(self, job):
        """Tool calls the server handed out, sent back, become the reply text they were read from
        (the cache holds its tokens); tools go to a template that shows them, or are ignored
        (job.tools_ignored says why; tool_choice that asks for a call is then a 400); a call
        asked for is started in the reply (its opening written in the template's format)."""
        for i, m in enumerate(job.messages):
            text = self.known_calls.text_of(m["tool_calls"]) if m.get("tool_calls") else None
            if text is not None:
                job.messages[i] = {"role": "assistant", "content": text, "pinned": m["pinned"]}
        if not job.tools:
            return
        if not self.template_tools:
            if job.forced_tool is not None:
                param = "function_call" if job.legacy_functions else "tool_choice"
                raise ApiError(400, f"{param} asks for a tool call, and {NO_TEMPLATE_TOOLS}: leave {param} at "
                                    "\"auto\" (the tools are then ignored) or load a model whose template has tools",
                               param)
            job.tools, job.tools_ignored = None, NO_TEMPLATE_TOOLS
            if not self.said_tools_ignored:
                self.said_tools_ignored = True
                log.warning("h2o-chat: requests bring tools, and %s: they are answered without them (%s header)",
                            NO_TEMPLATE_TOOLS, TOOLS_IGNORED_HEADER)
            return
        if job.forced_tool is not None and not job.continue_final:
            job.tool_prefix = call_prefix(self.tokenizer, job.forced_tool or None)
            job.messages.append({"role": "assistant", "content": job.tool_prefix, "pinned": False})
            job.continue_final = True

    async def completions(self, request):
        return await self.run(request, read_text_request(await self.read_body(request), self.cache_defaults))

    async def unknown(self, request, path):
        raise ApiError(404, f"no route /v1/{path}; this server has /v1/models, /v1/chat/completions and "
                            "/v1/completions")

    # --- llama.cpp's routes ----------------------------------------------------------------------
    async def native_completion(self, request):
        return await self.run(request, read_native_request(await self.read_body(request), self.cache_defaults))

    async def tokenize(self, request):
        """{"content", "add_special": false, "parse_special": true, "with_pieces": false} -> {"tokens"}."""
        body = await self.read_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "content must be text", "content")
        ids = tokenize(self.tokenizer, content, template=body.get("parse_special", True) is not False)
        if body.get("add_special") and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id] + ids
        if body.get("with_pieces"):
            return {"tokens": [{"id": i, "piece": self.tokenizer.decode([i])} for i in ids]}
        return {"tokens": ids}

    async def detokenize(self, request):
        """{"tokens": [ids]} -> {"content"}."""
        tokens = (await self.read_body(request)).get("tokens")
        vocab = len(self.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(400, f"tokens must be a list of token ids (0 to {vocab - 1})", "tokens")
        return {"content": self.tokenizer.decode(tokens)}

    async def props(self, request):
        """What llama.cpp clients read of the server: the default settings (its names), slots, template."""
        defaults = Sampling()
        params = {LLAMACPP_NAMES.get(name, name): getattr(defaults, name)
                  for name in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                               "presence_penalty", "frequency_penalty")}
        params.update(seed=-1, stop=[], n_probs=0, stream=False, n_predict=-1)  # -1: until the model stops
        return {"default_generation_settings": {"n_ctx": self.max_prompt_tokens, "params": params, "model": self.model_id},
                "total_slots": self.concurrency, "model_path": self.model_id, "model_alias": self.model_id,
                "chat_template": getattr(self.tokenizer, "chat_template", None) or "",
                "modalities": {"vision": False, "audio": False}, "build_info": "h2o-chat"}

    # --- running a job ---------------------------------------------------------------------------
    def check_prompt_size(self, job):
        """A 400 for a prompt over --max-prompt-tokens, counted as the session will render it,
        before any of it is computed."""
        if job.kind == "chat":
            messages = [Message.of(m) for m in job.messages]
            n = len(token_ids(render(self.tokenizer, job.system_prompt, messages, add_generation_prompt=not
                                     job.continue_final, open_reply=job.continue_final, tools=job.tools)))
        else:
            n = len(tokenize(self.tokenizer, job.messages[-1]["content"], template=True))
        if n > self.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {n:,} tokens; this server reads at most {self.max_prompt_tokens:,} "
                                "(--max-prompt-tokens)", "messages", "context_length_exceeded")

    def work(self, job, emit):
        """The worker thread: check the prompt, lend a session, answer (events: see `answer`), and
        say ("done",) once the session and the worker are free, so the client's next request finds both."""
        with self.workers:
            session = None
            try:
                if not job.cancelled.is_set():
                    self.check_prompt_size(job)
                    session, _ = self.pool.acquire("text" if job.kind != "chat" else "chat", job.cache,
                                                   job.system_prompt, job.messages, job.client, job.tools)
                    answer(session, job, emit, self.stop_ids, self.known_calls)
            except ApiError as e:
                emit(("error", e))
            except GenerationError as e:
                emit(("error", ApiError(503, str(e))))
            except ValueError as e:
                emit(("error", ApiError(400, str(e))))
            except Exception as e:  # never leave the request waiting on a worker that died; no paths in answers
                log.exception("h2o-chat: a request failed")
                emit(("error", ApiError(500, f"internal error ({type(e).__name__}); the server's log has the rest")))
            finally:
                if session is not None:
                    self.pool.release(session)
        emit(("done",))

    async def run(self, request, job):
        record = request.state.log
        job.client = record.client
        record.note = f"tools ignored: {job.tools_ignored}" if job.tools_ignored else None
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the server is shutting down
                job.cancel()

        threading.Thread(target=self.work, args=(job, emit), daemon=True, name="h2o-api").start()
        first = await next_event(events, request, job)
        if first is None or first[0] == "done":  # the client left (or it was cancelled) before a word
            record.error = "the client left before the first token"
            return Response(status_code=499)
        if first[0] == "error":
            record.error = first[1].message
            return first[1].response()
        _, prompt_tokens, cached, save_error = first
        headers = {NOT_SAVED_HEADER: save_error} if save_error else {}
        if job.tools_ignored:
            headers[TOOLS_IGNORED_HEADER] = job.tools_ignored
        shape = Shape(job.kind, uuid.uuid4().hex[:24], int(time.time()), self.model_id, self.tokenizer,
                      legacy=job.legacy_functions)
        reply = Reply(job, shape, prompt_tokens, cached, record)
        if not job.stream:
            return await reply.whole(events, request, headers)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(reply.sse(events), media_type="text/event-stream", headers=headers)


async def logged(stream, record):
    """A response's stream, its request's log line written when it ends: whole, or cut short by
    a client that left."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    finally:
        if not finished and record.error is None:
            tokens = (record.usage or {}).get("completion_tokens")
            record.error = "the client left" + (f" after {tokens:,} tokens" if tokens else " mid-stream")
        record.done()


# frontends the page names in its list of live conversations when a request mentions them
KNOWN_CLIENTS = ("SillyTavern", "Open WebUI", "LibreChat", "LobeChat", "Chatbox", "KoboldAI", "Agnaistic", "RisuAI",
                 "Msty", "AnythingLLM")


def client_name(headers):
    """Who sent a request, in a word the page can show: the X-Title header (OpenRouter's
    convention, which SillyTavern and others send), a known frontend named in the User-Agent,
    Referer or Origin, else the User-Agent's first product ("OpenAI/Python 1.99" -> "OpenAI/Python"),
    else None."""
    title = headers.get("x-title", "").strip()
    if title:
        return title[:40]
    def letters(text):  # "Open WebUI", "open-webui" and "OpenWebUI" all read "openwebui"
        return "".join(c for c in text.lower() if c.isalnum())

    said = letters(" ".join(headers.get(name, "") for name in ("user-agent", "referer", "origin")))
    known = next((name for name in KNOWN_CLIENTS if letters(name) in said), None)
    if known:
        return known
    agent = headers.get("user-agent", "").split()
    return agent[0][:40] if agent else None


async def next_event(events, request, job):
    """The workers' next event; None when the client disconnects meanwhile (the job is cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return None


@dataclass
class Reply:
    """The workers' events for one request, gathered into its answer (whole or streamed), its
    figures kept in the request's log record as they come."""

    job: object
    shape: Shape
    prompt_tokens: int
    cached: int
    record: RequestLog

    def usage(self, choices):
        return usage(self.prompt_tokens, self.cached, sum(c["tokens"] for c in choices))

    def new_choices(self):
        logprobs = self.job.top_logprobs is not None
        return [{"text": "", "finish": None, "tokens": 0, "stop_word": None, "logprobs": [] if logprobs else None,
                 "tool_calls": []} for _ in range(self.job.n)]

    def ended(self, choices, i, event):
        """An "end" event into choice i; the usage so far into the log record."""
        _, _, finish, tokens, stop_word = event
        choices[i].update(finish=finish, tokens=tokens, stop_word=stop_word)
        self.record.usage = self.usage(choices)

    def so_far(self, choices):
        """The usage of a reply cut short: the tokens each choice's session has drawn by now."""
        drawn = [c["tokens"] if c["finish"] else (s.last_turn.new_tokens if s.last_turn else 0)
                 for c, s in zip(choices, self.job.sessions)]
        return usage(self.prompt_tokens, self.cached, sum(drawn))

    async def whole(self, events, request, headers):
        choices = self.new_choices()
        while True:
            event = await next_event(events, request, self.job)
            if event is None:
                self.record.usage, self.record.error = self.so_far(choices), "the client left before the answer"
                return Response(status_code=499)
            if event[0] == "text":
                _, i, piece, entries = event
                self.record.token()
                choices[i]["text"] += piece
                if entries:
                    choices[i]["logprobs"] += entries
            elif event[0] == "tool_call":
                self.record.token()
                choices[event[1]]["tool_calls"].append(event[2])
            elif event[0] == "end":
                self.ended(choices, event[1], event)
            elif event[0] == "error":
                self.record.error = event[1].message
                return event[1].response()
            elif event[0] == "done":
                return JSONResponse(self.shape.whole(choices, self.usage(choices)), headers=headers)

    async def sse(self, events):
        """Each event as a server-sent event; OpenAI's end with [DONE], llama.cpp's with stop: true."""
        shape, choices, done = self.shape, self.new_choices(), False
        try:
            for chunk in shape.opening(self.job.n):
                yield sse(chunk)
            while True:
                event = await events.get()
                if event[0] == "text":
                    _, i, piece, entries = event
                    self.record.token()
                    if piece or entries:
                        yield sse(shape.chunk(i, piece, entries=entries))
                elif event[0] == "tool_call":
                    _, i, call = event
                    self.record.token()
                    choices[i]["tool_calls"].append(call)
                    for chunk in shape.tool_call_chunks(i, len(choices[i]["tool_calls"]) - 1, call):
                        yield sse(chunk)
                elif event[0] == "end":
                    self.ended(choices, event[1], event)
                    if shape.kind != "native":
                        yield sse(shape.chunk(event[1], None, event[2]))
                elif event[0] == "error":
                    self.record.error = event[1].message
                    yield sse(event[1].body() if shape.kind == "native" else {"error": event[1].body()["error"]})
                    done = True
                    break
                elif event[0] == "done":
                    done = True
                    if shape.kind == "native":
                        yield sse(shape.native_end(choices[0], self.usage(choices)))
                        break
                    if self.job.include_usage:
                        yield sse(shape.usage_chunk(self.usage(choices)))
                    yield "data: [DONE]\n\n"
                    break
        finally:  # a client that disconnects lands here too (the stream is cancelled): stop its reply
            self.job.cancel()
            if not done:
                self.record.usage = self.so_far(choices)


def answer(session, job, emit, stop_ids=(), known_calls=None):
    """Every choice of `job`: choice 0 in `session`, the others at the same time in copies of it
    made before it changes, so their decode steps are rows of one batch (when the app batches).
    Events: ("start", prompt_tokens, cached_tokens, save_error) once, before any other; then per
    choice ("text", i, piece, logprob entries) for every piece the session streams (a piece may
    be "" while text that could be a tool call is held back), ("tool_call", i, call) for each
    call read out of it, and ("end", i, finish_reason, completion_tokens, stop_word).
    known_calls: remembers the text each call was read from."""
    copies = [session.copy() for _ in range(job.n - 1)]
    job.sessions += [session, *copies]
    if job.cancelled.is_set():
        return
    started = threading.Event()  # choice 0 has said "start": the others may speak
    threads = [threading.Thread(target=reply_in_thread, args=(s, job, emit, i + 1, started, stop_ids, known_calls),
                                daemon=True, name="h2o-api-choice") for i, s in enumerate(copies)]
    for t in threads:
        t.start()
    try:
        reply(session, job, emit, 0, started, stop_ids, known_calls)
    except BaseException:
        job.cancel()  # the answer is the error: the other choices stop too
        raise
    finally:
        started.set()
        for t in threads:
            t.join()


def reply_in_thread(session, job, emit, index, started, stop_ids, known_calls):
    try:
        reply(session, job, emit, index, started, stop_ids, known_calls)
    except Exception as e:
        log.exception("h2o-chat: choice %d failed", index)
        emit(("error", ApiError(503 if isinstance(e, GenerationError) else 500, str(e) if isinstance(
            e, ValueError) else f"internal error ({type(e).__name__})")))


def machine_bound(session):
    """The most tokens a reply without max_tokens may run to here: the model's trained context
    (one reply longer than any text the model was trained on is a loop, not a reply: llama.cpp's
    server stops at its context too; seen with Open WebUI, whose requests give no max_tokens: the
    135M model wrote 7,000 words of one regenerated reply), and MACHINE_SHARE of what the memory
    free now holds (chat.limits), for this session's cache."""
    trained = session.model.config.get_text_config(decoder=True).max_position_embeddings
    most = Limits.of(session.model).max_new_tokens(session.cache_config)
    return min(trained, UNKNOWN_BOUND if most is None else max(1, int(most * MACHINE_SHARE)))


def reply(session, job, emit, index, started, stop_ids=(), known_calls=None):
    """One choice: take the request's history (the system prompt is the session's own: the pool
    lends only sessions that have it; the tools the template shows, the request's) and stream
    the reply to its last message, or write on in a final assistant message (job.continue_final).
    With tools, the reply's text is read for calls as it streams."""
    last = job.messages[-1]
    history = job.messages if job.continue_final else job.messages[:-1]
    sampling = dict(job.sampling)
    # no max_tokens: this reply runs to the machine's bound, a cap of this request's alone (the
    # conversation keeps Sampling's default, as the page would)
    session.reply_cap = machine_bound(session) if sampling["max_new_tokens"] is None else None
    if sampling["max_new_tokens"] is None:
        sampling["max_new_tokens"] = Sampling().max_new_tokens
    if index and sampling["seed"] is not None:
        sampling["seed"] += index  # each choice its own draw, all of them reproducible
    if job.ignore_eos:
        sampling["logit_bias"] = tuple(sorted({**dict(sampling["logit_bias"]), **{i: -100.0 for i in stop_ids}}.items()))
    session.configure(**sampling)  # stop strings too: the session cuts at them, and unfeeds what it cut
    session.top_logprobs = job.top_logprobs
    session.conversation.tools = job.tools
    session.messages = [dict(m) for m in history]
    if job.continue_final:
        stream = session.continue_reply()
    else:
        stream = session.send(last["content"], role=last["role"], tool_call_id=last.get("tool_call_id"))
    if job.cancelled.is_set():  # cancelled while the session was being lent: send() has just cleared its stop
        session.stop()
    names = [t["function"]["name"] for t in job.tools or []]
    calls = ToolCalls(names, job.tool_prefix) if job.tools else None
    made = []  # the calls handed out
    sent = 0  # logprob entries sent

    def start():
        if index > 0:
            started.wait()
        elif not started.is_set():
            stats = session.last_turn
            emit(("start", stats.prompt_tokens, stats.prompt_tokens - stats.prompt_computed, session.save_error))
            started.set()

    def entries(upto):
        nonlocal sent
        if job.top_logprobs is None:
            return None
        out, sent = session.token_logprobs[sent:upto], max(sent, upto)
        return out

    def tell(content, found):
        for call in found:
            if job.parallel_tool_calls or not made:
                made.append(call)
                emit(("tool_call", index, call))
        return content

    for piece in stream:
        start()
        if calls is not None:
            piece = tell(*calls.feed(piece))
        emit(("text", index, piece, entries(session.tokens_shown())))
    start()
    stats = session.last_turn
    rest = tell(*calls.finish()) if calls is not None else ""
    more = entries(stats.kept_tokens)
    if rest or more:
        emit(("text", index, rest, more))
    finish = "length" if stats.finish == "length" else "stop"
    if made:
        if known_calls is not None:
            known_calls.remember(made, session.messages[-1].content, names)
        if finish == "stop":
            finish = "function_call" if job.legacy_functions else "tool_calls"
    emit(("end", index, finish, stats.kept_tokens, stats.stop_string))
