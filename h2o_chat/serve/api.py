"""An OpenAI-compatible API beside the UI: `/v1/models`, `/v1/chat/completions`, `/v1/completions`
and `/health`, as routes for the FastAPI app Gradio runs on (one process, one model).

Clients resend the whole history with every request; the SessionPool lends each request the
live ChatSession that shares the most of it, so only the unseen rest is computed
(`usage.prompt_tokens_details.cached_tokens` says how much was not). Generation runs in a worker
thread per request; a client that disconnects stops it at the next token.

Per-request cache settings ride in an extension object, `"h2o": {"policy", "budget",
"n_recent", "n_sink", "score", "positions", "pinned": [message indices]}`; the rest default to the
app's flags. Repetition penalty and top_k are accepted as the extensions llama.cpp and vLLM name
them (`repetition_penalty`, `top_k`).
"""

import asyncio
import hmac
import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cache.config import APP_FIELDS
from ..chat.conversation import Sampling, cache_config
from ..chat.detok import StopStrings
from ..chat.session import ChatSession, GenerationError, check_text
from ..models.quantize import weights_label
from .pool import MAX_IDLE_KV_MIB, SessionPool, TextSession

ROLES = ("system", "developer", "user", "assistant")
DISCONNECT_POLL_S = 0.1  # how often a request waiting on its worker checks that its client is still there


class ApiError(Exception):
    """An error the client caused (or 503): answered in OpenAI's JSON error shape."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self):
        kind = {401: "authentication_error", 404: "not_found_error", 503: "server_error"}.get(
            self.status, "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# --- reading a request --------------------------------------------------------------------------

@dataclass
class Job:
    """One request, as the worker thread runs it."""

    kind: str  # "chat" or "text"
    system_prompt: str | None
    messages: list  # [{"role", "content", "pinned"}], the last one the user's (or an open reply)
    sampling: dict
    cache: dict
    stream: bool = False
    include_usage: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: object = None

    def cancel(self):
        """The client has gone: stop now (safe from any thread, at any point of the job)."""
        self.cancelled.set()
        if self.session is not None:
            self.session.stop()


def _text_of(content, where):
    """A message's content: text, or OpenAI's list of typed parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}: only text parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be text or a list of text parts", "messages")


