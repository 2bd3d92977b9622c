"""The cache's state saved beside its conversation, so that reopening it, restarting the app or
going back to an older branch loads a few MiB instead of replaying the whole history.

    data_dir/kv/<conversation id>/<tokens fed>-<their hash>-<model tag>-<settings tag>.safetensors

One file is one state of a conversation's timeline: what decides the next token after those
tokens. It holds every layer's buffers (keys and values, and the slots' ids, positions and
scores through their integer view, so the scores come back bit for bit), the pins and resolved
limits, the logits after the last token, the token ledger, the replies' generated ids
(template.KnownTokens: without them a reply re-tokenized from its text would differ from what
the cache holds) and a seeded sampler's generator. Its safetensors metadata tags it with the
format, the model's fingerprint (config, dtype, weights label, a hash of some weights' bytes and
of the tokenizer) and the CacheConfig, and a checksum of its tensors. A state is valid for a
rendering when its tokens are a prefix of the rendering's: the file name's hash finds it, the
saved ids confirm it. Never pickle: safetensors and JSON only; written atomically (a temporary
file, fsync, rename) by one background thread, so a reply's end only waits for a copy.

    States(data_dir, conversation, model, tokenizer)    one conversation's saved states
      .save(timeline, snapshot, known, generator)      queue a state (copied now, written later)
      .candidates(target, longer_than, config)         paths of usable states, most tokens first
      .load(path, timeline, target)                    a checked (Snapshot, Ledger), or None (a notice says why)
      .latest_session(known, sampler)                  the replies and the generator of the newest state
      .take_notices()                                  sentences for the user (a file that could not be used)
    flush(timeout)           wait until every queued state is written (tests, the bench, exit)
    usage(data_dir)          (bytes the saved caches use, bytes allowed)
    BUDGET                   DiskBudget: the total (--kv-disk-mib) and per-conversation bounds

Bounded on disk: after each write the conversation's files are cut to `conversation_mib` and all
conversations' together to `total_mib`, the least recently used first (a state loaded counts as
used); a folder whose conversation was deleted goes with them.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import weakref
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from ..cache.config import check_fields, setting
from ..models.quantize import weights_label
from . import store
from .ledger import Ledger
from .store import write_atomically
from .template import KnownTokens
from .timeline import Snapshot

FORMAT = 1
SUFFIX = ".safetensors"
MIB = 2**20
MAX_QUEUED = 16  # states waiting for the writer; past this the oldest waiting is dropped (a shortcut lost)
STALE_TEMP_S = 600  # a temporary file this old is a crashed write's leftover
log = logging.getLogger("h2o_chat")


@dataclass
class DiskBudget:
    """How much disk saved caches may take (see cache.config.setting): all conversations
    together, and each one (its current state and the older boundaries it can go back to)."""

    total_mib: float = setting(2048, "disk for saved KV caches, all conversations together; the least recently "
                               "used are dropped first (0: save none, every reopen replays)", low=0)
    conversation_mib: float = setting(512, "disk for one conversation's saved states (its latest and the older "
                                      "message boundaries it can go back to)", low=0)

    def __post_init__(self):
        check_fields(self)

    def limits(self):
        """(total bytes, bytes per conversation)."""
        total = int(self.total_mib * MIB)
        return total, min(total, int(self.conversation_mib * MIB))


BUDGET = DiskBudget()  # the process's bounds: serve/cli.py sets total_mib from --kv-disk-mib


# --- names and tags ---------------------------------------------------------------------------
def id_bytes(ids):
    """Token ids as the bytes their hashes are taken of (8 per token: a prefix is a slice)."""
    return array("q", ids).tobytes()


def ids_hash(data, n):
    """A 16-hex-digit hash of the first n tokens of `data` (id_bytes)."""
    return hashlib.blake2b(memoryview(data)[: 8 * n], digest_size=8).hexdigest()


def file_name(n_fed, hashed, model_tag, config_tag):
    return f"{n_fed:09d}-{hashed}-{model_tag}-{config_tag}{SUFFIX}"


def parse_name(name):
    """(n_fed, ids hash, model tag, settings tag) of a state's file name, or None."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    parts = name[: -len(SUFFIX)].split("-")
    if len(parts) != 4 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1], parts[2], parts[3]


def tag(text):
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# settings added after caches were first saved, with the value a file written before them had:
# written only when set otherwise, so a story saved before a setting existed still matches its settings
LATER_SETTINGS = {"budget_shape": "uniform", "keep_template": False, "kv_quant": "none"}


