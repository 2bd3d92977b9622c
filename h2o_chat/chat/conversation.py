"""Conversation: plain data, and the one thing that is saved.

    Conversation(id, title, created, updated, revision, messages, settings, forked_from, tools)
      messages: [Message(role "user" | "assistant" | "system" | "tool", content, pinned, tool_calls, tool_call_id)]
      tools: OpenAI's function tools the chat template shows the model (None: none)
      settings: Settings(cache: CacheConfig, sampling: Sampling, system_prompt: str | None)

Every setting is declared once, here (Sampling) or in cache.config.CacheConfig, with its default,
bounds and help; everything else (ChatSession, the page, the API, the saved file) reads it from
there. `CHOICES` are the values of the cache settings that are a choice.

`record()` / `Conversation.from_record()` are the JSON round trip (the file layout, format 2):

    {"version": 2, "id", "title", "created", "updated", "revision", "forked_from",
     "system_prompt", "system_prompt_pinned", "cache": {CacheConfig fields}, "sampling": {Sampling fields},
     "messages": [{"role", "content", "pinned", "tool_calls"?, "tool_call_id"?}], "tools"?}

(the keys marked ? only where they hold something: a chat without tools is saved as before).

Format 1 (before revisions) is the same without title/created/revision/forked_from and loads
with revision 0. `revision` counts the writes the file has seen: a writer must hold the
revision on disk to write (store.write), so two sessions never overwrite each other's turns.
"""

import time
import uuid
from dataclasses import asdict, dataclass, field, fields

from ..cache.config import CacheConfig, check_fields, check_number, nearest_allowed, setting

# a system message after the first turn: a frontend's note; "tool": a tool's result (an API client's)
ROLES = ("user", "assistant", "system", "tool")
CHOICES = {f.name: f.metadata["choices"] for f in fields(CacheConfig) if f.metadata.get("choices")}
TITLE_WORDS = 8


@dataclass
class Sampling:
    """How replies are drawn: the one declaration of every sampling setting (see cache.config.setting)."""

    temperature: float = setting(0.7, "randomness of replies (0 = greedy)", label="Temperature",
                                 low=0, high=5)
    top_p: float = setting(0.9, "draw from the likeliest tokens that together reach this probability (0 = greedy)",
                           label="Top-p", low=0, high=1)
    top_k: int = setting(0, "draw from the k likeliest tokens (0 = all)", label="Top-k", low=0, integer=True)
    repetition_penalty: float = setting(1.0, "divides the logits of tokens already seen (1 = off)",
                                        label="Repetition penalty", low=0, low_open=True)
    frequency_penalty: float = setting(0.0, "subtracts this times the count of each token the reply has drawn "
                                       "(OpenAI's formula; 0 = off)", label="Frequency penalty", low=-2, high=2)
    presence_penalty: float = setting(0.0, "subtracts this from every token the reply has drawn (OpenAI's formula; "
                                      "0 = off)", label="Presence penalty", low=-2, high=2)
    min_p: float = setting(0.0, "drop tokens less likely than this times the likeliest one (0 = off)", label="Min-p",
                           low=0, high=1)
    typical_p: float = setting(1.0, "locally typical sampling: the tokens closest to the expected surprise that "
                               "together reach this probability (1 = off)", label="Typical-p", low=0, high=1,
                               low_open=True)
    max_new_tokens: int = setting(256, "the longest a reply may run, in tokens", label="Max new tokens",
                                  low=1, integer=True)
    seed: int | None = setting(None, "a fixed seed draws the same reply every time (None: random)", label="Seed",
                               low=0, high=2**63 - 1, integer=True)
    stop: tuple = ()  # extra stop strings
    logit_bias: tuple = ()  # ((token id, bias), ...): added to the logits before sampling; -100 bans the token

    def __post_init__(self):
        check_fields(self)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = tuple(stop)
        self.logit_bias = check_logit_bias(self.logit_bias)


BIAS_LIMIT = 100  # OpenAI's bounds; a bias of -100 bans the token outright (sampler.py)


