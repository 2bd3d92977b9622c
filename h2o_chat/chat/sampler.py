"""Drawing the next token on the model's device.

    Sampler(sampling, stop_ids, device, top_logprobs=None)
      .begin(recent_ids, vocab_size)  before a reply: the tokens the repetition penalty sees
      .sample(logits [vocab] or [rows, vocab], ban_stop=False) -> the token(s), on the device
      .logprobs                        after a draw with top_logprobs set: [rows, 2 + 2k] float64

Everything stays on the device: no host sync per token (the caller reads the one token it must
stream, and feeds the same tensor back to the model). Rows are independent draws from the same
settings (n choices of one request, batch.py-style); one row is the usual case.

The steps, in order (what each field of Sampling means):
  1. penalties on the raw logits: repetition_penalty divides a positive logit (multiplies a
     negative one) of every token seen (the last RECENT_TOKENS before the reply, and the reply);
     frequency/presence penalties are OpenAI's: logit -= count * frequency + (count > 0) * presence,
     counting the tokens this reply has drawn;
  2. logit_bias is added; a bias of -100 bans the token (OpenAI: "-100 should result in a ban");
  3. logprobs, when asked, are read here: log-softmax of these logits (the model's distribution
     with the client's penalties and biases, before temperature and truncation);
  4. temperature (0 = greedy), then top_k, typical_p, top_p (0 = greedy), min_p; then one draw.
"""

import torch

RECENT_TOKENS = 1024  # the repetition penalty looks this far back (from the start of the reply)
BAN = -100.0  # a logit_bias of this bans the token outright


def stop_token_ids(model, tokenizer):
    """End-of-turn ids: the model's eos, the tokenizer's, and the usual chat end markers."""
    ids = set()
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


class Sampler:
    def __init__(self, sampling, stop_ids, device, top_logprobs=None):
        self.sampling, self.device = sampling, torch.device(device)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        self.top_logprobs = top_logprobs  # None: no logprobs; k: the drawn token's and the k likeliest
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.seen = None  # [vocab] bool, for the repetition penalty
        self.counts = None  # [rows, vocab] float: how often the reply has drawn each token
        self.bias = None  # [vocab] float: logit_bias, dense
        self.logprobs = None

    @property
    def _counting(self):
        return self.sampling.frequency_penalty != 0 or self.sampling.presence_penalty != 0

    def begin(self, recent_ids, vocab_size):
        """Before a reply: what the penalties start from (the reply has drawn nothing yet)."""
        self.counts = None
        if self.sampling.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            if recent_ids:
                self.seen[torch.tensor(recent_ids[-RECENT_TOKENS:], device=self.device)] = True

    def sample(self, logits, ban_stop=False):
        """logits [vocab] or [rows, vocab] (float, on the device) -> the drawn token (a 0-d long
        tensor) or tokens [rows], there."""
        rows = logits.view(-1, logits.shape[-1])
        token = self.sample_rows(rows, ban_stop)
        return token[0] if logits.dim() == 1 else token

    def sample_rows(self, logits, ban_stop=False):
        s = self.sampling
        logits = self.adjusted(logits, ban_stop)
        if self.top_logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
        token = self._draw(logits)
        if self.top_logprobs is not None:
            self.logprobs = pack_logprobs(logprobs, token, self.top_logprobs)
        if s.repetition_penalty != 1.0 and self.seen is not None:
            self.seen[token] = True
        if self._counting:
            if self.counts is None or self.counts.shape[0] != logits.shape[0]:
                self.counts = torch.zeros_like(logits)
            self.counts.scatter_add_(1, token[:, None], torch.ones_like(token[:, None], dtype=logits.dtype))
        return token

    def adjusted(self, logits, ban_stop=False):
        """Steps 1 and 2: the logits [rows, vocab] with penalties and biases (a copy)."""
        s = self.sampling
        logits = logits.float().clone()
        if ban_stop and self.stop_ids.numel():
            logits[:, self.stop_ids] = -float("inf")
        if s.repetition_penalty != 1.0 and self.seen is not None:
            penalised = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
            logits = torch.where(self.seen[: logits.shape[-1]], penalised, logits)
        if self._counting and self.counts is not None and self.counts.shape == logits.shape:
            logits -= self.counts * s.frequency_penalty + (self.counts > 0) * s.presence_penalty
        if s.logit_bias:
            logits += self._bias(logits.shape[-1])
        return logits

    def _bias(self, vocab_size):
        if self.bias is None or self.bias.numel() != vocab_size:
            ids = [i for i, _ in self.sampling.logit_bias if i < vocab_size]
            values = [-float("inf") if b <= BAN else b for i, b in self.sampling.logit_bias if i < vocab_size]
            self.bias = torch.zeros(vocab_size, device=self.device)
            self.bias[torch.tensor(ids, dtype=torch.long, device=self.device)] = torch.tensor(values, device=self.device)
        return self.bias

    def _draw(self, logits):
        """Step 4, for rows [rows, vocab] -> tokens [rows]."""
        s = self.sampling
        if s.temperature == 0 or s.top_p == 0:
            return logits.argmax(dim=-1)
        logits = logits / s.temperature
        if s.top_k:
            kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        probs = torch.softmax(logits, dim=-1)
        if s.typical_p < 1.0:
            probs = typical(probs, s.typical_p)
        if s.top_p < 1.0:
            probs = nucleus(probs, s.top_p)
        if s.min_p > 0:
            probs = probs.masked_fill(probs < s.min_p * probs.amax(dim=-1, keepdim=True), 0)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


