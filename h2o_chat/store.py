"""Saved sessions: one JSON file per session inside a data folder, written atomically.

Only JSON is ever read (never pickle). Session ids are checked so that no id can name a file
outside the folder.
"""

import json
import os
import re
import tempfile
from pathlib import Path

FORMAT_VERSION = 1
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: "$" would let "id\n" through


class SessionFileError(ValueError):
    """A saved session that cannot be loaded; the message says which and why."""


def check_id(session_id):
    if not isinstance(session_id, str) or not _ID.fullmatch(session_id):
        raise ValueError(f"invalid session id {session_id!r}: use 1-64 letters, digits, '-' or '_'")
    return session_id


def session_path(data_dir, session_id):
    return Path(data_dir) / f"{check_id(session_id)}.json"


def save(data_dir, session_id, record):
    """Write the record atomically: a crash leaves the old file or the new one, never half."""
    path = session_path(data_dir, session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{session_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": FORMAT_VERSION, **record}, f, ensure_ascii=False, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(data_dir, session_id):
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
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and _is_text(m.get("content"))
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
    """Ids of the saved sessions, newest first."""
    folder = Path(data_dir)
    if not folder.is_dir():
        return []
    files = [p for p in folder.glob("*.json") if _ID.fullmatch(p.stem) and p.is_file()]
    return [p.stem for p in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)]


def to_markdown(record):
    lines = [f"# {record.get('title') or 'h2o-chat session'}", ""]
    if record.get("system_prompt"):
        lines += [f"**system**: {record['system_prompt']}", ""]
    for m in record["messages"]:
        lines += [f"**{m['role']}**{' (pinned)' if m.get('pinned') else ''}:", "", m["content"], ""]
    return "\n".join(lines)
