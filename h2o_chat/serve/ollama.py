"""Ollama's API on the app's host and port, beside /v1 (Open WebUI's default connection, and
every tool that speaks only Ollama):

    POST /api/chat, /api/generate          replies: NDJSON lines (the default) or one object
    GET  /api/tags, /api/ps, /api/version  (and HEAD)   the one served model, its state, the version
    POST /api/show                         the model's details, parameters and chat template
    /api/pull, push, create, copy, delete, embed, embeddings, blobs   501 with a sentence

A request is translated into the /v1 body it stands for and read by serve/requests.py (the same
checks, the same sampler), then run by the same worker, SessionPool and --api-key as /v1: a chat
resent with one more turn lends the session that holds the earlier ones, and only the new tokens
are computed. Ollama's own answers: errors as {"error": "sentence"}, durations in nanoseconds,
`prompt_eval_count` the whole prompt and `prompt_eval_cached_count` the part that was not
computed (Ollama's newest fields: its count is the logical prompt, the cached part beside it).

What each field does (the README's paragraph says the same):

    honoured   model (the served id, with or without ":latest"), messages, prompt, system, raw,
               stream, options.{num_predict, temperature, top_k, top_p, min_p, typical_p,
               repeat_penalty, frequency_penalty, presence_penalty, seed, stop}, logprobs,
               top_logprobs, h2o (the /v1 cache extension)
    ignored    keep_alive (the model stays loaded: the page shares it), options.num_ctx (H2O keeps
               --budget slots however long the chat: there is no context window to size), the
               other load-time options (num_gpu, num_thread, use_mmap, ...), num_keep (the sinks),
               repeat_last_n (the penalty looks 1,024 tokens back), tools (a reply never calls a
               tool here; the response says so in X-H2O-Tools-Ignored), any unknown field
    refused    format, images, think, template, suffix, context (non-empty): 400 naming the field
"""

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import Sampling
from ..models.quantize import weights_label
from . import shapes
from .api import NOT_SAVED_HEADER, TOOLS_IGNORED_HEADER, next_event
from .requests import ApiError, read_chat_request, read_text_request

# The Ollama release whose API these routes follow (docs/api.md, the `ollama` Python client 0.6):
# clients compare it as a version number (Open WebUI keeps the lowest of its connections).
OLLAMA_VERSION = "0.12.6"
NDJSON = "application/x-ndjson"
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model that is never unloaded (Ollama's own for keep_alive < 0)

# options -> the /v1 body's names (read_sampling reads them); mirostat and tfs_z go along so that
# a value other than off is refused as on /v1
OPTION_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "typical_p": "typical_p", "repeat_penalty": "repetition_penalty",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed",
                "stop": "stop", "mirostat": "mirostat", "tfs_z": "tfs_z"}
# fields with no effect here that a client may hope had one: a 400 naming each, unless empty
REFUSED = {
    "format": "format (JSON mode, structured outputs) is not supported by this server: the sampler does not "
              "constrain replies; ask for JSON in the prompt instead",
    "images": "images are not supported: this server runs text-only models",
    "think": "think is not supported: this server does not separate a model's thinking from its reply",
    "template": "template is not supported: this server renders prompts with the model's own chat template "
                "(Jinja, see /api/show); send raw: true with a prompt you formatted yourself",
    "suffix": "suffix (fill-in-the-middle) is not supported by this server",
    "context": "context is not supported: send the conversation to /api/chat, which reuses its tokens "
               "(only the new turn is computed)",
}
NOT_HERE = ("h2o-chat serves the one model it was started with (--model) and cannot {}: manage models where "
            "they are stored, and restart h2o-chat with --model")
REFUSED_ROUTES = (  # (path, methods, what Ollama would do)
    ("/api/pull", ["POST"], "pull models"), ("/api/push", ["POST"], "push models"),
    ("/api/create", ["POST"], "create models"), ("/api/copy", ["POST"], "copy models"),
    ("/api/delete", ["DELETE", "POST"], "delete models"), ("/api/blobs/{digest}", ["HEAD", "POST"], "store blobs"),
)
EMBEDDINGS = ("h2o-chat does not compute embeddings (its models are chat models, and their hidden states are no "
              "trained embedding); use an embedding model's server for /api/embed")


