"""Drawing the next token on the model's device.

    Sampler(sampling, stop_ids, device)
      .begin(recent_ids, vocab_size)  before a reply: the tokens the repetition penalty sees
      .sample(logits [vocab], ban_stop=False) -> 0-d long tensor on the device

Everything stays on the device: no host sync per token (the caller reads the one token it must
stream with .item(), and feeds the same tensor back to the model). The repetition penalty
reads a [vocab] mask of tokens seen (the last RECENT_TOKENS before the reply, then every token
drawn), updated on the device. Seeded samplers draw the same tokens every run.
"""

import torch

RECENT_TOKENS = 1024  # the repetition penalty looks this far back (from the start of the reply)


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
    def __init__(self, sampling, stop_ids, device):
        self.sampling, self.device = sampling, torch.device(device)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.seen = None  # [vocab] bool

    def begin(self, recent_ids, vocab_size):
        if self.sampling.repetition_penalty == 1.0:
            return
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        if recent_ids:
            self.seen[torch.tensor(recent_ids[-RECENT_TOKENS:], device=self.device)] = True

    def sample(self, logits, ban_stop=False):
        """logits [vocab] (float, on the device) -> the drawn token, a 0-d long tensor there."""
        s = self.sampling
        logits = logits.clone()
        if ban_stop and self.stop_ids.numel():
            logits[self.stop_ids] = -float("inf")
        if self.seen is not None:
            penalised = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
            logits = torch.where(self.seen[: logits.numel()], penalised, logits)
        token = self._draw(logits)
        if self.seen is not None:
            self.seen[token] = True
        return token

    def _draw(self, logits):
        s = self.sampling
        if s.temperature == 0:
            return logits.argmax()
        logits = logits / s.temperature
        if s.top_k:
            kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        probs = torch.softmax(logits, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > s.top_p
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0))
        return torch.multinomial(probs, 1, generator=self.generator)[0]
