"""H2OCache: a transformers Cache that keeps at most `budget` tokens per layer and KV head.

Per layer it holds, for each batch row and KV head, `slots` cached tokens:
    keys, values   [batch, kv_heads, slots, head_dim]
    token_ids      [batch, kv_heads, slots]  absolute index of the token in each slot
    scores         [batch, kv_heads, slots]  attention mass received (float32, or float64)
    queries        [batch, kv_heads, slots]  how many queries could see the token ("mean" score)
    positions      [batch, kv_heads, slots]  RoPE position the key is rotated to now
Heads evict independently, so each head holds different tokens but the same number of them and
the tensors stay dense. Layers may have budgets of their own (CacheConfig.budget_shape): each is
handed its own `Budget` (`limits.layer(i)`), the total stays layers x budget. Slot order means nothing to attention; `token_ids` says who is where.
They live in three packed buffers per layer (see step.py).

One owner per piece of state: an `H2OLayer` owns its buffers, and every change to its slots is a
method of it; the `H2OCache` owns the settings, the resolved budget and the pins, and hands its
layers what they need. One forward step of a layer (`H2OLayer.attend`):
    for each chunk of at most `prefill_chunk` new tokens:
        write the chunk into free slots -> attend over all slots -> add the attention mass to
        the scores -> if slots > budget, evict back to budget.
Chunking inside the layer gives the same result as feeding the model chunk by chunk (a chunk at
layer l only depends on earlier tokens at layer l-1), yet a plain `model.generate` or
`model(ids)` gets it for free, and no [heads, n, n] matrix of a long prompt is ever built.

The decode step is the hot path. A bounded layer's buffers are allocated once with budget + 1
slots and never change size; one token is, per layer, step.attend over views made once, and
then one step.evict for every layer at once (the layers' buffers are views of one stacked buffer
each, `H2OCache.stack_layers`), from the first token after the layer's first input (while it fills,
its free slots are masked). Positions re-roll on a schedule the host knows (every head's span
grows by at most one a step), never on a value read from the device.
"""

import copy
import warnings
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import scoring
from .config import Budget, CacheConfig, layer_budgets
from .kv_int8 import (
    CODES,
    KEY_SCALE,
    KEY_ZERO,
    N_ROWS,
    QP_DTYPE,
    SCALES,
    ZEROS,
    WideScratch,
    dequantize,
    quantize,
)
from .policy import heavy_score, never_evicted, priority, protection_key, select_keep
from .step import (
    IDS,
    INT_OF,
    KEY,
    N_ACC,
    N_META,
    POS,
    QUERIES,
    SCORE,
    DecodeStep,
    Eviction,
    StepRows,
    score_dtype,
    step_layer,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GROWTH = 256  # slots an unbounded layer grows by
STATIC_FROM = 8  # a layer filling up takes the decode step once 1/STATIC_FROM of its budget is live,
STATIC_ALWAYS = 4096  # or from its first token when its budget is at most this (`steps_static` says why)


def pack_meta(meta, acc):
    """[N_META + acc rows, ...] integers: meta, then acc's bits (the saved-state format)."""
    return torch.cat((meta, acc.view(meta.dtype)))


def unpack_meta(packed, acc_dtype):
    """`pack_meta`'s tensor back as (meta, acc), each in memory of its own (a layer may adopt them:
    no buffer is a view of another dtype's memory), acc in `acc_dtype`."""
    return packed[:N_META].clone(), packed[N_META:].view(acc_dtype).clone()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys, delta, inv_freq):
    """RoPE keys moved by `delta` positions: R(p + delta) k0 = R(delta) R(p) k0.

    keys [batch, kv_heads, slots, head_dim], delta [batch, kv_heads, slots] integer.
    Angles in float32 as transformers computes them; the rotation in at least float32, written
    back in place."""
    angles = delta[..., None].float() * inv_freq  # [b, kvh, slots, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)
    k = keys.to(torch.promote_types(keys.dtype, torch.float32))
    keys.copy_(k * angles.cos().to(k.dtype) + rotate_half(k) * angles.sin().to(k.dtype))


def pinned_slots(pins, n_sink):
    """The slots pins take: their tokens, each counted once, less those the sinks hold anyway."""
    return len(set().union(*(range(max(start, n_sink), end) for start, end in pins)))


def check_pins(pins, limits):
    """PinRefused when `pins` leave these limits no room for the sinks and the recent window (in
    the layer with the fewest slots: a pinned token takes a slot in every layer)."""
    if limits is not None and limits.budget is not None:
        smallest = limits.tightest
        pinned = pinned_slots(pins, smallest.n_sink)
        if smallest.n_sink + pinned + smallest.n_recent > smallest.budget:
            raise PinRefused(smallest, pinned, smallest=limits.layers is not None)


class PinRefused(ValueError):
    """Pins the budget has no room for: `limits` (a Budget: the smallest layer's) and `pinned`, the
    slots they would take; `smallest`: the layers' budgets differ (budget_shape), and it says which."""

    def __init__(self, limits, pinned, smallest=False):
        self.limits, self.pinned = limits, pinned
        free = limits.budget - limits.n_sink - limits.n_recent
        which = "the smallest layer's budget" if smallest else "the budget"
        super().__init__(f"the pins need {pinned} slots, but {limits.n_recent} recent + {limits.n_sink} sinks leave "
                         f"{free} of {which} of {limits.budget}: raise the budget, lower the recent window or "
                         "unpin a message")