def add_ollama_routes(router, api):
    """Ollama's routes on `router`, served by `api` (serve.api.Api: its model, pool, workers and keys)."""
    ollama = Ollama(api)
    for path, handler, methods, needs_model in (
            ("/api/version", ollama.version, ["GET", "HEAD"], False), ("/api/tags", ollama.tags, ["GET", "HEAD"], True),
            ("/api/ps", ollama.ps, ["GET", "HEAD"], True), ("/api/show", ollama.show, ["POST"], True),
            ("/api/chat", ollama.chat, ["POST"], True), ("/api/generate", ollama.generate, ["POST"], True)):
        router.add_api_route(path, ollama.guarded(handler, needs_model), methods=methods)
    for path, methods, what in REFUSED_ROUTES:
        router.add_api_route(path, ollama.guarded(refuse(501, NOT_HERE.format(what)), False), methods=methods)
    for path in ("/api/embed", "/api/embeddings"):
        router.add_api_route(path, ollama.guarded(refuse(501, EMBEDDINGS), False), methods=["POST"])
    router.add_api_route("/api/{path:path}", ollama.guarded(ollama.unknown, False),
                         methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"])
    return ollama


def refuse(status, sentence):
    async def refused(request, **_):
        raise ApiError(status, sentence)
    return refused


def error_response(error):
    """An ApiError in Ollama's shape: {"error": "sentence"} (what its clients read)."""
    return JSONResponse({"error": error.message}, status_code=error.status)


def now_iso():
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds):
    return max(0, int(seconds * 1e9))


