"""`evaluate compress` and the kvpress arm of `bench dialogue`, end to end on the tiny models, and
the bridge to kvpress's own venv. Tests that need that venv run only when $H2O_KVPRESS_PYTHON
names its python (see h2o_chat/bench/peers/kvpress.py for how to make it); the rest run anywhere."""

import math
import sys

import pytest
import torch

from h2o_chat.bench import cli, compress, dialogue, evaluate
from h2o_chat.bench.common import make_cache, text_tokens
from h2o_chat.bench.peers import kvpress
from h2o_chat.models.load import load_model
from tests.conftest import read_results

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KVPRESS_PYTHON = kvpress.find_python()
needs_kvpress = pytest.mark.skipif(KVPRESS_PYTHON is None,
                                   reason=f"no kvpress venv: set {kvpress.ENV_VAR} to its python")


@pytest.fixture
def no_kvpress(monkeypatch):
    monkeypatch.delenv(kvpress.ENV_VAR, raising=False)


def tokens_and_model(tiny_model_dir, play_text, n):
    model, tokenizer = load_model(str(tiny_model_dir), dtype="float32")  # the NLLs are compared at fp32 tolerances
    return model, text_tokens(tokenizer, play_text, n)


# --- runs anywhere ------------------------------------------------------------------------------


def test_kept_to_ratio_keeps_exactly_kept():
    # kvpress keeps int(n * (1 - ratio)); the ratio we hand it must land on `kept` every time
    for n in range(1, 600, 7):
        for kept in range(1, n + 1, 3):
            assert int(n * (1 - kvpress.kept_to_ratio(kept, n))) == kept


def test_find_python(monkeypatch, tmp_path):
    monkeypatch.delenv(kvpress.ENV_VAR, raising=False)
    assert kvpress.find_python() is None
    assert kvpress.find_python(str(tmp_path / "missing" / "python")) is None
    monkeypatch.setenv(kvpress.ENV_VAR, sys.executable)
    assert kvpress.find_python() == sys.executable


def test_compressed_nll_without_eviction_is_the_plain_nll(tiny_model_dir, play_text):
    # the frozen copy at explicit positions must reproduce one plain forward over everything
    model, tokens = tokens_and_model(tiny_model_dir, play_text, 161)
    context, continuation = tokens[:, :120], tokens[:, 120:]
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits[0, 120:].float()
    plain = torch.nn.functional.cross_entropy(logits, tokens[0, 121:]).item()
    for method in ("full", "h2o"):  # h2o with room for everything never evicts
        cache = make_cache(model, method, budget=120, positions="absolute", prefill_chunk=32)
        nll, slots, _ = compress.compressed_nll(model, context, continuation, cache)
        assert slots == 120 and nll == pytest.approx(plain, abs=1e-5)
    cache = make_cache(model, "h2o", budget=24, positions="absolute", prefill_chunk=32)
    nll, slots, _ = compress.compressed_nll(model, context, continuation, cache)
    assert slots == 24 and math.isfinite(nll) and nll != pytest.approx(plain, abs=1e-5)


def test_evaluate_compress_quick(tiny_model_dir, play_text, tmp_path, capsys, no_kvpress):
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "compress", "--quick", "--text", str(play_text)])
    assert "skipping the kvpress arms" in capsys.readouterr().out
    data = read_results(tmp_path, "compress")
    rows, meta = data["rows"], data["meta"]
    assert [r["method"] for r in rows] == ["full"] + compress.COMPRESS_METHODS
    assert meta["context"] == 384 and meta["continuation"] == 64
    assert rows[0]["kept"] == 384 and all(r["kept"] == round(0.2 * 384) for r in rows[1:])
    assert all(r["kv_MiB"] < rows[0]["kv_MiB"] and r["ppl"] > 1 for r in rows[1:])
    assert rows[0]["vs_full"] == "+0.0%"


def test_bench_dialogue_quick(tiny_chat, tmp_path, monkeypatch, capsys, no_kvpress):
    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["Hi there", "Tell me more"]}\n{"turns": ["And then?", "Thanks"]}\n'
                     '{"turns": ["Why?", "Go on"]}\n')
    monkeypatch.setattr(dialogue, "load_model", lambda spec, **settings: tiny_chat)
    cli.main(["--out", str(tmp_path), "dialogue", "--quick", "--turns-file", str(turns), "--budget", "32"])
    assert "skipping the kvpress arm" in capsys.readouterr().out
    data = read_results(tmp_path, "dialogue")
    rows, meta = data["rows"], data["meta"]
    assert meta["new_tokens"] == 16
    assert [r["turn"] for r in rows if r["method"] == "h2o"] == [1, 2, 3, 4, 5, 6]
    assert [r["turn"] for r in rows if r["method"] == "naive"] == [1, 2, 4, 6]
    assert not [r for r in rows if r["method"] == "kvpress"]


