"""ChatSession: one conversation through one persistent H2OCache.

Each turn feeds only its new tokens. The tokens fed over the whole conversation are always a
prefix of what a full re-render of the history through the chat template gives (end-of-turn
tokens included): before each turn the session renders the history, feeds the part the cache
has not seen, and if the two ever disagree (a reply whose generated tokens tokenize differently
from its text, an edit, an undo) it rewinds to the latest snapshot that still agrees, or
replays from the start.
"""

import math
import numbers
import threading
import time
import unicodedata
import uuid
from dataclasses import asdict, dataclass

import torch

from . import store
from .cache import H2OCache
from .ledger import Ledger
from .policy import CacheConfig

MAX_MESSAGE_CHARS = 100_000  # a paste beyond this is refused: prefill alone would take minutes on CPU
AUTOSAVE_EVERY_S = 2.0  # while a reply streams: a crash loses at most this much of it
_PLACEHOLDER = "\x00h2o-content-{}\x00"
_INVISIBLE = ("Cc", "Cf")  # control and format characters (zero-width space, BOM, direction marks)


class GenerationError(ValueError):
    """The model could not run (out of memory). The session stays usable: a reply that was
    streaming keeps what it had shown, the cache is back at a state it has fully seen, and a
    message that never got a reply is taken back."""


OUT_OF_MEMORY = ("out of memory: the model could not run. The reply stops here; lower the cache budget "
                 "or max new tokens and try again")


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


def _number(name, value, low=None, high=None, integer=False, low_open=False):
    """A setting that must be a real number (bools, text, NaN refused) within bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if integer:
        if not isinstance(value, numbers.Integral) and not float(value).is_integer():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {'inf' if high is None else high}]"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    return value


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
class Sampling:
    """How replies are drawn. temperature 0 means greedy."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    stop: tuple = ()  # extra stop strings

    def __post_init__(self):
        self.temperature = _number("temperature", self.temperature, 0, 5)
        self.top_p = _number("top_p", self.top_p, 0, 1, low_open=True)
        self.top_k = _number("top_k", self.top_k, 0, integer=True)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0, low_open=True)
        self.max_new_tokens = _number("max_new_tokens", self.max_new_tokens, 1, integer=True)
        if self.seed is not None:
            self.seed = _number("seed", self.seed, 0, 2**63 - 1, integer=True)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = tuple(stop)


@dataclass
class Snapshot:
    n_fed: int
    cache: object
    logits: torch.Tensor


@dataclass
class TurnStats:
    ttft_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0