class Ollama:
    """The routes' shared state: `api` (the /v1 side's Api) and what Ollama says of its model."""

    def __init__(self, api):
        self.api = api
        model_id = api.model_id
        self.listed = model_id if ":" in model_id else f"{model_id}:latest"  # the name Ollama's clients see
        self.names = {model_id, self.listed}
        self.loaded_at = now_iso()
        self._details = None

    def guarded(self, handler, needs_model=True):
        """The route: /v1's access and readiness checks and log line, every ApiError in Ollama's shape."""
        return self.api.guarded(handler, needs_model, error_response=error_response)

    async def read_body(self, request):
        """The JSON body (the /v1 size limit), its model named as the served one (404 otherwise)."""
        body = await self.api.read_body(request, check_model=False)
        name = body.get("model") or body.get("name")  # /api/show's older clients send name
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"model is required; this server has {self.listed!r}")
        if name not in self.names:
            raise ApiError(404, f"model {name!r} not found: this server has {self.listed!r} (its one model) and "
                                "cannot pull others")
        return body, name

    # --- the model -------------------------------------------------------------------------------
    def details(self):
        """(details, size in bytes, digest, model_info): what the listings say of the served model."""
        if self._details is None:
            self._details = describe(self.api.model, self.api.model_id)
        return self._details

    def listing(self):
        details, size, digest, _ = self.details()
        return {"name": self.listed, "model": self.listed, "modified_at": modified_at(self.api.model) or self.loaded_at,
                "size": size, "digest": digest, "details": details}

    async def version(self, request):
        return {"version": OLLAMA_VERSION}

    async def tags(self, request):
        return {"models": [self.listing()]}

    async def ps(self, request):
        """Loaded for good (the page shares it): expires never; size_vram is what sits on a GPU."""
        entry = self.listing()
        on_gpu = self.api.model.device.type == "cuda"
        entry.update(expires_at=NEVER, size_vram=entry["size"] if on_gpu else 0,
                     context_length=self.api.max_prompt_tokens)
        del entry["modified_at"]
        return {"models": [entry]}

    async def show(self, request):
        await self.read_body(request)
        details, _, _, model_info = self.details()
        tokenizer = self.api.tokenizer
        return {"modelfile": self.modelfile(), "parameters": self.parameters(),
                "template": getattr(tokenizer, "chat_template", None) or "", "details": details,
                "model_info": model_info, "capabilities": ["completion"],
                "modified_at": modified_at(self.api.model) or self.loaded_at}

    def parameters(self):
        """The defaults a request's options override, in Modelfile's `name value` lines, and the
        end-of-turn tokens every reply stops at."""
        defaults = Sampling()
        lines = [f"{name:<30} {value}" for name, value in (
            ("temperature", defaults.temperature), ("top_k", defaults.top_k), ("top_p", defaults.top_p),
            ("min_p", defaults.min_p), ("typical_p", defaults.typical_p),
            ("repeat_penalty", defaults.repetition_penalty), ("frequency_penalty", defaults.frequency_penalty),
            ("presence_penalty", defaults.presence_penalty))]
        stops = sorted(self.api.tokenizer.convert_ids_to_tokens(sorted(self.api.stop_ids)))
        return "\n".join(lines + [f"{'stop':<30} {json.dumps(s, ensure_ascii=False)}" for s in stops])

    def modelfile(self):
        source = getattr(self.api.model, "name_or_path", "") or self.api.model_id
        parameters = "\n".join(f"PARAMETER {line}" for line in self.parameters().splitlines())
        return (f"# Modelfile generated by h2o-chat for {self.listed}\n# The chat template is the tokenizer's own "
                f"(Jinja): /api/show's template field.\nFROM {source}\n{parameters}\n")

    async def unknown(self, request, path):
        raise ApiError(404, f"no route /api/{path}; this server has Ollama's /api/chat, /api/generate, /api/tags, "
                            "/api/show, /api/ps and /api/version (and OpenAI's /v1)")

    # --- replies ---------------------------------------------------------------------------------
    async def chat(self, request):
        body, name = await self.read_body(request)
        messages = body.get("messages")
        if messages in (None, []):  # Ollama's way to load a model: it is loaded
            return loaded(name, chat=True)
        check_refused(body, messages if isinstance(messages, list) else [])
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list of {role, content} objects")
        chat = [chat_message(m, i) for i, m in enumerate(messages)]
        openai = {"messages": chat, "continue_final_message": True, "h2o": body.get("h2o"),
                  **options_body(body.get("options"), body)}
        job = read_ollama(read_chat_request, openai, self.api)
        return await self.run(request, self.streamed(job, body), name, chat=True, body=body)

    async def generate(self, request):
        body, name = await self.read_body(request)
        prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw")
        if prompt in (None, ""):  # Ollama's way to load a model: it is loaded
            return loaded(name, chat=False)
        check_refused(body)
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be text")
        if system is not None and not isinstance(system, str):
            raise ApiError(400, "system must be text")
        if raw not in (None, True, False):
            raise ApiError(400, "raw must be true or false")
        sampling = options_body(body.get("options"), body, text=raw is True)
        if raw:
            if system:
                raise ApiError(400, "system has no effect with raw: true (the prompt is fed exactly as written); "
                                    "put it in the prompt, or leave raw out")
            job = read_ollama(read_text_request, {"prompt": prompt, "h2o": body.get("h2o"), **sampling}, self.api)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            job = read_ollama(read_chat_request, {"messages": messages, "h2o": body.get("h2o"), **sampling}, self.api)
        return await self.run(request, self.streamed(job, body), name, chat=False, body=body)

    def streamed(self, job, body):
        """stream absent: true (Ollama streams unless told not to)."""
        if body.get("stream") not in (None, True, False):
            raise ApiError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
        job.stream = body.get("stream") is not False
        return job

    async def run(self, request, job, name, chat, body):
        """Run `job` in the /v1 worker (Api.work: its pool, its sessions) and answer in Ollama's
        shapes. The reply's timing is read in the worker thread, when its last token is out."""
        record = request.state.log  # the request's log line (serve/requestlog.py), written when it ends
        job.client = record.client
        received = time.perf_counter()
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event):  # in the worker thread
            if event[0] == "end" and job.sessions:  # the turn's clock, before the session is lent again
                event = (*event, replace(job.sessions[0].last_turn))
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the server is shutting down
                job.cancel()

        threading.Thread(target=self.api.work, args=(job, emit), daemon=True, name="h2o-ollama").start()
        first = await next_event(events, request, job)
        if first is None or first[0] == "done":  # the client left before a word
            record.error = "the client left before the first token"
            return Response(status_code=499)
        if first[0] == "error":
            record.error = first[1].message
            return error_response(first[1])
        reply = OllamaReply(job, name, chat, received, prompt_tokens=first[1], cached=first[2],
                            tokenizer=self.api.tokenizer, record=record)
        headers = {NOT_SAVED_HEADER: first[3]} if first[3] else {}
        if body.get("tools"):
            headers[TOOLS_IGNORED_HEADER] = (f"{len(body['tools'])} tools: this server answers without tools (the "
                                             "reply is text and never calls one)")
            record.note = f"tools ignored: {headers[TOOLS_IGNORED_HEADER]}"
        if not job.stream:
            return await reply.whole(events, request, headers)
        return StreamingResponse(reply.lines(events), media_type=NDJSON, headers=headers)


def loaded(name, chat):
    """Ollama's answer to a request with nothing to answer (its way of loading a model)."""
    out = {"model": name, "created_at": now_iso(), "done": True, "done_reason": "load"}
    return out | ({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})


