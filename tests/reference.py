"""A slow, obviously correct H2O for tests: explicit LLaMA attention, loops over layers, batch
rows, KV heads and queries, Python lists for the cache and Python sorting for eviction.

It reuses the model's projections, norms and MLPs (they are not what is being tested) and
re-implements everything a cache policy touches: which tokens each head keeps, their scores,
and the RoPE positions their keys are used at (always rotated fresh from the raw key, where
H2OCache re-rotates keys it holds). With kv_quant="int8" an entry keeps its key and value as
int8 slots hold them (`quantized`, written out element by element's rule): the key rounded
after its rotation, and at a re-lay rotated on from there and rounded again, as H2OCache must.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class Entry:
    token_id: int
    raw_key: torch.Tensor  # [head_dim], before RoPE
    value: torch.Tensor  # [head_dim]
    position: int  # RoPE position its key is used at (= token_id until a rolling re-lay)
    score: float = 0.0
    queries: int = 0
    stored_key: torch.Tensor | None = None  # kv_quant="int8": the rotated key as the slot holds it


def quantized(x):
    """x [head_dim] as an 8-bit slot holds it, widened: its range [low, high] cut into 255 steps of
    `scale` (at least float16's smallest number, 2^-24); each element's code the nearest of 0..255
    to (x - low) / scale; the value it comes back as low' + code * scale', where low' and scale'
    are low and scale rounded to float16 (the width a slot stores them at)."""
    low, high = x.min(), x.max()
    scale = torch.clamp((high - low) / 255, min=2.0**-24)
    code = torch.round((x - low) / scale)
    return low.half().to(x.dtype) + code * scale.half().to(x.dtype)


@dataclass
class ReferenceH2O:
    model: torch.nn.Module
    policy: str = "h2o"
    budget: int | list | None = None  # None: never evict; a list: each layer's budget
    n_sink: int = 0
    n_recent: int = 0
    score: str = "sum"
    decay: float = 0.9
    positions: str = "absolute"
    prefill_chunk: int = 256
    kv_quant: str = "none"
    pins: list = field(default_factory=list)

    def __post_init__(self):
        cfg = self.model.config
        self.n_layers, self.n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = self.model.model.rotary_emb.inv_freq.float()
        self.n_seen = 0
        self.roll_floor = [0] * self.n_layers  # rolling, per layer: no key sits below this position (0 until its first re-lay)
        self.entries = None  # [layer][batch][kv_head] -> list[Entry]

    def rope(self, x, position):
        # angles and their cos/sin in float32, exactly as transformers' rotary embedding does
        angles = torch.tensor(float(position)) * self.inv_freq
        cos, sin = torch.cat([angles.cos()] * 2).to(x.dtype), torch.cat([angles.sin()] * 2).to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[half:], x[:half]]) * sin

    @torch.no_grad()
    def forward(self, input_ids):
        """input_ids [batch, n] -> logits [batch, n, vocab]; processed in chunks like H2OCache."""
        b = input_ids.shape[0]
        if self.entries is None:
            self.entries = [[[[] for _ in range(self.n_kv)] for _ in range(b)] for _ in range(self.n_layers)]
        logits = []
        for s in range(0, input_ids.shape[1], self.prefill_chunk):
            logits.append(self._forward_chunk(input_ids[:, s : s + self.prefill_chunk]))
        return torch.cat(logits, dim=1)

    def _forward_chunk(self, ids):
        m = self.model.model
        b, n = ids.shape
        p0 = self.n_seen
        hidden = m.embed_tokens(ids)
        group = self.n_heads // self.n_kv
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(b, n, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(b, n, self.n_kv, self.head_dim)
            v = attn.v_proj(x).view(b, n, self.n_kv, self.head_dim)
            out = torch.zeros(b, n, self.n_heads, self.head_dim, dtype=x.dtype)
            for bi in range(b):
                for kh in range(self.n_kv):
                    entries = self.entries[li][bi][kh]
                    old = len(entries)
                    keys = [self.key(e) for e in entries]
                    for j in range(n):
                        entry = Entry(p0 + j, k[bi, j, kh], v[bi, j, kh], position=p0 + j)
                        if self.kv_quant == "int8":
                            entry.stored_key = quantized(self.rope(entry.raw_key, entry.position))
                            entry.value = quantized(entry.value)
                        entries.append(entry)
                        keys.append(self.key(entry))
                    mass = [[0.0] * len(entries) for _ in range(n)]  # [query][entry]
                    for qh in range(kh * group, (kh + 1) * group):
                        for i in range(n):
                            visible = old + i + 1
                            qv = self.rope(q[bi, i, qh], p0 + i)
                            logit = torch.stack([qv @ keys[e] for e in range(visible)]) * attn.scaling
                            prob = torch.softmax(logit.double(), dim=0)
                            out[bi, i, qh] = sum(prob[e].to(x.dtype) * entries[e].value for e in range(visible))
                            for e in range(visible):
                                mass[i][e] += prob[e].item()
                    for i in range(n):
                        for e in range(old + i + 1):
                            entries[e].queries += 1
                        for e, entry in enumerate(entries):
                            entry.score = (self.decay * entry.score if self.score == "decay" else entry.score) + mass[i][e]
            hidden = hidden + attn.o_proj(out.reshape(b, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.n_seen += n
        # rolling: once the oldest key of a layer *could* be more than twice its budget (or the
        # trained context) behind the next query, every head's keys are laid at contiguous
        # positions ending right before it. "Could": the bound the host knows without looking (the
        # floor left by the layer's last re-lay; a span grows by at most one a token), as H2OCache
        # decides it.
        for li in range(self.n_layers):
            budget = self.budget_of(li)
            evicting = budget is not None and len(self.entries[li][0][0]) > budget
            roll_span = min(2 * (budget or 0), self.model.config.max_position_embeddings)
            roll = self.positions == "rolling" and evicting and self.n_seen - self.roll_floor[li] > roll_span
            for bi in range(b):
                for kh in range(self.n_kv):
                    kept = self._evict(self.entries[li][bi][kh], budget)
                    if roll:
                        for rank, e in enumerate(sorted(kept, key=lambda e: e.token_id)):
                            position = self.n_seen - len(kept) + rank
                            if self.kv_quant == "int8":  # rotated on from the rounded key, rounded again
                                e.stored_key = quantized(self.rope(e.stored_key, position - e.position))
                            e.position = position
                    self.entries[li][bi][kh] = kept
            if roll:
                self.roll_floor[li] = self.n_seen - budget
        return self.model.lm_head(m.norm(hidden))

    def budget_of(self, layer):
        return self.budget[layer] if isinstance(self.budget, list) else self.budget

    def key(self, e):
        """The key attention uses: rotated fresh from the raw key, or an int8 slot's as it holds it."""
        return e.stored_key if self.kv_quant == "int8" else self.rope(e.raw_key, e.position)

    def priority(self, e):
        if self.policy != "h2o":
            return e.token_id
        return e.score / e.queries if self.score == "mean" else e.score

    def _evict(self, entries, budget):
        if budget is None or len(entries) <= budget:
            return entries
        n_sink = 0 if self.policy == "window" else self.n_sink

        def protected(e):
            pinned = any(s <= e.token_id < t for s, t in self.pins)
            return e.token_id < n_sink or e.token_id >= self.n_seen - self.n_recent or pinned

        kept = [e for e in entries if protected(e)]
        rest = sorted((e for e in entries if not protected(e)), key=lambda e: (self.priority(e), e.token_id), reverse=True)
        kept += rest[: budget - len(kept)]
        return kept

    # what the tests compare
    def kept(self, layer, batch, kv_head):
        return sorted(e.token_id for e in self.entries[layer][batch][kv_head])

    def fresh_keys(self, layer, batch, kv_head):
        """{token_id: the key as it should be held now: the raw key rotated fresh, in one step, to
        its position (int8: the rounded key rotated and rounded at each re-lay)}"""
        return {e.token_id: self.key(e) for e in self.entries[layer][batch][kv_head]}

    def scores(self, layer, batch, kv_head):
        mean = self.score == "mean"
        return {e.token_id: e.score / e.queries if mean else e.score for e in self.entries[layer][batch][kv_head]}


def explicit_grouped_attention(query, keys, values, scaling):
    """The oracle of `scoring.grouped_attention` (its version before the passes were fused): the
    logits made, then widened, scaled, masked and softmaxed, each as a pass of its own.
    query [batch, q_heads, n, head_dim], keys/values [batch, kv_heads, slots, head_dim] ->
    output [batch, n, q_heads, head_dim], probs [batch, kv_heads, group, n, slots]."""
    b, q_heads, n, d = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = query.reshape(b, kv_heads, group * n, d)
    logits = torch.matmul(q, keys.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scaling
    if n > 1:
        first_hidden = torch.arange(slots - n + 1, slots + 1)  # per query row
        hidden = torch.arange(slots)[None, :] >= first_hidden[:, None]  # [n, slots]
        logits = logits.view(b, kv_heads, group, n, slots).masked_fill(hidden, float("-inf"))
        logits = logits.view(b, kv_heads, group * n, slots)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)  # [b, kvh, group*n, d]
    return out.view(b, q_heads, n, d).transpose(1, 2), probs.view(b, kv_heads, group, n, slots)


def explicit_column_mass(probs, score, decay=0.9):
    """What a chunk adds to each slot's score, summed the explicit way: [b, kvh, slots]
    (for "decay", before the old scores are decayed by decay ** n)."""
    mass = probs.sum(dim=2)  # [b, kvh, n, slots]: the group's query heads add up
    if score == "decay":
        n = mass.shape[-2]
        weights = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float32)
        return (mass * weights[:, None]).sum(dim=2)
    return mass.sum(dim=2)