class ChatSession:
    def __init__(self, model, tokenizer, cache=None, system_prompt=None, temperature=0.7, top_p=0.9, top_k=0,
                 repetition_penalty=1.0, max_new_tokens=256, seed=None, stop=(), data_dir=None, session_id=None):
        self.model, self.tokenizer = model, tokenizer
        self.cache_config = cache_config(cache)
        self.sampling = Sampling(temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed, stop)
        self.system_prompt = self._check_system_prompt(system_prompt)
        self.data_dir = data_dir
        self.id = store.check_id(session_id) if session_id is not None else uuid.uuid4().hex[:12]
        self.messages = []  # [{"role", "content", "pinned"}]
        self.on_progress = None  # callable(done, total) while a transcript is replayed
        self.last_turn = TurnStats()
        self.turn_stats = []  # self.stats after every reply: what the panel's charts plot
        self.tokens_processed = 0  # every token run through the model, replays included
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the two flags below against close() from another thread
        self._busy = False  # a reply is being prepared or streamed
        self._free_when_idle = False  # close() came while busy: free the cache when the reply ends
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._stop_ids = self._find_stop_ids()
        self._new_cache()

    # --- what callers read -------------------------------------------------------------------
    @property
    def history(self):
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    @property
    def ledger(self):
        return self._ledger

    @property
    def stats(self):
        t = self.last_turn
        return {"tokens_seen": self.cache.get_seq_length(), "tokens_processed": self.tokens_processed,
                "slots_used": self.cache.slots_used(), "kv_bytes": self.cache.kv_bytes(),
                "full_kv_bytes": self.cache.full_kv_bytes(),
                "ttft_s": t.ttft_s, "tokens_per_s": t.new_tokens / t.decode_s if t.decode_s else 0.0}

    # --- conversation ------------------------------------------------------------------------
    def send(self, text):
        """Add a user message and stream the reply as text pieces."""
        text = check_text(text)
        # keep "before the last reply" (a reply that re-tokenizes differently rewinds there)
        # and take "before this exchange" (what undo returns to)
        self._snapshots = self._snapshots[-1:] + [self._snapshot()]
        self.messages.append({"role": "user", "content": text, "pinned": False})
        self.autosave()  # a crash from here on loses at most the reply
        try:
            return self._reply(self._render(add_generation_prompt=True), new_message=True)
        except GenerationError:  # the message could not even be read: take it back, as if never sent
            self.messages.pop()
            self.autosave()
            raise

    def continue_reply(self):
        """Stream more of the last reply (it must be the assistant's)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("there is no reply to continue")
        return self._reply(self._render(open_reply=True), new_message=False)

    def regenerate(self):
        """Drop the last reply and draw a new one from the same state. A last message that has
        no reply (the app was killed while answering it) gets one."""
        if not self.messages:
            raise ValueError("there is no reply to regenerate")
        dropped = self.messages.pop() if self.messages[-1]["role"] == "assistant" else None
        try:
            return self._reply(self._render(add_generation_prompt=True), new_message=True)
        except GenerationError:
            if dropped is not None:
                self.messages.append(dropped)  # the old reply stays when no new one could be started
            raise

    def undo(self):
        """Remove the last exchange (the reply and the message it answered)."""
        if not self.messages:
            raise ValueError("nothing to undo")
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self._rewind_to(self._render(open_reply=True))
        self.autosave()

    def edit(self, turn, text):
        """Replace the text of message `turn`; the cache replays from the first changed token."""
        self._check_turn(turn)
        self.messages[turn]["content"] = check_text(text)  # checked before anything changes
        self._sync(self._render(open_reply=True))
        self.autosave()

    def reset(self):
        self.messages = []
        self._new_cache()
        self.autosave()

    def stop(self):
        """Ask a streaming reply to end; safe from another thread. The partial reply is kept."""
        self._stop.set()

    def close(self):
        """The user has gone (a closed tab): stop the reply and free the KV cache, now or as soon
        as the reply has stopped. Safe from another thread. The transcript stays, so a session
        that is used again (the tab was only asleep) replays it into a fresh cache."""
        self.stop()
        with self._lock:
            if self._busy:
                self._free_when_idle = True
                return
            self._new_cache()

    def _set_busy(self, busy):
        with self._lock:
            self._busy = busy
            if not busy and self._free_when_idle:
                self._free_when_idle = False
                self._new_cache()

    def pin(self, turn, pinned=True):
        """Never evict this message's tokens (they count against the budget); pinned=False
        lets them compete again. Refused with ValueError when the budget has no room."""
        self._check_turn(turn)
        start, end = self._turn_range(turn)
        if pinned and not self.messages[turn]["pinned"]:
            self.cache.protect(start, end)
        elif not pinned and self.messages[turn]["pinned"]:
            self.cache.unprotect(start, end)
        self.messages[turn]["pinned"] = pinned
        self.autosave()

    def configure(self, cache=None, system_prompt=..., **sampling):
        """Change cache settings (the transcript is replayed through a fresh cache), the system
        prompt (replayed too) or sampling settings (no replay). Everything is checked before
        anything changes: a ValueError leaves the session as it was."""
        unknown = sorted(set(sampling) - set(Sampling.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}")
        new_sampling = Sampling(**{**asdict(self.sampling), **sampling}) if sampling else None
        new_cache = cache_config(cache) if cache is not None else None
        new_prompt = self._check_system_prompt(system_prompt) if system_prompt is not ... else ...
        if new_sampling is not None:
            self.sampling = new_sampling
            if "seed" in sampling:
                self._generator = torch.Generator().manual_seed(self.sampling.seed) if self.sampling.seed is not None else None
        replay = False
        if new_cache is not None:
            self.cache_config, replay = new_cache, True
        if new_prompt is not ...:
            self.system_prompt, replay = new_prompt, True
        if replay:
            self._new_cache()
            self._sync(self._render(open_reply=True))
        self.autosave()

    # --- saving ------------------------------------------------------------------------------
    def record(self):
        return {"id": self.id, "updated": time.time(), "system_prompt": self.system_prompt,
                "messages": [dict(m) for m in self.messages], "cache": asdict(self.cache_config),
                "sampling": asdict(self.sampling)}

    def autosave(self):
        if self.data_dir is not None:
            store.save(self.data_dir, self.id, self.record())

    def to_markdown(self):
        return store.to_markdown(self.record())

    @classmethod
    def restore(cls, model, tokenizer, session_id, data_dir, on_progress=None):
        """Load a saved session and replay its transcript through a fresh cache."""
        record = store.load(data_dir, session_id)
        try:
            sampling, cache = record.get("sampling") or {}, record.get("cache") or {}
            if not isinstance(sampling, dict) or not isinstance(cache, dict):
                raise ValueError("the settings are not key-value maps")
            sampling = {k: v for k, v in sampling.items() if k in Sampling.__dataclass_fields__}
            session = cls(model, tokenizer, cache=cache, system_prompt=record.get("system_prompt"),
                          data_dir=data_dir, session_id=session_id, **sampling)
        except (TypeError, ValueError) as e:
            raise store.SessionFileError(f"saved session {session_id!r} has invalid settings: {e}") from None
        session.on_progress = on_progress
        session.messages = [{"role": m["role"], "content": m["content"], "pinned": bool(m.get("pinned"))}
                            for m in record["messages"]]
        session._sync(session._render(open_reply=True))
        return session

    # --- internals: rendering ----------------------------------------------------------------
    def _render(self, add_generation_prompt=False, open_reply=False):
        """The token segments of the whole history as the chat template lays it out:
        a list of (vocab_ids, role, turn). With open_reply the last reply is left open (no
        end-of-turn), as it is right after generating it.

        Message texts are tokenized on their own with special tokens split, so a user typing
        "<|im_end|>" gets plain text, never a control token; the template's own text is
        tokenized normally. Both meet at the template's fixed separators."""
        messages = self.messages
        open_last = open_reply and messages and messages[-1]["role"] == "assistant"
        if open_last:
            messages, add_generation_prompt = messages[:-1], True
        chat = ([{"role": "system", "content": _PLACEHOLDER.format("s")}] if self.system_prompt else [])
        chat += [{"role": m["role"], "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt) \
            if chat else ""
        segments, turn = [], -1 if self.system_prompt else 0
        for i, key in enumerate((["s"] if self.system_prompt else []) + list(range(len(messages)))):
            head, text = text.split(_PLACEHOLDER.format(key), 1)
            content = self.system_prompt if key == "s" else messages[key]["content"]
            role = "system" if key == "s" else messages[key]["role"]
            segments.append((self._tokenize(head, template=True), role, turn))
            segments.append((self._tokenize(content, template=False), role, turn))
            turn += 1
        tail_turn = len(messages)
        if open_last:
            segments.append((self._tokenize(text, template=True), "assistant", tail_turn))
            segments.append((self._tokenize(self.messages[-1]["content"], template=False), "assistant", tail_turn))
        else:
            segments.append((self._tokenize(text, template=True), "assistant" if add_generation_prompt else "template",
                             tail_turn if add_generation_prompt else tail_turn - 1))
        return [s for s in segments if s[0]]

    def _tokenize(self, text, template):
        if not text:
            return []
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=not template).input_ids

    # --- internals: feeding and rewinding ----------------------------------------------------
    def _new_cache(self):
        self.cache = H2OCache(self.model, config=self.cache_config)
        self._ledger = Ledger()
        self._fed = []
        self._logits = None
        self._snapshots = []

    def _sync(self, segments):
        """Make the cache hold exactly the tokens of `segments`, feeding only what it lacks."""
        target = [t for ids, _, _ in segments for t in ids]
        common = self._rewind_to(segments)
        self._feed_segments(segments, common, total=len(target))
        self._reapply_pins()

    def _snapshot(self):
        return Snapshot(len(self._fed), self.cache.snapshot(), self._logits)

    def _rewind_to(self, segments):
        """Rewind to the longest state that is a prefix of `segments`; returns its length."""
        target = [t for ids, _, _ in segments for t in ids]
        common = 0
        for a, b in zip(self._fed, target):
            if a != b:
                break
            common += 1
        if common == len(self._fed):
            return common
        return self._go_back(common)

    def _go_back(self, common):
        """Return to the latest snapshot of at most `common` tokens (or to empty); its length."""
        usable = [s for s in self._snapshots if s.n_fed <= common]
        if usable:
            snap = max(usable, key=lambda s: s.n_fed)
            self.cache.restore(snap.cache)
            self._logits = snap.logits
        else:  # nothing to go back to: replay from the start
            snap = None
            self.cache.reset()
            self._logits = None
        n = snap.n_fed if snap else 0
        self._fed = self._fed[:n]
        self._ledger.truncate(n)
        self._snapshots = [s for s in self._snapshots if s.n_fed <= n]
        self._reapply_pins()
        return n

    def _feed_segments(self, segments, start, total):
        pos = 0
        for ids, role, turn in segments:
            if pos + len(ids) > start:
                self._feed(ids[max(0, start - pos):], role, turn, progress_total=total)
            pos += len(ids)

    @torch.no_grad()
    def _feed(self, ids, role, turn, progress_total=None):
        if not ids:
            return
        chunk = self.cache_config.prefill_chunk
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            x = torch.tensor([part], device=self.model.device)
            try:
                self._logits = self.model(x, cache=self.cache, logits_to_keep=1).logits[0, -1].float()
            except BaseException as e:
                # some layers may have taken the part and others not: go back to a state the cache
                # has fully seen (a snapshot, else empty); the next turn feeds the rest again
                self._go_back(len(self._fed))
                if isinstance(e, torch.OutOfMemoryError):
                    _release_memory()
                    raise GenerationError(OUT_OF_MEMORY) from None
                raise
            self._fed += part
            self.tokens_processed += len(part)
            self._ledger.append(part, [self.tokenizer.decode([t]) for t in part], role, turn)
            if progress_total and self.on_progress:
                self.on_progress(len(self._fed), progress_total)

    def _reapply_pins(self):
        ranges = [self._turn_range(turn, must_exist=False) for turn, m in enumerate(self.messages) if m["pinned"]]
        self.cache.set_pins([(start, end) for start, end in ranges if end > start])

    def _turn_range(self, turn, must_exist=True):
        turns = self._ledger.turns
        idx = [i for i, t in enumerate(turns) if t == turn]
        if not idx:
            if must_exist:
                raise ValueError(f"message {turn} has not been fed to the model yet")
            return 0, 0
        return idx[0], idx[-1] + 1

    # --- internals: generating ---------------------------------------------------------------
    def _reply(self, segments, new_message):
        """Generator: sync the cache to `segments`, then sample and stream a reply."""
        self._stop.clear()
        start = time.perf_counter()
        self._set_busy(True)  # until the stream ends: close() from another thread waits for it
        try:
            self._sync(segments)
        except BaseException:
            self._set_busy(False)
            raise
        if new_message:
            self.messages.append({"role": "assistant", "content": "", "pinned": False})
        self._snapshots.append(self._snapshot())  # what regenerate returns to
        return self._stream(start, ban_stop_first=not new_message)

    def _stream(self, start, ban_stop_first):
        message = self.messages[-1]
        turn = len(self.messages) - 1
        prefix = message["content"]
        reply, emitted, text, cut = [], "", "", -1
        stats = TurnStats()
        first_at = None
        saved_at = time.perf_counter()
        try:
            for step in range(self.sampling.max_new_tokens):
                if self._stop.is_set():
                    break
                if time.perf_counter() - saved_at >= AUTOSAVE_EVERY_S:  # a long reply is saved as it grows
                    self.autosave()
                    saved_at = time.perf_counter()
                try:
                    token = self._sample(self._logits, ban_stop=ban_stop_first and step == 0)
                except torch.OutOfMemoryError:
                    _release_memory()
                    raise GenerationError(OUT_OF_MEMORY) from None
                if token in self._stop_ids:
                    break
                reply.append(token)
                text = self.tokenizer.decode(reply, skip_special_tokens=True)
                cut = min((text.find(s) for s in self.sampling.stop if s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                if not text.endswith("\ufffd") and len(text) > len(emitted):
                    delta, emitted = text[len(emitted):], text
                    message["content"] = prefix + emitted
                    if first_at is None:
                        first_at = time.perf_counter()
                    yield delta
                if cut >= 0:
                    break
                self._feed([token], "assistant", turn)
            if reply and cut < 0 and text != emitted:  # flush an incomplete character at the very end
                delta, emitted = text[len(emitted):], text
                yield delta
        finally:
            end = time.perf_counter()
            stats.ttft_s = (first_at or end) - start
            stats.new_tokens = len(reply)
            stats.decode_s = end - (first_at or end)
            self.last_turn = stats
            message["content"] = prefix + emitted
            self.turn_stats.append({"turn": turn, **self.stats})
            self._set_busy(False)  # before saving: a failing disk must not keep close() waiting
            self.autosave()

    def _sample(self, logits, ban_stop=False):
        s = self.sampling
        logits = logits.clone()
        if ban_stop:
            logits[list(self._stop_ids)] = -float("inf")
        if s.repetition_penalty != 1.0 and self._fed:
            seen = torch.tensor(sorted(set(self._fed[-1024:])), device=logits.device)
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
        if s.temperature == 0:
            return int(logits.argmax())
        logits = logits / s.temperature
        if s.top_k:
            kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        probs = torch.softmax(logits, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > s.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self._generator))

    def _find_stop_ids(self):
        ids = set()
        eos = self.model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    # --- internals: checks -------------------------------------------------------------------
    def _check_system_prompt(self, text):
        """None or text; a blank one means no system prompt."""
        if text is None:
            return None
        check_text(text, "the system prompt", empty_ok=True)
        return text if text.strip() else None

    def _check_turn(self, turn):
        if not isinstance(turn, int) or not (0 <= turn < len(self.messages)):
            raise ValueError(f"no message {turn!r}: the history has {len(self.messages)} messages")


def _release_memory():
    """After an out-of-memory error, hand the failed allocation's cached blocks back to the GPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
