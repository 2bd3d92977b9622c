"""`bench decode-peers` and the bridge to OpenVINO GenAI's own venv. The command's h2o arm and the
bridge's plumbing (the eviction settings, the SchedulerConfig built from them, the worker's answer
read back) run anywhere; the tests that run OpenVINO itself need its venv ($H2O_OPENVINO_PYTHON,
~/openvino-venv, or this workplace's /work/venvs/openvino; see h2o_chat/bench/peers/openvino.py)
and are skipped, saying so, without it."""

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest

from h2o_chat.bench import cli, decode_peers
from h2o_chat.bench.peers import openvino
from tests.conftest import read_results
from tests.live import save_tiny_chat

OPENVINO_PYTHON = openvino.find_python() or openvino.find_python("/work/venvs/openvino/bin/python")
needs_openvino = pytest.mark.skipif(OPENVINO_PYTHON is None, reason=f"no OpenVINO GenAI venv: set {openvino.ENV_VAR} "
                                    f"to its python ({openvino.MAKE_VENV})")

# --- runs anywhere ------------------------------------------------------------------------------


def test_eviction_keeps_the_budget_in_all_with_summed_attention():
    assert openvino.eviction(512, 32, 224) == {"start_size": 32, "recent_size": 224, "max_cache_size": 512,
                                               "aggregation_mode": "SUM"}
    for budget, start, recent in ((512, 256, 256), (512, 0, 224), (512, 32, 0), (0.5, 32, 224)):
        with pytest.raises(ValueError, match="budget"):
            openvino.eviction(budget, start, recent)


class FakeGenai:
    """What `scheduler_config` reads of openvino_genai: the classes record what they were given."""

    AggregationMode = SimpleNamespace(SUM="SUM mode", NORM_SUM="NORM_SUM mode")

    class SchedulerConfig(SimpleNamespace):
        pass

    class CacheEvictionConfig(SimpleNamespace):
        pass


def test_scheduler_config_turns_eviction_on_with_the_fields_and_off_without():
    on = openvino.scheduler_config(FakeGenai, openvino.eviction(512, 32, 224))
    assert on.use_cache_eviction is True
    assert vars(on.cache_eviction_config) == {"start_size": 32, "recent_size": 224, "max_cache_size": 512,
                                              "aggregation_mode": "SUM mode"}
    off = openvino.scheduler_config(FakeGenai, None)
    assert off.use_cache_eviction is False and not hasattr(off, "cache_eviction_config")


def test_worker_result_reads_its_figures_and_its_errors():
    figures = {"decode_tok_s": 70.5, "new_tokens": 8}
    assert openvino.worker_result(0, "loading...\n" + json.dumps(figures) + "\n", "") == figures
    with pytest.raises(openvino.OpenVinoError, match="OpenVINO GenAI failed: RuntimeError: no such file"):
        openvino.worker_result(1, json.dumps({"error": "RuntimeError: no such file"}), "")
    with pytest.raises(openvino.OpenVinoError, match=r"exited with -11 and no figures \(Segmentation fault\).*pip install"):
        openvino.worker_result(-11, "", "Segmentation fault\n")


@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is not None, reason="openvino_genai is importable here")
def test_a_worker_without_openvino_says_so(tmp_path):
    # our own python as the "venv": the worker starts, reads its settings and answers with the import error
    with pytest.raises(openvino.OpenVinoError, match="ModuleNotFoundError: No module named 'openvino"):
        openvino.decode(sys.executable, tmp_path / "model.gguf", [1, 2, 3], 4, threads=1, timeout=120)


