"""Many conversations, one forward: the decode steps of every generating conversation run as a batch.

Why this is simple for H2O: once a conversation's cache holds `budget` slots per layer and KV head
(its steady state), N conversations stack into dense [N, kv_heads, budget + 1, head_dim] buffers,
with no paging. A conversation still below its budget joins with its free slots masked (never
attended, filled first), so one step serves both.

    batcher = Batcher(model, max_batch=4)
    session = ChatSession(model, tokenizer, batcher=batcher)  # one thread per conversation, as before

One thread, the batcher's, runs every forward of the model. A conversation's thread hands it each
forward (`run`) and waits. Decode steps of conversations with the same cache settings are gathered
into one batched forward; a prefill chunk (a new message, a replay) runs alone between two decode
steps, so the others keep streaming. Sampling, stop strings and the stop button stay in each
conversation's own thread, untouched.

Stacking: an `Arena` per cache setting holds, per layer,
    kv    [2, rows, kv_heads, budget + 1, head_dim]
    meta  [N_META, rows, kv_heads, budget + 1]          (the layout of cache/step.py)
    acc   [N_ACC, rows, kv_heads, budget + 1]
    qp    [4, rows, kv_heads, budget + 1]                (int8 slots only: their scales and zero points)
A joining conversation's buffers are copied into a free row, and its own H2OCache layers become
views of that row: its snapshots, the panel's reads and its position roll keep working unchanged.
When it leaves (its reply ended, or it sat out too many steps) the row is copied back into buffers
of its own and the last row moves into the hole, so rows [0, n) are always the batch.
"""

import threading
import time
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.kv_int8 import WideScratch
from ..cache.step import DecodeStep, Eviction, StepRows, step_layer
from ..models.compile import Compilation, step_compiler
from ..models.decode import Decoder

GATHER_S = 0.01  # how long a step waits for a conversation that has not handed in its token yet
IDLE_STEPS = 8  # steps a conversation may sit out before its row is handed back


