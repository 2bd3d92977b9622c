"""Function tools: whether a model's chat template shows them, and the model's calls read back
out of the text it writes.

    renders_tools(tokenizer) -> bool     the template shows a probe tool (rendered with and without it)
    call_prefix(tokenizer, name=None)    the start of a call in the template's own format (to force one)
    ToolCalls(names, prefix="")          a reply's text in, as it streams; its content and its calls out
      .feed(piece) -> (content, [call])  .finish() -> (content, [call])
    parse_calls(text, names) -> (content, [call])        the same for a whole text
    KnownCalls                           the text each call was read from, to render it back as written

A call is OpenAI's {"id", "type": "function", "function": {"name", "arguments": JSON text}}.
The formats the common templates' models write:

    Hermes, Qwen2.5/3   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (any number, text around)
    Llama 3.1/3.2       {"name": ..., "parameters": {...}}                        (the whole reply)

A call must name one of the request's tools; anything that is not a well-formed call stays text.
"""

import json
import threading
import uuid

from jinja2 import TemplateError

from .template import json_or_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PROBE_NAME = "h2o_probe_tool"
PROBE = [{"type": "function", "function": {"name": PROBE_NAME, "description": "a probe",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _apply(tokenizer, tools):
    chat = [{"role": "user", "content": "hi"}]
    return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)


def renders_tools(tokenizer):
    """True when the chat template shows the tools it is given (a probe tool's name appears in
    the rendering with it, and the rendering differs from the one without)."""
    try:
        with_probe, without = _apply(tokenizer, PROBE), _apply(tokenizer, None)
    except (TemplateError, TypeError, ValueError):
        return False
    return PROBE_NAME in with_probe and with_probe != without


def call_prefix(tokenizer, name=None):
    """The opening of a call, in the format the template asks for: a reply that starts with it
    can only go on as a call (of `name`, when given). Hermes' tags where the template writes
    them, else Llama's JSON."""
    hermes = OPEN in _apply(tokenizer, PROBE)
    if name is None:
        return OPEN + '\n{"name": "' if hermes else '{"name": "'
    named = json.dumps(name, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {named}, "arguments": ' if hermes else f'{{"name": {named}, "parameters": '


def new_call(name, arguments):
    """OpenAI's shape of one call; arguments: an object (or text, kept as it is)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def read_call(text, names):
    """A call from the JSON object `text` ({"name", "arguments" | "parameters"}), or None."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, (dict, str)):
        return None
    return new_call(obj["name"], arguments)


class ToolCalls:
    """One reply's text, split as it streams into content (handed out at once) and calls (each
    handed out when whole). names: the tools the request offered. prefix: text the reply was
    made to start with (call_prefix), read first and never handed out as content unless it
    turns out not to be a call.

    Held back: from an opening tag (or a tail that could become one) to its closing tag; a
    reply whose first visible character is "{" (Llama's JSON) until it ends; whitespace until
    what follows it is known (whitespace around calls is dropped)."""

    def __init__(self, names, prefix=""):
        self.names = set(names)
        self.pending = prefix  # text not handed out yet
        self.started = False  # something besides whitespace has come (text or a call)
        self.whole_reply = False  # the reply began with "{": it is read once it ends
        self.after_call = False  # the next content follows a call: its leading whitespace goes
        self.calls = []  # every call handed out

    def feed(self, piece):
        self.pending += piece
        return self._take(final=False)

    def finish(self):
        return self._take(final=True)

    def _take(self, final):
        content, calls = "", []
        while True:
            if not self.started:
                visible = self.pending.lstrip()
                if not visible and not final:
                    break
                self.started = bool(visible)
                self.whole_reply = visible.startswith("{")
            if self.whole_reply:
                if final:
                    call = read_call(self.pending.strip(), self.names)
                    calls += [call] if call else []
                    self.calls += calls
                    content += "" if call else self.pending
                    self.pending = ""
                break
            start = self.pending.find(OPEN)
            if start < 0:  # text: all of it but what could begin a tag, and whitespace that waits
                end = len(self.pending) if final else len(self.pending) - _tag_tail(self.pending)
                text = self.pending[:end] if final else self.pending[:end].rstrip()
                content += self._shown(text, final)
                self.pending = "" if final else self.pending[len(text):]
                break
            content += self._shown(self.pending[:start].rstrip(), final=False)  # whitespace before a call goes
            self.pending = self.pending[start:]
            end = self.pending.find(CLOSE)
            if end < 0 and not final:
                break
            stop = len(self.pending) if end < 0 else end + len(CLOSE)
            call = read_call(self.pending[len(OPEN): end if end >= 0 else None].strip(), self.names)
            if call is None:  # not a call after all: the tag and what it holds are text
                content += self.pending[:stop]
                self.after_call = False
            else:
                calls.append(call)
                self.calls.append(call)
                self.after_call = True
            self.pending = self.pending[stop:]
        return content, calls

    def _shown(self, text, final):
        """Text handed out as content: without leading whitespace right after a call, and
        nothing for whitespace that ends a reply with calls."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if final and self.calls and not text.strip():
            return ""
        return text


def _tag_tail(text):
    """How many characters at the end of `text` could begin the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_calls(text, names, prefix=""):
    """(content, [call]) of a whole reply: what ToolCalls hands out for it."""
    reader = ToolCalls(names, prefix)
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    return content + rest, calls + more


class KnownCalls:
    """The text each call the server handed out was read from, by the call's id: a client that
    sends the call back (an assistant message with tool_calls) gets the reply rendered as the
    model wrote it, so the cache, which holds those tokens, is reused past it."""

    def __init__(self, keep=4096):
        self.keep, self.texts = keep, {}  # call id -> (the reply's text, the names it could call)
        self._lock = threading.Lock()  # replies remember from their workers, requests ask from the server's loop

    def remember(self, calls, text, names):
        with self._lock:
            for call in calls:
                self.texts[call["id"]] = (text, frozenset(names))
            while len(self.texts) > self.keep:
                self.texts.pop(next(iter(self.texts)))

    def text_of(self, calls):
        """The reply text `calls` (OpenAI's shape) were read from, when it holds exactly them
        (the same names and arguments, in order); else None."""
        with self._lock:
            found = {self.texts.get(c.get("id")) for c in calls}
        if len(found) != 1 or None in found:
            return None
        text, names = found.pop()
        _, read = parse_calls(text, names)
        same = [(c["function"]["name"], json_or_text(c["function"]["arguments"])) for c in read] == \
            [(c["function"]["name"], json_or_text(c["function"]["arguments"])) for c in calls]
        return text if same else None