def _checked(text, where, empty_ok=False):
    try:
        return check_text(text, where, empty_ok=empty_ok)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def read_messages(messages):
    """(system_prompt, [{"role", "content", "pinned"}]) from OpenAI's messages: the leading
    system (or developer) messages make the system prompt; the rest must be user and assistant
    messages, the last one the user's (or an assistant's reply to continue)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    system, chat = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}: unknown role {role!r}; the roles are {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        text = _text_of(content, where)
        if role in ("system", "developer"):
            if chat:
                raise ApiError(400, f"{where}: a system message after the conversation has started is not "
                                    "supported; put system messages first", "messages")
            system.append(_checked(text, f"{where} (system)", empty_ok=True))
        else:
            chat.append({"role": role, "content": _checked(text, where, empty_ok=role == "assistant"),
                         "pinned": False})
    if not chat:
        raise ApiError(400, "messages hold no user message", "messages")
    system_prompt = "\n\n".join(s for s in system if s.strip()) or None
    if system_prompt is not None:
        _checked(system_prompt, "the system prompt", empty_ok=True)
    return system_prompt, chat, len(system)


def _number(body, name, kinds, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    return value


def read_sampling(body):
    """Sampling fields (OpenAI's names) -> all of Sampling's (what a request leaves out is
    Sampling's default, never what the session's previous request said), checked by Sampling."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, (int, float), 0):
            raise ApiError(400, f"{name} is not supported; use repetition_penalty (1.0 = off)", name)
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "only n = 1 is supported", "n")
    if body.get("logprobs") or body.get("echo"):
        raise ApiError(400, "logprobs and echo are not supported", "logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling = asdict(Sampling())
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        if body.get(name) is not None:
            sampling[name] = body[name]
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    sampling["stop"] = () if stop is None else stop
    try:
        return asdict(Sampling(**sampling))  # as Sampling reads them: a stop string becomes a tuple of one
    except (TypeError, ValueError) as e:
        name = str(e).split(" ")[0]
        name = {"max_new_tokens": "max_tokens"}.get(name, name)
        raise ApiError(400, str(e).replace("max_new_tokens", "max_tokens"), name) from None


def read_cache(body, defaults, n_system, n_chat):
    """The `h2o` extension object: cache settings over the app's defaults, and pinned message
    indices (into the request's messages)."""
    ext = body.get("h2o") or {}
    if not isinstance(ext, dict):
        raise ApiError(400, "h2o must be an object of cache settings", "h2o")
    unknown = sorted(set(ext) - set(APP_FIELDS) - {"pinned"})
    if unknown:
        raise ApiError(400, f"unknown h2o setting {unknown[0]!r}; the settings are "
                            f"{', '.join(APP_FIELDS)}, pinned", "h2o")
    cache = dict(defaults, **{k: v for k, v in ext.items() if k != "pinned"})
    try:
        cache_config(cache)  # checked with the rest of the body: a 400 before a worker starts
    except ValueError as e:
        raise ApiError(400, str(e), "h2o") from None
    pinned = ext.get("pinned") or []
    if not isinstance(pinned, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in pinned):
        raise ApiError(400, "h2o.pinned must be a list of message indices", "h2o")
    turns = []
    for i in pinned:
        if not 0 <= i < n_system + n_chat:
            raise ApiError(400, f"h2o.pinned: no message {i} (the request has {n_system + n_chat})", "h2o")
        if i < n_system:
            raise ApiError(400, f"h2o.pinned: message {i} is a system message; only user and assistant "
                                "messages can be pinned", "h2o")
        turns.append(i - n_system)
    return cache, turns


def read_chat_request(body, cache_defaults):
    """A /v1/chat/completions body (a dict) -> the Job that answers it; ApiError (400) saying what
    is wrong with anything it cannot run. Every check of the body is made here, before any work."""
    system_prompt, messages, n_system = read_messages(body.get("messages"))
    sampling = read_sampling(body)
    cache, pinned = read_cache(body, cache_defaults, n_system, len(messages))
    for turn in pinned:
        messages[turn]["pinned"] = True
    return Job("chat", system_prompt, messages, sampling, cache, *stream_flags(body))


def read_text_request(body, cache_defaults):
    """A /v1/completions body (a dict) -> the Job that answers it (the prompt as one open user
    turn); ApiError (400) otherwise."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be one string", "prompt")
    prompt = _checked(prompt, "the prompt")
    sampling = read_sampling(body)
    cache, _ = read_cache(body, cache_defaults, 0, 0)
    return Job("text", None, [{"role": "user", "content": prompt, "pinned": False}], sampling, cache,
               *stream_flags(body))


# --- the routes ---------------------------------------------------------------------------------

def create_router(model, tokenizer, cache_defaults, data_dir=None, api_key=None, closed=False, concurrency=1,
                  max_kv_mib=MAX_IDLE_KV_MIB, model_id=None, batcher=None):
    """The `/v1` routes and `/health`. api_key: required as `Authorization: Bearer KEY` on `/v1`;
    closed (the UI has a login and no key was given): `/v1` refuses every request, so the API is
    never open where the UI is not. model None: the model is still loading (503). batcher: the
    app's batch.Batcher, shared with the UI (None: each reply runs the model in its own worker)."""
    api = Api(model, tokenizer, cache_defaults, data_dir, api_key, closed, concurrency, max_kv_mib, model_id, batcher)
    router = APIRouter()
    router.pool, router.batcher = api.pool, batcher  # for tests and the bench: what is live
    router.add_api_route("/health", api.health, methods=["GET"])
    for path, handler, method in (("/v1/models", api.models, "GET"),
                                  ("/v1/chat/completions", api.chat_completions, "POST"),
                                  ("/v1/completions", api.completions, "POST")):
        router.add_api_route(path, api.guarded(handler), methods=[method])
    router.add_api_route("/v1/{path:path}", api.unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    return router


class Api:
    """What the routes share: the model, the pool of live sessions, the worker slots and the
    access rules. A request is read into a Job, run by a worker thread, and answered whole or as
    server-sent events from the worker's events."""

    def __init__(self, model, tokenizer, cache_defaults, data_dir, api_key, closed, concurrency, max_kv_mib,
                 model_id, batcher):
        self.model, self.tokenizer, self.cache_defaults, self.data_dir = model, tokenizer, cache_defaults, data_dir
        self.api_key, self.closed, self.batcher = api_key, closed, batcher
        self.model_id = model_id or (model is not None and Path(model.name_or_path).name) or "h2o-chat"
        self.workers = threading.BoundedSemaphore(concurrency)  # generations at once, as the UI's --concurrency
        self.pool = SessionPool(self.make_session, int(max_kv_mib * 2**20))

    def make_session(self, kind, cache, system_prompt):
        if kind == "text":
            return TextSession(self.model, self.tokenizer, cache=cache, batcher=self.batcher)
        return ChatSession(self.model, self.tokenizer, cache=cache, system_prompt=system_prompt,
                           data_dir=self.data_dir, batcher=self.batcher)

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

    def guarded(self, handler):
        """The route: access and readiness checked, every ApiError answered in OpenAI's shape."""
        async def route(request: Request):
            try:
                self.check_access(request)
                if self.model is None:
                    raise ApiError(503, "the model is loading; try again shortly")
                return await handler(request)
            except ApiError as e:
                return e.response()
        route.__name__ = handler.__name__
        return route

    async def read_body(self, request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model_name = body.get("model")
        if model_name not in (None, self.model_id):
            raise ApiError(404, f"the model {model_name!r} does not exist; this server has {self.model_id!r}",
                           "model", "model_not_found")
        return body

    # --- the routes ------------------------------------------------------------------------------
    async def health(self):
        if self.model is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": self.model_id}

    async def models(self, request):
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "h2o-chat", "weights": weights_label(self.model)}]}

    async def chat_completions(self, request):
        body = await self.read_body(request)
        return await self.run(request, read_chat_request(body, self.cache_defaults))

    async def completions(self, request):
        body = await self.read_body(request)
        return await self.run(request, read_text_request(body, self.cache_defaults))

    async def unknown(self, request: Request, path: str):
        try:
            self.check_access(request)
            raise ApiError(404, f"no route /v1/{path}; this server has /v1/models, /v1/chat/completions and "
                                "/v1/completions")
        except ApiError as e:
            return e.response()

    # --- running a job ---------------------------------------------------------------------------
    def work(self, job, emit):
        """The worker thread: lend a session, feed the prompt, stream the reply as events
        ("start", prompt_tokens, cached_tokens), ("text", piece), ("end", finish_reason,
        completion_tokens) or ("error", ApiError)."""
        last = ("end", "stop", 0)
        with self.workers:
            session = None
            try:
                if not job.cancelled.is_set():
                    session, _ = self.pool.acquire(job.kind, job.cache, job.system_prompt, job.messages)
                    job.session = session
                    last = reply(session, job, emit)
            except GenerationError as e:
                last = ("error", ApiError(503, str(e)))
            except ValueError as e:
                last = ("error", ApiError(400, str(e)))
            except BaseException as e:  # never leave the request waiting on a worker that died
                emit(("error", ApiError(500, f"{type(e).__name__}: {e}")))
                raise
            finally:
                if session is not None:
                    self.pool.release(session)
        emit(last)  # once the session and the worker are free: the client's next request finds both

    async def run(self, request, job):
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the server is shutting down
                job.cancel()

        threading.Thread(target=self.work, args=(job, emit), daemon=True, name="h2o-api").start()
        created, rid = int(time.time()), uuid.uuid4().hex[:24]
        try:
            first = await next_event(events, request, job)
        except asyncio.CancelledError:
            job.cancel()
            raise
        if first[0] == "error":
            return first[1].response()
        if first[0] == "end":  # cancelled before it started
            return JSONResponse({}, status_code=499)
        _, prompt_tokens, cached = first
        shape = Shape(job.kind, rid, created, self.model_id)
        if not job.stream:
            return await whole(events, request, job, shape, prompt_tokens, cached)
        return StreamingResponse(sse(events, job, shape, prompt_tokens, cached), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_flags(body):
    options = body.get("stream_options") or {}
    return bool(body.get("stream")), bool(isinstance(options, dict) and options.get("include_usage"))


async def whole(events, request, job, shape, prompt_tokens, cached):
    """A non-streamed answer: the worker's events gathered into one response."""
    text = []
    while True:
        event = await next_event(events, request, job)
        if event[0] == "text":
            text.append(event[1])
        elif event[0] == "error":
            return event[1].response()
        else:
            _, finish, completion_tokens = event
            return shape.whole("".join(text), finish, usage(prompt_tokens, cached, completion_tokens))


async def sse(events, job, shape, prompt_tokens, cached):
    """A streamed answer: each event as a server-sent event, then [DONE]."""
    try:
        if job.kind == "chat":
            yield shape.sse(shape.chunk({"role": "assistant", "content": ""}))
        while True:
            event = await events.get()
            if event[0] == "text":
                yield shape.sse(shape.chunk(event[1]))
            elif event[0] == "error":
                yield shape.sse({"error": json.loads(event[1].response().body)["error"]})
                break
            else:
                _, finish, completion_tokens = event
                yield shape.sse(shape.chunk(None, finish))
                if job.include_usage:
                    yield shape.sse(shape.usage_chunk(usage(prompt_tokens, cached, completion_tokens)))
                break
        yield "data: [DONE]\n\n"
    finally:  # a client that disconnects lands here too (the stream is cancelled): stop its reply
        job.cancel()


def reply(session, job, emit):
    """Everything the API asks of a ChatSession: take the request's history (the system prompt
    is the session's own: the pool lends only sessions that have it), stream the reply through
    StopStrings, emit ("start", prompt_tokens, cached_tokens) at the first text (the prompt has been
    fed by then: the session feeds each reply token only after its text is out); returns the
    ("end", finish_reason, completion_tokens) event."""
    open_reply = job.messages[-1]["role"] == "assistant"
    history = [dict(m) for m in (job.messages if open_reply else job.messages[:-1])]
    session.configure(**dict(job.sampling, stop=()))  # stop strings are matched here (StopStrings)
    session.messages = history
    before = session.stats["tokens_processed"]
    stream = session.continue_reply() if open_reply else session.send(job.messages[-1]["content"])
    started = False

    def start():
        prompt_tokens = len(session.ledger)
        emit(("start", prompt_tokens, prompt_tokens - (session.stats["tokens_processed"] - before)))
        return True

    text = StopStrings(job.sampling["stop"])
    for piece in stream:
        started = started or start()
        text.feed(piece)
        if shown := text.take():
            emit(("text", shown))
        if text.hit or job.cancelled.is_set():
            session.stop()  # the reply ends after this token
    started = started or start()
    if shown := text.take(final=True):  # the reply has ended: what was held back is its own text
        emit(("text", shown))
    if text.hit:  # the session's reply ran on into the stop string: it keeps what the client got
        prefix = job.messages[-1]["content"] if open_reply else ""
        session.messages = (history[:-1] if open_reply else history + [job.messages[-1]]) + [
            {"role": "assistant", "content": prefix + text.text, "pinned": False}]
        session.autosave()
    new_tokens = session.last_turn.new_tokens
    stopped = text.hit or new_tokens < session.sampling.max_new_tokens or job.cancelled.is_set()
    return "end", "stop" if stopped else "length", new_tokens


async def next_event(events, request, job):
    """The worker's next event; a client that disconnects meanwhile cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise asyncio.CancelledError from None


def usage(prompt_tokens, cached, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class Shape:
    """OpenAI's response objects for one request (chat.completion or text_completion)."""

    kind: str
    rid: str
    created: int
    model: str

    def _head(self, obj):
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.rid, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text, finish, use):
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    def chunk(self, delta, finish=None):
        if self.kind == "chat":
            content = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
            choice = {"index": 0, "delta": content, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use):
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    @staticmethod
    def sse(obj):
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
