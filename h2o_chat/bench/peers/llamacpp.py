"""llama.cpp's server beside h2o-chat: the `xllamacpp` wheel, in a virtual environment of its own.

What a local user would otherwise run: llama.cpp's HTTP server (prompt cache on, as it is by
default) on the GGUF file the embedded wheel ships. Like kvpress.py beside it, this one file has
two halves and imports only the standard library at module level:

  - the worker (`main`, run as a script by the llama.cpp venv's python) reads one JSON line of
    settings on stdin, starts `xllamacpp.Server` on 127.0.0.1, writes {"url": ...} on stdout,
    and serves until its stdin closes;
  - the client (`start_server`, `LlamaCppServer.complete`), imported from our environment,
    spawns the worker and talks to the server over HTTP (urllib: the OpenAI-style
    /v1/completions route with the prompt as token ids, so both sides see the same tokens).

Making the environment (outside the repository):

    python3 -m venv ~/llamacpp-venv && ~/llamacpp-venv/bin/pip install xllamacpp

then pass `--llamacpp ~/llamacpp-venv/bin/python` (or just `--llamacpp`, which looks there and in
$H2O_LLAMACPP_PYTHON).
"""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ENV_VAR = "H2O_LLAMACPP_PYTHON"
DEFAULT_PYTHON = "~/llamacpp-venv/bin/python"
MAKE_VENV = "python3 -m venv ~/llamacpp-venv && ~/llamacpp-venv/bin/pip install xllamacpp"


class LlamaCppError(RuntimeError):
    """The server refused a request (the message is the server's own), or could not start."""


# ---------------------------------------------------------------------------------------------
# Client: runs in our environment


def find_python(arg=None):
    """The llama.cpp venv's python: `arg`, else $H2O_LLAMACPP_PYTHON, else ~/llamacpp-venv; None
    when the one chosen is not there."""
    from ..common import venv_python  # not at the top: the worker half runs where this package is not

    return venv_python(arg, ENV_VAR, DEFAULT_PYTHON)


class LlamaCppServer:
    """A running llama.cpp server (one slot, so one conversation's prompt cache). Use as a
    context manager, or call `stop()`."""

    def __init__(self, process, url, settings):
        self.process, self.url, self.settings = process, url, settings

    def complete(self, prompt_ids, max_tokens, timeout=600, ignore_eos=False):
        """Greedy completion of `prompt_ids` (a list of token ids), at most `max_tokens` new
        tokens (fewer at an end-of-generation token, unless ignore_eos). Returns the server's response: `choices`,
        `usage` (prompt_tokens, completion_tokens, cached_tokens) and `timings` (prompt_ms,
        prompt_n, predicted_ms, predicted_n, cache_n). LlamaCppError with the server's message
        when it refuses (e.g. a prompt longer than its context)."""
        body = json.dumps({"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
                           "top_k": 1, "cache_prompt": True, "stream": False, "ignore_eos": ignore_eos}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise LlamaCppError(f"llama.cpp refused the request (HTTP {e.code}): {detail}") from None

    def stop(self, timeout=30):
        if self.process.poll() is None:
            self.process.stdin.close()  # the worker's signal to shut the server down
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(python, gguf, threads=2, n_ctx=8192, port=None, log=None, timeout=300):
    """Start llama.cpp's server on 127.0.0.1 in the venv of `python`, on the GGUF file `gguf`,
    with `threads` threads for decoding and prefill and a context of `n_ctx` tokens; returns a
    LlamaCppServer once it answers. Its log goes to `log` (a path; default: discarded)."""
    from ..common import free_port  # not at the top: the worker half runs where this package is not

    settings = {"model": str(gguf), "threads": threads, "n_ctx": n_ctx, "port": port or free_port()}
    stderr = open(log, "ab") if log else subprocess.DEVNULL
    process = subprocess.Popen([python, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=stderr)
    process.stdin.write((json.dumps(settings) + "\n").encode())
    process.stdin.flush()
    deadline = time.monotonic() + timeout
    line = process.stdout.readline()  # the worker writes it once the model is loaded
    if not line or time.monotonic() > deadline:
        process.kill()
        raise LlamaCppError(f"llama.cpp's server did not start (exit code {process.wait()}); "
                            f"make its venv with: {MAKE_VENV}")
    ready = json.loads(line)
    if "error" in ready:
        process.wait()
        raise LlamaCppError(f"llama.cpp's server did not start: {ready['error']}")
    return LlamaCppServer(process, ready["url"].rstrip("/"), {**settings, "version": ready.get("version")})


# ---------------------------------------------------------------------------------------------
# Worker: runs in the llama.cpp venv


def main():
    settings = json.loads(sys.stdin.readline())
    try:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = settings["model"]
        params.n_ctx = settings["n_ctx"]
        params.n_parallel = 1  # one slot: one conversation, as a local user runs it
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = settings["threads"]
        params.hostnames = ["127.0.0.1"]
        params.port = settings["port"]
        server = xllamacpp.Server(params)
        ready = {"url": server.listening_address, "version": getattr(xllamacpp, "__version__", None)}
    except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps(ready), flush=True)
    sys.stdin.read()  # serve until the client closes our stdin
    del server
    return 0


if __name__ == "__main__":
    # Run by path, python puts this folder first on sys.path, where our own modules would shadow
    # installed ones; the worker needs none of them.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