class H2OLayer(CacheLayerMixin):
    """One layer's slots. Buffers have room for `capacity` slots; the first `n_slots` are live.

    It is built with what never changes for its cache (the settings, the model's RoPE frequencies
    and trained positions) and is handed, per call, what can (the resolved `limits` and `pins`).
    `keys`, `values`, `token_ids`, `positions`, `scores`, `queries` are views of the live slots,
    read-only properties made at their first use after the slot count or the buffers change
    (so neither a steady decode step nor a growing one makes them)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, config: CacheConfig, inv_freq, max_positions, wide=None):
        self.config, self.inv_freq, self.max_positions = config, inv_freq, max_positions
        self.wide = wide if wide is not None else WideScratch()  # shared by the cache's layers (int8 slots)
        self.reset()

    def reset(self):
        self.is_initialized = False
        self.n_seen = 0  # tokens this layer has been given, evicted or not
        self.n_slots = 0
        self.kv = None  # [2, batch, kv_heads, capacity, head_dim]
        self.meta = None  # [N_META, batch, kv_heads, capacity] integer
        self.acc = None  # [N_ACC, batch, kv_heads, capacity] the score dtype
        self.qp = None  # [N_ROWS, batch, kv_heads, capacity] float16: int8 slots' scales and zero points
        self.pins_seen = None  # the pins the protection keys were computed for
        self.roll_floor = 0  # no key sits at a position below this (rolling positions)
        self.step = None  # the decode step's views and scratch buffers, made at its first run
        # the Eviction its decode step uses: one shared by every layer of its cache, whose buffers
        # are views of one stacked buffer each (H2OCache.stack_layers), or its own
        self.eviction = None
        self._live = None

    @property
    def buffers(self):
        """(kv, meta, acc, qp): every buffer that holds the slots, each [rows, batch, kv_heads,
        capacity, ...] (qp None but for int8 slots): what moves when a slot or a batch row moves."""
        return self.kv, self.meta, self.acc, self.qp

    @property
    def capacity(self):
        return self.kv.shape[3] if self.kv is not None else 0

    def _forget_views(self):
        """The slot count or the buffers changed: the live views are made again at their next use.
        Lazily, because the growing path (a layer below its budget, or an unbounded one) changes
        the count every step while nothing in the step reads them (a dozen views a layer saved)."""
        self._live = None

    def _live_views(self):
        """(keys, values, token_ids, positions, scores, queries): views of the first n_slots."""
        if self._live is None:
            if self.kv is None:
                self._live = (None,) * 6
            else:
                n = self.n_slots
                self._live = (self.kv[0, :, :, :n], self.kv[1, :, :, :n], self.meta[IDS, :, :, :n],
                              self.meta[POS, :, :, :n], self.acc[SCORE, :, :, :n], self.acc[QUERIES, :, :, :n])
        return self._live

    keys = property(lambda self: self._live_views()[0], doc="[batch, kv_heads, slots, head_dim]")
    values = property(lambda self: self._live_views()[1], doc="[batch, kv_heads, slots, head_dim]")
    token_ids = property(lambda self: self._live_views()[2], doc="[batch, kv_heads, slots] absolute token index")
    positions = property(lambda self: self._live_views()[3], doc="[batch, kv_heads, slots] RoPE position")
    scores = property(lambda self: self._live_views()[4], doc="[batch, kv_heads, slots] attention mass")
    queries = property(lambda self: self._live_views()[5], doc="[batch, kv_heads, slots] queries that saw it")

    # --- what transformers asks of a layer ------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("H2OLayer is updated through H2OCache")

    def get_seq_length(self):
        return self.n_seen

    def get_mask_sizes(self, query_length):
        # kv index j of the attended keys stands for token n_seen - n_slots + j: the new tokens
        # come last, so transformers' causal mask (used by sdpa fallbacks) comes out right.
        return self.n_slots + query_length, self.n_seen - self.n_slots

    def get_max_length(self):
        return -1

    # --- reading ----------------------------------------------------------------------------------
    def read_slots(self):
        """(token_ids long, heavy-hitter scores), each [batch, kv_heads, slots], copied from one
        reading of the buffers (None before it holds anything): safe while another thread feeds the
        layer (the app's panel does this), where two property reads could see two slot counts."""
        kv, meta, acc, n = self.kv, self.meta, self.acc, self.n_slots
        if kv is None:
            return None
        scores = heavy_score(acc[SCORE, :, :, :n], acc[QUERIES, :, :, :n], self.config.score)
        return meta[IDS, :, :, :n].long(), scores.clone()

    def widened(self, dtype):
        """(keys, values) [batch, kv_heads, slots, head_dim] in `dtype`: copies of the live slots, int8
        ones widened with their scales (what attention reads), for code that wants plain tensors."""
        n = self.n_slots
        if self.kv.dtype == CODES:
            return tuple(dequantize(self.kv[:, :, :, :n], self.qp[SCALES, :, :, :n], self.qp[ZEROS, :, :, :n], dtype))
        return self.keys.to(dtype, copy=True), self.values.to(dtype, copy=True)

    def snapshot(self):
        buffers = None if self.kv is None else tuple(None if b is None else b.clone() for b in self.buffers)
        return self.n_seen, self.n_slots, self.roll_floor, buffers

    @staticmethod
    def state_tensors(state, prefix):
        """A `snapshot()` as named tensors (`prefix` kv, meta: meta and acc packed as one integer
        tensor, `pack_meta`; qp for int8 slots; none before the layer holds anything)
        and its counts (n_seen, n_slots, roll_floor): what a saved cache file holds of this layer."""
        n_seen, n_slots, roll_floor, buffers = state
        tensors = {} if buffers is None else {prefix + "kv": buffers[0], prefix + "meta": pack_meta(*buffers[1:3])}
        if buffers is not None and buffers[3] is not None:
            tensors[prefix + "qp"] = buffers[3]
        return tensors, (n_seen, n_slots, roll_floor)

    @staticmethod
    def state_token_ids(state):
        """[batch, kv_heads, slots] the token in each live slot of a `snapshot()` (None: none)."""
        _, n_slots, _, buffers = state
        return None if buffers is None else buffers[1][IDS, :, :, :n_slots].long()

    @staticmethod
    def state_from(kv, meta, qp, counts, kv_heads, head_dim, dtype, limits, kv_dtype=None):
        """The `snapshot()` that `state_tensors` gave (kv, meta None for a layer that held
        nothing; qp None but for int8 slots), checked against the model (kv heads, head_dim,
        dtype), how the cache stores keys and values (`kv_dtype`: int8, or the model's dtype when
        None) and the resolved `limits`: ValueError saying what does not fit, before anything is
        touched."""
        n_seen, n_slots, roll_floor = counts
        if not 0 <= roll_floor <= n_seen or not 0 <= n_slots <= n_seen:
            raise ValueError(f"inconsistent counts (seen {n_seen}, slots {n_slots}, roll floor {roll_floor})")
        if kv is None or meta is None:
            if kv is not None or meta is not None or n_seen:
                raise ValueError("a layer's keys and values are missing")
            return 0, 0, 0, None
        kv_dtype = kv_dtype or dtype
        if kv.dtype != kv_dtype or meta.dtype != INT_OF.get(score_dtype(dtype)):
            raise ValueError(f"buffers of {kv.dtype} / {meta.dtype}, the cache stores {kv_dtype} for a model "
                             f"in {dtype}")
        if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[2] != kv_heads or kv.shape[4] != head_dim:
            raise ValueError(f"keys and values of shape {list(kv.shape)}, the model has {kv_heads} KV heads of "
                             f"{head_dim}")
        capacity = kv.shape[3]
        if kv.dtype == CODES and qp is None and list(meta.shape) == [N_META + N_ACC + N_ROWS, *kv.shape[1:4]]:
            raise ValueError("it holds int8 scales at float32, as h2o-chat stored them before float16")
        if list(meta.shape) != [N_META + N_ACC, *kv.shape[1:4]]:
            raise ValueError(f"slot data of shape {list(meta.shape)} for keys of shape {list(kv.shape)}")
        if kv.dtype == CODES and (qp is None or qp.dtype != QP_DTYPE or list(qp.shape) != [N_ROWS, *kv.shape[1:4]]):
            raise ValueError(f"int8 keys and values without their {QP_DTYPE} scales and zero points")
        if kv.dtype != CODES and qp is not None:
            raise ValueError("scales and zero points beside keys and values that are not int8")
        meta, acc = unpack_meta(meta, score_dtype(dtype))
        bounded = limits is not None and limits.budget is not None
        if n_slots > capacity or (bounded and (capacity != limits.budget + 1 or n_slots > limits.budget)):
            raise ValueError(f"{n_slots} slots in buffers of {capacity} for a budget of "
                             f"{limits.budget if bounded else 'none'}")
        ids = meta[IDS, :, :, :n_slots]
        if n_slots and (int(ids.min()) < 0 or int(ids.max()) >= n_seen):
            raise ValueError("slots hold tokens that were never fed")
        return n_seen, n_slots, roll_floor, (kv, meta, acc, qp)

    def restore(self, state, adopt=False):
        """Back to a `snapshot()` (which stays valid, unless `adopt`: its buffers may become the
        layer's own, for a state read from a file and used once). Buffers of the same shape are
        written in place, so the decode step's views stay valid."""
        n_seen, n_slots, roll_floor, buffers = state
        if buffers is None:
            self.set_buffers(None, None, None, None, 0)
        elif self.kv is not None and self.kv.shape == buffers[0].shape:
            for mine, saved in zip(self.buffers, buffers):
                if mine is not None:
                    mine.copy_(saved)
            self.n_slots = n_slots
            self._forget_views()
        elif adopt:
            self.set_buffers(*buffers, n_slots)
        else:
            self.set_buffers(*(None if b is None else b.clone() for b in buffers), n_slots)
        self.n_seen, self.roll_floor = n_seen, roll_floor
        self.pins_seen = None  # the snapshot's keys were made for its own pins: the cache's are set again

    # --- buffers ----------------------------------------------------------------------------------
    def set_buffers(self, kv, meta, acc, qp, n_slots):
        """Hold these buffers (chat/batch.py hands a layer views of a shared arena's row, and back);
        qp is None but for int8 slots."""
        self.kv, self.meta, self.acc, self.qp, self.n_slots = kv, meta, acc, qp, n_slots
        self.step = self.eviction = None
        self.is_initialized = kv is not None
        self._forget_views()

    def allocate(self, capacity, like):
        """Buffers of `capacity` slots, the live slots copied over (like: [batch, kv_heads, n, head_dim],
        the model's keys)."""
        b, h, _, d = like.shape
        kv_dtype = CODES if self.config.kv_quant == "int8" else like.dtype
        kv = torch.zeros(2, b, h, capacity, d, dtype=kv_dtype, device=like.device)
        meta = torch.zeros(N_META, b, h, capacity, dtype=INT_OF[score_dtype(like.dtype)], device=like.device)
        acc = torch.zeros(N_ACC, b, h, capacity, dtype=score_dtype(like.dtype), device=like.device)
        qp = torch.zeros(N_ROWS, b, h, capacity, dtype=QP_DTYPE, device=like.device) if kv_dtype == CODES else None
        if self.kv is not None:
            kv[:, :, :, : self.n_slots] = self.kv[:, :, :, : self.n_slots]
            meta[..., : self.n_slots] = self.meta[..., : self.n_slots]
            acc[..., : self.n_slots] = self.acc[..., : self.n_slots]
            if qp is not None:
                qp[..., : self.n_slots] = self.qp[..., : self.n_slots]
        self.set_buffers(kv, meta, acc, qp, self.n_slots)

    def refresh_protection(self, n_sink, pins):
        """The live slots' protection keys for these pins (nothing to do if they were made for them)."""
        if pins is self.pins_seen:
            return
        if self.kv is not None:
            self.meta[KEY, :, :, : self.n_slots] = protection_key(self.token_ids, n_sink, pins)
        self.pins_seen = pins

    # --- one forward step -------------------------------------------------------------------------
    def attend(self, keys, values, query, scaling, limits: Budget, pins):
        """This step's new keys, values [batch, kv_heads, n, head_dim] and queries [batch, q_heads,
        n, head_dim] -> attention output [batch, n, q_heads, head_dim], scoring and evicting, chunk
        by chunk (`decode` is the step of a full layer)."""
        self.refresh_protection(limits.n_sink, pins)
        n, chunk = keys.shape[2], self.config.prefill_chunk
        outs = [self.attend_chunk(keys[:, :, s : s + chunk], values[:, :, s : s + chunk], query[:, :, s : s + chunk],
                                  scaling, limits, pins) for s in range(0, n, chunk)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def attend_chunk(self, keys, values, query, scaling, limits, pins):
        """The general path: a prefill chunk, or a decode step before the layer is full. keys,
        values [batch, kv_heads, n, head_dim], query [batch, q_heads, n, head_dim] -> output
        [batch, n, q_heads, head_dim]. Writes the chunk, attends, scores, evicts."""
        b, h, n, d = keys.shape
        budget = limits.budget
        total = self.n_slots + n
        if self.kv is None or (budget is None and total > self.capacity):
            # bounded layers get their final size (budget + 1 spare slot) once; unbounded ones
            # grow 256 slots at a time instead of copying everything every step
            self.allocate(budget + 1 if budget is not None else -(-total // GROWTH) * GROWTH, keys)
        int8 = self.qp is not None
        if n == 1 and total <= self.capacity:
            self._write_token(keys, values, limits.n_sink, pins)
        elif total <= self.capacity:
            s = slice(self.n_slots, total)
            self.kv[:, :, :, s], self.acc[..., s], new_qp = self._new_slots(keys, values)
            if int8:
                self.qp[..., s] = new_qp
            self.meta[..., s] = self._new_meta(b, h, n, limits.n_sink, pins)
        if total <= self.capacity:
            kv, meta, acc = self.kv[:, :, :, :total], self.meta[..., :total], self.acc[..., :total]
            qp = self.qp[..., :total] if int8 else None
        else:  # a chunk larger than the spare room: attend over temporaries, keep into the buffers
            new_kv, new_acc, new_qp = self._new_slots(keys, values)
            kv = torch.cat((self.kv[:, :, :, : self.n_slots], new_kv), dim=3)
            meta = torch.cat((self.meta[..., : self.n_slots], self._new_meta(b, h, n, limits.n_sink, pins)), dim=3)
            acc = torch.cat((self.acc[..., : self.n_slots], new_acc), dim=3)
            qp = torch.cat((self.qp[..., : self.n_slots], new_qp), dim=3) if int8 else None
        self.n_seen += n
        read = dequantize(kv, qp[SCALES], qp[ZEROS], query.dtype) if int8 else kv
        out, probs = scoring.grouped_attention(query, read[0], read[1], scaling)
        scoring.add_mass(acc[SCORE], acc[QUERIES], probs, self.config.score, self.config.decay)
        evicted = budget is not None and total > budget
        if evicted:
            protected = meta[KEY] >= self.n_seen - limits.n_recent
            ranks = priority(self.config.policy, self.config.score, meta[IDS], acc[SCORE], acc[QUERIES])
            keep = select_keep(meta[IDS], ranks, protected, budget)
            kept_kv = kv.gather(3, keep[None, ..., None].expand(2, -1, -1, -1, d))
            kept_meta = meta.gather(3, keep[None].expand(N_META, -1, -1, -1))
            kept_acc = acc.gather(3, keep[None].expand(acc.shape[0], -1, -1, -1))
            self.kv[:, :, :, :budget], self.meta[..., :budget], self.acc[..., :budget] = kept_kv, kept_meta, kept_acc
            if int8:
                self.qp[..., :budget] = qp.gather(3, keep[None].expand(N_ROWS, -1, -1, -1))
            total = budget
        self.n_slots = total
        self._forget_views()
        if evicted:
            self.maybe_roll(limits)
        return out

    def make_step(self, group, dtype, scaling, alone):
        """The decode step's views and scratch over this layer's buffers, made once (the host's part:
        a compiled step never sees one made), for queries of `group` heads per KV head in `dtype`;
        `alone`: with an Eviction of its own (else the cache's layers share one, `stack_layers`)."""
        if self.step is None:
            wide = self.wide.for_slots(self.kv, self.acc.dtype)
            self.step = DecodeStep.over(self.kv, self.acc, self.qp, group, dtype, scaling, wide)
        if alone and (self.eviction is None or self.eviction.layers > 1):
            self.eviction = Eviction.over(*(None if b is None else b[None] for b in self.buffers))

    def advance(self, limits):
        """After a decode step (step.step_layer, alone or in a batch) wrote one token into the slots: count it
        (a free slot was filled while below the budget) and re-lay positions if due."""
        self.n_seen += 1
        if self.n_slots < limits.budget:
            self.n_slots += 1
            self._forget_views()
        self.maybe_roll(limits)

    def maybe_roll(self, limits):
        """Re-lay every head's keys at contiguous positions ending right before the next query,
        once the oldest key could be more than twice the budget (at most the trained context)
        behind it.

        The host decides, without reading the device: after a re-lay no key sits below
        `roll_floor` (before any, 0), and each step the span can grow by at most one. With sinks
        the bound is exact (the sink is the oldest key, never evicted); without, a re-lay can
        come earlier than needed, which keeps the guarantee. Re-rotating every step would keep
        distances within the budget exactly, but costs a pass over the whole cache per token and
        rounds each key once per step (drift in bf16). Doing it when the span reaches twice the
        budget costs one pass per ~budget tokens, and no distance the model sees exceeds
        2 x budget (nor the trained context)."""
        span = min(2 * limits.budget, self.max_positions)
        if self.config.positions != "rolling" or self.n_seen - self.roll_floor <= span:
            return
        if self.inv_freq.device != self.kv.device:
            self.inv_freq = self.inv_freq.to(self.kv.device)
        rank = self.token_ids.argsort(dim=-1).argsort(dim=-1)
        target = self.n_seen - self.n_slots + rank
        if self.kv.dtype != CODES:
            rotate_keys(self.keys, target - self.positions, self.inv_freq)
        else:  # int8 keys: widened, rotated, quantized again (one more rounding per re-lay)
            n, qp = self.n_slots, self.qp
            keys = dequantize(self.keys, qp[KEY_SCALE, :, :, :n], qp[KEY_ZERO, :, :, :n], self.acc.dtype)
            rotate_keys(keys, target - self.positions, self.inv_freq)
            self.keys[:], qp[KEY_SCALE, :, :, :n], qp[KEY_ZERO, :, :, :n] = quantize(keys, self.acc.dtype)
        self.positions.copy_(target)
        self.roll_floor = self.n_seen - self.n_slots

    def _new_slots(self, keys, values):
        """New keys, values [b, h, n, head_dim] as slots hold them: kv [2, b, h, n, head_dim] (int8
        for int8 slots), acc [N_ACC, b, h, n] (score and queries zero) and qp [N_ROWS, b, h, n] (int8
        slots' scales and zero points; None for the others)."""
        kv, acc_dtype = torch.stack((keys, values)), score_dtype(keys.dtype)
        acc = kv.new_zeros(N_ACC, *kv.shape[1:4], dtype=acc_dtype)
        if self.config.kv_quant == "none":
            return kv, acc, None
        codes, scales, zeros = quantize(kv, acc_dtype)
        return codes, acc, torch.cat((scales, zeros))  # [N_ROWS, b, h, n]: KEY_SCALE, VALUE_SCALE, KEY_ZERO, VALUE_ZERO

    def _new_meta(self, b, h, n, n_sink, pins):
        """[N_META, b, h, n]: the meta of the next n tokens."""
        ids = torch.arange(self.n_seen, self.n_seen + n, device=self.meta.device, dtype=self.meta.dtype)
        meta = self.meta.new_zeros(N_META, b, h, n)
        meta[IDS], meta[POS] = ids, ids  # new keys come rotated to their true position
        meta[KEY] = protection_key(ids, n_sink, pins)
        return meta

    def _write_token(self, keys, values, n_sink, pins):
        """One new token ([batch, kv_heads, 1, head_dim]) into the free slot n_slots, its meta
        filled in place (what `_new_meta` gives for n = 1, without its temporaries)."""
        slot = self.n_slots
        kv, meta = self.kv[:, :, :, slot], self.meta[..., slot]  # [2, b, h, d], [N_META, b, h]
        meta[IDS : KEY + 1].fill_(self.n_seen)  # its id, its position, its protection key
        if never_evicted(self.n_seen, n_sink, pins):
            meta[KEY].fill_(torch.iinfo(meta.dtype).max)
        self.acc[..., slot].fill_(0)
        if self.kv.dtype == CODES:
            new_kv, _, new_qp = self._new_slots(keys, values)
            kv.copy_(new_kv[:, :, :, 0])
            self.qp[..., slot].copy_(new_qp[..., 0])
            return
        kv[0].copy_(keys[:, :, 0])
        kv[1].copy_(values[:, :, 0])


class H2OCache(Cache):
    """A transformers KV cache that keeps a fixed number of slots per layer and KV head, evicting by
    the Heavy-Hitter Oracle (or window / sink / full), for LLaMA-family models.

    Constructing it switches the model's attention to "h2o" (plain sdpa for any other cache), so
    that each layer hands it the attention mass per KV head; nothing else is needed::

        cache = H2OCache(model, policy="h2o", budget=256, n_sink=4, n_recent=128)
        out = model.generate(input_ids, cache=cache, max_new_tokens=200)

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A LLaMA-family model (model types llama, mistral, qwen2) without sliding-window layers.
    config : CacheConfig, optional
        The settings; or give CacheConfig's fields as keywords (policy, budget, n_sink, n_recent,
        score, decay, positions, prefill_chunk). Bad settings raise ValueError before any work.

    Notes
    -----
    Per layer `i`, for input ids `[batch, seq]` (batch rows must not be padded):

    - `layers[i].keys`, `layers[i].values`: `[batch, kv_heads, slots, head_dim]`, `slots <= budget`
    - `token_ids(i)`: `[batch, kv_heads, slots]` long, the absolute index of the token in each slot
    - `scores(i)`: `[batch, kv_heads, slots]`, each slot's heavy-hitter score
    - `positions(i)`: `[batch, kv_heads, slots]` long, the RoPE position each key is rotated to
    - `attend(i, query, scaling)`: query `[batch, q_heads, n, head_dim]` ->
      `[batch, n, q_heads, head_dim]`

    `protect(start, end)` / `set_pins(ranges)` never evict absolute tokens `[start, end)` (they
    count against the budget); `snapshot()` / `restore(snapshot)` go back to a saved state;
    `kv_bytes()` and `full_kv_bytes()` compare the memory held with a cache that never evicts.
    """

    def __init__(self, model, config: CacheConfig | None = None, **settings):
        self.config = config if config is not None else CacheConfig(**settings)  # CacheConfig owns the defaults
        text_config = model.config.get_text_config(decoder=True)
        check_model(text_config, self.config)
        # absolute [start, end) ranges; a new list at every change, never changed in place: layers see it by identity
        self.pins: list[tuple[int, int]] = []
        self.max_positions = text_config.max_position_embeddings
        self._warned_positions = False
        self.limits: Budget | None = None  # resolved at the first input when the budget is a fraction
        n_layers = text_config.num_hidden_layers
        if not isinstance(self.config.budget, float):
            self.limits = self.config.resolve(0, n_layers)
        scoring.register()
        if model.config._attn_implementation != scoring.ATTN_NAME:
            model.set_attn_implementation(scoring.ATTN_NAME)
        inv_freq = model.base_model.rotary_emb.inv_freq.detach().float()
        # what a saved state must match (import_state): the shape and dtype of the keys this model writes
        self.kv_heads = text_config.num_key_value_heads
        self.group = text_config.num_attention_heads // self.kv_heads  # query heads per KV head
        self.scaling = model.base_model.layers[0].self_attn.scaling  # the attention's, for the decode step
        self.head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.dtype = model.dtype
        self._unattended = None  # the layer whose update() has not been followed by its attend() yet
        self._rows = None  # [layers] StepRows while a decode step of full layers runs (begin to end)
        self._steps = self._evictions = None  # and its DecodeSteps, one a layer, and Evictions: [one over every layer], or one per layer
        self.wide = WideScratch()  # where int8 slots are widened for attention, one layer at a time
        super().__init__(layers=[H2OLayer(self.config, inv_freq, self.max_positions, self.wide)
                                 for _ in range(n_layers)])

    # --- what users and the ledger read -------------------------------------------------------
    def token_ids(self, layer_idx):
        """[batch, kv_heads, slots] long: absolute index of the token in each slot (None before
        the layer holds anything)."""
        ids = self.layers[layer_idx].token_ids
        return None if ids is None else ids.long()

    def scores(self, layer_idx):
        """[batch, kv_heads, slots]: each slot's heavy-hitter score (what eviction ranks by)."""
        layer = self.layers[layer_idx]
        return None if layer.kv is None else heavy_score(layer.scores, layer.queries, self.config.score)

    def read_slots(self, layer_idx):
        """(token_ids, scores), each [batch, kv_heads, slots], copied from one reading of the
        layer (None before it holds anything): safe while another thread feeds the cache."""
        return self.layers[layer_idx].read_slots()

    def positions(self, layer_idx):
        """[batch, kv_heads, slots] long: the RoPE position each cached key is rotated to."""
        pos = self.layers[layer_idx].positions
        return None if pos is None else pos.long()

    def kv_bytes(self):
        """Bytes of keys and values held now (live slots only; int8 slots with their scales and zero
        points). The
        scratch int8 slots are widened into for attention (one layer's, `WideScratch`) is not counted."""
        total = 0
        for layer in self.layers:
            if layer.kv is not None:
                total += 2 * layer.keys.nelement() * layer.keys.element_size()
                if layer.qp is not None:  # a scale and a zero point for each key and value
                    total += N_ROWS * layer.scores.nelement() * layer.qp.element_size()
        return total

    @property
    def kv_width(self):
        """How keys and values are stored, in words: "int8", or the model's dtype ("bfloat16")."""
        return "int8" if self.config.kv_quant == "int8" else width_name(self.dtype)

    def full_kv_bytes(self):
        """Bytes a cache that never evicts would hold for the tokens seen so far, at the model's width
        (DynamicCache's)."""
        per_token = sum(2 * layer.keys[0, :, :1].nelement() * self.dtype.itemsize
                        for layer in self.layers if layer.kv is not None)
        return per_token * self.get_seq_length()

    def slots_used(self, layer_idx=0):
        """Slots per batch row and KV head that layer `layer_idx` holds now (<= its budget); None:
        the mean over the layers (rounded down), what a layer holds when their budgets differ."""
        if layer_idx is None:
            return sum(layer.n_slots for layer in self.layers) // len(self.layers)
        return self.layers[layer_idx].n_slots

    # --- going back -----------------------------------------------------------------------------
    def snapshot(self):
        """A copy of the whole cache state (bounded by the budget, so cheap), for `restore`."""
        return [layer.snapshot() for layer in self.layers], self.pins, self.limits

    def restore(self, snapshot, adopt=False):
        """Return to a `snapshot` (which stays valid: it can be restored again; unless `adopt`, for
        one read from a file and used once, whose buffers the layers may keep instead of copying)."""
        layers, pins, limits = snapshot
        for layer, state in zip(self.layers, layers):
            layer.restore(state, adopt)
        self._unattended = None
        self.pins, self.limits = list(pins), limits

    # --- saving ------------------------------------------------------------------------------
    def export_state(self, snapshot):
        """A `snapshot()` as (tensors, info) for a file (chat/saved_kv.py): per layer i that holds
        anything `layer.{i}.kv` [2, batch, kv_heads, capacity, head_dim], `layer.{i}.meta`
        [N_META + N_ACC, batch, kv_heads, capacity] (integers: the scores travel as their bits) and,
        for int8 slots, `layer.{i}.qp` [N_ROWS, batch, kv_heads, capacity] float16, and
        `layer.counts` [layers, 3] (n_seen, n_slots, roll_floor); info: the pins and resolved
        limits, plain values. The kv and qp tensors are the snapshot's own (no copy); meta is packed anew."""
        layers, pins, limits = snapshot
        tensors, counts = {}, []
        for i, state in enumerate(layers):
            named, count = H2OLayer.state_tensors(state, f"layer.{i}.")
            tensors.update(named)
            counts.append(count)
        tensors["layer.counts"] = torch.tensor(counts, dtype=torch.int64)
        info = {"pins": [list(p) for p in pins], "limits": None if limits is None else
                [limits.budget, limits.n_sink, limits.n_recent]}
        return tensors, info

    def import_state(self, tensors, info):
        """The snapshot `export_state` gave, checked against this cache's model (layers, KV heads,
        head_dim, dtype) and settings before anything is touched: ValueError saying what does not
        fit. `restore` it to use it; the tensors are moved to `device` by the caller."""
        counts = tensors.get("layer.counts")
        if counts is None or counts.dtype != torch.int64 or list(counts.shape) != [len(self.layers), 3]:
            raise ValueError(f"it holds {'no' if counts is None else list(counts.shape)[0]} layers, the model has "
                             f"{len(self.layers)}")
        limits = read_limits(info.get("limits"), self.config, len(self.layers))
        pins = read_pins(info.get("pins"))
        kv_dtype = CODES if self.config.kv_quant == "int8" else self.dtype
        layers = [H2OLayer.state_from(tensors.get(f"layer.{i}.kv"), tensors.get(f"layer.{i}.meta"),
                                      tensors.get(f"layer.{i}.qp"), row,
                                      self.kv_heads, self.head_dim, self.dtype, limits and limits.layer(i), kv_dtype)
                  for i, row in enumerate(counts.tolist())]
        if len({state[0] for state in layers}) > 1:
            raise ValueError("its layers have seen different numbers of tokens")
        if layers[0][0] and limits is None:
            raise ValueError("it has seen tokens but no budget was resolved")
        return layers, pins, limits

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self._unattended = None
        self.pins = []
        if isinstance(self.config.budget, float):
            self.limits = None

    # --- pins ------------------------------------------------------------------------------
    def protect(self, start, end):
        """Never evict absolute tokens [start, end) (those still cached). They count against the
        budget; pins that would leave no room for the sinks and the recent window are refused
        (PinRefused, a ValueError that says what would make room)."""
        if not (0 <= start < end):
            raise ValueError(f"protect: need 0 <= start < end, got [{start}, {end})")
        pins = self.pins + [(start, end)]
        check_pins(pins, self.limits)
        self.pins = pins

    def set_pins(self, ranges):
        """Replace every pin with these absolute [start, end) ranges, checked as `protect` checks
        them; a refused set leaves the old pins. Ranges may lie ahead of what has been fed: a
        token is protected from the moment it is written."""
        old = self.pins
        self.pins = []
        try:
            for start, end in ranges:
                self.protect(start, end)
        except ValueError:
            self.pins = old
            raise

    def unprotect(self, start, end):
        if (start, end) not in self.pins:
            raise ValueError(f"unprotect: [{start}, {end}) is not pinned")
        pins = list(self.pins)
        pins.remove((start, end))
        self.pins = pins

    def is_pinned(self, token):
        return never_evicted(token, 0, self.pins)

    # --- the transformers Cache interface ---------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Called by transformers' attention layer with this step's new keys and values
        [batch, kv_heads, n, head_dim], which it hands on to the attention function: the "h2o"
        one (scoring.py) finds this cache in its kwargs (put there per call, so several caches
        can share a model across threads) and calls `attend`, where the probabilities are known."""
        attn_kwargs = kwargs.get("kwargs")
        if attn_kwargs is None:
            raise RuntimeError("H2OCache: this model's attention does not pass its kwargs to cache.update")
        if self._unattended is not None:
            raise RuntimeError("H2OCache: the model's attention implementation was changed away from 'h2o'")
        if layer_idx == 0:
            self.begin(key_states.shape[2])
        self._unattended = layer_idx
        attn_kwargs["h2o_cache"] = self
        return key_states, value_states

    def begin(self, n_new):
        """Before a forward of `n_new` tokens reaches layer 0: the budget resolved (a fraction is
        resolved at the first input), and a warning once the conversation passes the trained
        positions with positions='absolute'. One token into full layers takes the decode step:
        its host part is done here (`decode_rows`), so what runs between `begin` and `end` is
        tensor work only, the same at every token."""
        if self.limits is None:
            self.limits = self.config.resolve(n_new, len(self.layers))
        self.check_positions(self.layers[0].n_seen + n_new)
        self._rows = self.decode_rows() if n_new == 1 and self.limits.budget is not None else None

    def attend(self, layer_idx, query, keys, values, scaling):
        """One layer's step: its new keys, values [batch, kv_heads, n, head_dim] written in, the
        queries [batch, q_heads, n, head_dim] attended over every slot, scored, evicted; returns
        [batch, n, q_heads, head_dim]. `begin(n)` comes first, once per forward, and `end()` after
        the last layer."""
        self._unattended = None
        rows = self._rows and self._rows[layer_idx]
        if rows is not None:
            return step_layer(layer_idx, self._steps, self._evictions, keys, values, query, self.config, rows)
        return self.layers[layer_idx].attend(keys, values, query, scaling, self.limits.layer(layer_idx), self.pins)

    def end(self):
        """After a forward's last layer: the token counted in the layers that took the decode step
        (the others counted it as they wrote it), positions re-laid if due."""
        rows, self._rows = self._rows, None
        for i, layer in enumerate(self.layers if rows is not None else ()):
            if rows[i] is not None:
                layer.advance(self.limits.layer(i))

    @property
    def static_step(self):
        """Between `begin(1)` and `end()`: every layer takes the decode step (full, or filling with
        its free slots masked), whose shapes are the same at every token (what a compiled step
        needs)."""
        return self._rows is not None and all(rows is not None for rows in self._rows)

    # --- for a compiled step (models/compile.py) ------------------------------------------------
    def step_shape(self):
        """During a static step: what a compiled step's graph depends on besides the model, as a
        hashable value (the settings; per layer the buffers' shapes and dtypes)."""
        first, c = self.layers[0], self.config
        return ("alone", c.policy, c.score, c.decay, c.kv_quant, tuple(layer.kv.shape for layer in self.layers),
                first.kv.dtype, first.acc.dtype, first.meta.dtype,  # acc's and meta's shapes follow from kv's
                tuple(rows.empty is None for rows in self._rows),  # filling layers mask their free slots
                len(self._evictions))  # one for every layer (stacked), or one each

    def decode_steps(self):
        """During a static step: each layer's DecodeStep (the buffers it writes in place)."""
        return self._steps

    def evictions(self):
        """During a static step: its Evictions (step.step_layer), whose scratch it writes in place too."""
        return self._evictions

    def replica(self):
        """A cache with these settings, pins and limits and a copy of this one's state in buffers of
        its own: what a step is compiled on off the user's thread (models/compile.py), never
        touching this one."""
        twin = copy.copy(self)
        twin.wide = WideScratch()
        twin.layers = [H2OLayer(self.config, layer.inv_freq, self.max_positions, twin.wide) for layer in self.layers]
        twin._rows = twin._unattended = twin._steps = twin._evictions = None
        twin.restore(self.snapshot())
        return twin

    def full_layers(self):
        """[layers] bools: the layer holds its budget, so a new token evicts one (the decode step's
        steady state)."""
        lim = self.limits
        if lim is None or lim.budget is None:
            return [False] * len(self.layers)
        return [layer.kv is not None and layer.n_slots == lim.layer(i).budget for i, layer in enumerate(self.layers)]

    def is_full(self):
        """Every layer holds its budget."""
        return all(self.full_layers())

    def prepare_decode(self):
        """The host's part of a decode step, alone or in a batch: protection keys that follow the pins,
        and a warning for a conversation past the trained positions."""
        self.check_positions(self.layers[0].n_seen + 1)
        for layer in self.layers:
            layer.refresh_protection(self.limits.n_sink, self.pins)

    def decode_rows(self):
        """[layers] StepRows for this cache's next token, every row of its batch stepping, None for
        a layer that takes the general path (`steps_static`); None when none takes the step. A
        layer still below its budget takes it too, its free slots masked (StepRows.empty), as a
        batch's rows do: the step's shapes are the budget's from the first token, so a compiled
        step (and inference_mode) covers a chat's first turns, not only those after the budget
        fills. Each such layer's decode step is made here."""
        static = self.steps_static()
        if not any(static):
            return None
        self.prepare_decode()
        layer, lim = self.layers[0], self.limits
        b, n_seen = layer.kv.shape[1], layer.n_seen
        rows = StepRows.make([n_seen] * b, [self.next_token_kept()] * b, [True] * b,
                             self.kv_heads, self.group, lim.n_recent, self.config.decay, layer.meta.dtype,
                             layer.acc.dtype, layer.kv.device)
        per_layer, masks = [], {}
        for i, (layer, takes_step) in enumerate(zip(self.layers, static)):
            if not takes_step:
                per_layer.append(None)
                continue
            budget = lim.layer(i).budget
            if layer.n_slots < budget:  # free slots [n_slots, budget): one mask for layers alike
                key = (layer.n_slots, budget)
                if key not in masks:
                    slot = torch.arange(layer.capacity, device=layer.kv.device)
                    masks[key] = replace(rows, empty=((slot >= layer.n_slots) & (slot < budget)).view(1, 1, -1))
                per_layer.append(masks[key])
            else:
                per_layer.append(rows)
        together = self.evicts_together(per_layer)
        if together:
            self.stack_layers()
        for layer, takes_step in zip(self.layers, static):
            if takes_step:
                layer.make_step(self.group, self.dtype, self.scaling, alone=not together)
        self._steps = [layer.step for layer in self.layers]  # once a step, not once a layer (step_layer reads it per layer)
        self._evictions = [self.layers[0].eviction] if together else [layer.eviction for layer in self.layers]
        return per_layer

    def evicts_together(self, per_layer):
        """Every layer steps alike (the same rows, the same capacity: a uniform budget), so one
        Eviction serves them all; otherwise (a pyramid, layers on the general path) each has its own."""
        return all(r is per_layer[0] for r in per_layer) and len({layer.capacity for layer in self.layers}) == 1

    def stack_layers(self):
        """Make the layers' buffers views of one stacked buffer of each kind ([layers, ...]) and give
        them one Eviction over all of them, unless they have it already: a copy of the slots, once
        after a layer's buffers were made or replaced (its first input, a restore of another size,
        a batch joined or left; `H2OLayer.set_buffers` drops the layer's Eviction, so nothing holds
        the old stack once every layer has let go of it)."""
        shared = self.layers[0].eviction
        if shared is not None and shared.layers == len(self.layers) and all(
                layer.eviction is shared for layer in self.layers):
            return
        buffers = zip(*(layer.buffers for layer in self.layers))  # per kind: every layer's
        stack = tuple(None if parts[0] is None else torch.stack(parts) for parts in buffers)
        shared = Eviction.over(*stack)
        for i, layer in enumerate(self.layers):
            layer.set_buffers(*(None if b is None else b[i] for b in stack), layer.n_slots)
            layer.eviction = shared

    def steps_static(self):
        """[layers] bools: the layer takes the decode step of static shapes, full or filling: its
        buffers hold exactly budget + 1 slots (a bounded layer's, allocated at its first input; a
        restored state's may be smaller until it fills), and its budget is at most STATIC_ALWAYS or
        at least an eighth of it is live.

        Why: the step runs over every slot, free ones masked, so part of its cost grows with the
        budget (the C attention skips free slots; the eviction's ops and torch's attention do not);
        the general path's grows with the live slots, but it runs ~40% more ops a token, outside
        inference_mode and the C kernels. Measured on the embedded model (int4, 2 cores, 32-160
        live, arms alternating token by token; 2026-12-07), the step against the general path:
        8.1 against 15.4 ms a token at budget 512, 9.2 against 15.5 at 2,048, 10.8 against 16.5 at
        4,096, 12.8 against 16.5 at 8,192; on torch's ops alone (`H2O_CHAT_NATIVE=0`: a float32
        model, a GPU) 14.4 against 16.8 at 512, 22.4 against 17.6 at 4,096. So a budget up to
        4,096 (the default is 512) takes the step from a chat's first token, and a larger one once
        an eighth of it is live.
        """
        lim = self.limits
        if lim is None or lim.budget is None:
            return [False] * len(self.layers)
        return [layer.kv is not None and layer.capacity == lim.layer(i).budget + 1
                and (lim.layer(i).budget <= STATIC_ALWAYS or STATIC_FROM * layer.n_slots >= lim.layer(i).budget)
                for i, layer in enumerate(self.layers)]

    def next_token_kept(self):
        """The next token is never evicted: a sink of a short chat, or pinned (policy.never_evicted)."""
        return never_evicted(self.layers[0].n_seen, self.limits.n_sink, self.pins)

    def advance(self):
        """Count a decode step's token in every layer (after `end`, or a batch's step)."""
        for i, layer in enumerate(self.layers):
            layer.advance(self.limits.layer(i))

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("H2OCache does not support beam search")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("H2OCache cannot be cropped: evicted tokens are gone")

    def check_positions(self, n_seen_after):
        if (self.config.positions == "absolute" and n_seen_after > self.max_positions
                and not self._warned_positions):
            self._warned_positions = True
            warnings.warn(
                f"H2OCache(positions='absolute'): the conversation has passed the model's "
                f"{self.max_positions} trained positions; quality will degrade. Use positions='rolling' "
                f"to keep every distance within the budget.", stacklevel=3)


def width_name(dtype):
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def read_limits(value, config: CacheConfig, n_layers):
    """Saved limits ([budget, n_sink, n_recent] or None) as a Budget these settings can have
    resolved to for `n_layers` layers (exactly their own for a whole-number budget; each layer's
    budget as `budget_shape` shares it); ValueError otherwise."""
    if value is None:
        if isinstance(config.budget, float):
            return None
        raise ValueError("the budget was never resolved")
    if not (isinstance(value, list) and len(value) == 3 and (value[0] is None or type(value[0]) is int)
            and all(type(v) is int and v >= 0 for v in value[1:])):
        raise ValueError(f"unreadable limits {value!r}")
    limits = Budget(*value)
    if not isinstance(config.budget, float):
        if limits != config.resolve(0):
            raise ValueError(f"limits {value} are not those of these settings")
        return config.resolve(0, n_layers)
    if limits.budget is None or limits.budget < 1 or limits.n_sink + limits.n_recent > limits.budget:
        raise ValueError(f"limits {value} cannot come from these settings")
    if config.budget_shape == "uniform":
        return limits
    try:
        return Budget(*value, layer_budgets(*value, n_layers))
    except ValueError:
        raise ValueError(f"limits {value} cannot come from these settings") from None


def read_pins(value):
    """Saved pins ([[start, end]]) as the cache holds them; ValueError otherwise."""
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)
                                              and 0 <= p[0] < p[1] for p in value):
        raise ValueError(f"unreadable pins {value!r}")
    return [tuple(p) for p in value]


def check_model(text_config, config: CacheConfig):
    """Refuse, before any work, what this cache cannot run correctly."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"H2OCache supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}")
    layer_types = getattr(text_config, "layer_types", None) or []
    if getattr(text_config, "use_sliding_window", True) and getattr(text_config, "sliding_window", None) \
            or any(t != "full_attention" for t in layer_types):
        raise ValueError("H2OCache does not support sliding-window attention layers")
    rope_type = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if config.positions == "rolling" and rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"positions='rolling' needs a static RoPE ({', '.join(STATIC_ROPE_TYPES)}), "
                         f"not {rope_type!r}; use positions='absolute'")
