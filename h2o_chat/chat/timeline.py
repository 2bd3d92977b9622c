"""Timeline: the derived state of one conversation, rebuildable from it at any time.

    Timeline(model, tokenizer, cache_config, batcher=None)
      .cache     the H2OCache
      .ledger    every token fed, in order (ledger.vocab_ids is the fed-token timeline)
      .logits    [vocab] after the last fed token (what the next token is drawn from)
      .sync(segments, pins, on_progress, should_stop)   the one replay path (see below)
      .feed_token(token, token_id, role, turn)   one generated token
      .mark()    a snapshot of now, to come back to cheaply (undo, regenerate, a changed reply)
      .snapshot() / .rewind(snapshot)   the same, held by the caller (a reply's stop-string cut)
      .saved     saved_kv.States or None: the conversation's states on disk, which sync may start from

`sync` makes the cache hold exactly the rendered `segments`: it keeps the longest fed prefix
they share (going back to the latest snapshot inside it, or to empty), protects the pinned
ranges (absolute [start, end) of the rendered tokens) BEFORE any of their tokens is fed, then
feeds the rest in chunks. Before feeding it loads, when the conversation has one on disk, the saved
state that holds the most of the rendering beyond what the cache holds (`resume`): a reopened
conversation, or an older branch, starts there instead of from nothing. Edit, settings change,
restore and reload all come through it. A pin
set after some of its tokens were evicted (a message pinned late) counts as a change at its
first missing token: the cache goes back to before it and feeds it again, so a pinned token is
held by every layer and KV head, always. `should_stop()` is asked before each chunk: a Stop or a
client that has gone ends a long prefill or replay within one chunk, leaving the timeline at a
consistent shorter state (the next sync feeds the rest).

A forward that fails (out of memory) goes back to a state the cache has fully seen, so the
timeline is never ahead of or behind the cache.
"""

import itertools
from dataclasses import dataclass

import torch

from ..cache.h2o import H2OCache, H2OLayer, check_pins
from ..models.decode import Decoder
from .ledger import Ledger
from .template import token_ids

MAX_SNAPSHOTS = 4  # before the last two exchanges and their replies: undo, regenerate, re-tokenized replies


class GenerationError(ValueError):
    """The model could not run (out of memory). The session stays usable: a reply that was
    streaming keeps what it had shown, the cache is back at a state it has fully seen, and a
    message that never got a reply is taken back (its text is in `unsent`)."""

    unsent = None


OUT_OF_MEMORY = ("out of memory: the model could not run. The reply stops here; lower the cache budget "
                 "or max new tokens and try again")


@dataclass
class Snapshot:
    n_fed: int
    cache: object
    logits: torch.Tensor | None


def first_missing_pin(pins, layer_ids, n):
    """The first token below `n` pinned by `pins` that some layer or KV head no longer holds, or
    None. layer_ids: per layer, [batch, kv_heads, slots] the token in each slot (None: nothing)."""
    wanted = sorted({t for start, end in pins for t in range(start, min(end, n))})
    if not wanted:
        return None
    first = None
    for ids in layer_ids:
        held = torch.zeros(1, len(wanted), dtype=torch.bool) if ids is None else \
            (ids[0, :, :, None].cpu() == torch.tensor(wanted)).any(dim=1)  # [kv_heads, wanted]
        missing = (~held.all(dim=0)).nonzero()
        if len(missing):
            first = min(first if first is not None else n, wanted[int(missing[0])])
    return first