def check_logit_bias(pairs):
    """((token id, bias), ...) sorted by id, from pairs or OpenAI's {"id": bias} map; ValueError otherwise."""
    if isinstance(pairs, dict):
        pairs = list(pairs.items())
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ValueError(f"logit_bias must map token ids to biases, got {pairs!r}")
    checked = {}
    for token, bias in pairs:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        token = check_number("logit_bias token id", token, low=0, integer=True)
        checked[token] = float(check_number(f"logit_bias[{token}]", bias, low=-BIAS_LIMIT, high=BIAS_LIMIT))
    return tuple(sorted(checked.items()))


def sampling(values=None, base=None):
    """A Sampling from a dict of its fields over `base` (the defaults when None); a misspelt
    field is a ValueError that names it, not a TypeError."""
    values = values or {}
    unknown = sorted(set(values) - set(Sampling.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}; the sampling settings are "
                         f"{', '.join(Sampling.__dataclass_fields__)}")
    return Sampling(**{**asdict(base or Sampling()), **values})


def cache_config(cache):
    """A CacheConfig from a CacheConfig, a dict of its fields or None; ValueError otherwise."""
    if isinstance(cache, CacheConfig):
        return cache
    if cache is None:
        cache = {}
    if not isinstance(cache, dict):
        raise ValueError(f"cache settings must be a dict of CacheConfig fields, got {type(cache).__name__}")
    unknown = sorted(set(cache) - set(CacheConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown cache setting {unknown[0]!r}; the settings are "
                         f"{', '.join(CacheConfig.__dataclass_fields__)}")
    return CacheConfig(**cache)


@dataclass
class Settings:
    """Everything a conversation runs with. system_prompt None means none."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: Sampling = field(default_factory=Sampling)
    system_prompt: str | None = None
    system_prompt_pinned: bool = False  # never evicted: the system prompt, given or the template's own

    def record(self):
        return {"system_prompt": self.system_prompt, "system_prompt_pinned": self.system_prompt_pinned,
                "cache": asdict(self.cache), "sampling": asdict(self.sampling)}

    @classmethod
    def from_record(cls, record):
        """(Settings, [changes]) from a saved file's fields. A file written by an older version or
        by hand may hold settings this version refuses: each becomes the nearest allowed
        (cache.config.nearest_allowed), and the changes say which, so the conversation still
        opens. Sampling fields this version does not know are dropped (a newer file may add some)."""
        saved_cache, saved_sampling = record.get("cache"), record.get("sampling")
        changes = [f"the {name} settings were unreadable ({value!r}): the defaults" for name, value in
                   (("cache", saved_cache), ("sampling", saved_sampling)) if value is not None and
                   not isinstance(value, dict)]
        saved_cache = saved_cache if isinstance(saved_cache, dict) else {}
        saved_sampling = {k: v for k, v in (saved_sampling if isinstance(saved_sampling, dict) else {}).items()
                          if k in Sampling.__dataclass_fields__}
        cache, cache_changes = nearest_allowed(CacheConfig, saved_cache)
        sampled, sampling_changes = nearest_allowed(Sampling, saved_sampling)
        system_prompt = record.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError("the system prompt is not text")
        settings = cls(cache, sampled, system_prompt or None, record.get("system_prompt_pinned") is True)
        return settings, changes + cache_changes + sampling_changes


@dataclass
class Message:
    role: str
    content: str
    pinned: bool = False
    tool_calls: list | None = None  # an assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # a tool result: the call it answers

    @classmethod
    def of(cls, value):
        """A Message from a Message or a {"role", "content", "pinned"?, "tool_calls"?, "tool_call_id"?} dict."""
        if isinstance(value, Message):
            return value
        if not isinstance(value, dict) or value.get("role") not in ROLES or not isinstance(value.get("content"), str):
            raise ValueError(f"a message is a dict with a role ({' or '.join(ROLES)}) and text content, got {value!r}")
        calls, call_id = value.get("tool_calls") or None, value.get("tool_call_id")
        if calls is not None and not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
            raise ValueError(f"tool_calls must be a list of function calls with a name and arguments, got {calls!r}")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"tool_call_id must be text, got {call_id!r}")
        return cls(value["role"], value["content"], bool(value.get("pinned")), calls, call_id)

    def record(self):
        """As saved: the tool fields only where they hold something."""
        out = {"role": self.role, "content": self.content, "pinned": self.pinned}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _is_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        isinstance(function.get("arguments"), str)


def check_tools(tools):
    """None, or a list of OpenAI function tools ({"type": "function", "function": {"name", ...}});
    ValueError otherwise."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
        raise ValueError("tools must be a list of function tools, each {\"type\": \"function\", \"function\": "
                         "{\"name\": ..., \"parameters\": {...}}}")
    return tools or None


def new_id():
    return uuid.uuid4().hex[:12]


@dataclass
class Conversation:
    id: str = field(default_factory=new_id)
    messages: list = field(default_factory=list)  # [Message]
    settings: Settings = field(default_factory=Settings)
    title: str = ""  # "" until someone names it: the first words of the first message stand in
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    revision: int = 0  # the revision on disk this copy was read as (0: never saved)
    forked_from: str | None = None
    tools: list | None = None  # OpenAI's function tools, shown to the model by the chat template
    # sentences for the user about this copy (its saved settings could not be used as they were);
    # never saved, and no part of what two copies compare
    notices: list = field(default_factory=list, compare=False, repr=False)

    @property
    def display_title(self):
        if self.title:
            return self.title
        first = next((m.content for m in self.messages if m.role == "user"), "")
        words = first.split()
        return " ".join(words[:TITLE_WORDS]) + (" ..." if len(words) > TITLE_WORDS else "") or "New chat"

    def record(self):
        return {"id": self.id, "title": self.title, "created": self.created, "updated": self.updated,
                "revision": self.revision, "forked_from": self.forked_from, **self.settings.record(),
                "messages": [m.record() for m in self.messages], **({"tools": self.tools} if self.tools else {})}

    @classmethod
    def from_record(cls, record, conversation_id):
        """From a record store.load has checked (messages and system prompt are well formed);
        ValueError/TypeError for invalid settings."""
        updated = record.get("updated")
        updated = updated if isinstance(updated, (int, float)) and not isinstance(updated, bool) else 0.0
        created = record.get("created")
        created = created if isinstance(created, (int, float)) and not isinstance(created, bool) else updated
        revision = record.get("revision", 0)
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            raise ValueError(f"the revision must be a non-negative whole number, got {revision!r}")
        title, forked_from = record.get("title") or "", record.get("forked_from")
        settings, changes = Settings.from_record(record)
        conversation = cls(id=conversation_id, messages=[Message.of(m) for m in record["messages"]],
                           title=title if isinstance(title, str) else "", created=created, updated=updated,
                           revision=revision, forked_from=forked_from if isinstance(forked_from, str) else None,
                           tools=check_tools(record.get("tools")))
        conversation.use_settings(settings, changes)
        return conversation

    def use_settings(self, settings, changes=()):
        """Run on `settings`, the nearest allowed to what was saved; `changes` ("budget 0 -> 512")
        become a notice (they are saved with the next change)."""
        self.settings = settings
        if changes:
            self.notices.append("This conversation's saved settings could not run as they were, so the nearest "
                                f"allowed are used: {'; '.join(changes)} (saved with the next change).")

    def become_fork(self):
        """Turn this copy into a new conversation that has never been saved (new id, revision 0),
        in place: where a writer that lost a revision race keeps its text. Messages stay the
        same objects, so a reply streaming into one goes on streaming into the fork."""
        self.forked_from, self.id, self.revision = self.id, new_id(), 0
        self.title, self.created = f"{self.display_title} (copy)", time.time()
        return self

    def summary(self):
        return Summary(self.id, self.display_title, self.updated, len(self.messages))


@dataclass(frozen=True)
class Summary:
    """One line of the saved-conversations list. error: why the file cannot be opened (None when it can)."""

    id: str
    title: str
    updated: float
    n_messages: int
    error: str | None = None


def to_markdown(conversation):
    lines = [f"# {conversation.display_title}", ""]
    if conversation.settings.system_prompt:
        lines += [f"**system**: {conversation.settings.system_prompt}", ""]
    for m in conversation.messages:
        lines += [f"**{m.role}**{' (pinned)' if m.pinned else ''}:", "", m.content, ""]
    return "\n".join(lines)
