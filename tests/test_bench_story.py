"""bench story on the tiny chat model through app.py: every turn reuses the previous reply."""

import json

import pytest

from h2o_chat.bench import cli
from tests.live import save_tiny_chat

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_bench_story_reuses_the_previous_reply_every_turn(tmp_path):
    folder = save_tiny_chat(tmp_path / "tiny")
    cli.main(["--model", str(folder), "--out", str(tmp_path), "story", "--turns", "4", "--seeds", "0,1",
                "--max-tokens", "12", "--h2o-args=--budget 48 --n-sink 2 --n-recent 16 --dtype float32"])
    rows = json.loads((tmp_path / "story_turns.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 4 and {r["policy"] for r in rows} == {"h2o", "full"}
    assert all(r["reply_reused"] for r in rows if r["turn"] > 1)
    # the first story computes its first turn; the second starts alike (the same messages), and its first
    # turn starts from the first story's saved state (docs/saved-cache.md)
    assert all(r["cached_tokens"] == 0 for r in rows if r["turn"] == 1 and r["seed"] == 0)
    table = (tmp_path / "story.md").read_text()
    assert table.startswith("Command: `python -m h2o_chat.bench") and "| h2o | 8 | 6/6 |" in table
