"""Peers at equal KV memory: memory points turned into the slots each width affords (bench/memory.py),
the SVG chart the comparisons draw (bench/svg.py), `evaluate compress --memory` and `evaluate
summarize --memory` end to end on the tiny model, and, where their venvs exist, kvpress's presses and
OpenVINO's eviction at the same bytes (skipped, saying so, without them)."""

import json
import math
import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from h2o_chat.bench import compress, evaluate, memory, summarize, svg
from h2o_chat.bench.peers import kvpress, openvino
from h2o_chat.models.load import load_model
from tests.conftest import read_results, run_ppl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SVG = "{http://www.w3.org/2000/svg}"
OPENVINO_PYTHON = openvino.find_python() or openvino.find_python("/work/venvs/openvino/bin/python")
needs_openvino = pytest.mark.skipif(OPENVINO_PYTHON is None, reason=f"no OpenVINO GenAI venv: set {openvino.ENV_VAR} "
                                    f"to its python ({openvino.MAKE_VENV})")
needs_kvpress = pytest.mark.skipif(kvpress.find_python() is None,
                                   reason=f"no kvpress venv: set {kvpress.ENV_VAR} to its python")


# --- the conversion -----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_int8_affords_4d_over_2d_plus_16_times_the_bf16_slots(head_dim):
    # bytes a token over 30 layers and 3 KV heads: bf16 keys and values, or int8 codes + 4 float32
    layers_heads = 30 * 3
    bf16, int8 = layers_heads * 2 * head_dim * 2, layers_heads * (2 * head_dim + 16)
    for n in (1, 97, 663, 3584, 4096):
        for point in (Fraction(1, 10), Fraction(1, 5), Fraction(1, 2), Fraction(1)):
            assert memory.slots_at(point, n, bf16, bf16) == math.floor(point * n)
            slots = memory.slots_at(point, n, bf16, int8)
            assert slots == math.floor(point * n * Fraction(4 * head_dim, 2 * head_dim + 16))
            assert slots * int8 <= point * n * bf16 < (slots + 1) * int8  # the most that fit, exactly
    assert memory.slots_at(Fraction(1, 10), 3584, 23040, 12240) == 674  # the embedded model: 358.4 * 256 / 136


def test_slots_at_a_block_multiple_is_whole_blocks_that_fit():
    for n in range(100, 2000, 37):
        budget = memory.slots_at(Fraction(1, 5), n, 23040, 13680, multiple=32)
        assert budget % 32 == 0 and budget * 13680 <= Fraction(1, 5) * n * 23040 < (budget + 32) * 13680


def test_memory_points_parse_exactly_and_refuse_what_is_not_a_fraction():
    assert memory.memory_points("0.1,0.2,0.5") == [Fraction(1, 10), Fraction(1, 5), Fraction(1, 2)]
    assert memory.memory_points("1") == [Fraction(1)] and memory.percent(Fraction(1, 10)) == "10%"
    for bad in ("0", "1.5", "-0.1", "ten"):
        with pytest.raises(ValueError):
            memory.memory_points(bad)


def test_the_arms_flags_parse(monkeypatch, capsys):
    """--memory, widths in --methods and OpenVINO's modes reach the commands as they should; a bad
    memory point ends the command with argparse's message."""
    seen = {}
    for module in (compress, summarize):
        monkeypatch.setattr(module, "run", lambda args, name=module.__name__: seen.__setitem__(name, args))
    evaluate.main(["compress", "--memory", "0.1,0.5", "--methods", "h2o-sum,h2o-sum:int8", "--presses",
                   "kvpress-snapkv,KnormPress"])
    evaluate.main(["summarize", "--file", "x.jsonl", "--memory", "0.2", "--methods", "full,h2o,h2o:int8",
                   "--openvino", "--openvino-modes", "SUM,NORM_SUM", "--skip", "12"])
    c, s = seen[compress.__name__], seen[summarize.__name__]
    assert c.memory == [Fraction(1, 10), Fraction(1, 2)] and c.methods == ["h2o-sum", "h2o-sum:int8"]
    assert c.presses == ["kvpress-snapkv", "KnormPress"]
    assert [memory.width_of(m) for m in c.methods] == ["", "int8"]
    assert s.memory == [Fraction(1, 5)] and s.openvino == "" and s.openvino_modes == ["SUM", "NORM_SUM"]
    assert s.skip == 12 and s.methods == ["full", "h2o", "h2o:int8"]
    for command in (["compress", "--memory", "0"], ["summarize", "--file", "x.jsonl", "--memory", "2"]):
        with pytest.raises(SystemExit):
            evaluate.main(command)
        assert "--memory" in capsys.readouterr().err


def test_bytes_per_token_is_measured_per_width(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir), dtype="float32")
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert memory.bytes_per_token(model) == layers * heads * 2 * head_dim * 4  # float32 keys and values
    assert memory.bytes_per_token(model, "int8") == layers * heads * (2 * head_dim + 4 * 2)  # codes, float16 scales and zeros
    assert memory.bytes_per_token(model, "dynamic") == memory.bytes_per_token(model)


