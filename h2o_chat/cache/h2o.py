"""H2OCache: a transformers Cache that keeps at most `budget` tokens per layer and KV head.

Per layer it holds, for each batch row and KV head, `slots` cached tokens:
    keys, values   [batch, kv_heads, slots, head_dim]
    token_ids      [batch, kv_heads, slots]  absolute index of the token in each slot
    scores         [batch, kv_heads, slots]  attention mass received (float32, or float64)
    queries        [batch, kv_heads, slots]  how many queries could see the token ("mean" score)
    positions      [batch, kv_heads, slots]  RoPE position the key is rotated to now
Heads evict independently, so each head holds different tokens but the same number of them and
the tensors stay dense. Slot order means nothing to attention; `token_ids` says who is where.

Storage: two packed buffers per layer, so the fields that move together move in one scatter:
    kv    [2, batch, kv_heads, capacity, head_dim]  keys then values, in the model's dtype
    meta  [5, batch, kv_heads, capacity]  integers (int32, int64 for a float64 model): token id,
          position, protection key (see policy.protection_key), and the bits of the float32
          (float64) score and query count. Moves go through the integer view, so they are
          bit-exact; arithmetic on the scores goes through a float view of the same memory.

One forward step of a layer (`attend`, called from the "h2o" attention function):
    for each chunk of at most `prefill_chunk` new tokens:
        write the chunk into free slots -> attend over all slots -> add the attention mass to
        the scores -> if slots > budget, evict back to budget.
Chunking inside the layer gives the same result as feeding the model chunk by chunk (a chunk at
layer l only depends on earlier tokens at layer l-1), yet a plain `model.generate` or
`model(ids)` gets it for free, and no [heads, n, n] matrix of a long prompt is ever built.

The decode step is the hot path. A bounded layer's buffers are allocated once with budget + 1
slots and never change size. Once full, a step (`H2OLayer.decode_step`) writes the new token
into the spare last slot, attends over all budget + 1, adds the mass, picks one victim per head
and scatters the spare slot into it ("cache replace"): about twenty batched ops into buffers
and views made once, no allocation, no host sync. Positions re-roll on a schedule the host
knows (every head's span grows by at most one a step), never on a value read from the device.
"""

import warnings
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import scoring
from .config import Budget, CacheConfig
from .policy import protection_key, select_keep

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GROWTH = 256  # slots an unbounded layer grows by
IDS, POS, KEY, SCORE, QUERIES = range(5)  # rows of a layer's meta buffer
N_META = 5
INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}  # same width: one is a view of the other


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


def score_dtype(model_dtype):
    return torch.promote_types(model_dtype, torch.float32)


