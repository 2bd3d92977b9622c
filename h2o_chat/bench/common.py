"""What the benchmarks share: their inputs, the caches they compare, how they write results, and
how they start the app and talk to a server.

Every benchmark is a module of its own (`decode.py`, `dialogue.py`, ...) with a `run(args)`;
cli.py and evaluate.py hold the command lines that call them.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import DynamicCache

from ..cache.h2o import H2OCache

REPO = Path(__file__).resolve().parents[2]  # the checkout: app.py is there
DATA_DIR = REPO.parent / "shared" / "data"  # the default inputs, next to the checkout
MT_BENCH = DATA_DIR / "mt_bench.jsonl"
SHAKESPEARE = DATA_DIR / "tinyshakespeare.txt"


# ---------------------------------------------------------------------------------------------
# Inputs


def read_input(path):
    """A text or jsonl input's contents; a missing one ends the command with a message that says
    where the defaults live, instead of a traceback."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file. The default inputs live in ../shared/data next to the project "
                         "checkout; pass your own with --text (any UTF-8 text), --turns-file (jsonl with a "
                         "`turns` list per line) or --file.")
    return path.read_text(encoding="utf-8")


def text_tokens(tokenizer, path, n_tokens):
    """The first n_tokens tokens of a text file, [1, n_tokens]."""
    text = read_input(path)
    ids = tokenizer(text[: n_tokens * 8], return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"{path} has only {ids.shape[1]} tokens, {n_tokens} wanted")
    return ids[:, :n_tokens]


def user_turns(path, n, cycle=False):
    """The first n user turns of a jsonl file with a `turns` list per line; with cycle, a file
    with fewer starts over (the shared MT-Bench file has 79 questions, 158 turns)."""
    turns = []
    for line in read_input(path).splitlines():
        if line.strip():
            turns += json.loads(line)["turns"]
    if len(turns) < n and not (cycle and turns):
        raise ValueError(f"{path} has {len(turns)} user turns, {n} wanted")
    return [turns[i % len(turns)] for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Caches

LEAN = "+lean"
COMPILED = "+compiled"  # the lean step with its tensor work compiled (Decoder.compile)


def make_cache(model, method, budget, **settings):
    """'dynamic' (transformers' DynamicCache), 'full', 'window', 'sink', 'h2o' or 'h2o-<score>',
    each with ':int8' for int8 keys and values (CacheConfig.kv_quant; 'h2o:int8'); a '+lean' or
    '+compiled' suffix, see decode.py's `decode_step`, makes the same cache. `settings` are CacheConfig's (n_sink=,
    positions=, prefill_chunk=...); the ones not given are its defaults."""
    method, _, width = method.removesuffix(LEAN).removesuffix(COMPILED).partition(":")
    if method == "dynamic":
        return DynamicCache()
    policy, _, score = method.partition("-")
    settings = {**settings, **({"score": score} if score else {}), **({"kv_quant": width} if width else {})}
    return H2OCache(model, policy=policy, budget=budget, **settings)


def kv_bytes(cache):
    if isinstance(cache, H2OCache):
        return cache.kv_bytes()
    return sum(2 * layer.keys.nelement() * layer.keys.element_size() for layer in cache.layers)


def rss_kib(field):
    """A memory figure of this process from /proc/self/status, in KiB: VmRSS now, VmHWM its peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


# ---------------------------------------------------------------------------------------------
# Results: out/NAME.json (rows and meta), out/NAME.md (the table, under the command that made it), plots


def markdown_table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def write_results(out, name, rows, columns, meta):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown_table(rows, columns)
    (out / f"{name}.md").write_text(f"Command: `{meta['command']}`\n\n{table}\n")
    print(table)


def write_plot(out, name, rows, x, y, series, title, logy=False):
    """One line per value of rows[series], y against x, saved as out/name.png. Rows whose x or y
    is missing ('' or None) are skipped, so one table can feed several plots."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=120)
    for label in dict.fromkeys(r[series] for r in rows):
        points = [(r[x], r[y]) for r in rows if r[series] == label and r[x] not in ("", None) and r[y] not in ("", None)]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=str(label))
    ax.set(xlabel=x, ylabel=y, title=title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(out) / f"{name}.png")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Servers: the app in its own process, the peers' venvs, the OpenAI client


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, process, deadline_s=600):
    """Until `url`/health answers 200 (the app and llama.cpp's server listen once their model is
    loaded); RuntimeError if `process` exits first or the deadline passes."""
    import httpx

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {deadline_s} s")


@contextlib.contextmanager
def app_server(flags=(), threads=None, checkout=REPO, data_dir=None):
    """The app (`checkout`'s app.py: this one, or e.g. a worktree of an older commit to compare)
    in its own process on a free local port, with a data folder of its own (or `data_dir`, kept):
    yields (url, process) at once, so several can load their models together (`wait_healthy` says
    when one answers); stopped, and its own folder removed, when the block ends. threads: its
    OMP_NUM_THREADS. app.py rather than `-m h2o_chat.serve.cli`: every commit has it, the module moved."""
    port, checkout = free_port(), Path(checkout).resolve()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    with tempfile.TemporaryDirectory(prefix="h2o-bench-") as own_dir:
        data_dir = data_dir or own_dir
        command = [sys.executable, str(checkout / "app.py"), "--port", str(port), "--data-dir", data_dir, *flags]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=checkout)
        try:
            yield f"http://127.0.0.1:{port}", process
        finally:
            process.terminate()
            process.wait(60)


def venv_python(arg, env_var, default=None):
    """A peer's python (kvpress, llama.cpp: each in a venv of its own): `arg` (its flag), else
    $env_var, else `default`; None when the one chosen is not there. A choice that does not exist
    is not replaced by the next: the run would compare against some other install than asked."""
    chosen = arg or os.environ.get(env_var) or default
    return shutil.which(os.path.expanduser(chosen)) if chosen else None


def api_client(url):
    """An OpenAI client of the server at `url`; no retries, which would time a second request."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="bench", timeout=900, max_retries=0)


def served_model(url):
    """The id of the model the server at `url` serves (the first it lists)."""
    import httpx

    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def stream_reply(client, model, messages, max_tokens):
    """One streamed greedy reply: (text, usage, ttft_s, streaming_s). ttft_s: request sent -> first
    text; streaming_s: first text -> end (0 when no text came); usage: the server's, or None."""
    start, first, pieces, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    first = first or end
    return "".join(pieces), usage, first - start, end - first
