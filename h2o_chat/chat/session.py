"""ChatSession: the runtime of one Conversation.

The Conversation (conversation.py) is the one source of truth: messages with their pins,
settings, revision; it is what is saved. Everything else is derived and rebuilt from it by one
replay path, `Timeline.sync`: the H2OCache, the ledger of fed tokens, the snapshots. Before a
turn the session renders the conversation (render.py), and sync feeds only what the cache has
not seen, with the pinned ranges protected before their tokens are fed.

    ChatSession(model, tokenizer, cache=None, system_prompt=None, data_dir=None, session_id=None,
                batcher=None, compile="auto", **sampling)
                                                         a new conversation (Sampling fields); a shared
                                                         batch.Batcher decodes it in one batch with others;
                                                         compile: the compiled decode step (in the background)
    ChatSession.from_conversation(model, tokenizer, conversation, data_dir=None, on_progress=None, should_stop=None)
    ChatSession.open(model, tokenizer, conversation_id, data_dir, on_progress=None, should_stop=None)  (= restore)

    .conversation .id .messages .history .settings .cache_config .sampling .system_prompt
    .cache .ledger .stats .turn_stats .last_turn .busy .notices
    send(text, role="user") / continue_reply() / regenerate()   -> generator of text pieces
    undo(), edit(turn, text), pin(turn, pinned=True), configure(cache=None, system_prompt=..., **sampling),
    catch_up(),
    reset(), stop(), close(), autosave(), record(), to_markdown(), take_notices()

Calls check their input at once: a ValueError (with a sentence saying what is wrong) leaves
the session exactly as it was. send/continue_reply/regenerate do all their work lazily, inside
the generator they return: one that is never iterated changes nothing and leaves the session
free. Stop keeps what was streamed, and ends a long prefill within one chunk. Saving is compare-and-swap on the conversation's revision
(store.write): a session that lost the race to another one (a second tab on the same saved
conversation) saves its copy as a fork, switches to it and says so in `notices`, so nothing
either of them sent is lost. A data folder that cannot be written never fails a reply: the session
goes on unsaved, logs one line and says so in `notices` (and `save_error`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from ..cache.config import CacheConfig
from ..cache.h2o import PinRefused, pinned_slots, width_name
from ..models.compile import Compilation, step_compiler, step_kind
from . import saved_kv, store
from .conversation import CHOICES, Conversation, Message, Settings, cache_config, sampling, to_markdown  # noqa: F401
from .limits import Limits
from .reply import Reply
from .sampler import Sampler, stop_token_ids
from .template import MAX_REPLIES, SYSTEM, KnownTokens, render, template_ranges, turn_ranges
from .timeline import GenerationError, Timeline  # noqa: F401  (GenerationError: part of this module's API)

MAX_MESSAGE_CHARS = 100_000  # a paste beyond this is refused: prefill alone would take minutes on CPU
AUTOSAVE_EVERY_S = 2.0  # while a reply streams: a crash loses at most this much of it
_INVISIBLE = ("Cc", "Cf")  # control and format characters (zero-width space, BOM, direction marks)
MESSAGE_ROLES = ("user", "system", "assistant", "tool")  # what send() adds; a late system message is a frontend's note
log = logging.getLogger("h2o_chat")


def check_text(text, what="the message", empty_ok=False):
    """A message or system prompt: text (str), valid Unicode, at most MAX_MESSAGE_CHARS, and
    (unless empty_ok) something visible. Everything else is kept exactly as typed: emoji,
    right-to-left text, zero-width joiners, control characters and strings that look like
    special tokens or template code are all plain text."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be text, not {type(text).__name__}")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ValueError(f"{what} is too long ({len(text):,} characters; the limit is {MAX_MESSAGE_CHARS:,})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer or file can hold it
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {e.start})") from None
    if not empty_ok and all(c.isspace() or unicodedata.category(c) in _INVISIBLE for c in text):
        raise ValueError(f"{what} is empty")
    return text


def check_system_prompt(text):
    """None or text; a blank one means no system prompt."""
    if text is None:
        return None
    check_text(text, "the system prompt", empty_ok=True)
    return text if text.strip() else None