class H2OLayer(CacheLayerMixin):
    """One layer's slots. Buffers have room for `capacity` slots; the first `n_slots` are live.

    `keys`, `values`, `token_ids`, `positions`, `scores`, `queries` are views of the live slots,
    read-only properties made at their first use after the slot count or the buffers change
    (so neither a steady decode step nor a growing one makes them)."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        self.is_initialized = False
        self.n_seen = 0  # tokens this layer has been given, evicted or not
        self.n_slots = 0
        self.kv = None  # [2, batch, kv_heads, capacity, head_dim]
        self.meta = None  # [N_META, batch, kv_heads, capacity] integer
        self.pending = None  # (keys, values) handed over by update(), consumed by attend()
        self.pins_seen = None  # the cache's pins version the protection keys were computed for
        self.roll_floor = 0  # no key sits at a position below this (rolling positions)
        self.step = None  # the decode step's views and scratch buffers, made at its first run
        self._views()

    @property
    def capacity(self):
        return self.kv.shape[3] if self.kv is not None else 0

    @property
    def meta_f(self):
        """The meta buffer seen as floats (the score rows)."""
        return self.meta.view(score_dtype(self.kv.dtype))

    def _views(self):
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
                n, meta_f = self.n_slots, self.meta_f
                self._live = (self.kv[0, :, :, :n], self.kv[1, :, :, :n], self.meta[IDS, :, :, :n],
                              self.meta[POS, :, :, :n], meta_f[SCORE, :, :, :n], meta_f[QUERIES, :, :, :n])
        return self._live

    keys = property(lambda self: self._live_views()[0], doc="[batch, kv_heads, slots, head_dim]")
    values = property(lambda self: self._live_views()[1], doc="[batch, kv_heads, slots, head_dim]")
    token_ids = property(lambda self: self._live_views()[2], doc="[batch, kv_heads, slots] absolute token index")
    positions = property(lambda self: self._live_views()[3], doc="[batch, kv_heads, slots] RoPE position")
    scores = property(lambda self: self._live_views()[4], doc="[batch, kv_heads, slots] attention mass")
    queries = property(lambda self: self._live_views()[5], doc="[batch, kv_heads, slots] queries that saw it")

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

    def reset(self):
        self.__init__()

    def set_buffers(self, kv, meta, n_slots):
        self.kv, self.meta, self.n_slots, self.step = kv, meta, n_slots, None
        self.is_initialized = kv is not None
        self._views()

    def allocate(self, capacity, like):
        """Buffers of `capacity` slots, the live slots copied over (like: [batch, kv_heads, n, head_dim])."""
        b, h, _, d = like.shape
        kv = like.new_zeros(2, b, h, capacity, d)
        meta = torch.zeros(N_META, b, h, capacity, dtype=INT_OF[score_dtype(like.dtype)], device=like.device)
        if self.kv is not None:
            kv[:, :, :, : self.n_slots] = self.kv[:, :, :, : self.n_slots]
            meta[..., : self.n_slots] = self.meta[..., : self.n_slots]
        self.set_buffers(kv, meta, self.n_slots)

    def new_meta(self, b, h, n, cache):
        """[N_META, b, h, n]: the meta of the next n tokens (scores and query counts zero)."""
        ids = torch.arange(self.n_seen, self.n_seen + n, device=self.meta.device, dtype=self.meta.dtype)
        meta = self.meta.new_zeros(N_META, b, h, n)
        meta[IDS], meta[POS] = ids, ids  # new keys come rotated to their true position
        meta[KEY] = protection_key(ids, cache.limits.n_sink, cache.pins)
        return meta

    def write_token(self, cache, keys, values):
        """One new token ([batch, kv_heads, 1, head_dim]) into the free slot n_slots, its meta
        filled in place (what `new_meta` gives for n = 1, without its temporaries)."""
        slot = self.n_slots
        kv, meta = self.kv[:, :, :, slot], self.meta[..., slot]  # [2, b, h, d], [N_META, b, h]
        kv[0].copy_(keys[:, :, 0])
        kv[1].copy_(values[:, :, 0])
        meta[IDS : KEY + 1].fill_(self.n_seen)  # its id, its position, its protection key
        if self.n_seen < cache.limits.n_sink or cache.is_pinned(self.n_seen):
            meta[KEY].fill_(torch.iinfo(meta.dtype).max)
        meta[SCORE:].fill_(0)

    def refresh_protection(self, cache):
        """Pins changed: recompute the live slots' protection keys."""
        if self.kv is not None and cache.limits is not None:
            self.meta[KEY, :, :, : self.n_slots] = protection_key(self.token_ids, cache.limits.n_sink, cache.pins)
        self.pins_seen = cache.pins_version

    # --- the general path: a prefill chunk, or a decode step before the layer is full -------
    def attend_chunk(self, cache, keys, values, query, scaling):
        """keys, values [batch, kv_heads, n, head_dim], query [batch, q_heads, n, head_dim] ->
        output [batch, n, q_heads, head_dim]. Writes the chunk, attends, scores, evicts."""
        b, h, n, d = keys.shape
        budget = cache.limits.budget
        total = self.n_slots + n
        if self.kv is None or (budget is None and total > self.capacity):
            # bounded layers get their final size (budget + 1 spare slot) once; unbounded ones
            # grow 256 slots at a time instead of copying everything every step
            self.allocate(budget + 1 if budget is not None else -(-total // GROWTH) * GROWTH, keys)
        if n == 1 and total <= self.capacity:
            self.write_token(cache, keys, values)
            kv, meta = self.kv[:, :, :, :total], self.meta[..., :total]
        elif total <= self.capacity:
            s = slice(self.n_slots, total)
            self.kv[0, :, :, s], self.kv[1, :, :, s], self.meta[..., s] = keys, values, self.new_meta(b, h, n, cache)
            kv, meta = self.kv[:, :, :, :total], self.meta[..., :total]
        else:  # a chunk larger than the spare room: attend over temporaries, keep into the buffers
            kv = torch.cat((self.kv[:, :, :, : self.n_slots], torch.stack((keys, values))), dim=3)
            meta = torch.cat((self.meta[..., : self.n_slots], self.new_meta(b, h, n, cache)), dim=3)
        self.n_seen += n
        meta_f = meta.view(score_dtype(keys.dtype))
        out, probs = scoring.grouped_attention(query, kv[0], kv[1], scaling)
        cache._add_scores(meta_f[SCORE], meta_f[QUERIES], probs)
        evicted = budget is not None and total > budget
        if evicted:
            lim = cache.limits
            protected = meta[KEY] >= self.n_seen - lim.n_recent
            keep = select_keep(meta[IDS], cache._priority(meta[IDS], meta_f), protected, budget)
            kept_kv = kv.gather(3, keep[None, ..., None].expand(2, -1, -1, -1, d))
            kept_meta = meta.gather(3, keep[None].expand(N_META, -1, -1, -1))
            self.kv[:, :, :, :budget], self.meta[..., :budget] = kept_kv, kept_meta
            total = budget
        self.n_slots = total
        self._views()
        if evicted:
            cache._maybe_roll(self)
        return out

    # --- the hot path: one token into a full layer -----------------------------------------
    def decode_step(self, cache, keys, values, query, scaling):
        """One new token ([batch, kv_heads, 1, head_dim]) into a layer holding `budget` slots:
        write it into the spare slot, attend over all, score, move the spare into the victim.
        Returns [batch, 1, q_heads, head_dim]."""
        s = self.step
        if s is None:
            s = self.step = make_step(self.kv, self.meta, query, scaling)
        s.spare_k.copy_(keys)
        s.spare_v.copy_(values)
        s.spare_ints.fill_(self.n_seen)  # its id, its position, its protection key
        if cache.is_pinned(self.n_seen):
            s.spare_key.fill_(torch.iinfo(self.meta.dtype).max)
        s.spare_acc.fill_(0)
        self.n_seen += 1
        s.threshold.fill_(self.n_seen - cache.limits.n_recent)
        out = attend_and_replace(s, self.kv, self.meta, query, cache.config)
        cache._maybe_roll(self)
        return out


def make_step(kv, meta, query, scaling):
    """The decode step's views over whole buffers (budget + 1 slots) and its scratch buffers, made
    once. kv [2, batch, kv_heads, budget + 1, head_dim], meta [N_META, batch, kv_heads, budget + 1],
    query [batch, q_heads, 1, head_dim]."""
    meta_f = meta.view(score_dtype(kv.dtype))
    _, b, h, cap, d = kv.shape
    group, spare = query.shape[1] // h, cap - 1
    acc, dev = meta_f.dtype, kv.device
    return SimpleNamespace(
        group=group, bh=b * h,
        spare_k=kv[0, :, :, spare:], spare_v=kv[1, :, :, spare:],  # [b, h, 1, d]
        spare_kv=kv[:, :, :, spare:], spare_meta=meta[..., spare:],
        spare_ints=meta[IDS : KEY + 1, :, :, spare], spare_key=meta[KEY, :, :, spare],
        spare_acc=meta[SCORE:, :, :, spare],
        keys_t=kv[0].view(b * h, cap, d).transpose(1, 2), values=kv[1].view(b * h, cap, d),
        ids=meta[IDS], key=meta[KEY], scores=meta_f[SCORE], queries=meta_f[QUERIES],
        scores3=meta_f[SCORE].view(b * h, 1, cap),
        ones=torch.ones(1, 1, group, dtype=acc, device=dev).expand(b * h, 1, group),
        scale=torch.tensor(scaling, dtype=acc, device=dev),
        one=torch.ones((), dtype=acc, device=dev), inf=torch.tensor(torch.inf, dtype=acc, device=dev),
        id_max=torch.tensor(torch.iinfo(meta.dtype).max, dtype=meta.dtype, device=dev),
        spare_index=torch.tensor(spare, device=dev),
        threshold=torch.zeros((), dtype=meta.dtype, device=dev),
        logits=kv.new_empty(b * h, group, cap), out=kv.new_empty(b * h, group, d),
        # softmax in at least float32, like transformers' eager attention: for a bf16 model
        # the logits are copied up and the probabilities down, into buffers made here
        logits_acc=torch.empty(b * h, group, cap, dtype=acc, device=dev) if acc != kv.dtype else None,
        probs=torch.empty(b * h, group, cap, dtype=acc, device=dev),
        probs_low=kv.new_empty(b * h, group, cap) if acc != kv.dtype else None,
        protected=torch.empty(b, h, cap, dtype=torch.bool, device=dev),
        rank=torch.empty(b, h, cap, dtype=acc, device=dev), lowest=torch.empty(b, h, 1, dtype=acc, device=dev),
        is_lowest=torch.empty(b, h, cap, dtype=torch.bool, device=dev),
        tiebreak=torch.empty(b, h, cap, dtype=meta.dtype, device=dev),
        victim=torch.empty(b, h, 1, dtype=torch.long, device=dev),
        stage_kv=kv.new_empty(2, b, h, 1, d), stage_meta=meta.new_empty(N_META, b, h, 1),
        # the victims as indices into the slots of every (row, head) laid end to end: one
        # index_copy_ moves the spare (a bf16 scatter_ along the slot dim is ~10x slower on CPU)
        kv_flat=kv.view(2, b * h * cap, d), meta_flat=meta.view(N_META, b * h * cap),
        slot_base=torch.arange(0, b * h * cap, cap, device=dev), flat_victim=torch.empty(b * h, dtype=torch.long, device=dev),
    )


def attend_and_replace(s, kv, meta, query, config, rows=None):
    """The decode step once the new token sits in the spare last slot (its meta written and
    s.threshold set): attend over every slot, add the mass to the scores, pick one victim per head
    and move the spare into it ("cache replace"). About twenty batched ops into the buffers of
    `make_step`: no allocation, no host sync. Returns [batch, 1, q_heads, head_dim].

    rows: None for one conversation; for conversations stacked as batch rows (batch.py), their
    per-row state: `weights` [batch * kv_heads, 1, group] (0 for a row that sits this step out),
    `beta` [batch * kv_heads, 1, 1] (the decay, 1 for those rows), `query_add` [batch, 1, 1],
    `threshold` [batch, 1, 1], `empty` [batch, kv_heads, slots] bool or None (the free slots of a
    conversation still below its budget: never attended, filled first), `idle` [batch, 1, 1] bool
    or None (rows whose spare moves onto itself, so nothing of theirs changes)."""
    b, q_heads, _, d = query.shape
    logits = torch.bmm(query.reshape(s.bh, s.group, d), s.keys_t, out=s.logits)  # a view unless rows > 1 come strided
    if s.logits_acc is not None:
        logits = s.logits_acc.copy_(logits)
    logits.mul_(s.scale)
    if rows is not None and rows.empty is not None:
        logits.view(b, -1, s.group, logits.shape[-1]).masked_fill_(rows.empty[:, :, None], -torch.inf)
    probs = torch.softmax(logits, -1, out=s.probs)
    out = torch.bmm(probs if s.probs_low is None else s.probs_low.copy_(probs), s.values, out=s.out)
    # the group's mass into the scores, one batched matmul: [b*kvh, 1, group] @ probs
    weights = s.ones if rows is None else rows.weights
    if config.score == "decay":
        if rows is None:
            s.scores3.baddbmm_(weights, probs, beta=config.decay)
        else:
            s.scores3.mul_(rows.beta).baddbmm_(weights, probs)
    else:
        s.scores3.baddbmm_(weights, probs)
    if config.score == "mean":
        s.queries.add_(s.one if rows is None else rows.query_add)
    # the victim: the unprotected slot of lowest priority, the older token on ties
    torch.ge(s.key, s.threshold if rows is None else rows.threshold, out=s.protected)
    if config.policy == "h2o":
        priority = s.scores / s.queries.clamp(min=1) if config.score == "mean" else s.scores
        torch.where(s.protected, s.inf, priority, out=s.rank)
        torch.amin(s.rank, -1, keepdim=True, out=s.lowest)
        torch.eq(s.rank, s.lowest, out=s.is_lowest)
        torch.where(s.is_lowest, s.ids, s.id_max, out=s.tiebreak)
    else:  # window, sink: the oldest unprotected token
        torch.where(s.protected, s.id_max, s.ids, out=s.tiebreak)
    if rows is not None and rows.empty is not None:
        s.tiebreak.masked_fill_(rows.empty, -1)  # a free slot is taken before any token is evicted
    torch.argmin(s.tiebreak, -1, keepdim=True, out=s.victim)
    if rows is not None and rows.idle is not None:
        torch.where(rows.idle, s.spare_index, s.victim, out=s.victim)
    # cache replace: the spare slot (copied out first: a source may not alias its target)
    s.stage_kv.copy_(s.spare_kv)
    s.stage_meta.copy_(s.spare_meta)
    torch.add(s.slot_base, s.victim.view(-1), out=s.flat_victim)
    s.kv_flat.index_copy_(1, s.flat_victim, s.stage_kv.view(2, -1, d))
    s.meta_flat.index_copy_(1, s.flat_victim, s.stage_meta.view(N_META, -1))
    return out.view(b, 1, q_heads, d)


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
        self.pins: list[tuple[int, int]] = []
        self.pins_version = 0  # bumped whenever pins change; layers refresh their protection keys
        self.inv_freq = model.base_model.rotary_emb.inv_freq.detach().float()
        self.max_positions = text_config.max_position_embeddings
        self._warned_positions = False
        self.limits: Budget | None = None
        if not isinstance(self.config.budget, float):
            self._set_limits(self.config.resolve(0))
        scoring.register()
        if model.config._attn_implementation != scoring.ATTN_NAME:
            model.set_attn_implementation(scoring.ATTN_NAME)
        super().__init__(layers=[H2OLayer() for _ in range(text_config.num_hidden_layers)])

    # --- what users and the ledger read -------------------------------------------------------
    def token_ids(self, layer_idx):
        """[batch, kv_heads, slots] long: absolute index of the token in each slot (None before
        the layer holds anything)."""
        ids = self.layers[layer_idx].token_ids
        return None if ids is None else ids.long()

    def scores(self, layer_idx):
        """[batch, kv_heads, slots]: each slot's heavy-hitter score (what eviction ranks by)."""
        layer = self.layers[layer_idx]
        return None if layer.kv is None else self._score(layer.scores, layer.queries)

    def read_slots(self, layer_idx):
        """(token_ids, scores), each [batch, kv_heads, slots], copied from one reading of the
        layer (None before it holds anything): safe while another thread feeds the cache (the
        app's panel does this), where token_ids() then scores() could see two slot counts."""
        layer = self.layers[layer_idx]
        kv, meta, n = layer.kv, layer.meta, layer.n_slots
        if kv is None:
            return None
        meta_f = meta.view(score_dtype(kv.dtype))
        return meta[IDS, :, :, :n].long(), self._score(meta_f[SCORE, :, :, :n], meta_f[QUERIES, :, :, :n]).clone()

    def positions(self, layer_idx):
        """[batch, kv_heads, slots] long: the RoPE position each cached key is rotated to."""
        pos = self.layers[layer_idx].positions
        return None if pos is None else pos.long()

    def kv_bytes(self):
        """Bytes of keys and values held now (live slots only)."""
        return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in self.layers if layer.kv is not None)

    def full_kv_bytes(self):
        """Bytes a cache that never evicts would hold for the tokens seen so far."""
        per_token = sum(2 * layer.keys[0, :, :1].nelement() * layer.keys.element_size()
                        for layer in self.layers if layer.kv is not None)
        return per_token * self.get_seq_length()

    def slots_used(self, layer_idx=0):
        """Slots per batch row and KV head that layer `layer_idx` holds now (<= budget)."""
        return self.layers[layer_idx].n_slots

    def snapshot(self):
        """A copy of the whole cache state (bounded by the budget, so cheap), for `restore`."""
        layers = [(layer.n_seen, layer.n_slots, layer.roll_floor,
                   None if layer.kv is None else (layer.kv.clone(), layer.meta.clone())) for layer in self.layers]
        return layers, list(self.pins), self.limits

    def restore(self, snapshot):
        """Return to a `snapshot` (which stays valid: it can be restored again). Buffers of the
        same shape are written in place, so the decode step's views stay valid."""
        layers, pins, limits = snapshot
        for layer, (n_seen, n_slots, roll_floor, buffers) in zip(self.layers, layers):
            layer.pending = None
            if buffers is None:
                layer.set_buffers(None, None, 0)
            elif layer.kv is not None and layer.kv.shape == buffers[0].shape:
                layer.kv.copy_(buffers[0])
                layer.meta.copy_(buffers[1])
                layer.n_slots = n_slots
                layer._views()
            else:
                layer.set_buffers(buffers[0].clone(), buffers[1].clone(), n_slots)
            layer.n_seen, layer.roll_floor = n_seen, roll_floor
        self.pins, self.limits = list(pins), limits
        self.pins_version += 1

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self.pins = []
        self.pins_version += 1
        if isinstance(self.config.budget, float):
            self.limits = None

    # --- pins ------------------------------------------------------------------------------
    def protect(self, start, end):
        """Never evict absolute tokens [start, end) (those still cached). They count against the
        budget; pins that would leave no room for the sinks and the recent window are refused."""
        if not (0 <= start < end):
            raise ValueError(f"protect: need 0 <= start < end, got [{start}, {end})")
        pins = self.pins + [(start, end)]
        if self.limits is not None and self.limits.budget is not None:
            lim = self.limits
            pinned = len(set().union(*(range(max(s, lim.n_sink), e) for s, e in pins)))
            if lim.n_sink + pinned + lim.n_recent > lim.budget:
                raise ValueError(
                    f"cannot pin {end - start} more tokens: {pinned} pinned + {lim.n_sink} sinks + "
                    f"{lim.n_recent} recent would exceed the budget of {lim.budget} slots")
        self._set_pins(pins)

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
            self._set_pins(old)
            raise

    def unprotect(self, start, end):
        if (start, end) not in self.pins:
            raise ValueError(f"unprotect: [{start}, {end}) is not pinned")
        pins = list(self.pins)
        pins.remove((start, end))
        self._set_pins(pins)

    def _set_pins(self, pins):
        self.pins = pins
        self.pins_version += 1

    def is_pinned(self, token):
        return any(start <= token < end for start, end in self.pins)

    # --- the transformers Cache interface ---------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Called by the attention layer with this step's new keys and values
        [batch, kv_heads, n, head_dim]. We only hand ourselves to the "h2o" attention function
        through its kwargs (per call, so several caches can share a model across threads); the
        work happens in `attend`, where the attention probabilities are known."""
        attn_kwargs = kwargs.get("kwargs")
        if attn_kwargs is None:
            raise RuntimeError("H2OCache: this model's attention does not pass its kwargs to cache.update")
        layer = self.layers[layer_idx]
        if layer.pending is not None:
            raise RuntimeError("H2OCache: the model's attention implementation was changed away from 'h2o'")
        if self.limits is None:
            self._set_limits(self.config.resolve(key_states.shape[2]))
        if layer_idx == 0:
            self._check_positions(layer.n_seen + key_states.shape[2])
        layer.pending = (key_states, value_states)
        attn_kwargs["h2o_cache"] = self
        return key_states, value_states

    def attend(self, layer_idx, query, scaling):
        """Attention of this step's queries [batch, q_heads, n, head_dim] for one layer, with
        scoring and eviction; returns [batch, n, q_heads, head_dim]."""
        layer = self.layers[layer_idx]
        keys, values = layer.pending
        layer.pending = None
        if layer.pins_seen != self.pins_version:
            layer.refresh_protection(self)
        n, chunk = keys.shape[2], self.config.prefill_chunk
        if n == 1 and layer.n_slots == self.limits.budget:
            return layer.decode_step(self, keys, values, query, scaling)
        outs = [layer.attend_chunk(self, keys[:, :, s : s + chunk], values[:, :, s : s + chunk],
                                   query[:, :, s : s + chunk], scaling) for s in range(0, n, chunk)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("H2OCache does not support beam search")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("H2OCache cannot be cropped: evicted tokens are gone")

    # --- scoring and eviction ----------------------------------------------------------------
    def _add_scores(self, scores, queries, probs):
        """probs [batch, kv_heads, group, n, slots]: the newest n slots are this chunk's tokens;
        scores and queries [batch, kv_heads, slots], added to in place. The column mass is one
        reduction over the group's query heads and the chunk's rows together (no [b, kvh, n,
        slots] partial sum is made)."""
        b, h, group, n, slots = probs.shape
        if self.config.score == "decay":
            # each query row first decays what came before it: chunking does not change the result
            d = self.config.decay
            weights = d ** torch.arange(n - 1, -1, -1, device=probs.device, dtype=torch.float32)
            rows = weights.to(probs.dtype).repeat(group)  # [group * n]: row (g, i) weighs d^(n-1-i)
            scores.mul_(d**n).add_(torch.matmul(rows, probs.view(b, h, group * n, slots)))
            return
        scores.add_(probs.sum(dim=(2, 3)))
        if self.config.score == "mean":
            seen_by = torch.full((slots,), n, dtype=torch.float32, device=probs.device)
            seen_by[slots - n :] = torch.arange(n, 0, -1, dtype=torch.float32, device=probs.device)
            queries.add_(seen_by)

    def _score(self, scores, queries):
        return scores / queries.clamp(min=1) if self.config.score == "mean" else scores

    def _priority(self, token_ids, meta_f):
        """What eviction ranks by: the score for h2o, recency for window and sink (newest kept)."""
        if self.config.policy == "h2o":
            return self._score(meta_f[SCORE], meta_f[QUERIES])
        return token_ids

    def _maybe_roll(self, layer):
        """Re-lay every head's keys at contiguous positions ending right before the next query,
        once the oldest key could be more than `roll_span` positions behind it.

        The host decides, without reading the device: after a re-lay no key sits below
        `roll_floor` (before any, 0), and each step the span can grow by at most one. With sinks
        the bound is exact (the sink is the oldest key, never evicted); without, a re-lay can
        come earlier than needed, which keeps the guarantee. Re-rotating every step would keep
        distances within the budget exactly, but costs a pass over the whole cache per token and
        rounds each key once per step (drift in bf16). Doing it when the span reaches twice the
        budget costs one pass per ~budget tokens, and no distance the model sees exceeds
        2 x budget (nor the trained context)."""
        if self.config.positions != "rolling" or layer.n_seen - layer.roll_floor <= self.roll_span:
            return
        rank = layer.token_ids.argsort(dim=-1).argsort(dim=-1)
        target = layer.n_seen - layer.n_slots + rank
        rotate_keys(layer.keys, target - layer.positions, self._inv_freq(layer.keys))
        layer.positions.copy_(target)
        layer.roll_floor = layer.n_seen - layer.n_slots

    def _set_limits(self, limits):
        self.limits = limits
        if limits.budget is not None:
            self.roll_span = min(2 * limits.budget, self.max_positions)

    def _inv_freq(self, like):
        if self.inv_freq.device != like.device:
            self.inv_freq = self.inv_freq.to(like.device)
        return self.inv_freq

    def _check_positions(self, n_seen_after):
        if (self.config.positions == "absolute" and n_seen_after > self.max_positions
                and not self._warned_positions):
            self._warned_positions = True
            warnings.warn(
                f"H2OCache(positions='absolute'): the conversation has passed the model's "
                f"{self.max_positions} trained positions; quality will degrade. Use positions='rolling' "
                f"to keep every distance within the budget.", stacklevel=3)


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
