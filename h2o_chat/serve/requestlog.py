"""One log line per API request, as llama.cpp's server prints them: what was asked, by whom, how
it ended, the tokens and the speed.

    POST /v1/chat/completions 200 · Open WebUI · prompt 1,204 (1,150 cached) · 256 new · TTFT 0.41 s · 23.5 tokens/s · 11.3 s
    POST /v1/chat/completions 400 · OpenAI/Python · 0.01 s · tool_choice asks for a call, and ...
    POST /v1/chat/completions 200 · curl · prompt 12 (0 cached) · 40 new · ... · the client left after 40 tokens

`log_request(route, status, client, usage, timing, error, note)` writes it, at INFO on the
logger "h2o_chat.requests" (the command line shows it on stderr; `--quiet` leaves it out). Every
route family logs through it: `RequestLog` gathers one request's figures as it runs and writes
its line once, when the answer (or its stream) has ended.
"""

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("h2o_chat.requests")
MAX_ERROR_CHARS = 300  # of an error's message in the line (a 400 can quote a whole request)


def request_line(route, status, client=None, usage=None, timing=None, error=None, note=None):
    """The line (see the module's docstring). usage: OpenAI's usage object ({"prompt_tokens",
    "completion_tokens", "prompt_tokens_details": {"cached_tokens"}}) or None; timing:
    {"ttft_s", "tokens_per_s", "seconds"} (any of them); error: why it failed or stopped early;
    note: anything else the user should know of it (tools that were ignored)."""
    parts = [f"{route} {status}", client or "unknown client"]
    if usage is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        parts += [f"prompt {usage['prompt_tokens']:,} ({cached:,} cached)", f"{usage['completion_tokens']:,} new"]
    timing = timing or {}
    if timing.get("ttft_s") is not None:
        parts.append(f"TTFT {timing['ttft_s']:.2f} s")
    if timing.get("tokens_per_s") is not None:
        parts.append(f"{timing['tokens_per_s']:.1f} tokens/s")
    if timing.get("seconds") is not None:
        parts.append(f"{timing['seconds']:.2f} s")
    if note:
        parts.append(note)
    if error:
        error = " ".join(str(error).split())
        parts.append(error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + " ...")
    return " · ".join(parts)


def log_request(route, status, client=None, usage=None, timing=None, error=None, note=None):
    """Write one request's line (request_line's arguments)."""
    if log.isEnabledFor(logging.INFO):
        log.info(request_line(route, status, client, usage, timing, error, note))


@dataclass
class RequestLog:
    """One request's figures while it runs; `done` writes its line (once, however often it is
    called: a stream that ends and is then closed calls it twice)."""

    route: str  # "POST /v1/chat/completions"
    client: str | None = None
    start: float = field(default_factory=time.perf_counter)
    status: int = 200
    usage: dict | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: str | None = None
    note: str | None = None
    written: bool = False

    def token(self):
        """A piece of a reply has come: the first one's time is the TTFT."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now

    def timing(self):
        out = {"seconds": time.perf_counter() - self.start}
        if self.first_token_at is not None:
            out["ttft_s"] = self.first_token_at - self.start
            decode_s = self.last_token_at - self.first_token_at
            new = (self.usage or {}).get("completion_tokens", 0)
            if decode_s > 0 and new:
                out["tokens_per_s"] = new / decode_s
        return out

    def done(self, status=None, error=None):
        if self.written:
            return
        self.written = True
        self.status = status if status is not None else self.status
        self.error = error or self.error
        log_request(self.route, self.status, self.client, self.usage, self.timing(), self.error, self.note)