def config_text(config):
    settings = {k: v for k, v in asdict(config).items() if k not in LATER_SETTINGS or v != LATER_SETTINGS[k]}
    return json.dumps(settings, sort_keys=True)


TOKENIZER_PROBE = ("The keeper's log, 1887: \"Storm at 03:40; the Heron's light seen NNE.\"\n\tNo sign since.  "
                   "Ça va? Ünïcödé, 東京, Привет, 😀 <|im_start|>user\n<|im_end|> </s> [INST] 0123456789 == != -> "
                   "https://example.org/a_b?c=d#e    ")
_FINGERPRINTS = weakref.WeakKeyDictionary()  # model -> {id(tokenizer): fingerprint}: computed once


def fingerprint(model, tokenizer):
    """What makes a state belong to a model, as JSON text: its config (without paths), dtype,
    weights label, a hash of the first MiB of a few weight tensors (two random models of one
    config differ there) and a hash of the tokenizer (its vocabulary and chat template)."""
    known = _FINGERPRINTS.setdefault(model, {})
    if id(tokenizer) not in known:
        config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and
                  k not in ("transformers_version", "dtype", "torch_dtype")}
        tensors = list(model.state_dict().items())
        picked = sorted({0, 1, len(tensors) // 2, len(tensors) - 1} & set(range(len(tensors))))
        weights = hashlib.sha256()
        for i in picked:
            name, t = tensors[i]
            weights.update(f"{name} {t.dtype} {list(t.shape)}".encode())
            if t.device.type != "meta":  # offloaded weights (device_map) have no bytes here: their names and shapes
                flat = t.detach().reshape(-1)[: MIB // max(t.element_size(), 1)].contiguous()
                weights.update(flat.cpu().view(torch.uint8).numpy().tobytes())
        # the tokenizer by what it does (its whole vocabulary would cost ~0.1 s to hash at every start)
        probe = tokenizer(TOKENIZER_PROBE, add_special_tokens=False, split_special_tokens=False).input_ids
        token_text = hashlib.sha256(json.dumps([len(tokenizer), probe, sorted(tokenizer.all_special_tokens),
                                                str(getattr(tokenizer, "chat_template", ""))]).encode()).hexdigest()
        known[id(tokenizer)] = json.dumps({"config": config, "dtype": str(model.dtype), "weights": weights_label(model),
                                           "weights_sha256": weights.hexdigest(), "tokenizer_sha256": token_text},
                                          sort_keys=True)
    return known[id(tokenizer)]


def checksum(tensors):
    """blake2b of every tensor's name and bytes, in name order: a garbled file is refused."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode() + str(list(t.shape)).encode())
        if t.numel():
            h.update(t.view(torch.uint8).reshape(-1).numpy())
    return h.hexdigest()


# --- one conversation's states ------------------------------------------------------------------
class States:
    """The saved states of one conversation (and of those it was forked from: a fork keeps
    finding the states of the history it shares), for one model and tokenizer."""

    def __init__(self, data_dir, conversation, model, tokenizer):
        """conversation: a function giving the Conversation (a session may swap it, or fork it)."""
        self.data_dir, self._conversation = Path(data_dir), conversation
        self.fingerprint = fingerprint(model, tokenizer)
        self.model_tag = tag(self.fingerprint)
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.device = model.device
        self.notices = []
        self._parents = {}  # conversation id -> the id it was forked from (read once from its file)

    conversation = property(lambda self: self._conversation())

    def take_notices(self):
        notices, self.notices = self.notices, []
        return notices

    def _notice(self, text):
        if text not in self.notices:  # every state of a conversation may be refused for one reason
            self.notices.append(text)

    def folder(self, conversation_id=None):
        return store.kv_folder(self.data_dir, conversation_id or self.conversation.id)

    def chain(self, depth=8):
        """This conversation's id, then those it was forked from (nearest first)."""
        ids, parent = [self.conversation.id], self.conversation.forked_from
        while parent and parent not in ids and len(ids) < depth:
            ids.append(parent)
            if parent not in self._parents:
                try:
                    self._parents[parent] = store.load(self.data_dir, parent).get("forked_from")
                except (store.SessionFileError, ValueError):
                    self._parents[parent] = None
            parent = self._parents[parent] if isinstance(self._parents[parent], str) else None
        return ids

    def files(self):
        """(path, n_fed, ids hash, model tag, settings tag) of every state along the chain."""
        found = []
        for conversation_id in self.chain():
            try:
                entries = list(os.scandir(self.folder(conversation_id)))
            except (FileNotFoundError, NotADirectoryError, ValueError):
                continue
            for entry in entries:
                parsed = parse_name(entry.name)
                if parsed is not None:
                    found.append((Path(entry.path), *parsed))
        return found

    # --- finding and loading ----------------------------------------------------------------------
    def candidates(self, target, longer_than, config, settings_notice=True):
        """Paths of this model's states under these settings whose tokens are a prefix of
        `target` (ids) longer than `longer_than`, most tokens first. At a first load (longer_than
        0) a state that would have fitted but belongs to another model or (unless not
        `settings_notice`) other settings is named in a notice."""
        WRITER.settle(self.data_dir, self.chain(), longer_than, target)  # a state still being written is one to find
        files = [f for f in self.files() if longer_than < f[1] <= len(target)]
        if not files:
            return []
        data = id_bytes(target)
        config_tag = tag(config_text(config))
        prefix = {n: ids_hash(data, n) for n in {f[1] for f in files}}
        usable = [f for f in files if f[2] == prefix[f[1]]]
        mine = sorted((f for f in usable if f[3] == self.model_tag and f[4] == config_tag), key=lambda f: -f[1])
        if not mine and usable and longer_than == 0:
            if any(f[3] != self.model_tag for f in usable):
                self._notice("The saved cache belongs to another model: replaying the conversation.")
            elif settings_notice:
                self._notice("The saved cache was made with other cache settings: replaying the conversation.")
        return [f[0] for f in mine]

    def load(self, path, timeline, target):
        """The state in `path`, checked against this model, the timeline's settings and `target`
        before anything is touched: (Snapshot, Ledger), or None with a notice saying why (a file
        that can never be read is removed)."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                info = f.metadata() or {}
                refusal = self._refusal(info, timeline.cache.config)
                if refusal:
                    self._notice(f"The saved cache {refusal}: replaying the conversation.")
                    return None
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if checksum(tensors) != info.get("checksum"):
                raise ValueError("its contents do not match their checksum")
            state = json.loads(info["state"])
            cache_state = timeline.cache.import_state(
                {k: v.to(self.device) for k, v in tensors.items() if k.startswith("layer.")}, state)
            ledger = Ledger.from_tensors({k[7:]: v for k, v in tensors.items() if k.startswith("ledger.")},
                                         self.vocab_size)
            n = len(ledger)
            if n != int(info["n_fed"]) or (cache_state[0][0][0] != n) or ledger.vocab_ids != list(target[:n]):
                raise ValueError("its tokens are not those of this conversation")
            logits = tensors.get("logits")
            if logits is not None and (logits.dim() != 1 or not logits.is_floating_point() or
                                       logits.numel() < self.vocab_size):
                raise ValueError(f"logits of shape {list(logits.shape)} for a vocabulary of {self.vocab_size}")
        except FileNotFoundError:  # dropped meanwhile (the disk budget, another process)
            return None
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, it is refused the same way
            reason = str(e) if isinstance(e, ValueError) and not type(e).__name__.startswith("Safetensor") \
                else "the file is truncated or garbled"
            self._notice(f"The saved cache could not be read ({reason}): replaying the conversation.")
            log.warning("h2o-chat: saved cache %s could not be read (%s); removed", path.name, e)
            path.unlink(missing_ok=True)
            return None
        touch(path)  # used: the last to be dropped
        return Snapshot(n, cache_state, None if logits is None else logits.to(self.device)), ledger

    def _refusal(self, info, config):
        """Why a file's tags do not let it be used here (None when they do)."""
        version = info.get("format", "")
        if not version.isdigit():
            return "could not be read (it is not an h2o-chat cache file)"
        if int(version) > FORMAT:
            return f"was written by a newer h2o-chat (format {version}, this one reads {FORMAT})"
        if info.get("fingerprint") != self.fingerprint:
            return "belongs to another model"
        if info.get("cache_config") != config_text(config):
            return "was made with other cache settings"
        return None

    def latest_session(self, known, sampler):
        """Give `known` (template.KnownTokens) the replies of this model's newest state, and a
        seeded `sampler` its generator when the seed is the same: what the session had when it
        last saved. A file that cannot be read is skipped (its state, when asked for, says why)."""
        WRITER.settle(self.data_dir, self.chain())
        files = sorted((f for f in self.files() if f[3] == self.model_tag), key=lambda f: _mtime(f[0]), reverse=True)
        for path, *_ in files[:1]:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    info = f.metadata() or {}
                    if info.get("fingerprint") != self.fingerprint or not info.get("format", "").isdigit() \
                            or int(info["format"]) > FORMAT:
                        return
                    names = set(f.keys())
                    replies = {k[6:]: f.get_tensor(k) for k in names if k.startswith("known.")}
                    generator = f.get_tensor("generator") if "generator" in names else None
                known.load(replies, self.vocab_size)
                seed = info.get("seed")
                if generator is not None and sampler.generator is not None and seed == str(sampler.sampling.seed):
                    sampler.generator.set_state(generator)
            except Exception as e:  # noqa: BLE001 - a bad file only costs the shortcut; load() names it
                log.info("h2o-chat: replies of %s not read (%s)", path.name, e)

    # --- saving -------------------------------------------------------------------------------
    def save(self, timeline, snapshot, known, generator=None, seed=None):
        """Queue `snapshot` (a Snapshot of `timeline`, taken now or kept by it) for writing, with
        the replies `known` holds and a seeded sampler's generator. Copies what can still change
        (the ledger's first n_fed tokens, the replies); the writer thread does the rest."""
        n = snapshot.n_fed
        if n == 0 or BUDGET.limits()[0] == 0:
            return
        ledger = Ledger(*(getattr(timeline.ledger, name)[:n] for name in ("vocab_ids", "pieces", "roles", "turns")))
        job = Job(self.data_dir, self.conversation.id, self.model_tag, self.fingerprint, timeline.cache,
                  snapshot, ledger, dict(known.replies), known.keep,
                  None if generator is None else generator.get_state(), seed)
        WRITER.put(job)


def touch(path):
    try:
        os.utime(path)
    except OSError:
        pass


def _mtime(path):
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


# --- writing ----------------------------------------------------------------------------------
@dataclass
class Job:
    """One state to write: everything copied when it was queued."""

    data_dir: Path
    conversation_id: str
    model_tag: str
    fingerprint: str
    cache: object  # the H2OCache, for its export_state and settings (read-only)
    snapshot: object  # timeline.Snapshot
    ledger: Ledger
    replies: dict
    keep: int
    generator: torch.Tensor | None
    seed: int | None

    def tensors(self):
        """(tensors, metadata) of the file."""
        tensors, state = self.cache.export_state(self.snapshot.cache)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        tensors.update({f"ledger.{k}": v for k, v in self.ledger.export(self.snapshot.n_fed).items()})
        known = KnownTokens(None, keep=self.keep)
        known.replies = self.replies
        tensors.update({f"known.{k}": v for k, v in known.export().items()})
        if self.snapshot.logits is not None:
            tensors["logits"] = self.snapshot.logits.detach().cpu().contiguous()
        if self.generator is not None:
            tensors["generator"] = self.generator
        meta = {"format": str(FORMAT), "fingerprint": self.fingerprint, "cache_config": config_text(self.cache.config),
                "n_fed": str(self.snapshot.n_fed), "state": json.dumps(state), "checksum": checksum(tensors),
                "written": f"{time.time():.3f}"}
        if self.generator is not None:
            meta["seed"] = str(self.seed)
        return tensors, meta

    def path(self):
        n = self.snapshot.n_fed
        name = file_name(n, ids_hash(id_bytes(self.ledger.vocab_ids), n), self.model_tag,
                         tag(config_text(self.cache.config)))
        return store.kv_folder(self.data_dir, self.conversation_id) / name


@dataclass
class Written:
    """What one write cost: for the bench and the README's figures."""

    path: Path
    bytes: int
    seconds: float


class Writer:
    """The one thread that writes saved states, in the order they were queued."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: list[Job] = []
        self._current: Job | None = None  # the one being written
        self._thread = None
        self._warned = set()  # data folders whose write failed (said once)
        self.written: list[Written] = []  # the last writes (at most 100)

    def put(self, job):
        with self._cond:
            self._queue.append(job)
            if len(self._queue) > MAX_QUEUED:
                self._queue.pop(0)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="h2o-kv-writer")
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout=60.0):
        """Wait until every queued state is written; False when the timeout passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._current is None, timeout)

    def settle(self, data_dir, conversation_ids, longer_than=-1, target=None, timeout=30.0):
        """Wait until no state of these conversations with more than `longer_than` tokens (and,
        given `target` ids, whose tokens are a prefix of them) is waiting or being written: a
        state queued before a load is one it can find. A state that cannot be a prefix of the
        target (the reply an edit goes back before) is not waited for."""
        def pending(job):
            n_fed = job.snapshot.n_fed if job is not None else 0
            return job is not None and job.data_dir == data_dir and job.conversation_id in conversation_ids \
                and n_fed > longer_than and (target is None or job.ledger.vocab_ids[:n_fed] == list(target[:n_fed]))

        with self._cond:
            return self._cond.wait_for(lambda: not any(pending(j) for j in (*self._queue, self._current)), timeout)

    def _loop(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                job = self._current = self._queue.pop(0)
            try:
                self.write(job)
            except Exception as e:  # noqa: BLE001 - a state that cannot be written only costs a replay later
                if job.data_dir not in self._warned:
                    self._warned.add(job.data_dir)
                    log.warning("h2o-chat: a KV cache could not be saved in %s (%s); reopening will replay",
                                job.data_dir, e)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def write(self, job):
        start = time.perf_counter()
        if not store.session_path(job.data_dir, job.conversation_id).is_file():
            return  # deleted (or never saved): nothing to save beside
        tensors, meta = job.tensors()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total, per_conversation = BUDGET.limits()
        if size > per_conversation:
            log.info("h2o-chat: a %.0f MiB cache is over the %.0f MiB a conversation may keep on disk: not saved",
                     size / MIB, per_conversation / MIB)
            return
        path = job.path()
        write_atomically(path, safetensors_bytes(tensors, meta))
        self.written = self.written[-99:] + [Written(path, path.stat().st_size, time.perf_counter() - start)]
        enforce(job.data_dir, keep=path)


WRITER = Writer()
atexit.register(WRITER.flush, 10.0)  # a normal exit finishes the write under way (a crash leaves the old file)


def flush(timeout=60.0):
    """Wait until every queued state is on disk (False if `timeout` passed first)."""
    return WRITER.flush(timeout)


# --- the disk budget ----------------------------------------------------------------------------
def scan(data_dir, tidy=False):
    """{conversation id: [(path, bytes, last used)]} of every saved state in the data folder.
    tidy: also remove what belongs to no conversation (the folder of a deleted one, crashed
    writes' leftovers); the writer does after each write, a reader (the page's usage) does not."""
    root, found = Path(data_dir) / store.KV_FOLDER, {}
    try:
        folders = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return found
    now = time.time()
    for folder in folders:
        try:
            if not store.session_path(data_dir, folder.name).is_file():
                if tidy:
                    shutil.rmtree(folder.path, ignore_errors=True)
                continue
            entries = list(os.scandir(folder.path))
        except (ValueError, OSError):  # a name that is no conversation id: not ours, left alone
            continue
        rows = []
        for entry in entries:
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_S:
                if tidy:
                    Path(entry.path).unlink(missing_ok=True)
            elif parse_name(entry.name) is not None:
                rows.append((Path(entry.path), stat.st_size, stat.st_mtime))
        found[folder.name] = rows
    return found


def enforce(data_dir, keep=None):
    """Drop the least recently used states until the conversation of `keep` fits its bound and
    all of them the total (never `keep`, the state just written)."""
    total_allowed, per_conversation = BUDGET.limits()
    states = scan(data_dir, tidy=True)
    doomed = [row for rows in states.values() for row in oldest_beyond(rows, per_conversation, keep)]
    left = [r for rows in states.values() for r in rows if r not in doomed]
    doomed += oldest_beyond(left, total_allowed, keep)
    for path, _, _ in doomed:
        path.unlink(missing_ok=True)


def oldest_beyond(rows, allowed, keep):
    """The least recently used of `rows` (path, bytes, last use) whose removal brings their size
    within `allowed`, never `keep`."""
    size, doomed = sum(r[1] for r in rows), []
    for row in sorted(rows, key=lambda r: r[2]):
        if size <= allowed:
            break
        if row[0] != keep:
            doomed.append(row)
            size -= row[1]
    return doomed


def usage(data_dir):
    """(bytes the saved caches of `data_dir` take, bytes they may take): for the page."""
    used = sum(r[1] for rows in scan(data_dir).values() for r in rows)
    return used, BUDGET.limits()[0]