@dataclass
class TurnStats:
    """One reply's timing, live while it streams (the clock runs until `end` is set). finish:
    "stop" (end of turn, a stop string, Stop) or "length" (max_new_tokens), once it has ended;
    kept_tokens: the tokens whose text the reply kept (those drawn past a stop-string cut are not)."""

    start: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    end: float | None = None
    new_tokens: int = 0
    kept_tokens: int = 0
    finish: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    processed_before: int = 0  # the timeline's tokens_processed when the turn began
    prompt_tokens: int = 0  # tokens the reply was drawn after
    prompt_computed: int = 0  # of those, the ones this turn ran through the model (the rest were cached)

    @property
    def ttft_s(self):
        return (self.first_at or self.end or time.perf_counter()) - self.start

    @property
    def decode_s(self):
        return (self.end or time.perf_counter()) - self.first_at if self.first_at else 0.0


class ChatSession:
    """One conversation with a model whose KV cache is an `H2OCache`: each turn feeds only its own
    new tokens, replies stream as text, and every change (edit, undo, pin, settings) goes through
    one replay path, so the cache always holds exactly the chat template's rendering of the chat.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A LLaMA-family causal LM (see `load_model`); it maps ids `[batch, seq]` to logits
        `[batch, seq, vocab]`. The session runs it with batch 1 (or in the rows a `batcher` gives).
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer, with a chat template.
    cache : CacheConfig, dict or None, default None
        The cache settings (`CacheConfig` fields); None: CacheConfig's defaults.
    system_prompt : str or None, default None
        None or blank: no system prompt.
    data_dir : str, path or None, default None
        Where the conversation is autosaved (one JSON file) after every change; None: never saved.
    session_id : str or None, default None
        The conversation's id (1-64 letters, digits, '-' or '_'); None: a new random one.
    conversation : Conversation or None, default None
        An existing conversation to run (it is replayed); give it or the settings above, not both.
    on_progress : callable(done, total) or None, default None
        Called while a conversation is replayed into the cache, with tokens fed and to feed.
    batcher : batch.Batcher or None, default None
        Shared with other sessions: their decode steps run as one batched forward.
    should_stop : callable() -> bool, or None, default None
        Asked before each chunk of the replay of `conversation`: True ends it there (a Stop
        pressed while a restored conversation is read back); the next turn feeds the rest.
    lazy : bool, default False
        With `conversation`: fill the cache at the first turn instead of now.
    compile : {"auto", "on", "off"}, default "auto"
        The compiled decode step (models/compile.py, declared in `Compilation`): the session starts
        on the eager step and switches to the compiled one when a background thread has made it;
        "auto" compiles on a CUDA GPU only (on a CPU it stays eager, with one log line saying why),
        "on" on any device, "off" never. Anything it cannot compile stays eager, with one log line.
    **sampling_fields
        `Sampling` fields (temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed,
        stop); what is not given is Sampling's default.

    Raises
    ------
    ValueError
        A setting that is not valid (it names it), before anything is built.

    Notes
    -----
    What callers read: `history` (the transcript as role/content dicts), `messages`
    (`Message`s, with pins), `settings`, `cache_config`, `sampling`, `system_prompt`, `cache`
    (the `H2OCache`: per layer keys and values `[1, kv_heads, slots <= budget, head_dim]`),
    `ledger` (every token fed), `stats`, `busy`, `conversation` (what is saved).
    """

    def __init__(self, model, tokenizer, cache: CacheConfig | dict | None = None, system_prompt: str | None = None,
                 data_dir: str | os.PathLike | None = None, session_id: str | None = None,
                 conversation: Conversation | None = None, on_progress: Callable[[int, int], None] | None = None,
                 batcher=None, should_stop: Callable[[], bool] | None = None, lazy: bool = False,
                 compile: str = Compilation.compile, **sampling_fields):
        limits = Limits.of(model)
        if conversation is None:
            settings = Settings(cache_config(cache), sampling(sampling_fields), check_system_prompt(system_prompt))
            limits.check(settings)
            conversation = Conversation(settings=settings)
            if session_id is not None:
                conversation.id = store.check_id(session_id)
        elif cache is not None or system_prompt is not None or session_id is not None or sampling_fields:
            raise ValueError("give either a conversation or new settings, not both")
        else:  # a saved one opens whatever it asks: what this machine cannot run becomes the nearest it can
            conversation.use_settings(*limits.nearest(conversation.settings))
        self.model, self.tokenizer, self.data_dir = model, tokenizer, data_dir
        self.batcher = batcher  # batch.Batcher shared with other sessions, or None: the model runs here
        # the model's compiled decode step (models/compile.py: compiled in the background), or None
        self.compiler = step_compiler(model, compile, data_dir)
        self.conversation = conversation
        self.on_progress = on_progress  # callable(done, total) while the conversation is replayed
        # sentences for the user (settings that could not be used as saved, a save that became a
        # fork); take_notices() drains them
        self.notices, conversation.notices = conversation.notices, []
        self.save_error = None  # why the last save failed (a sentence without paths), None when it worked
        self.top_logprobs = None  # k: each reply token's logprob and the k likeliest, in token_logprobs
        self.reply_cap = None  # a reply's length when a request says it, instead of sampling's (never saved)
        self.last_turn = None  # no reply since the session was made (or opened): no timing to show
        self.turn_stats = []  # self.stats after every reply: what the panel's charts plot
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the two flags below against close() from another thread
        self._busy = False  # a reply is being prepared or streamed
        self._free_when_idle = False  # close() came while busy: free the cache when the reply ends
        self._stop_ids = stop_token_ids(model, tokenizer)
        # the replies as they were generated (a text completion's prompt: the last few texts fed)
        self._known = KnownTokens(tokenizer, template=self._template_text, keep=8 if self._template_text else MAX_REPLIES)
        self._segments_fed = []  # the last sync's segments (a continued reply's tokens so far)
        self._reply = None  # the reply streaming now, or the last one (reply.Reply)
        # the conversation's cache states saved beside it (saved_kv.py): what a sync starts from
        self.saved = saved_kv.States(data_dir, lambda: self.conversation, model, tokenizer) \
            if data_dir is not None and saved_kv.BUDGET.total_mib > 0 else None
        self._marks = []  # snapshots taken at a reply's start (what regenerate returns to), saved at its end
        self.timeline = self._sampler = None  # made by _rebuild, the one place that makes them
        self._rebuild(replay=bool(conversation.messages) and not lazy, should_stop=should_stop)

    @classmethod
    def from_conversation(cls, model, tokenizer, conversation: Conversation, data_dir=None, on_progress=None,
                          batcher=None, should_stop=None, lazy=False, compile=Compilation.compile) -> ChatSession:
        """The runtime of `conversation`: its cache state saved in `data_dir` is loaded when it
        belongs to this model and settings (only what the conversation has beyond it is fed),
        else it is replayed into a fresh cache (pinned messages protected before their tokens
        are fed, a notice saying why), calling `on_progress(done, total)` as it goes. lazy: fill
        the cache at the first turn instead (from the saved state that shares the most with it)."""
        return cls(model, tokenizer, conversation=conversation, data_dir=data_dir, on_progress=on_progress,
                   batcher=batcher, should_stop=should_stop, lazy=lazy, compile=compile)

    @classmethod
    def open(cls, model, tokenizer, conversation_id: str, data_dir: str | os.PathLike, on_progress=None,
             batcher=None, should_stop=None, lazy=False, compile=Compilation.compile) -> ChatSession:
        """A saved conversation, its cache loaded from the state saved beside it (or replayed:
        see `from_conversation`).

        Parameters
        ----------
        conversation_id : str
            Its id (the file's name in `data_dir`, without `.json`).
        data_dir : str or path
            The data folder it was saved in; the session goes on saving there.

        Returns
        -------
        ChatSession

        Raises
        ------
        store.SessionFileError
            (a ValueError) when the file is missing, corrupt or holds invalid settings.
        """
        return cls.from_conversation(model, tokenizer, store.read(data_dir, conversation_id), data_dir, on_progress,
                                     batcher, should_stop, lazy, compile)

    restore = open

    # --- what callers read -------------------------------------------------------------------
    id = property(lambda self: self.conversation.id)
    settings = property(lambda self: self.conversation.settings)
    cache_config = property(lambda self: self.settings.cache)
    sampling = property(lambda self: self.settings.sampling)
    system_prompt = property(lambda self: self.settings.system_prompt)
    cache = property(lambda self: self.timeline.cache)
    ledger = property(lambda self: self.timeline.ledger)
    busy = property(lambda self: self._busy)
    choices = CHOICES  # what the UI offers for the settings that are a choice

    @property
    def messages(self):
        return self.conversation.messages

    @messages.setter
    def messages(self, messages):
        self.conversation.messages = [Message.of(m) for m in messages]

    @property
    def history(self) -> list[dict]:
        """The transcript: [{"role": "user" | "assistant", "content": str}], oldest first."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    @property
    def stats(self) -> dict:
        """tokens_seen (fed so far), tokens_processed (run through the model, replays included),
        slots_used (per layer and KV head), kv_bytes and full_kv_bytes (what a cache that never
        evicts would hold), kv_width and model_width (how keys and values are stored: "int8",
        "bfloat16", ...; a full cache's at the model's), step (the decode step that runs: "eager",
        "compiling" or "compiled"), ttft_s and tokens_per_s of the last reply (None before one); live
        while a reply streams."""
        t, cache = self.last_turn, self.cache
        timing = {"ttft_s": None, "tokens_per_s": None} if t is None else \
            {"ttft_s": t.ttft_s, "tokens_per_s": t.new_tokens / t.decode_s if t.decode_s else 0.0}
        return {"tokens_seen": cache.get_seq_length(), "tokens_processed": self.timeline.tokens_processed,
                "slots_used": cache.slots_used(None), "kv_bytes": cache.kv_bytes(), "full_kv_bytes": cache.full_kv_bytes(),
                "kv_width": cache.kv_width, "model_width": width_name(cache.dtype), "step": self.step_kind, **timing}

    @property
    def step_kind(self):
        """The decode step that runs this conversation's tokens: "eager", "compiling" (eager while the
        compiled one is made in the background) or "compiled" (models/compile.py)."""
        return step_kind(self.batcher.decoder if self.batcher is not None else self.timeline.decoder)

    # --- replies: generators that do their work when iterated ---------------------------------
    def send(self, text: str, role: str = "user", tool_call_id: str | None = None) -> Iterator[str]:
        """Add a message and stream the reply to it.

        The message is checked at once; everything else happens while the returned generator is
        iterated (one that is never iterated changes nothing).

        Parameters
        ----------
        text : str
            The message, kept exactly as typed (see `check_text` for what is refused).
        role : {"user", "system", "assistant"}, default "user"
            A system message after the history is a frontend's instruction for this reply (a
            continue nudge, an impersonation prompt); an assistant message is answered as a
            finished turn (OpenAI's semantics for a final assistant message; `continue_reply`
            writes on in it instead); a tool message is a tool's result (an API client's), for
            the call `tool_call_id`.

        Returns
        -------
        Iterator[str]
            The reply's text pieces; joined, they are the reply (`history[-1]["content"]`).

        Raises
        ------
        ValueError
            At once, for a message that is not usable text or while a reply is being written;
            `GenerationError` (a ValueError) while iterating, when the model runs out of memory.
        """
        if role not in MESSAGE_ROLES:
            raise ValueError(f"role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
        message = Message(role, check_text(text, empty_ok=role != "user"), tool_call_id=tool_call_id)
        self._stop.clear()  # a Stop pressed from here on stops this reply, even before it starts
        return self._exchange(message)

    def regenerate(self) -> Iterator[str]:
        """Drop the last reply and draw a new one from the same state (a generator of text pieces,
        as `send`). A last message that has no reply (the app was killed while answering it) gets
        one. ValueError when there is nothing to regenerate."""
        if not self.messages:
            raise ValueError("there is no reply to regenerate")
        self._stop.clear()
        return self._exchange(None)

    def continue_reply(self) -> Iterator[str]:
        """Stream more of the last reply (a generator of text pieces, as `send`); ValueError when
        the last message is not the assistant's."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise ValueError("there is no reply to continue")
        self._stop.clear()
        return self._continue()

    def _exchange(self, message):
        """A new message and its reply, or (message None) a new draw of the last reply."""
        return self._turn(lambda: self._feed_prompt(message), ban_stop_first=False, save_start=True)

    def _continue(self):
        """More of the last reply: its first token may not end it."""
        return self._turn(lambda: self._sync(open_reply=True, should_stop=self._stop.is_set), ban_stop_first=True)

    def _turn(self, feed_prompt, ban_stop_first, save_start=False):
        """A reply's life, lazily (a generator): the session is busy from its first step to its
        cleanup. feed_prompt() makes the cache hold the prompt and returns False when a Stop ended
        that early (an empty reply: the next turn feeds the rest). save_start: the state the reply
        starts from is saved at its end (an older branch starts there)."""
        self._begin()
        try:
            self.last_turn = TurnStats(processed_before=self.timeline.tokens_processed)  # TTFT includes the prefill
            if not feed_prompt():
                self.last_turn.finish, self.last_turn.end = "stop", time.perf_counter()
                return
            self.timeline.mark()  # what regenerate returns to
            if save_start and self.saved is not None and self.save_error is None:  # else nothing ever saves
                self._marks.append(self.timeline.snapshots[-1])  # it, and each kept mark holds a copy of the cache
            self._reply = Reply(self, ban_stop_first, AUTOSAVE_EVERY_S)
            with self._reply as reply:  # close(): the reply's cleanup, however it ends
                yield from reply.pieces()
        finally:
            self._end()

    def _feed_prompt(self, message):
        """Add `message` (None: take the last reply back) and feed the prompt of its reply; an empty
        assistant message then waits for it. A prompt that cannot be read (out of memory) puts the
        messages back as they were. False when a Stop ended the reading early."""
        messages = self.messages
        if message is None and not messages:
            raise ValueError("there is no reply to regenerate")
        dropped = messages.pop() if message is None and messages[-1].role == "assistant" else None
        if message is not None:
            self.timeline.mark()  # what undo returns to
            messages.append(message)
            self.autosave()  # a crash from here on loses at most the reply
        try:
            complete = self._sync(add_generation_prompt=True, should_stop=self._stop.is_set)
        except ValueError as e:  # the message could not even be read (out of memory): as if never sent
            if message is not None:
                messages.pop()
                e.unsent = message.content  # for the UI to put back in the box
            if dropped is not None:
                messages.append(dropped)
            raise
        messages.append(Message("assistant", ""))
        return complete

    @property
    def token_logprobs(self):
        """[(token id, logprob, [(id, logprob)] * k)] of the last reply's tokens, when top_logprobs is set."""
        return self._reply.token_logprobs if self._reply is not None else []

    def tokens_shown(self):
        """How many tokens of the reply streaming now (or the last one) have their text shown:
        their logprobs can be sent with it."""
        return self._reply.tokens_shown() if self._reply is not None else 0

    def _open_reply_ids(self, turn):
        """The tokens a continued reply's text was fed as (the last segment of the last sync)."""
        last = self._segments_fed[-1] if self._segments_fed else None
        return list(last.ids) if last is not None and last.turn == turn and last.role == "assistant" else []

    def _remember_reply(self, text, ids):
        self._known.remember(text, ids)

    def _begin(self):
        with self._lock:
            if self._busy:
                raise ValueError("a reply is being written: stop it first")
            self._busy = True

    def _end(self):
        with self._lock:
            self._busy = False
            if self._free_when_idle:
                self._free_when_idle = False
                self._free()
        self.autosave()  # after the flag: a failing disk must not keep close() waiting

    # --- changes: checked first, then applied through the one replay path ----------------------
    def undo(self) -> None:
        """Remove the last exchange (the reply and the message it answered); the cache goes back to
        what it held before it. ValueError when there is nothing to undo."""
        self._check_idle()
        if not self.messages:
            raise ValueError("nothing to undo")
        if self.messages[-1].role == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1].role == "user":
            self.messages.pop()
        self._sync()
        self.autosave()

    def edit(self, turn: int, text: str) -> None:
        """Replace the text of message `turn` (an index into `messages`); the cache replays from
        the first changed token. ValueError (nothing changed) for a turn that does not exist, text
        that is not usable, or an edit that no longer fits a pin."""
        self._check_idle()
        message = self.messages[self._check_turn(turn)]
        old, message.content = message.content, check_text(text)
        try:
            self._sync()
        except GenerationError:
            raise
        except ValueError:  # the edited message no longer fits its pin: as it was
            message.content = old
            raise
        finally:
            self.autosave()

    def pin(self, turn: int, pinned: bool = True) -> None:
        """Never evict the words of message `turn` (they count against the budget); turn -1
        (template.SYSTEM) is the system prompt, the one given or the template's own. pinned=False
        lets them compete again; asking for what is already so changes nothing.

        A pin is whole before this returns: every layer and KV head holds every pinned token. A
        message pinned after some of its tokens were evicted is fed again from before them (the
        latest snapshot there, else a replay, calling on_progress). Refused with ValueError, saying
        what would make room, when the budget has none."""
        self._check_idle()
        if turn != SYSTEM or isinstance(turn, bool):
            self._check_turn(turn)
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned must be True or False, got {pinned!r}")
        if self._is_pinned(turn) == pinned:
            return
        self._set_pinned(turn, pinned)
        try:
            self._sync()
        except PinRefused as e:
            self._set_pinned(turn, not pinned)
            raise ValueError(self._no_room(turn, e.limits)) from None
        except ValueError:
            self._set_pinned(turn, not pinned)
            raise
        self.autosave()

    def _is_pinned(self, turn):
        return self.settings.system_prompt_pinned if turn == SYSTEM else self.messages[turn].pinned

    def _set_pinned(self, turn, pinned):
        if turn == SYSTEM:
            self.settings.system_prompt_pinned = pinned
        else:
            self.messages[turn].pinned = pinned

    def _no_room(self, turn, lim):
        """Why `turn` cannot be pinned, in numbers a user can act on."""
        segments = self._segments()
        others = pinned_slots(self._pins(segments, leave_out=turn), lim.n_sink)
        size = pinned_slots(turn_ranges(segments, {turn}), lim.n_sink)
        free = lim.budget - lim.n_recent - lim.n_sink - others
        what = "the system prompt" if turn == SYSTEM else "this message"
        small = " (the smallest layer's budget)" if self.cache.limits.layers is not None else ""
        return (f"{what} is {size} tokens; {lim.n_recent} recent + {lim.n_sink} sinks + {others} pinned leave "
                f"{max(free, 0)} free of {lim.budget}{small}: raise the budget or lower the recent window"
                + (", or unpin another message" if others else ""))

    def configure(self, cache: CacheConfig | dict | None = None, system_prompt: str | None = ...,
                  **sampling_fields) -> None:
        """Change settings; what is not given stays as it is.

        Parameters
        ----------
        cache : CacheConfig, dict or None, default None
            New cache settings: the chat is replayed through a fresh cache.
        system_prompt : str or None, optional
            A new system prompt (None or blank: none): the chat is replayed.
        **sampling_fields
            `Sampling` fields to change (no replay). A `seed` given starts its generator afresh.

        Raises
        ------
        ValueError
            Everything is checked, and a replay done, before anything changes: a refusal (out of
            memory included) leaves the session as it was.
        """
        self._check_idle()
        new = Settings(cache_config(cache) if cache is not None else self.cache_config,
                       sampling(sampling_fields, base=self.sampling),
                       check_system_prompt(system_prompt) if system_prompt is not ... else self.system_prompt,
                       self.settings.system_prompt_pinned)
        Limits.of(self.model).check(new)  # what this machine cannot run is refused before anything is made
        self._rebuild(new, seed_given="seed" in sampling_fields)
        self.autosave()

    def copy(self):
        """A second runtime of this conversation, never saved, holding a copy of its cache (no
        replay): the other choices of an n > 1 request are drawn in copies, as rows of one batch."""
        self._check_idle()
        twin = type(self)(self.model, self.tokenizer, cache=self.cache_config, system_prompt=self.system_prompt,
                          batcher=self.batcher, **asdict(self.sampling))
        twin.messages = [Message(m.role, m.content, m.pinned, m.tool_calls, m.tool_call_id) for m in self.messages]
        twin.conversation.tools = self.conversation.tools
        twin._known.replies = dict(self._known.replies)
        twin._rebuild(timeline=self.timeline.copy(), replay=False)
        return twin

    def catch_up(self) -> bool:
        """Take the saved copy of this conversation if another session (a second tab on it) has
        saved it since this one did: its messages and settings, fed from the first token that
        differs (so only the other tab's new turns are computed). True when it did; nothing to do
        without a data folder, while a reply is being written, or when the file cannot be read
        (the next save then forks, as ever)."""
        if self.data_dir is None or self._busy:
            return False
        try:
            saved = store.read(self.data_dir, self.id)
        except store.SessionFileError:
            return False
        if saved.revision <= self.conversation.revision:
            return False
        saved.use_settings(*Limits.of(self.model).nearest(saved.settings))
        self.notices += saved.notices
        saved.notices = []
        self._rebuild(conversation=saved)
        return True

    def reset(self):
        """Empty the conversation (same id and settings)."""
        self._check_idle()
        self.messages = []
        self._rebuild(fresh=True, replay=False)
        self.autosave()

    def stop(self) -> None:
        """Ask a streaming reply to end; safe from another thread. The reply ends within one token
        and keeps what it streamed; a prompt being read stops within one prefill chunk (the
        reply is empty)."""
        self._stop.set()

    def close(self):
        """The user has gone (a closed tab): stop the reply and free the KV cache, now or as soon
        as the reply has stopped. Safe from another thread. The conversation stays, so a session
        that is used again (the tab was only asleep) replays it into a fresh cache."""
        self.stop()
        with self._lock:
            if self._busy:
                self._free_when_idle = True
                return
            self._free()

    # --- saving --------------------------------------------------------------------------------
    def autosave(self):
        """Save the conversation; if another session saved it meanwhile, save ours as a fork. When
        no reply is being written, the cache's state is saved beside it too (saved_kv.py; a copy
        now, written by a background thread): a reply's end, an edit, an undo. While a reply
        streams only the text is saved: the state saved before it is still a valid start."""
        if self.data_dir is None:
            return
        try:
            try:
                store.write(self.data_dir, self.conversation)
            except store.StaleRevisionError as e:
                fork = self.conversation.become_fork()
                store.write(self.data_dir, fork)
                self.notices.append(f"{e}. Your copy is saved as a new conversation, {fork.display_title!r} "
                                    f"({fork.id}).")
        except OSError as e:  # a full disk, a folder made read-only: the chat goes on, unsaved
            reason = e.strerror or type(e).__name__
            if self.save_error is None:  # said once, not at every save of every token's worth
                log.warning("h2o-chat: conversation %s is not being saved: the data folder cannot be written (%s)",
                            self.id, reason)
                self.notices.append(f"This chat is not being saved: the data folder cannot be written ({reason}).")
            self.save_error = reason
            return
        self.save_error = None
        if not self._busy:
            self._save_state()

    def _save_state(self):
        """Queue the cache's state for saving (unless it is queued already), after the reply starts
        marked since the last save that the timeline still holds."""
        timeline = self.timeline
        if self.saved is None or self.save_error is not None:
            return
        head = None
        if timeline.fed and timeline.saved_changes != timeline.changes:
            head = timeline.snapshot()  # copied before the writer is woken: it would compete for the cores
            timeline.saved_changes = timeline.changes
        marks, self._marks = self._marks, []
        for snap in marks:
            if any(s is snap for s in timeline.snapshots):
                self.saved.save(timeline, snap, self._known)
        if head is not None:
            self.saved.save(timeline, head, self._known, self._sampler.generator, self.sampling.seed)

    def take_notices(self):
        notices, self.notices = self.notices, []
        return notices

    def record(self):
        return {**self.conversation.record(), "version": store.FORMAT_VERSION}

    def to_markdown(self):
        return to_markdown(self.conversation)

    # --- internals -----------------------------------------------------------------------------
    def _rebuild(self, settings=None, conversation=None, timeline=None, fresh=False, replay=True, seed_given=False,
                 should_stop=None):
        """The one place that puts settings into effect and remakes what is derived from the
        conversation (the timeline, the sampler, the charts), by one set of rules:

        - `settings` become the conversation's, or `conversation` (a saved copy caught up with)
          replaces it;
        - the timeline is new and empty when the cache settings changed or `fresh` (a freed
          cache, an emptied chat); `timeline` is used instead when given (a copy's);
        - the charts (turn_stats) start again when the cache settings changed or the chat is empty;
        - a new sampler when the sampling changed or `seed_given`: a seeded one draws on from where
          the old one was unless its seed changed or was given (the same seed and request give
          the same reply, as OpenAI's seed does);
        - when `replay`, the chat is fed (`_sync`) if the timeline is new or the system prompt or
          the messages changed; should_stop() may end that early (False is returned);
        - a ValueError (a pin with no room, out of memory) puts everything back as it was.
        """
        before = (self.conversation, self.conversation.settings, self.timeline, self._sampler, self.turn_stats)
        old_conversation, was, old_timeline = before[:3]
        first = old_timeline is None  # __init__: nothing is made yet
        if conversation is not None:
            self.conversation = conversation
        elif settings is not None:
            self.conversation.settings = settings
        new = self.settings
        new_cache = first or new.cache != was.cache
        try:
            if timeline is not None or fresh or new_cache:
                # a saved state under the old settings is not news right after the user changed them
                self.timeline = timeline or Timeline(self.model, self.tokenizer, new.cache, self.batcher, self.saved,
                                                     self.compiler, settings_notice=first or not new_cache)
            if new_cache or not self.messages:
                self.turn_stats = []
            if first or seed_given or new.sampling != was.sampling:
                sampler = Sampler(new.sampling, self._stop_ids, self.model.device)
                if not first and not seed_given and new.sampling.seed == was.sampling.seed:
                    sampler.generator = self._sampler.generator
                self._sampler = sampler
            if first and self.messages and self.saved is not None:
                self.saved.latest_session(self._known, self._sampler)  # before rendering: replies as they were drawn
            changed = self.timeline is not old_timeline or self.conversation is not old_conversation or \
                new.system_prompt != was.system_prompt
            return self._sync(should_stop=should_stop) if replay and changed else True
        except ValueError:
            self.conversation, self.conversation.settings, self.timeline, self._sampler, self.turn_stats = before
            raise

    def _free(self):
        """The user has gone: the cache's state is saved (a copy, written later; unless it is saved
        already), and the cache freed. The conversation is replayed (or its state loaded) when used again."""
        self._save_state()
        self._rebuild(fresh=True, replay=False)

    _template_text = False  # message texts are plain text (a TextSession's prompt is not)

    def _segments(self, add_generation_prompt=False, open_reply=True):
        return render(self.tokenizer, self.system_prompt, self.messages, add_generation_prompt, open_reply,
                      known=self._known, tools=self.conversation.tools)

    def _pins(self, segments, leave_out=None):
        turns = {i for i, m in enumerate(self.messages) if m.pinned} | ({SYSTEM} if self.settings.system_prompt_pinned
                                                                        else set())
        ranges = turn_ranges(segments, turns - {leave_out})
        return ranges + template_ranges(self.tokenizer, segments) if self.cache_config.keep_template else ranges

    def _sync(self, add_generation_prompt=False, open_reply=True, should_stop=None):
        """Make the cache hold the rendered conversation; False when should_stop() ended it early."""
        segments = self._segments(add_generation_prompt, open_reply and not add_generation_prompt)
        try:
            complete = self.timeline.sync(segments, self._pins(segments), self.on_progress, should_stop)
        except PinRefused as e:
            if not self.cache_config.keep_template:
                raise
            kept = pinned_slots(template_ranges(self.tokenizer, segments), e.limits.n_sink)
            raise ValueError(f"{e}; {kept} of the {e.pinned} are the chat template's tokens, which keep template "
                             "tokens never evicts: or turn that off") from None
        finally:
            if self.saved is not None:
                self.notices += self.saved.take_notices()  # a saved cache that could not be used, and why
        self._segments_fed = segments
        n = len(self.timeline.fed)
        self.turn_stats = [row for row in self.turn_stats if row["tokens_seen"] <= n]  # a replay redraws
        return complete

    @property
    def _fed(self):
        return list(self.timeline.fed)

    def _check_idle(self):
        if self._busy:
            raise ValueError("a reply is being written: stop it first")

    def _check_turn(self, turn):
        if isinstance(turn, bool) or not isinstance(turn, int) or not (0 <= turn < len(self.messages)):
            raise ValueError(f"no message {turn!r}: the history has {len(self.messages)} messages"
                             + ("" if isinstance(turn, int) else " (give its number, from 0)"))
        return turn