def check_refused(body, messages=()):
    for field, sentence in REFUSED.items():
        if body.get(field) not in (None, "", [], {}, False):
            raise ApiError(400, sentence, field)
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("images"):
            raise ApiError(400, f"messages[{i}]: {REFUSED['images']}", "images")


def chat_message(message, index):
    """An Ollama message as /v1's reader takes it: role and content (thinking, tool_name and
    empty images dropped; tool_calls kept, for /v1's reader to judge)."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{index}] must be an object with role and content", "messages")
    return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}


def until_stop(num_predict):
    return num_predict is None or (isinstance(num_predict, int) and not isinstance(num_predict, bool)
                                   and num_predict <= 0)


def options_body(options, body, text=False):
    """options (and logprobs, top_logprobs) -> the /v1 body fields they stand for. num_predict
    absent or <= 0 leaves max_tokens out: until the model stops, as /v1 without max_tokens."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object (temperature, num_predict, ...)", "options")
    out = {OPTION_NAMES[k]: v for k, v in options.items() if k in OPTION_NAMES}
    num_predict = options.get("num_predict")
    if not until_stop(num_predict) and (isinstance(num_predict, bool) or not isinstance(num_predict, int)):
        raise ApiError(400, f"options.num_predict must be a whole number (-1: until the model stops), got "
                            f"{num_predict!r}", "num_predict")
    if not until_stop(num_predict):  # absent: until the model stops, at the machine's bound (serve.api.machine_bound)
        out["max_tokens"] = num_predict
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise ApiError(400, "logprobs must be true or false", "logprobs")
    if logprobs:  # chat's logprobs + top_logprobs; a text completion's logprobs: k
        out.update({"logprobs": top or 0} if text else {"logprobs": True, "top_logprobs": top or 0})
    return out


# /v1's names in the reader's sentences -> Ollama's
RENAMED = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def read_ollama(reader, openai_body, api):
    """The Job for the /v1 body `openai_body`, read by `reader`; its sentences in Ollama's names."""
    try:
        return reader(openai_body, api.cache_defaults)
    except ApiError as e:
        if e.param in (*OPTION_NAMES.values(), "max_tokens"):
            message = e.message
            for old, new in RENAMED.items():
                message = message.replace(old, new)
            raise ApiError(e.status, f"options.{message}", e.param) from None
        raise


@dataclass
class Served:
    """One reply's figures, measured in one place: what the final object reports (Ollama's
    nanoseconds) and what the request's log line says. Times are time.perf_counter() seconds."""

    prompt_tokens: int  # the whole prompt the reply was drawn after
    cached_tokens: int  # of those, the ones reused from the cache (not computed)
    new_tokens: int  # the reply's tokens
    finish: str  # "stop" or "length"
    received: float  # the request came in
    turn: object  # the session's TurnStats of the reply: start, first_at, end

    def usage(self):
        """The figures in OpenAI's usage shape: what the request's log line reads."""
        return shapes.usage(self.prompt_tokens, self.cached_tokens, self.new_tokens)

    def ollama(self):
        turn = self.turn
        return {"total_duration": ns(time.perf_counter() - self.received),
                "load_duration": ns(turn.start - self.received),  # waiting for a worker and a session
                "prompt_eval_count": self.prompt_tokens, "prompt_eval_cached_count": self.cached_tokens,
                "prompt_eval_duration": ns((turn.first_at or turn.end) - turn.start),
                "eval_count": self.new_tokens, "eval_duration": ns(turn.decode_s)}


