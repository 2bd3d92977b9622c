"""bench story: its counts and intervals on hand-made rows; on the tiny chat model through app.py,
every turn reuses the previous reply."""

import argparse
import json

import pytest

from h2o_chat.bench import cli
from h2o_chat.bench.story import budget_of, degenerate, rate, summary, wilson
from tests.live import save_tiny_chat


def test_the_wilson_interval_gives_newcombe_s_textbook_values():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in Medicine
    # 17:857-872: the score method (no continuity correction) on the paper's worked examples
    for (k, n), (low, high) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                                (1, 29): (0.0061, 0.1718)}.items():
        assert wilson(k, n) == (pytest.approx(low, abs=5e-5), pytest.approx(high, abs=5e-5))
    assert wilson(0, 0) == (0.0, 1.0)  # no trials: nothing known
    assert rate(1, 108) == "1/108 = 0.9% [0.2, 5.1]"


def row(seed, turn, bad, policy="h2o", prompt=100):
    return {"seed": seed, "policy": policy, "turn": turn, "degenerate": bad, "prompt_tokens": prompt,
            "cached_share": 0.99, "reply_reused": turn > 1, "ttft_s": 0.1}


def test_the_summary_counts_degenerate_replies_and_the_stories_that_have_one():
    rows = [row(0, t, t >= 2) for t in (1, 2, 3)] + [row(1, t, False, prompt=600) for t in (1, 2, 3)] + \
        [row(2, t, t == 3, prompt=300 * t) for t in (1, 2, 3)] + [row(s, t, True, "full") for s in (0, 1) for t in (1, 2)]
    h2o, full = summary(rows, ["h2o", "full"], [0, 1, 2], budget=512)
    assert h2o["degenerate"] == rate(3, 9) and h2o["stories_degenerate"] == rate(2, 3)
    assert h2o["over_budget"] == "5/9"  # seed 1's three turns and seed 2's last two (600 and 900 tokens)
    assert full["degenerate"] == rate(4, 4) and full["stories_degenerate"] == "2/2 = 100.0% [34.2, 100.0]"
    assert summary(rows, ["h2o"], [1])[0]["stories_degenerate"].startswith("0/1 = 0.0% [0.0, ")
    assert summary(rows, ["h2o"], [1])[0]["over_budget"] == ""  # no budget given: not counted


def test_the_budget_the_app_runs_with_is_read_off_its_flags():
    assert budget_of("") == 512 and budget_of("--budget 300 --dtype float32") == 300
    assert budget_of("--n-sink 2 --budget=64") == 64 and budget_of("--budget 0.2") is None  # a fraction: per prompt


def test_the_story_flags_take_a_range_of_seeds_and_only_known_arms():
    assert cli.seed_list("0-19") == list(range(20)) and cli.seed_list("3,5") == [3, 5] and cli.seed_list("7") == [7]
    assert cli.arm_list("h2o,full,sink,template") == ["h2o", "full", "sink", "template"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown arm 'h2o2'; the arms are h2o, full, sink, template"):
        cli.arm_list("h2o,h2o2")


def test_degenerate_flags_the_collapse_seen_and_not_plain_prose():
    prose = ("Mira sets the lantern down and studies the seal. \"The council has never sent anyone this far in "
             "winter. Sit by the stove; we will read it together when your hands stop shaking.\"")
    assert not degenerate(prose, 40)
    assert degenerate("Ere-ry-Mer-Euse-A-Ar and then", 12)  # the hyphen run of the failure the issue saw
    assert degenerate("the sea " * 40, 80)  # a loop
    assert degenerate("a,b;c:d." * 10, 40)  # under 2.5 characters a token


def test_degenerate_passes_hyphenated_english_and_still_flags_fragment_runs():
    # the four replies docs/story-fidelity.md read as false positives: English words joined by
    # hyphens, each part a word (short ones like "I", "of", "in" are words too)
    english = ["her great-great-great-great-great-great-great-great-great-grandfather, who sailed",
               'they called her "Mira-I-Love-The-Clan-Your-Self" and laughed',
               "Icy-boil-our-daily-life, she said",
               "a hag-burgh-the-farce-like tale",
               "a state-of-the-art, up-to-the-minute, son-in-law-to-be report"]
    for text in english:
        assert not degenerate(text, 14), text
    # what was flagged and read as degenerate: fragments that are not words, two or more in a run
    collapsed = ["Ere-ry-Mer-Euse-A-Ar and then", "Si-U-I-O-I-WIZAR-D-O-R-O!", "lo-hek-ki-l-k-ar-o-ra-le,",
                 "shak-k-a-l-le,", "God...Munk-ne-ez-bedz-lo", '"Wilde-thre-dall-s-ar-owe.',
                 "exe-chira-c-e-l-a-m-le", "JEl-El-El-El-El-El-JIMMI"]
    for text in collapsed:
        assert degenerate(text, 12), text


@pytest.mark.live
@pytest.mark.slow
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