@dataclass
class Request:
    """One forward for one conversation: input_ids [1, n] into `cache`; logits [vocab] float32."""

    cache: object
    input_ids: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class Batcher:
    """Runs the model for every conversation that uses it, batching their decode steps. A thread
    that calls `run` does its own torch work on one intra-op thread from then on (see `run`)."""

    def __init__(self, model, max_batch=4, gather_s=GATHER_S, compile=Compilation.compile, data_dir=None, threads=None):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model, self.max_batch, self.gather_s = model, max_batch, gather_s
        self.decoder = Decoder(model)
        compiler = step_compiler(model, compile, data_dir)  # models/compile.py: compiled in the background
        if compiler is not None:
            self.decoder.switch_to(compiler.step())
        # the intra-op threads the model's forwards run with (default: this thread's); the batcher's
        # thread should be the only one with a team of them (models/threads.py)
        self.threads = threads or torch.get_num_threads()
        self.arenas = {}  # cache settings -> Arena (only while it has members)
        self.steps = self.rows_stepped = 0  # batched steps run, and conversations they advanced
        self.largest_batch = 0  # most conversations stacked at once
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._leaving: list[tuple[object, threading.Event]] = []
        self._members: set[int] = set()  # id() of every cache that holds an arena row (read under _cond)
        self._thread = None

    # --- what conversation threads call -------------------------------------------------------
    def run(self, cache, input_ids):
        """The forward of `input_ids` [1, n] into `cache`: the logits of its last token [vocab],
        float32. Blocks until the batcher thread has run it (batched with others when it can)."""
        request = Request(cache, input_ids)
        # The caller's own torch work (sampling a token) runs on one thread. Each Python thread
        # that runs torch ops gets its own OpenMP team, whose threads spin after each op; on a
        # 2-core CPU, conversation threads sampling with two threads each took the cores from the
        # batcher's forward (measured: one such thread slowed a decode step from 32 to 49 ms).
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="h2o-batcher")
                self._thread.start()
            self._pending.append(request)
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.logits

    def leave(self, cache):
        """`cache` stops decoding (its reply ended): it gets buffers of its own again, so the
        conversation can snapshot, rewind or be dropped without touching the batch."""
        with self._cond:
            if id(cache) not in self._members:
                return
            done = threading.Event()
            self._leaving.append((cache, done))
            self._cond.notify_all()
        done.wait()

    @property
    def batch_size(self):
        """Conversations stacked now."""
        return len(self._members)

    # --- the batcher thread ---------------------------------------------------------------------
    def _loop(self):
        torch.set_num_threads(self.threads)  # a new thread takes the last setting made anywhere: one, from run()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._leaving)
                self._gather()
                requests, self._pending = self._pending, []
                leaving, self._leaving = self._leaving, []
            try:
                self._serve(requests, leaving)
            except BaseException as e:  # a bug here must fail its callers, never leave them waiting
                for r in requests:
                    if not r.done.is_set() and r not in self._pending:
                        r.error = e
                        r.done.set()
                for _, done in leaving:
                    done.set()

    def _serve(self, requests, leaving):
        for cache, done in leaving:
            self._leave(cache)
            done.set()
        decode, room = [], self.max_batch - len(self._members)
        for r in requests:  # members first, then newcomers while there is room
            if self._stackable(r) and (id(r.cache) in self._members or room > 0):
                room -= id(r.cache) not in self._members
                decode.append(r)
        alone = [r for r in requests if r not in decode]
        for r in alone:
            if id(r.cache) in self._members:  # a member that reset or grew: it runs on its own now
                self._leave(r.cache)
        for key in {arena_key(r.cache) for r in decode}:
            self._step(key, [r for r in decode if arena_key(r.cache) == key])
        if alone:  # one prefill chunk (or unstackable step) between two decode steps
            with self._cond:
                self._pending[:0] = alone[1:]
            self._alone(alone[0])

    def _gather(self):
        """Wait, briefly, until every stacked conversation has handed in its next token."""
        deadline = time.monotonic() + self.gather_s
        while not self._leaving:
            waiting = {id(r.cache) for r in self._pending}
            left = deadline - time.monotonic()
            if self._members <= waiting or left <= 0:
                return
            self._cond.wait(left)

    def _stackable(self, request):
        cache = request.cache
        if request.input_ids.shape[1] != 1 or cache.limits is None or cache.limits.budget is None:
            return False
        if any(layer.kv is None or layer.capacity != cache.limits.layer(i).budget + 1 for i, layer in enumerate(cache.layers)):
            return False  # nothing fed yet, or an unbounded layer: it runs alone
        return True

    def _step(self, key, requests):
        arena = self.arenas.get(key)
        if arena is None:
            arena = self.arenas[key] = Arena()
        for r in requests:
            if id(r.cache) not in self._members:
                arena.join(r.cache)
                self._add_member(r.cache)
        try:
            logits = arena.step(self.decoder, requests)
        except BaseException as e:  # the members' caches are part-stepped: each rewinds its own
            for cache in list(arena.members):
                self._leave(cache)
            for r in requests:
                r.error = e
                r.done.set()
            return
        self.steps += 1
        self.rows_stepped += len(requests)
        for r in requests:
            r.logits = logits[arena.row_of(r.cache)]
            r.done.set()
        for cache in arena.idle_too_long():
            self._leave(cache)

    def _alone(self, request):
        try:
            request.logits = self.decoder.forward(request.input_ids, request.cache)[0]
        except BaseException as e:
            request.error = e
        request.done.set()

    def _leave(self, cache):
        for key, arena in list(self.arenas.items()):
            if cache in arena.members:
                arena.leave(cache)
                if not arena.members:
                    del self.arenas[key]  # its buffers go back to the allocator
        with self._cond:
            self._members.discard(id(cache))

    def _add_member(self, cache):
        with self._cond:
            self._members.add(id(cache))
            self.largest_batch = max(self.largest_batch, len(self._members))


def arena_key(cache):
    """What conversations must share to be stacked: how their caches score and evict (each layer's budget too)."""
    c, lim = cache.config, cache.limits
    return c.policy, c.score, c.decay, c.positions, c.kv_quant, lim.budget, lim.n_sink, lim.n_recent, lim.layers