def test_openvino_split_keeps_whole_blocks_and_room_to_evict():
    for budget in range(3 * openvino.BLOCK, 2048, openvino.BLOCK):
        start, recent = openvino.split(budget)
        assert start == openvino.BLOCK and recent % openvino.BLOCK == 0 and start + recent < budget
        assert openvino.eviction(budget, start, recent, "NORM_SUM")["aggregation_mode"] == "NORM_SUM"
    assert openvino.split(512) == (32, 224)  # half of what the start block leaves, in whole blocks


# --- the figure ---------------------------------------------------------------------------------


def test_line_chart_draws_a_polyline_per_series_with_labelled_axes(tmp_path):
    table = [("h2o-sum", 0.8, 41.0), ("h2o-sum", 1.7, 38.5), ("h2o-sum:int8", 0.8, 39.0), ("h2o-sum:int8", 1.7, 37.9),
             ("kvpress-snapkv", 0.8, 900.0), ("kvpress-snapkv", 1.7, 39.2)]
    series = {}
    for method, mib, ppl in table:
        series.setdefault(method, []).append((mib, ppl))
    series["full"] = [(0.8, 37.2), (8.4, 37.2)]
    path = tmp_path / "chart.svg"
    svg.write_chart(path, series, "a title", "KV cache held (MiB)", "perplexity", dashed=["full"], y_max=80)
    root = ET.parse(path).getroot()
    lines = root.findall(f"{SVG}polyline")
    assert [line.get("data-series") for line in lines] == ["h2o-sum", "h2o-sum:int8", "kvpress-snapkv", "full"]
    assert all(len(line.get("points").split()) == 2 for line in lines)
    assert [line.get("stroke-dasharray") for line in lines] == [None, None, None, "6 4"]
    assert len({line.get("stroke") for line in lines}) == 4
    texts = {t.get("class"): t.text for t in root.iter(f"{SVG}text") if t.get("class")}
    assert texts == {"x-label": "KV cache held (MiB)", "y-label": "perplexity"}
    every_text = [t.text for t in root.iter(f"{SVG}text")]
    assert "900 (off the axis)" in every_text and "a title" in every_text
    assert all(label in every_text for label in series)  # the legend


def test_nice_ticks_cover_the_range_in_round_steps():
    assert svg.nice_ticks(0.83, 8.44) == [0, 2, 4, 6, 8, 10]
    assert svg.nice_ticks(37.2, 41.0) == [37, 38, 39, 40, 41]
    ticks = svg.nice_ticks(5, 5)
    assert ticks[0] <= 5 <= ticks[-1]


# --- the commands, end to end ---------------------------------------------------------------------


def test_compress_at_equal_memory_gives_int8_more_slots_in_the_same_bytes(tiny_model_dir, play_text, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.delenv(kvpress.ENV_VAR, raising=False)
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "compress", "--quick", "--text",
                   str(play_text), "--memory", "0.1,0.5", "--methods", "h2o-sum,h2o-sum:int8"])
    assert "skipping the kvpress arms" in capsys.readouterr().out
    data = read_results(tmp_path, "compress", plot=False)
    rows, per_token = data["rows"], data["meta"]["bytes_per_token"]
    full = rows[0]
    assert (full["method"], full["memory"], full["kept"], full["kv_pct"]) == ("full", "100%", 384, "100.0%")
    by = {(r["method"], r["memory"]): r for r in rows}
    for point in ("10%", "50%"):
        bf16, int8 = by[("h2o-sum", point)], by[("h2o-sum:int8", point)]
        allowed = Fraction(point[:-1]) / 100 * full["kv_bytes"]
        assert bf16["kept"] == memory.slots_at(Fraction(point[:-1]) / 100, 384, per_token["model width"],
                                               per_token["model width"])
        assert int8["kept"] == memory.slots_at(Fraction(point[:-1]) / 100, 384, per_token["model width"],
                                               per_token["int8"]) > bf16["kept"]
        for r in (bf16, int8):  # what each held fits the point, and one more slot would not have
            slot = per_token["int8" if r is int8 else "model width"]
            assert r["kv_bytes"] == r["kept"] * slot and r["kv_bytes"] <= allowed < r["kv_bytes"] + slot
    root = ET.parse(tmp_path / "compress-kv.svg").getroot()
    assert [p.get("data-series") for p in root.findall(f"{SVG}polyline")] == [
        "h2o-sum", "h2o-sum:int8", f"full ({full['kv_MiB']} MiB)"]


