"""H2OCache: a transformers Cache that keeps at most `budget` tokens per layer and KV head.

Per layer it holds, for each batch row and KV head, `slots` cached tokens:
    keys, values   [batch, kv_heads, slots, head_dim]
    token_ids      [batch, kv_heads, slots]  absolute index of the token in each slot
    scores         [batch, kv_heads, slots]  attention mass received (float32, or float64)
    queries        [batch, kv_heads, slots]  how many queries could see the token ("mean" score)
    positions      [batch, kv_heads, slots]  RoPE position the key is rotated to now
Heads evict independently, so each head holds different tokens but the same number of them and
the tensors stay dense. Slot order means nothing to attention; `token_ids` says who is where.

One forward step of a layer (`attend`, called from the "h2o" attention function):
    for each chunk of at most `prefill_chunk` new tokens:
        write the chunk into free slots -> attend over all slots -> add the attention mass to
        the scores -> if slots > budget, evict back to budget.
Chunking inside the layer gives the same result as feeding the model chunk by chunk (a chunk at
layer l only depends on earlier tokens at layer l-1), yet a plain `model.generate` or
`model(ids)` gets it for free, and no [heads, n, n] matrix of a long prompt is ever built.

The decode step is the hot path. Buffers keep one spare slot (capacity budget + 1): the new
token is written there, and after attention it is moved into the evicted slot ("cache
replace"), so a step copies one slot per head instead of the whole cache.
"""

import warnings
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import scoring
from .policy import Budget, CacheConfig, protected_mask, select_keep, select_victim

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FIELDS = ("keys", "values", "token_ids", "scores", "queries", "positions")
GROWTH = 256  # slots an unbounded layer grows by


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