class Arena:
    """The stacked caches of conversations with the same cache settings; row r is members[r]."""

    def __init__(self):
        self.members = []  # H2OCache per row
        self.idle = []  # steps each member has sat out in a row
        self.kv = self.meta = self.acc = self.qp = None  # per layer: [2, rows, kv_heads, cap, head_dim], [N_META | N_ACC | 4, rows, kv_heads, cap]
        self.stack = None  # (kv, meta, acc, qp) [layers, ...] when the layers' buffers are views of one each (every layer's cap alike)
        self.steps = None  # per layer: the DecodeStep over the current number of rows
        self.evictions = None  # and the step's Evictions (one over every layer when stacked, else one each)
        self.wide = WideScratch()  # where int8 slots are widened for attention, one layer at a time

    @property
    def rows(self):
        return self.kv[0].shape[1] if self.kv else 0

    def row_of(self, cache):
        return next(r for r, c in enumerate(self.members) if c is cache)

    def join(self, cache):
        if len(self.members) == self.rows:
            self._grow(max(1, 2 * self.rows), cache)
        r = len(self.members)
        for i, layer in enumerate(cache.layers):
            row = self._row(i, r)
            for mine, its in zip(row, layer.buffers):
                if its is not None:
                    mine.copy_(its)
            layer.set_buffers(*row, layer.n_slots)
        self.members.append(cache)
        self.idle.append(0)
        self.steps = None

    def leave(self, cache):
        """Copy `cache`'s row into buffers of its own (if it still uses the row: a cache that
        reset or restored a differently sized snapshot already has its own), then move the last
        row into the hole."""
        r, last = self.row_of(cache), len(self.members) - 1
        if self._holds(cache, r):
            for layer in cache.layers:
                own = torch.contiguous_format
                layer.set_buffers(*(None if b is None else b.clone(memory_format=own) for b in layer.buffers),
                                  layer.n_slots)
        if r != last:
            moved = self.members[last]
            held = self._holds(moved, last)
            for i, layer in enumerate(moved.layers):
                for b in self._layer(i):
                    if b is not None:
                        b[:, r].copy_(b[:, last])
                if held:
                    layer.set_buffers(*self._row(i, r), layer.n_slots)
            self.members[r], self.idle[r] = moved, self.idle[last]
        self.members.pop()
        self.idle.pop()
        self.steps = None

    def idle_too_long(self):
        return [c for c, idle in zip(self.members, self.idle) if idle > IDLE_STEPS or not self._holds(c, self.row_of(c))]

    def _holds(self, cache, r):
        layer = cache.layers[0]
        return layer.kv is not None and layer.kv.data_ptr() == self.kv[0][:, r : r + 1].data_ptr() \
            and layer.kv.shape[3] == self.kv[0].shape[3]

    def _layer(self, i):
        """Layer i's buffers, in H2OLayer.buffers' order: (kv, meta, acc, qp), qp None but for int8 slots."""
        return self.kv[i], self.meta[i], self.acc[i], self.qp[i]

    def _row(self, i, r):
        """Layer i's buffers of row r, as views [.., 1, kv_heads, cap, ..] a member's layer holds."""
        return tuple(None if b is None else b[:, r : r + 1] for b in self._layer(i))

    def _grow(self, rows, like):
        # zeros: a free slot's value times 0 is 0, never NaN. Layers of one capacity (a uniform
        # budget) get one stacked buffer of each kind, so one Eviction serves them all (step.py)
        layers = like.layers
        if len({layer.capacity for layer in layers}) == 1:
            stack = tuple(None if b is None else b.new_zeros(len(layers), b.shape[0], rows, *b.shape[2:])
                          for b in layers[0].buffers)
            grown = [tuple(None if b is None else b[i] for b in stack) for i in range(len(layers))]
        else:
            stack = None
            grown = [tuple(None if b is None else b.new_zeros(b.shape[0], rows, *b.shape[2:]) for b in layer.buffers)
                     for layer in layers]
        if self.kv:  # per layer: the rows held so far copied over
            for i, new in enumerate(grown):
                for b, old in zip(new, self._layer(i)):
                    if b is not None:
                        b[:, : self.rows].copy_(old)
        held = [self._holds(c, r) for r, c in enumerate(self.members)]
        self.stack = stack
        self.kv, self.meta, self.acc, self.qp = (list(b) for b in zip(*grown))
        for r, cache in enumerate(self.members):
            if held[r]:
                for i, layer in enumerate(cache.layers):
                    layer.set_buffers(*self._row(i, r), layer.n_slots)

    @torch.no_grad()
    def step(self, decoder, requests):
        """One decode step of `requests` (a token each, for members): a batched forward over
        every row, where a member without a request sits this step out unchanged. Returns the
        logits [rows, vocab] float32."""
        n, first = len(self.members), self.members[0]
        asked = {id(r.cache): r for r in requests}
        active = [id(c) in asked for c in self.members]
        self.idle = [0 if a else i + 1 for a, i in zip(active, self.idle)]
        dev = first.layers[0].kv.device
        dummy = torch.zeros(1, 1, dtype=torch.long, device=dev)
        input_ids = torch.cat([asked[id(c)].input_ids if id(c) in asked else dummy for c in self.members])
        for cache in self.members:
            cache.prepare_decode()
        rows = self._row_state(active)
        if self.steps is None:
            self.steps = [self._decode_step(i, n) for i in range(len(self.kv))]
            self.evictions = self._evictions(n)
        stacked = StackedCache(self, rows)
        n_seen = torch.tensor([c.layers[0].n_seen for c in self.members], device=dev)
        logits = decoder.step(input_ids, n_seen, stacked)
        for cache, on in zip(self.members, active):
            if on:
                cache.advance()
        return logits

    def _decode_step(self, i, n):
        """Layer i's DecodeStep over rows [0, n), made on the host before the step runs."""
        first = self.members[0]
        kv, acc, qp = self.kv[i][:, :n], self.acc[i][:, :n], self.qp[i]
        return DecodeStep.over(kv, acc, None if qp is None else qp[:, :n], first.group, first.dtype, first.scaling,
                               self.wide.for_slots(kv, acc.dtype))

    def _evictions(self, n):
        """The step's Evictions over rows [0, n): one over every layer when they are stacked, else one per layer."""
        if self.stack is not None:
            return [Eviction.over(*(None if b is None else b[:, :, :n] for b in self.stack))]
        return [Eviction.over(*(None if b is None else b[None, :, :n] for b in self._layer(i))) for i in range(len(self.kv))]

    def _row_state(self, active):
        """Layer i's StepRows: what differs between the rows of one step, the same for every layer
        but for the free slots of layers whose budgets differ."""
        first = self.members[0]
        layer, lim = first.layers[0], first.limits
        n_seen = [c.layers[0].n_seen for c in self.members]
        kept = [a and c.next_token_kept() for a, c in zip(active, self.members)]
        rows = StepRows.make(n_seen, kept, active, first.kv_heads, first.group, lim.n_recent, first.config.decay,
                             layer.meta.dtype, layer.acc.dtype, layer.kv.device)
        if lim.layers is None:
            return [replace(rows, empty=self._empty_slots(0))] * len(first.layers)
        return [replace(rows, empty=self._empty_slots(i)) for i in range(len(first.layers))]

    def _empty_slots(self, i):
        """[rows, 1, cap] bool: layer i's free slots, [n_slots, budget) of each row; None when every row is full."""
        budget = self.members[0].limits.layer(i).budget
        n_slots = [c.layers[i].n_slots for c in self.members]
        if all(s >= budget for s in n_slots):
            return None
        slot = torch.arange(self.kv[i].shape[3], device=self.kv[i].device)
        filled = torch.tensor(n_slots, device=slot.device)[:, None]
        return ((slot >= filled) & (slot < budget))[:, None]