def test_find_python(monkeypatch, tmp_path):
    monkeypatch.delenv(openvino.ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/openvino-venv
    assert openvino.find_python() is None
    assert openvino.find_python(str(tmp_path / "missing" / "python")) is None
    monkeypatch.setenv(openvino.ENV_VAR, sys.executable)
    assert openvino.find_python() == sys.executable


def test_rotated_rounds_start_with_each_arm_in_turn():
    arms = ["h2o", "llama.cpp", decode_peers.EVICT, decode_peers.FULL]
    orders = [decode_peers.rotated(arms, r) for r in range(5)]
    assert [o[0] for o in orders] == ["h2o", "llama.cpp", decode_peers.EVICT, decode_peers.FULL, "h2o"]
    assert all(sorted(o) == sorted(arms) for o in orders)


def test_summary_rows_take_medians_and_ratios():
    runs = {"h2o": [{"decode_tok_s": s, "new_tokens": 8, "weights": "int4"} for s in (50, 60, 52)],
            decode_peers.EVICT: [{"decode_tok_s": s, "tpot_tok_s": s + 1, "new_tokens": 8, "weights": "ov"}
                                 for s in (80, 75, 100)]}
    h2o, evict = decode_peers.summary_rows(runs)
    assert (h2o["decode_tok_s"], h2o["tpot_tok_s"], h2o["vs_openvino_evict"]) == (52, "", "0.65x")
    assert (evict["decode_tok_s"], evict["tpot_tok_s"], evict["vs_h2o"]) == (80, 81, "1.54x")


@pytest.mark.slow
def test_bench_decode_peers_h2o_arm_in_fresh_processes(play_text, tmp_path):
    model = save_tiny_chat(tmp_path / "model", never_ends=True)
    cli.main(["--model", str(model), "--text", str(play_text), "--out", str(tmp_path / "out"), "decode-peers",
              "--history", "100", "--new-tokens", "6", "--budget", "64", "--repeats", "2", "--dtype", "float32",
              "--threads", "1"])
    data = read_results(tmp_path / "out", "decode-peers", plot=False)
    (row,) = data["rows"]
    assert row["arm"] == "h2o" and row["weights"] == "fp32" and row["new_tokens"] == 6 and row["decode_tok_s"] > 0
    assert len(data["meta"]["runs"]["h2o"]) == 2
    # the held-out text's 100 tokens (one a character here), the instruction and the chat template
    assert data["meta"]["history_tokens"] > 100 + len(decode_peers.INSTRUCTION)


def test_bench_decode_peers_refuses_what_the_peers_cannot_run(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.delenv(openvino.ENV_VAR, raising=False)
    with pytest.raises(SystemExit, match="pip install openvino-genai"):
        cli.main(["--out", str(tmp_path), "decode-peers", "--openvino", str(tmp_path / "missing" / "python")])
    with pytest.raises(SystemExit, match="read a GGUF file"):  # a safetensors folder: the peers need the GGUF
        cli.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "decode-peers", "--openvino", sys.executable])
    with pytest.raises(SystemExit, match="evictable area"):
        cli.main(["--out", str(tmp_path), "decode-peers", "--openvino", sys.executable, "--openvino-recent", "480"])


# --- needs the OpenVINO venv ----------------------------------------------------------------------


@needs_openvino
@pytest.mark.embedded
@pytest.mark.slow
def test_openvino_decodes_the_ids_and_its_eviction_bounds_its_cache():
    from h2o_chat.models.load import embedded_gguf_path

    gguf, long, short = embedded_gguf_path(), [1, 504, 3060, 198] * 150, [1, 504, 3060, 198] * 25
    evict = openvino.eviction(256, 32, 96)
    on = openvino.decode(OPENVINO_PYTHON, gguf, long, 40, threads=1, cache_eviction=evict)
    off = openvino.decode(OPENVINO_PYTHON, gguf, long, 40, threads=1)
    assert on["new_tokens"] == off["new_tokens"] == len(on["tokens"]) == 40  # end of text ignored
    assert on["decode_tok_s"] > 0 and on["tpot_tok_s"] > 0 and on["version"].startswith("20")
    assert "max_cache_size: 256" in on["scheduler"] and "aggregation_mode: SUM" in on["scheduler"]
    assert "use_cache_eviction: true" in on["scheduler"] and "use_cache_eviction: false" in off["scheduler"]
    # 640 tokens seen: off holds them all (20 blocks of 32), on at most 256 and one block
    assert on["kv_MiB"] <= off["kv_MiB"] * (256 + 32) / 640 + 1e-6
    # a history the budget holds: nothing is evicted, the same greedy tokens
    assert openvino.decode(OPENVINO_PYTHON, gguf, short, 24, 1, evict)["tokens"] == \
        openvino.decode(OPENVINO_PYTHON, gguf, short, 24, 1)["tokens"]


@needs_openvino
@pytest.mark.embedded
@pytest.mark.slow
def test_bench_decode_peers_quick_with_openvino(tmp_path):
    cli.main(["--out", str(tmp_path), "decode-peers", "--quick", "--history", "600", "--openvino", OPENVINO_PYTHON])
    data = read_results(tmp_path, "decode-peers", plot=False)
    rows = {r["arm"]: r for r in data["rows"]}
    assert list(rows) == ["h2o", decode_peers.EVICT, decode_peers.FULL]
    assert rows[decode_peers.EVICT]["new_tokens"] == rows[decode_peers.FULL]["new_tokens"] == 16
    assert all(r["decode_tok_s"] > 0 for r in rows.values()) and rows["h2o"]["vs_openvino_evict"].endswith("x")
    assert data["meta"]["openvino_eviction"] == openvino.eviction(512, 32, 224)
    assert data["meta"]["history_tokens"] > 600
    assert rows[decode_peers.EVICT]["kv_MiB"] < rows[decode_peers.FULL]["kv_MiB"]  # 512 + a block, of ~650