def test_kvpress_arm_skips_models_not_loaded_from_a_folder(tiny_chat, capsys, monkeypatch):
    monkeypatch.setenv(kvpress.ENV_VAR, sys.executable)  # a python is there, the model folder is not
    assert kvpress.worker_for(None, tiny_chat[0]) is None
    assert "not loaded from one" in capsys.readouterr().out


# --- needs the kvpress venv ---------------------------------------------------------------------


@needs_kvpress
@pytest.mark.slow
def test_worker_sees_the_same_inputs(tiny_model_dir, play_text):
    """Uncompressed, the worker's NLL is ours; compressed in one shot by the same rule (4 sinks
    + the newest tokens), StreamingLLMPress keeps the same tokens as our sink cache, so the NLLs
    agree too. Both would break if the bridge fed different tokens, positions or masks."""
    model, tokens = tokens_and_model(tiny_model_dir, play_text, 241)
    context, continuation = tokens[:, :200], tokens[:, 200:]
    ours_full, _, _ = compress.compressed_nll(model, context, continuation,
                                              make_cache(model, "full", budget=200, positions="absolute"))
    ours_sink, _, _ = compress.compressed_nll(model, context, continuation, make_cache(
        model, "sink", budget=50, n_sink=4, positions="absolute", prefill_chunk=200))
    task = {"kind": "compress_nll", "context_ids": context[0].tolist(), "continuation_ids": continuation[0].tolist()}
    job = {"model": str(tiny_model_dir), "tasks": [
        {**task, "press": "ObservedAttentionPress", "compression_ratio": 0.0},
        {**task, "press": "SnapKVPress", "kept": 200},
        {**task, "press": "StreamingLLMPress", "kept": 50}]}
    result = kvpress.run_job(KVPRESS_PYTHON, job, timeout=600)
    observed, snapkv, streaming = result["results"]
    assert observed["kept_max"] == snapkv["kept_max"] == 200 and streaming["kept_min"] == streaming["kept_max"] == 50
    assert observed["nll"] == pytest.approx(ours_full, abs=1e-4)
    assert snapkv["nll"] == pytest.approx(ours_full, abs=1e-4)
    assert streaming["nll"] == pytest.approx(ours_sink, abs=1e-4)
    assert result["versions"]["kvpress"] == kvpress.KVPRESS_VERSION


@needs_kvpress
@pytest.mark.slow
def test_evaluate_compress_with_kvpress(tiny_model_dir, play_text, tmp_path):
    evaluate.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "compress", "--quick", "--text", str(play_text),
                   "--methods", "h2o-sum", "--kvpress-python", KVPRESS_PYTHON])
    data = read_results(tmp_path, "compress")
    rows, meta = data["rows"], data["meta"]
    assert [r["method"] for r in rows] == ["full", "h2o-sum", *compress.KVPRESS_PRESSES]
    assert all(r["kept"] == 77 and r["kv_MiB"] == rows[1]["kv_MiB"] for r in rows[1:])
    assert meta["kvpress"]["kvpress"] == kvpress.KVPRESS_VERSION


@needs_kvpress
@pytest.mark.slow
def test_bench_dialogue_with_kvpress(tiny_chat, tmp_path):
    model, tokenizer = tiny_chat
    folder = tmp_path / "tiny-chat"  # the worker loads the model from disk
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["Hi there", "Tell me more"]}\n{"turns": ["And then?", "Thanks"]}\n')
    cli.main(["--model", str(folder), "--out", str(tmp_path), "dialogue", "--quick", "--turns-file", str(turns),
              "--turns", "4", "--budget", "32", "--methods", "h2o,kvpress", "--kvpress-python", KVPRESS_PYTHON,
              "--dtype", "float32"])
    data = read_results(tmp_path, "dialogue")
    rows = data["rows"]
    kv = [r for r in rows if r["method"] == "kvpress"]
    assert [r["turn"] for r in kv] == [1, 2, 4]
    assert all(r["ttft_s"] > 0 for r in kv)
    # histories longer than the budget are cut to 32 slots per layer and head: 2 layers, 2 KV heads,
    # head_dim 16, keys and values in float32
    long = [r for r in kv if r["tokens_seen"] > 32]
    assert long and all(r["kv_MiB"] == round(32 * 2 * 2 * 16 * 2 * 4 / 2**20, 2) for r in long)