class StackedLayer(CacheLayerMixin):
    """What transformers asks of a layer of the stacked cache (the work is in StackedCache.attend)."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, *args, **kwargs):
        raise RuntimeError("StackedLayer is updated through StackedCache")

    def get_seq_length(self):
        return 0

    def get_mask_sizes(self, query_length):
        return query_length, 0  # the "h2o" attention ignores the mask: make it as small as it can be

    def get_max_length(self):
        return -1


class StackedCache(Cache):
    """The cache one batched decode step runs with: rows [0, n) of an arena, one token each;
    `rows[i]`, layer i's StepRows."""

    static_step = True  # every layer of every row holds budget + 1 slots

    def __init__(self, arena, rows):
        self.arena, self.rows = arena, rows
        super().__init__(layers=[StackedLayer() for _ in arena.kv])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kwargs["kwargs"]["h2o_cache"] = self  # the "h2o" attention calls attend() below
        return key_states, value_states

    def begin(self, n_new):
        """Nothing to prepare: the arena made its members ready (Arena.step)."""

    def attend(self, layer_idx, query, keys, values, scaling):
        """query [rows, q_heads, 1, head_dim], keys, values [rows, kv_heads, 1, head_dim] ->
        [rows, 1, q_heads, head_dim]."""
        arena = self.arena
        return step_layer(layer_idx, arena.steps, arena.evictions, keys, values, query, arena.members[0].config,
                          self.rows[layer_idx])

    def end(self):
        """Nothing to count here: the arena advances its members (Arena.step)."""

    # --- for a compiled step (models/compile.py) ------------------------------------------------
    def step_shape(self):
        """What a compiled step's graph depends on besides the model: the members' settings, the
        arena's rows and buffers, the rows stepped, which layers have free slots, whether a row sits out."""
        arena, rows = self.arena, self.rows
        return ("stacked", arena_key(arena.members[0]), len(arena.members), tuple(kv.shape for kv in arena.kv),
                arena.kv[0].dtype, arena.acc[0].dtype, arena.meta[0].dtype, tuple(r.empty is None for r in rows),
                rows[0].idle is None)

    def decode_steps(self):
        return self.arena.steps

    def evictions(self):
        return self.arena.evictions

    def replica(self):
        """A StackedCache over an arena of its own with the same rows and a copy of each member:
        what a step is compiled on off the batcher's thread, never touching this one."""
        arena, members = Arena(), [cache.replica() for cache in self.arena.members]
        arena._grow(self.arena.rows, members[0])  # the same rows: the step's views have the same strides
        for cache in members:
            arena.join(cache)
        arena.steps = [arena._decode_step(i, len(members)) for i in range(len(arena.kv))]
        arena.evictions = arena._evictions(len(members))
        return StackedCache(arena, self.rows)  # the rows (what differs between them) are only read
