"""`python -m h2o_chat.bench.evaluate ppl` and `summarize` end to end on the tiny model: the outputs
parse and have the rows they should. The figures are measurements, not asserted."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h2o_chat.bench import evaluate, ppl
from h2o_chat.bench.common import make_cache
from tests.conftest import make_tiny_llama, read_results, run_ppl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_old_command_python_m_h2o_chat_evaluate_still_runs_the_evaluations():
    """Earlier READMEs and scripts say `python -m h2o_chat.evaluate`: it is the same command."""
    import h2o_chat.evaluate

    assert h2o_chat.evaluate.main is evaluate.main
    run = subprocess.run([sys.executable, "-m", "h2o_chat.evaluate", "ppl", "--help"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--budgets" in run.stdout and "ppl" in run.stdout


def test_numbers():
    assert evaluate.numbers("0.1,0.2,0.5") == [0.1, 0.2, 0.5]
    assert evaluate.numbers("410,820") == [410, 820]
    assert evaluate.numbers("auto,0.25") == [None, 0.25]


@pytest.mark.parametrize("method", ["full", "window", "sink", "h2o-sum", "h2o-mean", "h2o-decay"])
@pytest.mark.parametrize("positions", ["rolling", "absolute"])
def test_feeding_many_tokens_per_call_changes_nothing(method, positions):
    # --feed is only speed: the cache evicts every prefill_chunk tokens inside each layer, which
    # must give the same NLLs as calling the model on prefill_chunk tokens at a time
    model = make_tiny_llama(torch.float64)
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(3))

    def nlls(feed):
        cache = make_cache(model, method, budget=40, n_sink=2, positions=positions, prefill_chunk=8)
        return ppl.streaming_nlls(model, tokens, cache, feed)

    torch.testing.assert_close(nlls(64), nlls(8), rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_ppl_budgets_and_the_long_part(tiny_model_dir, play_text, tmp_path):
    rows = run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "128", "--budgets", "0.25,0.5", "--chunk",
                   "8", "--long-tokens", "700", "--long-budget", "32", "--segment", "200")["rows"]
    # full once, every other method at each budget (25% and 50% of 128 tokens)
    assert [(r["method"], r["budget"]) for r in rows] == [("full", "all")] + [
        (m, b) for m in ppl.PPL_METHODS[1:] for b in (32, 64)]
    assert all(r["ppl"] > 1 for r in rows) and rows[0]["vs_full"] == "+0.0%"
    by = {(r["method"], r["budget"]): r for r in rows}
    assert by[("window", 32)]["n_sink"] == 0 and by[("sink", 32)]["n_sink"] == 4
    assert by[("h2o-sum", 64)]["n_recent"] == 30  # half of what the 4 sinks leave

    long = read_results(tmp_path, "ppl-long")
    assert long["meta"]["max_position_embeddings"] == 512
    segments = long["rows"][:4]
    assert [r["tokens"] for r in segments] == ["1-200", "201-400", "401-600", "601-699"]
    # the full cache stops at the model's 512 positions; the bounded caches go on
    assert [r["full"] for r in segments] == [segments[0]["full"], segments[1]["full"], "n/a", "n/a"]
    # the bounded caches are scored on past the context: a real perplexity (finite, above 1) per segment
    assert all(math.isfinite(r[m]) and r[m] > 1 for r in segments for m in ("window", "sink", "h2o-sum"))
    assert [r["tokens"] for r in long["rows"][4:]] == ["1-511 (all within context)", "512-699 (all past context)"]
    assert long["rows"][-1]["full"] == "n/a"


@pytest.mark.slow
def test_ppl_sweeps_sinks_recent_split_and_positions(tiny_model_dir, play_text, tmp_path):
    rows = run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "96", "--budgets", "40", "--chunk", "8",
                   "--methods", "full,window,sink,h2o-sum", "--n-sink", "0,4", "--n-recent", "0.25,0.75",
                   "--positions", "rolling,absolute", "--long-tokens", "0")["rows"]
    labels = [r["label"] for r in rows]
    # window has no knobs but positions; sink has no recent split; each distinct cache runs once
    assert labels[:3] == ["full", "window rolling", "window absolute"]
    assert {"sink sink0 rolling", "sink sink4 absolute"} <= set(labels)
    h2o = [r for r in rows if r["method"] == "h2o-sum"]
    assert len(h2o) == 2 * 2 * 2
    assert {(r["n_sink"], r["n_recent"]) for r in h2o} == {(0, 10), (0, 30), (4, 10), (4, 30)}
    assert len(labels) == len(set(labels))
    assert not (tmp_path / "ppl-long.json").exists()


@pytest.mark.slow
def test_ppl_sweeps_the_kv_width_and_reports_the_bytes_held(tiny_model_dir, play_text, tmp_path):
    rows = {r["label"]: r for r in run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "96", "--budgets",
                                           "32", "--chunk", "8", "--methods", "full,h2o-sum", "--kv-quant",
                                           "none,int8", "--long-tokens", "0")["rows"]}
    assert list(rows) == ["full", "full:int8", "h2o-sum", "h2o-sum:int8"]
    # the tiny model's float32, head_dim 16: 64 bytes of keys and values a token and head, or
    # 2 x 16 int8 codes and four float16 scales and zero points (40); 32 of the 95 tokens fed kept
    assert [rows[k]["kv_pct"] for k in rows] == ["100.0%", "62.5%", f"{32 / 95:.1%}", f"{32 / 95 * 0.625:.1%}"]
    # int8 slots (their bytes above) cost the random tiny model next to nothing: within 1% of the full
    # cache's ppl (rounded to 3 decimals the two can even coincide, so inequality is not asserted)
    assert rows["full"]["vs_full"] == "+0.0%" and rows["full:int8"]["ppl"] == pytest.approx(rows["full"]["ppl"], rel=0.01)


@pytest.mark.slow
def test_ppl_quick(tiny_model_dir, play_text, tmp_path):
    data = run_ppl(tiny_model_dir, play_text, tmp_path, "--quick", "--methods", "full,sink,h2o-sum",
                   "--long-methods", "full,h2o-sum")
    assert data["meta"]["tokens"] == 384 and {r["budget"] for r in data["rows"]} == {"all", 38, 77, 192}
    long = read_results(tmp_path, "ppl-long")
    assert long["meta"]["tokens"] == 768 and long["meta"]["budget"] == 64


ARTICLES = [
    ("The town council voted on Monday to close the old bridge over the river for repairs. Drivers will "
     "have to use the ring road for six months, officials said.", "An old river bridge will close for six months."),
    ("A local bakery won the national bread award for its sourdough loaf. The owner said the secret was "
     "patience and a starter kept alive for twenty years.", "A bakery has won a national award for its sourdough."),
    ("Heavy rain flooded several streets in the city centre overnight. No one was hurt, but shops stayed "
     "closed while the water was pumped away.", "Overnight rain flooded city centre streets."),
]


@pytest.fixture
def requests_file(tmp_path):
    path = tmp_path / "xsum.jsonl"
    with open(path, "w") as f:
        for i, (article, summary) in enumerate(ARTICLES):
            f.write(json.dumps({"article": f"###\nArticle: {article}\n\nSummarize the above article in 1 sentence.\n",
                                "summary_gt": summary, "max_tokens": 12, "n": 1, "stop": ["###"],
                                "temperature": 0.3 if i else 0, "top_p": 1}) + "\n")
    return path


@pytest.mark.slow
def test_summarize(tiny_model_dir, requests_file, tmp_path):
    out = tmp_path / "out"
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(out), "summarize", "--file", str(requests_file),
                   "--fractions", "0.2,0.5"])
    data = read_results(out, "summarize")
    rows = data["rows"]
    assert [(r["method"], r["fraction"]) for r in rows] == [("full", 1.0)] + [
        (m, f) for m in ("h2o", "window", "sink") for f in (0.2, 0.5)]
    assert all(0 <= r[k] <= 100 for r in rows for k in ("rouge1", "rouge2", "rougeL", "rougeL_vs_full"))
    assert rows[0]["rougeL_vs_full"] == 100
    assert all(0 < r["new_tokens"] <= 12 for r in rows)
    assert data["meta"]["requests"] == 3
    prompt = data["meta"]["prompt_tokens"]["mean"]
    assert rows[0]["budget_mean"] == pytest.approx(prompt, abs=0.1) and rows[1]["budget_mean"] == pytest.approx(0.2 * prompt, abs=1)
    gens = [json.loads(line) for line in (out / "summarize-generations.jsonl").read_text().splitlines()]
    assert len(gens) == 3 * len(rows) and all("###" not in g["text"] for g in gens)


@pytest.mark.slow
def test_summarize_quick_and_seeded(tiny_model_dir, requests_file, tmp_path):
    # sampling is seeded per request: two runs give the same summaries
    for out in (tmp_path / "a", tmp_path / "b"):
        evaluate.main(["--model", str(tiny_model_dir), "--out", str(out), "summarize", "--file", str(requests_file),
                       "--quick", "--methods", "full,h2o", "--fractions", "0.5"])
    a, b = ((out / "summarize-generations.jsonl").read_text() for out in (tmp_path / "a", tmp_path / "b"))
    assert a == b
    assert all(r["new_tokens"] <= 12 for r in read_results(tmp_path / "a", "summarize")["rows"])


def test_ppl_per_quantization(tiny_model_dir, play_text, tmp_path):
    """One table: each cache on each weights, against the same cache on the first weights."""
    data = run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "96", "--budgets", "0.5", "--chunk", "8",
                   "--methods", "full,h2o-sum", "--long-tokens", "0", "--quantization", "none,int8,int4",
                   "--dtype", "float32")
    rows = data["rows"]
    assert [(r["quantization"], r["label"]) for r in rows] == [
        (q, m) for q in ("none", "int8", "int4") for m in ("full", "h2o-sum")]
    assert all(r["vs_none"] == "+0.00%" for r in rows[:2]) and all(r["vs_none"].endswith("%") for r in rows)
    assert set(data["meta"]["weights"]) == {"none", "int8", "int4"}
    assert "| quantization |" in (tmp_path / "ppl.md").read_text()
