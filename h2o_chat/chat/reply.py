"""Reply: one reply being drawn into the conversation's last message, from its first token to its cleanup.

    with Reply(session, ban_stop_first, autosave_every_s) as reply:   the prompt is fed: timeline.logits is next
        yield from reply.pieces()      the per-token loop: draw, read, show, feed
    reply.close()                      the cleanup, once, whatever ended the reply (see close)
    reply.token_logprobs               [(token id, logprob, [(id, logprob)] * k)] when the session asks for top_logprobs
    reply.tokens_shown()               the tokens whose text was shown (their logprobs can be sent with it)

The message is an assistant message, empty (a new reply) or holding the text a continued reply
writes on after (`prefix`). A stop string may end inside text the model has already been fed: from
the first token whose text is held back (it could begin one) the reply keeps a snapshot, and close()
rewinds the cache to it when the stop string is found, so the cache holds no token of the cut text.
"""

import time

from .detok import Detokenizer
from .sampler import unpack_logprobs


class Reply:
    """One reply of `session` (a ChatSession) into its last message; `ban_stop_first`: the first
    token may not end the turn (a continued reply must say something)."""

    def __init__(self, session, ban_stop_first, autosave_every_s):
        self.session, self.timeline, self.sampler = session, session.timeline, session._sampler
        self.message, self.turn = session.messages[-1], len(session.messages) - 1
        self.prefix = self.message.content
        self.prefix_ids = session._open_reply_ids(self.turn) if self.prefix else []  # the prefix as it was fed
        self.detok = Detokenizer(session.tokenizer, session.sampling.stop)
        self.max_tokens = session.reply_cap or session.sampling.max_new_tokens
        self.stop_ids, self.ban_stop_first, self.autosave_every_s = session._stop_ids, ban_stop_first, autosave_every_s
        self.token_logprobs = []
        self.held = None  # the snapshot before the first token whose text is held back, while it is
        self.closed = False
        self.start = len(self.timeline.fed)  # where the reply's tokens begin in the ledger
        self.stats = stats = session.last_turn
        stats.prompt_tokens = self.start
        stats.prompt_computed = self.timeline.tokens_processed - stats.processed_before
        stats.finish = "length"
        self.sampler.top_logprobs = session.top_logprobs
        self.sampler.begin(self.timeline.fed, self.timeline.logits.numel())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pieces(self):
        """The reply's text pieces as they can be shown; the message holds their sum as it grows."""
        stats, timeline, detok, saved_at = self.stats, self.timeline, self.detok, time.perf_counter()
        for step in range(self.max_tokens):
            if self.session._stop.is_set():
                stats.finish = "stop"
                return
            if time.perf_counter() - saved_at >= self.autosave_every_s:  # a long reply is saved as it grows
                self.session.autosave()
                saved_at = time.perf_counter()
            token = self.sampler.sample(timeline.logits, ban_stop=self.ban_stop_first and step == 0)
            token_id = self._read(token)  # the one host sync per token: the text must be streamed
            if token_id in self.stop_ids:
                stats.finish = "stop"
                break
            stats.new_tokens += 1
            piece = detok.push(token_id)
            if piece:
                self.message.content = self.prefix + detok.text
                stats.first_at = stats.first_at or time.perf_counter()
                yield piece
            if detok.stopped:
                stats.finish = "stop"
                break
            self.held = (self.held or timeline.snapshot()) if detok.holding else None
            timeline.feed_token(token, token_id, "assistant", self.turn)
        piece = detok.finish()  # the natural end: an incomplete last character is shown as it is
        if piece:
            self.message.content = self.prefix + detok.text
            yield piece

    def close(self):
        """The cleanup, once, however the reply ended (its end, Stop, a client gone, an error): the
        cache leaves the batch, a stop string's cut tokens are taken back out of it, the timing
        ends, the message holds exactly what was shown, the reply's tokens are remembered as its
        text's (template.KnownTokens) and the charts get the reply's row."""
        if self.closed:
            return
        self.closed = True
        session, timeline, detok, stats = self.session, self.timeline, self.detok, self.stats
        timeline.leave_batch()  # the reply's cache rows go back to it, before anything else touches them
        if detok.stopped and self.held is not None:
            timeline.rewind(self.held)  # the cache holds no token of the text the stop string cut
        stats.end = time.perf_counter()
        stats.kept_tokens = detok.tokens_shown() if detok.stopped else stats.new_tokens
        stats.stop_string = detok.out.matched
        self.message.content = self.prefix + detok.text
        session._remember_reply(self.message.content, self.prefix_ids + timeline.fed[self.start :])
        session.turn_stats.append({"turn": self.turn, **session.stats})

    def tokens_shown(self):
        return self.detok.tokens_shown()

    def _read(self, token):
        """The drawn token's id, read from the device (with its logprobs, when asked, in the same read)."""
        if self.sampler.top_logprobs is None:
            return int(token)
        token_id, logprob, top = unpack_logprobs(self.sampler.logprobs[0].tolist(), self.sampler.top_logprobs)
        self.token_logprobs.append((token_id, logprob, top))
        return token_id