class OllamaReply:
    """The worker's events for one request, as Ollama's objects: streamed lines or one object."""

    def __init__(self, job, name, chat, received, prompt_tokens, cached, tokenizer, record):
        self.job, self.name, self.chat, self.received, self.tokenizer = job, name, chat, received, tokenizer
        self.record = record  # the request's RequestLog: its usage and token times as they come
        self.prompt_tokens, self.cached = prompt_tokens, cached
        self.served = None

    def obj(self, text, done=False, entries=None):
        out = {"model": self.name, "created_at": now_iso()}
        out.update({"message": {"role": "assistant", "content": text}} if self.chat else {"response": text})
        out["done"] = done
        if entries is not None:
            out["logprobs"] = [self.logprob(e) for e in entries]
        return out

    def logprob(self, entry):
        """(token id, logprob, [(id, logprob)] * k) -> Ollama's {token, logprob, bytes, top_logprobs}."""
        token_id, logprob, top = entry
        return {**self.described(token_id, logprob), "top_logprobs": [self.described(i, lp) for i, lp in top]}

    def described(self, token_id, logprob):
        token = self.tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def end(self, event):
        _, _, finish, tokens, _, turn = event
        self.served = Served(self.prompt_tokens, self.cached, tokens, finish, self.received, turn)
        self.record.usage = self.served.usage()

    def final(self, text, entries=None):
        return {**self.obj(text, True, entries), "done_reason": self.served.finish, **self.served.ollama()}

    async def whole(self, events, request, headers):
        text, entries = [], [] if self.job.top_logprobs is not None else None
        while True:
            event = await next_event(events, request, self.job)
            if event is None:
                self.record.error = "the client left before the answer"
                return Response(status_code=499)
            if event[0] == "text":
                self.record.token()
                text.append(event[2])
                if entries is not None and event[3]:
                    entries += event[3]
            elif event[0] == "end":
                self.end(event)
            elif event[0] == "error":
                self.record.error = event[1].message
                return error_response(event[1])
            elif event[0] == "done":
                return JSONResponse(self.final("".join(text), entries), headers=headers)

    async def lines(self, events):
        """One JSON object a line: a piece each, then the final one with the figures."""
        try:
            while True:
                event = await events.get()
                if event[0] == "text" and (event[2] or event[3]):
                    self.record.token()
                    yield json.dumps(self.obj(event[2], entries=event[3]), ensure_ascii=False) + "\n"
                elif event[0] == "end":
                    self.end(event)
                elif event[0] == "error":  # Ollama's clients read an error line as the request's failure
                    self.record.error = event[1].message
                    yield json.dumps({"error": event[1].message}, ensure_ascii=False) + "\n"
                    break
                elif event[0] == "done":
                    final = self.final("", [] if self.job.top_logprobs is not None else None)
                    yield json.dumps(final, ensure_ascii=False) + "\n"
                    break
        finally:  # a client that disconnects lands here too (the stream is cancelled): stop its reply
            self.job.cancel()


# --- what the listings say of the model ----------------------------------------------------------

def describe(model, model_id):
    """(details, size, digest, model_info) of `model`, from what it is: its config, its weights
    as loaded (size: their bytes in memory), its parameter count. The digest is a sha256 of the
    id, config and weight layout (a label that changes when the model does), not of its files."""
    config = model.config.get_text_config(decoder=True)
    arch = config.model_type
    count = parameter_count(model)
    label = weights_label(model)
    source = str(getattr(model, "name_or_path", "") or "")
    gguf = "GGUF" in (label or "") or source.endswith(".gguf")
    details = {"parent_model": "", "format": "gguf" if gguf else "safetensors", "family": arch, "families": [arch],
               "parameter_size": human_count(count), "quantization_level": label}
    size = weight_bytes(model)
    digest = hashlib.sha256("\n".join((model_id, config.to_json_string(), label or "", str(size))).encode()).hexdigest()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    info = {"general.architecture": arch, "general.parameter_count": count,
            f"{arch}.context_length": config.max_position_embeddings, f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_hidden_layers, f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_attention_heads,
            f"{arch}.attention.head_count_kv": config.num_key_value_heads, f"{arch}.attention.key_length": head_dim,
            f"{arch}.attention.value_length": head_dim, f"{arch}.vocab_size": config.vocab_size}
    return details, size, digest, info


def parameter_count(model):
    """Weights as the model's shapes count them (a packed int4 layer holds in x out of them, not
    its packed bytes), tied weights once."""
    seen, count = set(), 0
    for module in model.modules():
        in_f, out_f = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(in_f, int) and isinstance(out_f, int):
            weight = getattr(module, "weight", None)
            if weight is None or id(weight) not in seen:
                count += in_f * out_f
                seen.add(id(weight))
            bias = getattr(module, "bias", None)
            count += bias.numel() if bias is not None else 0
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
    return count


def weight_bytes(model):
    """Bytes of the model's parameters and buffers as they sit in memory, shared storage once."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def human_count(n):
    """Ollama's parameter_size: "8.0B", "135M", "412K"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if unit == "B" else f"{n / scale:.0f}{unit}"
    return str(n)


def modified_at(model):
    """When the model's files were last written (its folder or file), or None when it has none here."""
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    try:
        stamp = path.stat().st_mtime if str(path) not in ("", ".") else None
    except OSError:
        return None
    return None if stamp is None else datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")