NUCLEUS_CANDIDATES = 256  # tokens `nucleus` sorts first: a nucleus of top_p 0.9 rarely holds more


def nucleus(probs, top_p):
    """probs [rows, vocab] -> the likeliest tokens whose probabilities reach top_p (at least one),
    the rest zeroed.

    Why not one sort: sorting a 49,152-token vocabulary took 2.8 ms a draw on this project's CPU,
    a sixth of a decode step. The nucleus is a prefix of the sorted tokens, so the NUCLEUS_CANDIDATES likeliest
    (topk, ~0.2 ms) decide it whenever it ends among them: the same prefix sums in the same order,
    the same tokens kept (a tie at its edge may keep another of the tied tokens, as any sort may).
    Otherwise, a flat distribution, the whole vocabulary is sorted. One host sync to tell."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    top, order = probs.topk(k, dim=-1)  # sorted, likeliest first
    before = top.cumsum(-1) - top  # each token's prefix sum before it
    # every later token lies outside too when the last candidate does (its prefix sum only grows;
    # the margin absorbs the rounding of `cumsum - p`, and anything that close is sorted whole)
    if k < probs.shape[-1] and not bool((before[:, -1] > top_p + 1e-6).all()):
        top, order = probs.sort(dim=-1, descending=True)
        before = top.cumsum(-1) - top
    return torch.zeros_like(probs).scatter_(-1, order, top.masked_fill(before > top_p, 0))


def typical(probs, mass):
    """Locally typical sampling (Meister et al. 2022): tokens ranked by how far their surprise
    -log p is from the expected surprise (the entropy), kept until they reach `mass`."""
    logp = torch.log(probs.clamp_min(1e-30))
    entropy = -(probs * logp).nansum(-1, keepdim=True)
    order = (-logp - entropy).abs().argsort(dim=-1)
    sorted_probs = probs.gather(-1, order)
    outside = sorted_probs.cumsum(-1) - sorted_probs > mass
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0))


def pack_logprobs(logprobs, token, k):
    """[rows, 2 + 2k] float64, one host read for a token's logprobs: the drawn token's id and
    logprob, then the k likeliest tokens' ids and logprobs (ids are exact in float64)."""
    chosen = logprobs.gather(-1, token[:, None])
    top = logprobs.topk(k, dim=-1) if k else None
    parts = [token[:, None].double(), chosen.double()]
    if top is not None:
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=-1)


def unpack_logprobs(row, k):
    """One row of pack_logprobs, read on the host: (token id, logprob, [(id, logprob)] * k)."""
    token, logprob = int(row[0]), row[1]
    return token, logprob, [(int(i), v) for i, v in zip(row[2 : 2 + k], row[2 + k : 2 + 2 * k])]
