"""Incremental detokenizing, with stop strings.

    Detokenizer(tokenizer, stop=())
      .push(token_id) -> str   the new text that is safe to show (maybe "")
      .finish() -> str         the rest, at the natural end of a reply
      .text                    everything shown so far; .stopped: a stop string was reached

Each token decodes only a short window (the tokens since the last complete character, plus
the ones before them for context: the "prefix/read offset" method), so a reply of n tokens
costs O(n), not the O(n^2) of decoding the whole reply at every token. Stop strings are
searched only in the text added since the last search (and the stop length before it), and
text that could still become a stop string is held back until it cannot, so nothing of a
stop string is ever shown. Concatenating every piece equals decoding the whole reply
(truncated before the first stop string).
"""


class Detokenizer:
    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids = []
        self.prefix = self.read = 0  # ids[prefix:read]: context already turned into text
        self.decoded = ""  # text of ids[:read], cut at a stop string
        self.shown = 0  # len of decoded already handed out
        self.searched = 0  # decoded[:searched] holds no stop string
        self.stopped = False

    @property
    def text(self):
        return self.decoded[: self.shown]

    def push(self, token_id):
        if self.stopped:
            return ""
        self.ids.append(token_id)
        context = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) > len(context) and not window.endswith("\ufffd"):  # a complete character more
            self._add(window[len(context) :])
            self.prefix, self.read = self.read, len(self.ids)
        return self._hand_out(final=False)

    def finish(self):
        """At the natural end: whatever is left (an incomplete character as the tokenizer shows it)."""
        if not self.stopped and self.read < len(self.ids):
            context = self._decode(self.ids[self.prefix : self.read])
            self._add(self._decode(self.ids[self.prefix :])[len(context) :])
            self.read = len(self.ids)
        return self._hand_out(final=True)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _add(self, piece):
        self.decoded += piece
        start = max(0, self.searched - self.longest_stop + 1)
        cut = min((i for i in (self.decoded.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.decoded, self.stopped = self.decoded[:cut], True
        self.searched = len(self.decoded)

    def _hand_out(self, final):
        end = len(self.decoded) if final or self.stopped else len(self.decoded) - self._held_back()
        piece, self.shown = self.decoded[self.shown : end], max(self.shown, end)
        return piece

    def _held_back(self):
        """Length of the longest end of the text that is the start of a stop string."""
        for n in range(min(self.longest_stop - 1, len(self.decoded)), 0, -1):
            tail = self.decoded[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