class Timeline:
    def __init__(self, model, tokenizer, cache_config, batcher=None, saved=None, compiler=None, settings_notice=True):
        self.model, self.tokenizer, self.batcher = model, tokenizer, batcher
        self.saved = saved  # saved_kv.States: the conversation's saved states, where a sync may start from
        # whether a saved state under other cache settings is news: on opening a conversation it
        # says why it replays; right after the user changed the settings it is what they asked for
        self.settings_notice = settings_notice
        self.cache = H2OCache(model, config=cache_config)
        self.decoder = Decoder(model)  # the lean forward for one generated token (decode.py)
        self.compiler = compiler  # models.compile.StepCompiler: the model's compiled step, or None
        if compiler is not None:
            self.decoder.switch_to(compiler.step())
        self.ledger = Ledger()
        self.logits = None
        self.snapshots = []
        self.tokens_processed = 0  # every token run through the model, replays included
        self.changes = 0  # counts every change of the state: a state already saved is not saved again
        self.saved_changes = None  # `changes` when the state was last saved, or loaded from disk

    @property
    def fed(self):
        return self.ledger.vocab_ids

    def sync(self, segments, pins=(), on_progress=None, should_stop=None):
        """Feed what the cache lacks of `segments`; pins checked (ValueError, nothing changed) first.
        Returns False when should_stop() ended it early."""
        self.cache.set_pins(pins)  # refused here, before anything changed, when the budget has no room
        target = token_ids(segments)
        common = 0
        for a, b in zip(self.fed, target):
            if a != b:
                break
            common += 1
        layer_ids = (self.cache.token_ids(i) for i in range(len(self.cache.layers)))  # read only if pins need it
        broken = first_missing_pin(self.cache.pins, layer_ids, common)  # pinned after some of its tokens were evicted
        if broken is not None:
            common = broken
        if common < len(self.fed):
            self.go_back(common)
            self.cache.set_pins(pins)  # a snapshot brings its own pins back
        if self.resume(target, pins) and on_progress:
            on_progress(len(self.fed), len(target))
        parts, pos = [], 0  # what is missing of each segment
        for ids, role, turn, *_ in segments:
            if pos + len(ids) > len(self.fed):
                parts.append((ids[max(0, len(self.fed) - pos) :], role, turn))
            pos += len(ids)
        return self.feed(parts, on_progress, len(target), should_stop)

    def resume(self, target, pins):
        """Load the saved state (chat/saved_kv.py) that holds the most of `target` (ids) beyond
        what the cache holds now, if one does and every pinned token before its end is still in
        it; True when one was loaded."""
        if self.saved is None or len(target) <= len(self.fed):
            return False
        for path in self.saved.candidates(target, len(self.fed), self.cache.config, self.settings_notice):
            loaded = self.saved.load(path, self, target)
            if loaded is None:
                continue
            snap, ledger = loaded
            layers, _, limits = snap.cache
            try:
                check_pins(pins, limits)
            except ValueError:
                continue
            if first_missing_pin(pins, (H2OLayer.state_token_ids(s) for s in layers), snap.n_fed) is not None:
                continue
            self.cache.restore(snap.cache, adopt=True)  # read for this alone: no copy
            self.cache.set_pins(pins)
            self.logits, self.ledger = snap.logits, ledger
            self.changes += 1
            self.saved_changes = self.changes  # it is on disk already: not written again until it changes
            return True
        return False

    def copy(self):
        """Another timeline at the same state: a copy of the cache, the ledger and the snapshots
        (snapshots are only ever read, so they are shared)."""
        twin = Timeline(self.model, self.tokenizer, self.cache.config, self.batcher, compiler=self.compiler)
        twin.cache.restore(self.cache.snapshot())
        twin.ledger = Ledger(*(list(getattr(self.ledger, name)) for name in ("vocab_ids", "pieces", "roles", "turns")))
        twin.logits, twin.snapshots, twin.tokens_processed = self.logits, list(self.snapshots), self.tokens_processed
        return twin

    def mark(self):
        self.snapshots = self.snapshots[-(MAX_SNAPSHOTS - 1) :] + [self.snapshot()]

    def snapshot(self):
        return Snapshot(len(self.fed), self.cache.snapshot(), self.logits)

    def rewind(self, snap):
        """Back to `snap` (a snapshot of this timeline, taken since the last go_back before it)."""
        self.cache.restore(snap.cache)
        self.logits = snap.logits
        self.ledger.truncate(snap.n_fed)
        self.snapshots = [s for s in self.snapshots if s.n_fed <= snap.n_fed]
        self.changes += 1

    def go_back(self, n):
        """Return to the latest snapshot of at most `n` tokens (or to empty)."""
        usable = [s for s in self.snapshots if s.n_fed <= n]
        snap = max(usable, key=lambda s: s.n_fed) if usable else None
        if snap:
            self.cache.restore(snap.cache)
        else:
            self.cache.reset()
        self.logits = snap.logits if snap else None
        n = snap.n_fed if snap else 0
        self.ledger.truncate(n)
        self.snapshots = [s for s in self.snapshots if s.n_fed <= n]
        self.changes += 1

    @torch.no_grad()
    def feed(self, parts, on_progress=None, total=None, should_stop=None):
        """Feed parts [(ids, role, turn)] in order, in chunks of prefill_chunk tokens that run
        across their boundaries: a forward reads every weight once, so a new message (its
        template head, its text, the reply's opening: three parts) costs one forward, not three.
        Returns False when should_stop() said to stop before a chunk."""
        chunk = self.cache.config.prefill_chunk
        tokens = [(t, role, turn) for ids, role, turn in parts for t in ids]
        for s in range(0, len(tokens), chunk):
            if should_stop is not None and should_stop():
                return False
            part = tokens[s : s + chunk]
            self._forward(torch.tensor([[t for t, _, _ in part]], device=self.model.device))
            for (role, turn), run in itertools.groupby(part, key=lambda token: token[1:]):
                ids = [t for t, _, _ in run]
                self.ledger.append(ids, [self.tokenizer.decode([t]) for t in ids], role, turn)
            if on_progress:
                on_progress(len(self.fed), total)
        return True

    @torch.no_grad()
    def feed_token(self, token, token_id, role, turn):
        """token: the 0-d tensor the sampler drew (on the device, so no copy); token_id: its value."""
        self._forward(token.view(1, 1))
        self.ledger.append([token_id], [self.tokenizer.decode([token_id])], role, turn)

    def leave_batch(self):
        """A reply ended: the cache stops sharing a batch (batch.py), so it can be snapshot or rewound."""
        if self.batcher is not None:
            self.batcher.leave(self.cache)

    def _forward(self, x):
        try:
            if self.batcher is not None:  # one thread runs the model for every session, batching decode steps
                self.logits = self.batcher.run(self.cache, x)
            else:
                self.logits = self.decoder.forward(x, self.cache)[0]
        except BaseException as e:
            # some layers may have taken the input and others not: go back to a state the cache
            # has fully seen (a snapshot, else empty); the next sync feeds the rest again
            self.go_back(len(self.fed))
            if isinstance(e, torch.OutOfMemoryError):
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # hand the failed allocation's cached blocks back
                raise GenerationError(OUT_OF_MEMORY) from None
            raise
        self.tokens_processed += x.shape[1]
        self.changes += 1
