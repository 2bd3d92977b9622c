"""Reading a request body into a Job: every check of a body is made here, before any work, and
anything the server cannot do is a 400 (`ApiError`) naming it.

Three shapes: OpenAI's chat completion (`read_chat_request`), its text completion
(`read_text_request`) and llama.cpp's native `/completion` (`read_native_request`: its own field
names). Each body field is one of

    honoured   read below (sampling fields go to chat.conversation.Sampling, which checks them)
    ignored    IGNORED: accepted and without effect (bookkeeping, or settings that H2O makes moot)
    refused    REFUSED: a 400 naming it, unless it holds its default (SillyTavern sends them all,
               at their defaults, with every request)

and any other field is ignored. The README's field table lists the same names.
"""

import json
import math
import threading
from dataclasses import asdict, dataclass, field

from fastapi.responses import JSONResponse

from ..cache.config import APP_FIELDS, SettingError
from ..chat.conversation import Sampling, cache_config, check_tools
from ..chat.session import check_text

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: a legacy tool result
MAX_CHOICES = 8  # n: rows of one batch
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's and SillyTavern's "random" (llama.cpp reports -1 as 4294967295)
UNLIMITED_PREDICT = (-1, -2)  # llama.cpp's n_predict "until the end of the turn" (-2: "until the context is full")

# Fields whose effect we do not implement: refused unless they hold this default (a value, or a
# set of values that mean "off"). Empty strings, lists and objects count as their default too.
REFUSED = {
    "response_format": ({"type": "text"},), "json_schema": None, "grammar": None, "grammar_string": None,
    "guided_json": None, "guided_grammar": None, "echo": (False,), "suffix": None, "best_of": (1,),
    "mirostat": (0,), "mirostat_mode": (0,), "dry_multiplier": (0,), "xtc_probability": (0,), "top_a": (0,),
    "tfs": (1,), "tfs_z": (1,), "smoothing_factor": (0,), "skew": (0,), "dynatemp_range": (0,),
    "dynamic_temperature": (False,), "epsilon_cutoff": (0,), "eta_cutoff": (0,), "penalty_alpha": (0,),
    "num_beams": (1,), "no_repeat_ngram_size": (0,), "encoder_repetition_penalty": (1,), "guidance_scale": (1,),
    "negative_prompt": None, "min_tokens": (0,), "min_length": (0,), "banned_tokens": None,
    "custom_token_bans": None, "banned_strings": None, "audio": None, "n_cmpl": (1,),
}
# Fields accepted without effect, and why: bookkeeping, or what H2O makes moot (no context to
# truncate, every prompt reused), or our fixed sampler order (see chat/sampler.py).
IGNORED = (
    "model_name user metadata store service_tier modalities reasoning_effort prediction "
    "user_name char_name api_type api_server legacy_api chat_completion_source custom_url custom_include_body "
    "custom_exclude_body custom_include_headers custom_prompt_post_processing "
    "add_bos_token skip_special_tokens spaces_between_special_tokens truncation_length num_ctx max_tokens_second "
    "cache_prompt id_slot n_keep n_discard min_keep n_indent t_max_predict_ms return_tokens timings_per_token "
    "return_progress post_sampling_probs response_fields samplers sampler_order sampler_priority temperature_last "
    "repeat_last_n rep_pen_range repetition_penalty_range rep_pen_slope repetition_decay rep_pen_decay "
    "dry_base dry_allowed_length dry_sequence_breakers dry_penalty_last_n mirostat_tau mirostat_eta "
    "dynatemp_low dynatemp_high dynatemp_exponent min_temp max_temp smoothing_curve xtc_threshold "
    "length_penalty early_stopping speculative_ngram sampler_seed include_reasoning stopping_strings rep_pen "
    "num_predict"
).split()


