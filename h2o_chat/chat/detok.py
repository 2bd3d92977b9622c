"""Incremental detokenizing, and the one stop-string matcher.

    Detokenizer(tokenizer, stop=())
      .push(token_id) -> str   the new text that is safe to show (maybe "")
      .finish() -> str         the rest, at the natural end of a reply
      .text                    everything shown so far; .stopped: a stop string was reached
      .holding                 text is held back (it could begin a stop string)
      .tokens_shown()          the tokens whose text starts in what was shown (after a stop: before the cut)

    StopStrings(stops)         text pieces in, the text before the first stop string out
      .feed(piece); .take(final=False) -> what is safe to show now; .text; .hit

Each token decodes only a short window (the tokens since the last complete character, plus
the ones before them for context: the "prefix/read offset" method), so a reply of n tokens
costs O(n), not the O(n^2) of decoding the whole reply at every token. Stop strings are
searched only in the text added since the last search (and the stop length before it), and
text that could still become a stop string is held back until it cannot, so nothing of a
stop string is ever shown. Concatenating every piece equals decoding the whole reply
(truncated before the first stop string). The chat, the /v1 API (OpenAI's `stop`, matched on
the text it streams) and the evaluations all cut with StopStrings.
"""

import bisect


class StopStrings:
    """The text fed to it, cut before the first of `stops`; `take` hands it out in pieces, holding
    back a tail that could still become a stop string until it cannot."""

    def __init__(self, stops=()):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything fed, cut before the first stop string
        self.searched = 0  # text[:searched] holds no stop string
        self.shown = 0  # text[:shown] was handed out
        self.hit = False
        self.matched = None  # the stop string that cut the text

    def feed(self, piece):
        if self.hit:
            return
        self.text += piece
        start = max(0, self.searched - self.longest + 1)
        found = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if found:
            cut, self.matched = min(found)
            self.text, self.hit = self.text[:cut], True
        self.searched = len(self.text)

    def take(self, final=False):
        """What is safe to show since the last take: everything once the text has ended (final)
        or hit a stop string, else all but the longest tail that starts a stop string."""
        end = len(self.text) if final or self.hit else len(self.text) - self._held_back()
        piece, self.shown = self.text[self.shown : end], max(self.shown, end)
        return piece

    def _held_back(self):
        for n in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


def cut_at_stop(text, stops):
    """`text` before the first of the stop strings."""
    cut = StopStrings(stops)
    cut.feed(text)
    return cut.text


class Detokenizer:
    def __init__(self, tokenizer, stop=()):
        self.tokenizer = tokenizer
        self.ids = []
        self.starts = []  # where each token's text begins in the decoded text
        self.prefix = self.read = 0  # ids[prefix:read]: context already turned into text
        self.out = StopStrings(stop)  # the text of ids[:read], cut at a stop string

    @property
    def text(self):
        return self.out.text[: self.out.shown]

    @property
    def stopped(self):
        return self.out.hit

    @property
    def holding(self):
        return self.out.shown < len(self.out.text)

    def tokens_shown(self):
        return bisect.bisect_left(self.starts, len(self.text))  # starts never decrease

    def push(self, token_id):
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.starts.append(len(self.out.text))
        context = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) > len(context) and not window.endswith("\ufffd"):  # a complete character more
            self.out.feed(window[len(context) :])
            self.prefix, self.read = self.read, len(self.ids)
        return self.out.take()

    def finish(self):
        """At the end of the reply: whatever is left, less an incomplete last character. A reply cut
        in the middle of a character's bytes (max new tokens ran out there) decodes them as U+FFFD,
        which would be saved as text the model never wrote; the tokens stay in the cache, and the
        next turn, finding the text shorter, feeds it again from there."""
        if not self.stopped and self.read < len(self.ids):
            context = self._decode(self.ids[self.prefix : self.read])
            self.out.feed(self._decode(self.ids[self.prefix :])[len(context) :].rstrip("\ufffd"))
            self.read = len(self.ids)
        return self.out.take(final=True)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