class H2OLayer(CacheLayerMixin):
    """One layer's slots. Buffers have room for `capacity` slots; the first `n_slots` are live."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        self.is_initialized = False
        self.n_seen = 0  # tokens this layer has been given, evicted or not
        self.n_slots = 0
        self.buf = {}  # field -> [batch, kv_heads, capacity(, head_dim)]
        self.pending = None  # (keys, values) handed over by update(), consumed by attend()

    def __getattr__(self, field):  # layer.keys, layer.token_ids, ...: views of the live slots
        if field in FIELDS:
            buf = self.__dict__["buf"]
            return buf[field][:, :, : self.n_slots] if buf else None
        raise AttributeError(field)

    @property
    def capacity(self):
        return self.buf["keys"].shape[2] if self.buf else 0

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

    def append(self, keys, values, spare_capacity):
        """Write n new tokens [batch, kv_heads, n, head_dim] into the next free slots."""
        b, h, n, d = keys.shape
        need = self.n_slots + n
        if need > self.capacity:
            # bounded caches get their final size (budget + 1 spare slot) at once; unbounded
            # ones grow 256 slots at a time instead of copying everything every step
            grown = -(-need // GROWTH) * GROWTH
            capacity = min(grown, spare_capacity) if spare_capacity and need <= spare_capacity else grown
            self._reallocate(None, capacity, keys)
        s = slice(self.n_slots, need)
        ids = torch.arange(self.n_seen, self.n_seen + n, device=keys.device).expand(b, h, n)
        self.buf["keys"][:, :, s] = keys
        self.buf["values"][:, :, s] = values
        self.buf["token_ids"][:, :, s] = ids
        self.buf["positions"][:, :, s] = ids  # new keys come rotated to their true position
        self.buf["scores"][:, :, s] = 0
        self.buf["queries"][:, :, s] = 0
        self.n_slots, self.n_seen = need, self.n_seen + n
        self.is_initialized = True

    def _reallocate(self, keep, capacity, like):
        """New buffers of `capacity` slots holding the slots `keep` [batch, kv_heads, k] first
        (None: all live slots, in place order)."""
        b, h, d = like.shape[0], like.shape[1], like.shape[-1]
        k = self.n_slots if keep is None else keep.shape[2]
        score_dtype = torch.promote_types(like.dtype, torch.float32)
        new = {
            "keys": like.new_empty(b, h, capacity, d),
            "values": like.new_empty(b, h, capacity, d),
            "token_ids": torch.empty(b, h, capacity, dtype=torch.long, device=like.device),
            "scores": torch.empty(b, h, capacity, dtype=score_dtype, device=like.device),
            "queries": torch.empty(b, h, capacity, dtype=score_dtype, device=like.device),
            "positions": torch.empty(b, h, capacity, dtype=torch.long, device=like.device),
        }
        for field, old in self.buf.items():
            if keep is None:
                new[field][:, :, :k] = old[:, :, :k]
            else:
                new[field][:, :, :k] = old.gather(2, keep if old.ndim == 3 else keep[..., None].expand(-1, -1, -1, d))
        self.buf, self.n_slots = new, k

    def move_last_into(self, victim):
        """Drop slot `victim` [batch, kv_heads] by moving the last live slot into it."""
        last = self.n_slots - 1
        for field, buf in self.buf.items():
            index = victim[..., None] if buf.ndim == 3 else victim[..., None, None].expand(-1, -1, 1, buf.shape[-1])
            # a copy: with one KV head and one row the last slot is a dense view of the buffer,
            # and scatter_ refuses a source that shares memory with its destination
            buf.scatter_(2, index, buf[:, :, last : last + 1].clone())
        self.n_slots = last


class H2OCache(Cache):
    """A KV cache that evicts by the Heavy-Hitter Oracle (or window / sink / full), for LLaMA-family
    models in transformers. Constructing it switches the model's attention to "h2o" (which is
    plain sdpa for any other cache), so that scores are captured; nothing else is needed:

        cache = H2OCache(model, policy="h2o", budget=256, n_sink=4, n_recent=128)
        out = model.generate(input_ids, cache=cache, max_new_tokens=200)

    See `CacheConfig` for the arguments. Batch rows must not be padded.
    """

    def __init__(self, model, policy="h2o", budget=512, n_sink=4, n_recent=None, score="sum", decay=0.9,
                 positions="rolling", prefill_chunk=256, config: CacheConfig | None = None):
        self.config = config or CacheConfig(policy, budget, n_sink, n_recent, score, decay, positions, prefill_chunk)
        text_config = model.config.get_text_config(decoder=True)
        check_model(text_config, self.config)
        self.pins: list[tuple[int, int]] = []
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
        """[batch, kv_heads, slots]: absolute index of the token in each slot."""
        return self.layers[layer_idx].token_ids

    def scores(self, layer_idx):
        """[batch, kv_heads, slots]: each slot's heavy-hitter score (what eviction ranks by)."""
        return self._score(self.layers[layer_idx])

    def read_slots(self, layer_idx):
        """(token_ids, scores), each [batch, kv_heads, slots], copied from one reading of the
        layer (None before it holds anything): safe while another thread feeds the cache (the
        app's panel does this), where token_ids() then scores() could see two slot counts."""
        layer = self.layers[layer_idx]
        buf, n = layer.buf, layer.n_slots
        if not buf:
            return None
        live = SimpleNamespace(**{field: buf[field][:, :, :n] for field in ("token_ids", "scores", "queries")})
        return live.token_ids.clone(), self._score(live).clone()

    def positions(self, layer_idx):
        """[batch, kv_heads, slots]: the RoPE position each cached key is rotated to."""
        return self.layers[layer_idx].positions

    def kv_bytes(self):
        """Bytes of keys and values held now (live slots only)."""
        return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in self.layers if layer.buf)

    def full_kv_bytes(self):
        """Bytes a cache that never evicts would hold for the tokens seen so far."""
        per_token = sum(2 * layer.keys[0, :, :1].nelement() * layer.keys.element_size()
                        for layer in self.layers if layer.buf)
        return per_token * self.get_seq_length()

    def slots_used(self, layer_idx=0):
        """Slots per batch row and KV head that layer `layer_idx` holds now (<= budget)."""
        return self.layers[layer_idx].n_slots

    def snapshot(self):
        """A copy of the whole cache state (bounded by the budget, so cheap), for `restore`."""
        layers = [(layer.n_seen, layer.n_slots, {f: b.clone() for f, b in layer.buf.items()}) for layer in self.layers]
        return layers, list(self.pins), self.limits

    def restore(self, snapshot):
        """Return to a `snapshot` (which stays valid: it can be restored again)."""
        layers, pins, limits = snapshot
        for layer, (n_seen, n_slots, buf) in zip(self.layers, layers):
            layer.n_seen, layer.n_slots, layer.pending = n_seen, n_slots, None
            layer.buf = {f: b.clone() for f, b in buf.items()}
            layer.is_initialized = bool(buf)
        self.pins, self.limits = list(pins), limits

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self.pins = []
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
        self.pins.remove((start, end))

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
        n, chunk = keys.shape[2], self.config.prefill_chunk
        budget = self.limits.budget
        spare = budget + 1 if budget is not None else None
        outs = []
        for s in range(0, n, chunk):
            layer.append(keys[:, :, s : s + chunk], values[:, :, s : s + chunk], spare)
            out, probs = scoring.grouped_attention(query[:, :, s : s + chunk], layer.keys, layer.values, scaling)
            self._add_scores(layer, probs)
            if budget is not None and layer.n_slots > budget:
                self._evict(layer)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("H2OCache does not support beam search")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("H2OCache cannot be cropped: evicted tokens are gone")

    # --- scoring and eviction ----------------------------------------------------------------
    def _add_scores(self, layer, probs):
        """probs [batch, kv_heads, group, n, slots]: the newest n slots are this chunk's tokens."""
        mass = probs.sum(dim=2)  # [b, kvh, n, slots]: the GQA group's query heads add up
        n, slots = mass.shape[-2], mass.shape[-1]
        scores = layer.scores
        if self.config.score == "decay":
            # each query row first decays what came before it: chunking does not change the result
            d = self.config.decay
            weights = d ** torch.arange(n - 1, -1, -1, device=mass.device, dtype=torch.float32)
            scores.mul_(d**n).add_((mass * weights[:, None]).sum(dim=2))
            return
        scores.add_(mass.sum(dim=2))
        if self.config.score == "mean":
            seen_by = torch.full((slots,), n, dtype=torch.float32, device=mass.device)
            seen_by[slots - n :] = torch.arange(n, 0, -1, dtype=torch.float32, device=mass.device)
            layer.queries.add_(seen_by)

    def _score(self, layer):
        return layer.scores / layer.queries.clamp(min=1) if self.config.score == "mean" else layer.scores

    def _priority(self, layer):
        return self._score(layer) if self.config.policy == "h2o" else layer.token_ids  # window, sink: newest

    def _evict(self, layer):
        lim = self.limits
        protected = protected_mask(layer.token_ids, layer.n_seen, lim.n_sink, lim.n_recent, self.pins)
        priority = self._priority(layer)
        if layer.n_slots == lim.budget + 1:
            victim = select_victim(layer.token_ids, priority, protected)
            layer.move_last_into(victim)
        else:
            keep = select_keep(layer.token_ids, priority, protected, lim.budget)
            layer._reallocate(keep, lim.budget + 1, layer.keys)
        if self.config.positions == "rolling":
            self._roll(layer)

    def _roll(self, layer):
        """Re-lay the keys of each head whose oldest key is more than `roll_span` positions behind
        the next query at contiguous positions ending right before it.

        Re-rotating every step would keep distances within the budget exactly, but costs a pass
        over the whole cache per token and rounds each key once per step (drift in bf16). Doing
        it when the span reaches twice the budget costs one pass per ~budget tokens, and no
        distance the model sees exceeds 2 x budget (nor the trained context)."""
        span = layer.n_seen - layer.positions.amin(dim=-1)  # [b, kvh]
        stale = span > self.roll_span
        if not stale.any():
            return
        rank = layer.token_ids.argsort(dim=-1).argsort(dim=-1)
        target = layer.n_seen - layer.n_slots + rank
        delta = torch.where(stale[..., None], target - layer.positions, 0)
        rotate_keys(layer.keys, delta, self._inv_freq(layer.keys))
        layer.positions.add_(delta)

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