class ApiError(Exception):
    """An error the client caused (or 5xx): answered in OpenAI's JSON error shape."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self):
        if self.status >= 500:
            return "server_error"
        return {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self):
        return JSONResponse(self.body(), status_code=self.status)


@dataclass
class Job:
    """One request, as the worker threads run it."""

    kind: str  # "chat", "text" (OpenAI's completions) or "native" (llama.cpp's /completion)
    system_prompt: str | None
    messages: list  # [{"role", "content", "pinned", "tool_calls"?, "tool_call_id"?}]: the last one is answered
    sampling: dict  # Sampling's fields; max_new_tokens None: until the model stops (the machine's bound)
    cache: dict
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices, drawn as rows of one batch
    top_logprobs: int | None = None  # None: no logprobs; k: the drawn token's and the k likeliest
    continue_final: bool = False  # a final assistant message is written on (else it is answered)
    ignore_eos: bool = False  # the end-of-turn tokens are never drawn (llama.cpp's ignore_eos, ban_eos_token)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sessions: list = field(default_factory=list)
    client: str | None = None  # who sent it (client_name), for the page's list of live conversations
    tools: list | None = None  # OpenAI's function tools, for the template to show (None: none, or "none" chosen)
    forced_tool: str | None = None  # tool_choice "required" (""), or the name of the function it must call
    parallel_tool_calls: bool = True  # False: at most one call is handed back
    legacy_functions: bool = False  # asked with `functions`: answered with message.function_call
    tools_ignored: str | None = None  # why the tools given were not shown to the model (X-H2O-Tools-Ignored)
    tool_prefix: str = ""  # the opening of a call the reply was made to start with (a call asked for)

    def cancel(self):
        """The client has gone: stop now (safe from any thread, at any point of the job)."""
        self.cancelled.set()
        for session in list(self.sessions):
            session.stop()


# --- messages -----------------------------------------------------------------------------------

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


def _checked(text, where, empty_ok=False, param="messages"):
    try:
        return check_text(text, where, empty_ok=empty_ok)
    except ValueError as e:
        raise ApiError(400, str(e), param) from None


def read_messages(messages):
    """(system_prompt, [{"role", "content", "pinned", "tool_calls"?, "tool_call_id"?}], n_leading):
    the leading system (or developer) messages make the system prompt; every other message keeps
    its place, a later system message too (SillyTavern's author's note, continue nudge,
    impersonation prompt). An assistant's tool calls (legacy: function_call) and a tool's result
    (legacy: role "function") are kept for the template."""
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
        if content is None and role in ("assistant", "tool", "function"):
            content = ""
        text = _text_of(content, where)
        role = {"developer": "system", "function": "tool"}.get(role, role)
        if role == "system" and not chat:
            system.append(_checked(text, f"{where} (system)", empty_ok=True))
            continue
        message = {"role": role, "content": _checked(text, where, empty_ok=role != "user"), "pinned": False}
        calls = _read_calls(m, where) if role == "assistant" else None
        if calls:
            message["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ApiError(400, f"{where}: tool_call_id must be text", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        chat.append(message)
    if not any(m["role"] == "user" for m in chat):
        raise ApiError(400, "messages hold no user message", "messages")
    system_prompt = "\n\n".join(s for s in system if s.strip()) or None
    if system_prompt is not None:
        _checked(system_prompt, "the system prompt", empty_ok=True)
    return system_prompt, chat, len(system)


def _read_calls(message, where):
    """An assistant message's tool calls in OpenAI's shape (arguments as JSON text), from its
    tool_calls or its legacy function_call; [] when it has none."""
    calls = message.get("tool_calls")
    if calls in (None, []) and isinstance(message.get("function_call"), dict):
        calls = [{"id": None, "type": "function", "function": message["function_call"]}]
    if calls in (None, []):
        return []
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}: tool_calls must be a list of calls", "messages")
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}: each tool call needs a function with a name", "messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        read.append({"id": call.get("id"), "type": "function",
                     "function": {"name": function["name"], "arguments": arguments}})
    return read


def read_tools(body):
    """(tools or None, forced, parallel, legacy) from tools / tool_choice / parallel_tool_calls,
    or the legacy functions / function_call (read the same way). forced: None (the model
    chooses), "" (tool_choice "required": some call) or the name of the function it must call.
    tool_choice "none": no tools at all (the template is not shown them)."""
    legacy = body.get("tools") in (None, []) and body.get("functions") not in (None, [])
    if legacy:
        functions = body["functions"]
        if not isinstance(functions, list):
            raise ApiError(400, "functions must be a list of functions", "functions")
        tools, choice, param = [{"type": "function", "function": f} for f in functions], body.get("function_call"), \
            "function_call"
    else:
        tools, choice, param = body.get("tools"), body.get("tool_choice"), "tool_choice"
    try:
        tools = check_tools(tools or None)
    except ValueError as e:
        raise ApiError(400, str(e), "functions" if legacy else "tools") from None
    names = [t["function"]["name"] for t in tools or []]
    forced = None
    if choice == "none":
        tools = None
    elif choice == "required":
        forced = ""
    elif isinstance(choice, dict):
        forced = (choice.get("function") or {}).get("name") if not legacy else choice.get("name")
        if not isinstance(forced, str) or forced not in names:
            raise ApiError(400, f"{param} names a function the request does not offer ({choice!r}); the tools are "
                                f"{', '.join(names) or 'none'}", param)
    elif choice not in (None, "auto"):
        raise ApiError(400, f"{param} must be \"none\", \"auto\", \"required\" or a function, got {choice!r}", param)
    if forced is not None and not tools:
        raise ApiError(400, f"{param} asks for a call, and the request offers no tools", param)
    return tools, forced, body.get("parallel_tool_calls") is not False, legacy


# --- sampling -----------------------------------------------------------------------------------

def _is_default(value, default):
    return value is None or value in ("", [], {}) or (default is not None and value in default)


def check_refused(body):
    """A 400 naming the first field whose effect this server does not implement, unless it holds its default."""
    for name, default in REFUSED.items():
        if name == "best_of" and body.get("best_of") == body.get("n"):  # vLLM's clients send best_of = n
            continue
        if name in body and not _is_default(body[name], default):
            raise ApiError(400, f"{name} is not supported by this server (got {body[name]!r}); leave it out or "
                                "at its default", name)


def _number(body, name, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and
                                                                         not math.isfinite(value)):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    return value


def read_logit_bias(value):
    """OpenAI's {"id": bias} or llama.cpp's [[id, bias]] ([id, false] bans it) -> ((id, bias), ...)."""
    if value in (None, {}, []):
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(i, -100 if b is False else b) for i, b in value]
    else:
        raise ApiError(400, "logit_bias must map token ids to biases ({\"id\": bias} or [[id, bias]])", "logit_bias")
    for token, _ in pairs:
        if isinstance(token, str) and not token.strip().isdigit():
            raise ApiError(400, f"logit_bias: {token!r} is not a token id (use /tokenize to find ids)", "logit_bias")
    return pairs


def read_sampling(body, names=None):
    """Sampling fields -> all of Sampling's (what a request leaves out is Sampling's default, never
    what the session's previous request said), checked by Sampling; no max_tokens is
    max_new_tokens None (until the model stops). names: the body's name for each Sampling field
    where it differs (llama.cpp's repeat_penalty, n_predict)."""
    names = names or {}
    check_refused(body)
    sampling = asdict(Sampling())
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seed"):
        given = names.get(name, name)
        if body.get(given) is not None:
            sampling[name] = body[given]
    if body.get("typical") is not None and body.get("typical_p") is None:  # SillyTavern sends both names
        sampling["typical_p"] = body["typical"]
    if sampling["seed"] in RANDOM_SEEDS:
        sampling["seed"] = None
    if body.get("do_sample") is False:  # text-generation-webui's greedy
        sampling["temperature"] = 0
    max_tokens = body.get(names.get("max_new_tokens", "max_completion_tokens"))
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    sampling["stop"] = () if stop is None else stop
    sampling["logit_bias"] = read_logit_bias(body.get("logit_bias"))
    try:
        checked = asdict(Sampling(**sampling))  # as Sampling reads them: a stop string becomes a tuple of one
        if max_tokens is None:  # until the model stops, as OpenAI and llama.cpp: the machine's bound, at reply time
            checked["max_new_tokens"] = None
        return checked
    except (TypeError, ValueError) as e:
        field = (e.name if isinstance(e, SettingError) else str(e).split(" ")[0]).split("[")[0]
        name = names.get(field) or {"max_new_tokens": "max_tokens"}.get(field, field)  # the body's own name
        said = f"{e.name.replace(field, name, 1)} {e.rule}" if isinstance(e, SettingError) else str(e)
        raise ApiError(400, said.replace("max_new_tokens", "max_tokens"), name) from None


def read_choices(body):
    n = _number(body, "n", 1)
    if not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be a whole number from 1 to {MAX_CHOICES}, got {n!r}", "n")
    return n


def read_top_logprobs(body, kind):
    """None (no logprobs) or how many alternatives: chat's logprobs: true + top_logprobs: k,
    completions' logprobs: k, llama.cpp's n_probs: k."""
    if kind == "chat":
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            if isinstance(wanted, int) and not isinstance(wanted, bool):  # SillyTavern's text-completion habit
                wanted, body = True, {**body, "top_logprobs": wanted}
            else:
                raise ApiError(400, "logprobs must be true or false", "logprobs")
        k = _number(body, "top_logprobs", 0)
        if not wanted:
            return None
        name = "top_logprobs"
    else:
        name = "n_probs" if kind == "native" else "logprobs"
        k = _number(body, name, None)
        if k is None or k is False or (kind == "native" and k == 0):
            return None
    if not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {k!r}", name)
    return k


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
    except SettingError as e:
        raise ApiError(400, f"h2o.{e.name} {e.rule}", "h2o") from None
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
            raise ApiError(400, f"h2o.pinned: message {i} is part of the system prompt; only the messages after "
                                "it can be pinned", "h2o")
        turns.append(i - n_system)
    return cache, turns


def stream_flags(body):
    options = body.get("stream_options") or {}
    return bool(body.get("stream")), bool(isinstance(options, dict) and options.get("include_usage"))


# --- the three shapes ---------------------------------------------------------------------------

def read_chat_request(body, cache_defaults):
    """A /v1/chat/completions body (a dict) -> the Job that answers it; ApiError (400) saying what
    is wrong with anything it cannot run. A final assistant message is written on (prefill, as
    llama.cpp's server and Ollama do) unless continue_final_message is false or
    add_generation_prompt true (then it is answered as a finished turn, as OpenAI does)."""
    system_prompt, messages, n_system = read_messages(body.get("messages"))
    sampling = read_sampling(body)
    cache, pinned = read_cache(body, cache_defaults, n_system, len(messages))
    for turn in pinned:
        messages[turn]["pinned"] = True
    tools, forced, parallel, legacy = read_tools(body)
    asked = body.get("continue_final_message")
    continue_final = asked if isinstance(asked, bool) else body.get("add_generation_prompt") is not True
    last = messages[-1]
    return Job("chat", system_prompt, messages, sampling, cache, *stream_flags(body), n=read_choices(body),
               top_logprobs=read_top_logprobs(body, "chat"), ignore_eos=ignores_eos(body),
               continue_final=continue_final and last["role"] == "assistant" and not last.get("tool_calls"),
               tools=tools, forced_tool=forced, parallel_tool_calls=parallel, legacy_functions=legacy)


def ignores_eos(body):
    return body.get("ignore_eos") is True or body.get("ban_eos_token") is True


def _prompt(body):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be one string (token id lists are not supported)", "prompt")
    return _checked(prompt, "the prompt", param="prompt")


def read_text_request(body, cache_defaults):
    """A /v1/completions body (a dict) -> the Job that answers it (the prompt, continued as
    written); ApiError (400) otherwise."""
    prompt = _prompt(body)
    sampling = read_sampling(body)
    cache, _ = read_cache(body, cache_defaults, 0, 0)
    return Job("text", None, [{"role": "user", "content": prompt, "pinned": False}], sampling, cache,
               *stream_flags(body), n=read_choices(body), top_logprobs=read_top_logprobs(body, "text"),
               ignore_eos=ignores_eos(body))


LLAMACPP_NAMES = {"repetition_penalty": "repeat_penalty", "max_new_tokens": "n_predict"}


def read_native_request(body, cache_defaults):
    """llama.cpp's POST /completion body -> a Job: its field names (n_predict, repeat_penalty,
    n_probs, ignore_eos), its defaults where they differ from OpenAI's, one prompt string."""
    prompt = _prompt(body)
    body = dict(body)
    if body.get("n_predict") in UNLIMITED_PREDICT:
        body["n_predict"] = None  # until the model stops (the machine's bound)
    if body.get("repeat_penalty") is None and body.get("repetition_penalty") is not None:
        body["repeat_penalty"] = body["repetition_penalty"]
    sampling = read_sampling(body, LLAMACPP_NAMES)
    cache, _ = read_cache(body, cache_defaults, 0, 0)
    return Job("native", None, [{"role": "user", "content": prompt, "pinned": False}], sampling, cache,
               bool(body.get("stream")), False, top_logprobs=read_top_logprobs(body, "native"),
               ignore_eos=ignores_eos(body))
