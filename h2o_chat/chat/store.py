"""Saved conversations: one JSON file per Conversation inside a data folder.

    read(data_dir, conversation_id) -> Conversation          SessionFileError if it cannot be
    write(data_dir, conversation)   -> the new revision       StaleRevisionError if another
                                                               writer got there first
    summaries(data_dir) -> [Summary], newest first             (id, title, updated, n_messages)
    delete(data_dir, id)                                       the file, its lock and its saved caches
    list_ids(data_dir), load(data_dir, id) -> record dict, save(data_dir, id, record): the
    file level underneath (save has no revision check). kv_folder(data_dir, id): where the
    conversation's cache states are saved (chat/saved_kv.py).

Writes are atomic (a temporary file, fsync, rename: a crash leaves the old file or the new
one, never half). `write` is compare-and-swap on the revision: it writes only when the file's
revision is the one the conversation was read as, under a lock file, so two sessions (two tabs,
two processes) on one saved conversation cannot overwrite each other's turns; the loser is told
with StaleRevisionError and keeps its text (ChatSession saves it as a fork).

Only JSON is ever read (never pickle). Ids are checked so that no id can name a file outside
the folder. Format 1 files (before revisions) load as revision 0.
"""

import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .conversation import ROLES, Conversation, Summary

FORMAT_VERSION = 2
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: "$" would let "id\n" through


class SessionFileError(ValueError):
    """A saved conversation that cannot be loaded; the message says which and why."""


class StaleRevisionError(ValueError):
    """Another writer saved this conversation since it was read: writing would lose its turns."""

    def __init__(self, conversation_id, ours, on_disk):
        super().__init__(f"conversation {conversation_id!r} was changed elsewhere (another tab or session saved "
                         f"revision {on_disk}; this copy was read as revision {ours}), so it was not overwritten")
        self.conversation_id, self.ours, self.on_disk = conversation_id, ours, on_disk


def check_id(session_id):
    if not isinstance(session_id, str) or not _ID.fullmatch(session_id):
        raise ValueError(f"invalid session id {session_id!r}: use 1-64 letters, digits, '-' or '_'")
    return session_id


def session_path(data_dir, session_id):
    return Path(data_dir) / f"{check_id(session_id)}.json"


KV_FOLDER = "kv"  # data_dir/kv/<id>/: the conversation's saved cache states (chat/saved_kv.py)


def kv_folder(data_dir, session_id):
    return Path(data_dir) / KV_FOLDER / check_id(session_id)


def delete(data_dir, conversation_id):
    """Remove a saved conversation: its file, its lock and its saved cache states. A conversation
    that is not there is no error (it is gone either way); an invalid id is (ValueError)."""
    path = session_path(data_dir, conversation_id)
    with _locked(path):
        path.unlink(missing_ok=True)
        shutil.rmtree(kv_folder(data_dir, conversation_id), ignore_errors=True)
    (path.parent / f".{path.stem}.lock").unlink(missing_ok=True)


# --- conversations ---------------------------------------------------------------------------
def read(data_dir, conversation_id):
    record = load(data_dir, conversation_id)
    try:
        return Conversation.from_record(record, conversation_id)
    except (TypeError, ValueError) as e:
        raise SessionFileError(f"saved session {conversation_id!r} has invalid settings: {e}") from None


def write(data_dir, conversation):
    """Save `conversation` if the file still holds the revision it was read as (or there is no
    file and it was never saved). Sets its revision and `updated` to the saved ones."""
    path = session_path(data_dir, conversation.id)
    with _locked(path):
        on_disk = _revision_on_disk(path)
        if on_disk != conversation.revision:
            raise StaleRevisionError(conversation.id, conversation.revision, on_disk)
        updated = time.time()
        save(data_dir, conversation.id, {**conversation.record(), "revision": on_disk + 1, "updated": updated})
        # inside the lock: a second save of this same copy (from another thread) must see the
        # revision this one wrote, or it takes itself for another writer and forks
        conversation.revision, conversation.updated = on_disk + 1, updated
    return conversation.revision


def summaries(data_dir):
    """One Summary per saved file, newest first; a file that cannot be read is listed with its error."""
    rows = []
    for conversation_id in list_ids(data_dir):
        try:
            rows.append(read(data_dir, conversation_id).summary())
        except SessionFileError as e:
            mtime = session_path(data_dir, conversation_id).stat().st_mtime
            rows.append(Summary(conversation_id, f"(unreadable) {conversation_id}", mtime, 0, str(e)))
    return sorted(rows, key=lambda s: s.updated, reverse=True)


def _revision_on_disk(path):
    """0 when there is no file (or a format 1 file, which had no revisions)."""
    if not path.is_file():
        return 0
    try:
        revision = json.loads(path.read_text(encoding="utf-8")).get("revision", 0)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError):
        return -1  # a file we cannot read is never silently replaced
    return revision if isinstance(revision, int) and not isinstance(revision, bool) else -1


@contextmanager
def _locked(path):
    """Holds `.<id>.lock` next to the file: the check and the write of `write` are one step
    for every thread and process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.stem}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- files -----------------------------------------------------------------------------------
def save(data_dir, session_id, record):
    """Write the record atomically: a crash leaves the old file or the new one, never half."""
    path = session_path(data_dir, session_id)
    text = json.dumps({**record, "version": FORMAT_VERSION}, ensure_ascii=False, indent=1)
    write_atomically(path, text.encode("utf-8"))


def write_atomically(path, data):
    """A temporary file beside `path`, fsync, rename: a crash leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(data_dir, session_id):
    """The saved record, checked: a version this code reads, a well-formed transcript."""
    path = session_path(data_dir, session_id)
    if not path.is_file():
        raise SessionFileError(f"no saved session {session_id!r} in {data_dir}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: absurd nesting
        raise SessionFileError(f"saved session {session_id!r} is corrupt ({e.__class__.__name__}: {e})") from None
    except OSError as e:
        raise SessionFileError(f"saved session {session_id!r} cannot be read ({e.strerror})") from None
    if not isinstance(record, dict) or not isinstance(record.get("version"), int):
        raise SessionFileError(f"saved session {session_id!r} is not an h2o-chat session file")
    if record["version"] > FORMAT_VERSION:
        raise SessionFileError(f"saved session {session_id!r} was written by a newer h2o-chat "
                               f"(format {record['version']}, this one reads {FORMAT_VERSION})")
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and _is_text(m.get("content"))
            for m in messages):
        raise SessionFileError(f"saved session {session_id!r} has a malformed transcript")
    if not (record.get("system_prompt") is None or _is_text(record["system_prompt"])):
        raise SessionFileError(f"saved session {session_id!r} has a malformed system prompt")
    return record


def _is_text(value):
    """A str that UTF-8 can hold (JSON's "\ud800" escapes decode to lone surrogates, which cannot)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def list_ids(data_dir):
    """Ids of the saved sessions, newest file first."""
    folder = Path(data_dir)
    if not folder.is_dir():
        return []
    files = [p for p in folder.glob("*.json") if _ID.fullmatch(p.stem) and p.is_file()]
    return [p.stem for p in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)]


def to_markdown(record):
    """A saved record (dict) as Markdown; ChatSession.to_markdown gives its conversation's."""
    from .conversation import to_markdown as conversation_markdown

    return conversation_markdown(Conversation.from_record(record, record.get("id") or "export"))
