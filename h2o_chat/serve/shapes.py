"""The response objects, in each client's shape: OpenAI's chat.completion and text_completion
(whole, or as server-sent event chunks) and llama.cpp's /completion (its `content`/`stop` stream).

A chat reply's tool calls (chat/tools.py reads them out of its text) go in message.tool_calls
with finish_reason "tool_calls" (a request that used the legacy `functions`: message.function_call,
"function_call"); streamed, each call is two delta chunks as OpenAI sends them: its index, id and
name with empty arguments, then its arguments.

A reply is told to a Shape as choices of text pieces with their tokens' logprobs, as
`[(token id, logprob, [(id, logprob)] * k)]` (chat/sampler.py); each shape writes them its way:

    chat        choices[i].logprobs.content = [{"token", "logprob", "bytes", "top_logprobs": [...]}]
    text        choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    native      completion_probabilities = [{"id", "token", "logprob", "bytes", "top_logprobs": [...],
                "probs": [{"tok_str", "prob"}]}]  (the last: the older shape SillyTavern reads)
"""

import json
import math
from dataclasses import dataclass, field

FINISH_TO_LLAMACPP = {"stop": "eos", "length": "limit"}


def usage(prompt_tokens, cached, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Shape:
    """The response objects of one request (kind: "chat", "text" or "native")."""

    kind: str
    rid: str
    created: int
    model: str
    tokenizer: object = None
    legacy: bool = False  # the request used `functions`: calls are answered as function_call
    offsets: dict = field(default_factory=dict)  # text completions' text_offset: characters so far, per choice

    def _head(self, obj):
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.rid, "object": obj, "created": self.created, "model": self.model}

    def token(self, token_id):
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    # --- logprobs -------------------------------------------------------------------------------
    def logprobs(self, entries, index=0):
        """One choice's logprobs object for `entries` (None when logprobs were not asked for)."""
        if entries is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        if self.kind == "text":
            start = self.offsets.get(index, 0)
            tokens = [self.token(t) for t, _, _ in entries]
            offsets = [start + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            self.offsets[index] = start + sum(len(x) for x in tokens)
            return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                    "top_logprobs": [{self.token(i): lp for i, lp in top} for _, _, top in entries],
                    "text_offset": offsets}
        return [self._native_entry(e) for e in entries]

    def _described(self, token_id, logprob):
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat_entry(self, entry):
        token_id, logprob, top = entry
        return {**self._described(token_id, logprob), "top_logprobs": [self._described(i, lp) for i, lp in top]}

    def _native_entry(self, entry):
        token_id, logprob, top = entry
        return {"id": token_id, **self._described(token_id, logprob),
                "top_logprobs": [{"id": i, **self._described(i, lp)} for i, lp in top],
                "probs": [{"tok_str": self.token(i), "prob": math.exp(lp)} for i, lp in top]}

    # --- whole answers --------------------------------------------------------------------------
    def whole(self, choices, use, extra=None):
        """choices: [{"text", "finish", "logprobs": entries or None}] -> the response object."""
        if self.kind == "native":
            return self.native_end(choices[0], use, whole=True, extra=extra)
        if self.kind == "chat":
            out = [{"index": i, "message": self._message(c), "logprobs": self.logprobs(c["logprobs"], i),
                    "finish_reason": c["finish"]} for i, c in enumerate(choices)]
            return {**self._head("chat.completion"), "choices": out, "usage": use}
        out = [{"index": i, "text": c["text"], "logprobs": self.logprobs(c["logprobs"], i), "finish_reason": c["finish"]}
               for i, c in enumerate(choices)]
        return {**self._head("text_completion"), "choices": out, "usage": use}

    def _message(self, choice):
        calls = choice.get("tool_calls") or []
        message = {"role": "assistant", "content": choice["text"] if choice["text"] or not calls else None}
        if calls and self.legacy:
            message["function_call"] = dict(calls[0]["function"])
        elif calls:
            message["tool_calls"] = calls
        return message

    # --- streams --------------------------------------------------------------------------------
    def opening(self, n):
        """What a stream starts with: chat's role chunks (one per choice)."""
        if self.kind != "chat":
            return []
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def chunk(self, index, delta, finish=None, entries=None):
        """One streamed piece of choice `index`: text (a str), chat's opening delta (a dict), or
        None with its finish reason."""
        if self.kind == "native":
            out = {"index": index, "content": delta or "", "stop": False}
            if entries is not None:
                out["completion_probabilities"] = self.logprobs(entries, index)
            return out
        if self.kind == "chat":
            content = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
            choice = {"index": index, "delta": content, "logprobs": self.logprobs(entries, index),
                      "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta or "", "logprobs": self.logprobs(entries, index), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def tool_call_chunks(self, index, number, call):
        """A whole call of choice `index` (its `number`-th) as OpenAI streams one: index, id, type
        and name with empty arguments first, then the arguments."""
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if self.legacy:
            deltas = [{"function_call": {"name": name, "arguments": ""}}, {"function_call": {"arguments": arguments}}]
        else:
            deltas = [{"tool_calls": [{"index": number, "id": call["id"], "type": "function",
                                       "function": {"name": name, "arguments": ""}}]},
                      {"tool_calls": [{"index": number, "function": {"arguments": arguments}}]}]
        return [self.chunk(index, delta) for delta in deltas]

    def usage_chunk(self, use):
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    def native_end(self, choice, use, whole=False, extra=None):
        """llama.cpp's last stream event (or its whole answer): stop true, why, and the counts."""
        stop_type = "word" if choice.get("stop_word") else FINISH_TO_LLAMACPP.get(choice["finish"], "eos")
        out = {"index": 0, "content": choice["text"] if whole else "", "stop": True, "model": self.model,
               "stop_type": stop_type, "stopping_word": choice.get("stop_word") or "",
               "tokens_predicted": use["completion_tokens"], "tokens_evaluated": use["prompt_tokens"],
               "tokens_cached": use["prompt_tokens_details"]["cached_tokens"], "truncated": False,
               **(extra or {})}
        if whole and choice.get("logprobs") is not None:
            out["completion_probabilities"] = self.logprobs(choice["logprobs"])
        return out