def test_streaming_ppl_at_equal_memory_fills_each_bytes_share_within_one_token(tiny_model_dir, play_text, tmp_path):
    """`evaluate ppl --memory`: each width's budget is the most slots whose bytes (the cache's own
    kv_bytes() at the end of the stream) fit in the share of the full cache's (its full_kv_bytes()),
    one more token's bytes (measured, from the run's meta) would not; int8 gets more slots."""
    data = run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "96", "--memory", "0.2,0.5", "--chunk",
                   "8", "--methods", "full,h2o-sum,h2o-mean", "--kv-quant", "none,int8", "--long-tokens", "0")
    rows, per_token = data["rows"], data["meta"]["bytes_per_token"]
    assert [(r["label"], r["memory"]) for r in rows] == [("full", "100%"), ("full:int8", "100%")] + [
        (m + w, p) for m in ("h2o-sum", "h2o-mean") for p in ("20%", "50%") for w in ("", ":int8")]
    full = rows[0]
    assert full["kv_bytes"] == full["full_kv_bytes"] == 95 * per_token["model width"]  # 96 tokens, 95 fed
    by = {(r["label"], r["memory"]): r for r in rows}
    for method in ("h2o-sum", "h2o-mean"):
        for point in ("20%", "50%"):
            bf16, int8 = by[(method, point)], by[(method + ":int8", point)]
            assert int8["budget"] > bf16["budget"]
            for r, slot in ((bf16, per_token["model width"]), (int8, per_token["int8"])):
                allowed = Fraction(point[:-1]) / 100 * r["full_kv_bytes"]
                assert r["kv_bytes"] == r["budget"] * slot  # the budget is what it held at the end
                assert r["kv_bytes"] <= allowed < r["kv_bytes"] + slot
    assert "| memory | budget |" in (tmp_path / "ppl.md").read_text()


@needs_kvpress
def test_compress_at_equal_memory_runs_the_presses_at_the_models_width(tiny_model_dir, play_text, tmp_path):
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "compress", "--quick", "--text",
                   str(play_text), "--memory", "0.2", "--methods", "h2o-sum", "--presses", "kvpress-snapkv,KnormPress"])
    rows = read_results(tmp_path, "compress", plot=False)["rows"]
    ours = next(r for r in rows if r["method"] == "h2o-sum")
    for press in ("kvpress-snapkv", "KnormPress"):
        row = next(r for r in rows if r["method"] == press)
        assert row["memory"] == "20%" and row["kept"] == ours["kept"] and row["kv_bytes"] == ours["kv_bytes"]


@pytest.mark.slow
def test_summarize_at_equal_memory(tiny_model_dir, tmp_path):
    from tests.test_evaluate import ARTICLES

    path = tmp_path / "xsum.jsonl"
    path.write_text("".join(json.dumps({"article": f"###\nArticle: {a}\n\nSummarize the above article in 1 sentence.\n",
                                        "summary_gt": s, "max_tokens": 8, "stop": ["###"], "temperature": 0.3}) + "\n"
                            for a, s in ARTICLES))
    out = tmp_path / "out"
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(out), "summarize", "--file", str(path), "--skip", "1",
                   "--memory", "0.2,0.5", "--methods", "full,h2o,h2o:int8", "--chunk", "16"])
    data = read_results(out, "summarize", plot=False)
    rows, meta = data["rows"], data["meta"]
    assert meta["requests"] == 2 and meta["temperature"] == 0  # --skip 1 of 3; greedy at equal memory
    assert [(r["method"], r["memory"]) for r in rows] == [("full", 1.0)] + [
        (m, p) for m in ("h2o", "h2o:int8") for p in ("20%", "50%")]
    by = {(r["method"], r["memory"]): r for r in rows}
    for point in ("20%", "50%"):
        assert by[("h2o:int8", point)]["budget_mean"] > by[("h2o", point)]["budget_mean"]
        assert all(by[(m, point)]["kv_pct"] <= float(point[:-1]) for m in ("h2o", "h2o:int8"))
    assert (out / "summarize-kv.svg").is_file()


@needs_openvino
@pytest.mark.slow
def test_openvino_counts_its_own_bytes_and_holds_its_budget_in_blocks():
    """OpenVINO's u8 cache on the embedded GGUF: a token's bytes measured twice alike; with nothing
    evicted its cache is the prompt and replies' whole blocks, with its eviction on it ends within
    max_cache_size plus one block."""
    from h2o_chat.models.load import embedded_gguf_path

    gguf = embedded_gguf_path()
    per_token = openvino.bytes_per_token(OPENVINO_PYTHON, gguf, threads=1)
    assert per_token > 0
    budget = 4 * openvino.BLOCK
    task = {"prompt_ids": list(range(1000, 1400)), "max_new_tokens": 40, "stop": [], "ignore_eos": True,
            "eviction": openvino.eviction(budget, *openvino.split(budget), "SUM")}
    done = openvino.generate(OPENVINO_PYTHON, gguf, [task, {**task, "eviction": None}], threads=1)
    evicted, full = done["results"]
    assert evicted["kv_bytes_last"] <= (budget + openvino.BLOCK) * per_token < full["kv_bytes_last"]
    assert full["kv_bytes_last"] == -(-440 // openvino.BLOCK) * openvino.BLOCK * per_token  # whole blocks
    assert len(full["tokens"]) == 40 and len(evicted["tokens"]) == 40
