"""The benchmark and evaluation commands run end to end on the tiny model and write results
that parse. The figures themselves are not asserted: they are measurements, not properties."""

import json

import pytest

from h2o_chat.bench import (
    batch,
    cli,
    compress,
    decode,
    dialogue,
    evaluate,
    ops,
    page,
    panel,
    ppl,
    prefill,
    soak,
    summarize,
)
from h2o_chat.bench.peers import llamacpp
from h2o_chat.bench.random_gguf import TINY_K, write_random_gguf
from tests.conftest import read_results, run_ppl
from tests.live import save_tiny_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_decode(tiny_model_dir, play_text, tmp_path):
    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
              "decode", "--seen", "32,64", "--steps", "3", "--repeats", "2", "--budget", "16",
              "--methods", "dynamic,full,h2o,h2o-noevict,h2o+lean", "--quantization", "none,int8,int4", "--dtype", "float32"])
    data = read_results(tmp_path, "decode", plot=False)
    rows = data["rows"]
    assert {(r["seen"], r["method"], r["quantization"]) for r in rows} == {
        (s, m, q) for s in (32, 64) for m in ("dynamic", "full", "h2o", "h2o-noevict", "h2o+lean")
        for q in ("none", "int8", "int4")}
    assert data["meta"]["weights"] == {"none": "fp32", "int8": "int8, lm_head fp32", "int4": "int4, lm_head fp32"}
    assert all(r["vs_none"] == "1.00x" for r in rows if r["quantization"] == "none")
    by = {(r["seen"], r["method"]): r for r in rows if r["quantization"] == "none"}
    # the H2O cache holds 16 slots per layer and head, the full ones everything
    assert by[(64, "h2o")]["kv_MiB"] < by[(64, "full")]["kv_MiB"] == by[(64, "dynamic")]["kv_MiB"]
    assert (tmp_path / "decode-speed.png").stat().st_size > 0 and (tmp_path / "decode-memory.png").exists()


def test_bench_decode_times_the_c_kernels_against_torch_s_ops(tiny_model_dir, play_text, tmp_path):
    from h2o_chat import native
    from h2o_chat.bench.decode import native_kernels

    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
              "decode", "--seen", "32", "--steps", "3", "--repeats", "2", "--budget", "16",
              "--methods", "h2o+lean", "--quantization", "int4", "--dtype", "bfloat16", "--native", "on,off"])
    rows = read_results(tmp_path, "decode", plot=False)["rows"]
    assert sorted(r["native"] for r in rows) == ["off", "on"] and all(r["ms_per_token"] > 0 for r in rows)
    with native_kernels(False):  # what an off arm's Decoder, steps and int4 layers see
        assert native.attend_one() is None and native.rotate_one() is None and native.int4_mm() is None
    with pytest.raises(SystemExit, match="--native takes on, off or on,off"):
        cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
                  "decode", "--seen", "32", "--native", "maybe"])


def test_bench_prefill_speed_per_weights(tiny_model_dir, play_text, tmp_path):
    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path), "prefill-speed",
              "--tokens", "40,100", "--dtypes", "float32", "--quantization", "none,int4", "--repeats", "2"])
    rows = read_results(tmp_path, "prefill-speed", plot=False)["rows"]
    assert [(r["tokens"], r["quantization"], r["method"]) for r in rows] == [
        (n, q, m) for n in (40, 100) for q in ("none", "int4") for m in ("dynamic", "h2o")]
    assert all(r["tokens_per_s"] > 0 and r["ops_per_token"] > 0 for r in rows)
    assert [r["vs_none"] for r in rows[:2]] == ["1.00x", "1.00x"]


def test_bench_batch_on_the_cpu(tmp_path):
    # the real run needs CUDA and Llama-2-7B's shape; the same code on a tiny shape on the CPU
    cli.main(["--out", str(tmp_path), "batch", "--device", "cpu", "--shape", "tiny", "--quick",
              "--prompt", "64", "--new-tokens", "8", "--batch", "1", "--max-batch", "4"])
    rows = read_results(tmp_path, "batch", plot=False)["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for m in ("full", "h2o") for b in (1, 2, 4)]
    assert all(r["latency_s"] > 0 for r in rows)
    h2o = [r for r in rows if r["method"] == "h2o"]
    assert all(r["kv_MiB"] < f["kv_MiB"] for r, f in zip(h2o, rows))  # budget 20% of 72 tokens


@pytest.mark.parametrize("command", ["batch", "gpu"])
def test_a_cuda_bench_without_cuda_says_so(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(batch.torch.cuda, "is_available", lambda: False)
    cli.main(["--out", str(tmp_path), command])
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert json.loads((tmp_path / f"{command}.json").read_text())["meta"]["skipped"] == "no CUDA GPU"


@pytest.mark.slow
def test_bench_prefill(tiny_model_dir, play_text, tmp_path):
    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
              "prefill", "--tokens", "200", "--budget", "16"])
    rows = read_results(tmp_path, "prefill", plot=False)["rows"]
    assert [r["method"] for r in rows] == ["dynamic", "h2o"]
    assert all(r["peak_MiB"] >= 0 and r["seconds"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.live
def test_bench_reopen(play_text, tmp_path):
    """Stories reopened in fresh processes from their saved cache (nothing computed), restored and
    reloaded in the page of a restarted app (where chromium is), and the /v1 older branch resent to
    two app.py servers, with saved caches and without."""
    model_dir = save_tiny_chat(tmp_path / "model")
    cli.main(["--model", str(model_dir), "--text", str(play_text), "--out", str(tmp_path / "out"), "reopen",
              "--quick", "--dtype", "float32", "--budget", "48", "--threads", "1"])
    rows = read_results(tmp_path / "out", "reopen", plot=False)["rows"]
    assert [r["tokens"] >= n for r, n in zip(rows, (300, 1000))] == [True, True]
    assert all(r["computed"] == 0 and r["messages"] >= 8 and r["replay_s"] > 0 and r["open_s"] > 0 and
               r["disk_MiB"] > 0 and not r["notices"] for r in rows)
    if page.CHROMIUM:
        assert all(r["page_restore_s"] > 0 and r["page_reload_s"] > 0 for r in rows), rows
    (writes,) = read_results(tmp_path / "out", "reopen_writes", plot=False)["rows"]
    assert writes["states_written"] == 2 * writes["replies"] and writes["MiB_per_state"] > 0
    v1 = read_results(tmp_path / "out", "reopen_v1", plot=False)["rows"]
    saved, before = v1[:2], v1[2:]
    assert all(r["cached_tokens"] >= 0.9 * r["prompt_tokens"] for r in saved)
    assert before[0]["cached_tokens"] < before[0]["prompt_tokens"]  # without them: only what memory still holds


@pytest.mark.slow
def test_evaluate_ppl(tiny_model_dir, play_text, tmp_path):
    rows = run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "120", "--budget", "24", "--chunk", "8",
                   "--long-tokens", "0", plot=False)["rows"]
    assert [r["method"] for r in rows] == ppl.PPL_METHODS
    assert all(r["ppl"] > 1 for r in rows)
    assert rows[0]["vs_full"] == "+0.0%"


def test_bench_dialogue(tiny_chat, tmp_path, monkeypatch):
    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["Hi there", "Tell me more"]}\n{"turns": ["And then?", "Thanks"]}\n')
    monkeypatch.setattr(dialogue, "load_model", lambda spec, **settings: tiny_chat)
    cli.main(["--out", str(tmp_path), "dialogue", "--turns-file", str(turns), "--turns", "4",
              "--new-tokens", "5", "--budget", "32", "--naive-every", "2"])
    rows = read_results(tmp_path, "dialogue", plot=False)["rows"]
    assert [r["turn"] for r in rows if r["method"] == "h2o"] == [1, 2, 3, 4]
    assert [r["turn"] for r in rows if r["method"] == "naive"] == [1, 2, 4]
    assert [r["turn"] for r in rows if r["method"] == "full"] == [1, 2, 3, 4]


def test_bench_panel(tiny_chat, play_text, tmp_path, monkeypatch):
    monkeypatch.setattr(panel, "load_model", lambda spec, **settings: tiny_chat)
    cli.main(["--text", str(play_text), "--out", str(tmp_path), "panel", "--tokens", "300", "--new-tokens", "8",
              "--budget", "32", "--turns", "0"])
    rows = read_results(tmp_path, "panel", plot=False)["rows"]
    assert [r["measure"] for r in rows][:4] == ["decode without panel", "decode with panel"] * 2
    assert rows[-1]["measure"].startswith("render panel of ") and rows[-1]["value"] >= 0


@pytest.mark.browser
@pytest.mark.live
@pytest.mark.slow
@pytest.mark.skipif(page.CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_bench_panel_streams_replies_into_the_real_page(tmp_path):
    # the app in its own process (the tiny chat model from a folder), the page in chromium
    folder = save_tiny_chat(tmp_path / "model")
    turns = page.page_speed(str(folder), budget=48, turns=2, new_tokens=12)
    assert [t["turn"] for t in turns] == [1, 2]
    for t in turns:  # each reply streamed, ended, and the page's stats line gave its speed
        assert t["reply_chars"] > 0 and t["server_tokens_per_s"] > 0
        assert 0 < t["page_ttft_s"] < 300 and t["page_stream_s"] >= 0 and t["browser_cpu_s"] > 0


def test_bench_soak(tiny_chat, tmp_path, monkeypatch):
    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["Hi there", "Tell me more"]}\n{"turns": ["And then?"]}\n')
    monkeypatch.setattr(soak, "load_model", lambda spec, **settings: tiny_chat)
    cli.main(["--out", str(tmp_path), "soak", "--quick", "--turns-file", str(turns), "--budget", "32"])
    data = json.loads((tmp_path / "soak-rolling.json").read_text())
    # --quick: 8 turns; the file has 3, so it starts over
    assert [r["turn"] for r in data["rows"]] == list(range(1, 9))
    assert data["meta"]["summary"]["turns_done"] == 8 and data["meta"]["summary"]["error"] is None
    assert all(r["reply_tokens"] <= 16 for r in data["rows"])


def test_bench_soak_reports_a_failed_turn(tiny_chat, tmp_path, monkeypatch):
    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["Hi there", "Tell me more", "Boom", "Never sent"]}\n')
    monkeypatch.setattr(soak, "load_model", lambda spec, **settings: tiny_chat)
    send = soak.ChatSession.send

    def failing_send(self, text, *args, **kwargs):
        if text == "Boom":
            raise RuntimeError("simulated failure")
        return send(self, text, *args, **kwargs)

    monkeypatch.setattr(soak.ChatSession, "send", failing_send)
    with pytest.raises(SystemExit, match="soak failed: turn 3: RuntimeError: simulated failure"):
        cli.main(["--out", str(tmp_path), "soak", "--turns", "4", "--new-tokens", "4", "--turns-file", str(turns),
                  "--budget", "32"])
    data = json.loads((tmp_path / "soak-rolling.json").read_text())
    assert [r["turn"] for r in data["rows"]] == [1, 2]  # what ran before the failure is kept


@pytest.mark.parametrize("argv", [
    ["decode", "--quick"],  # --text is a top-level option of bench
    ["dialogue", "--quick", "--turns-file", "{missing}"],
    ["soak", "--quick", "--turns-file", "{missing}"],
])
def test_a_missing_input_file_is_a_clear_message(tiny_chat, tmp_path, monkeypatch, argv):
    # a checkout without ../shared/data next to it gets a message, not a traceback
    missing = str(tmp_path / "nowhere.txt")
    for module in (decode, dialogue, soak):
        monkeypatch.setattr(module, "load_model", lambda spec, **settings: tiny_chat)
    argv = [a.format(missing=missing) for a in argv]
    with pytest.raises(SystemExit, match="nowhere.txt: no such file.*--text"):
        cli.main(["--out", str(tmp_path), "--text", missing, *argv])


@pytest.mark.parametrize("argv", [["ppl", "--quick", "--text", "{missing}"],
                                  ["compress", "--quick", "--text", "{missing}"],
                                  ["summarize", "--quick", "--file", "{missing}"]])
def test_evaluate_a_missing_input_file_is_a_clear_message(tiny_chat, tmp_path, monkeypatch, argv):
    missing = str(tmp_path / "nowhere.txt")
    for module in (ppl, compress, summarize):
        monkeypatch.setattr(module, "load_model", lambda spec, **settings: tiny_chat)
    with pytest.raises(SystemExit, match="nowhere.txt: no such file"):
        evaluate.main(["--out", str(tmp_path), *[a.format(missing=missing) for a in argv]])


def test_bench_ops_counts_ops_and_the_one_streaming_sync(tiny_model_dir, play_text, tmp_path):
    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
              "ops", "--seen", "40", "--steps", "3", "--budget", "16", "--dtype", "fp32"])
    rows = {r["method"]: r for r in read_results(tmp_path, "ops", plot=False)["rows"]}
    assert set(rows) == {"dynamic", "h2o", "full", "h2o+lean", "full+lean"}
    assert all(r["ops_per_token"] > 50 for r in rows.values())
    # the decode step's one .item() (the token streamed) and nothing from the cache, evicting or not
    assert {r["syncs_per_token"] for r in rows.values()} == {1.0}
    assert rows["dynamic"]["added_vs_dynamic"] == 0
    # the lean step runs the same cache with fewer ops than transformers' forward around it
    assert rows["h2o+lean"]["ops_per_token"] < rows["h2o"]["ops_per_token"]
    assert rows["full+lean"]["ops_per_token"] < rows["full"]["ops_per_token"]
    # where a token's time goes: the float32 tiny model's matmuls are aten::mm/addmm, its attention
    # in the h2o cache a bmm; everything else is "rest"
    assert all(r["ms_per_token"] > 0 and r["profiled_ms_rest"] > 0 for r in rows.values())
    assert rows["h2o+lean"]["profiled_ms_matmul"] > 0 and rows["h2o+lean"]["profiled_ms_attention"] > 0


@pytest.mark.slow
def test_bench_ops_splits_a_compiled_steps_time_into_guards_wrapper_and_kernels(tiny_model_dir, play_text, tmp_path):
    import torch

    # a fresh process's compile limits: other tests' compiled steps (test_decode.py) share the step's
    # code object, and past dynamo's recompile limit it would run eagerly
    torch._dynamo.reset()
    cli.main(["--model", str(tiny_model_dir), "--text", str(play_text), "--out", str(tmp_path),
              "ops", "--seen", "40", "--steps", "3", "--budget", "16", "--dtype", "fp32", "--methods", "h2o+lean,h2o+compiled"])
    rows = {r["method"]: r for r in read_results(tmp_path, "ops", plot=False)["rows"]}
    lean, compiled = rows["h2o+lean"], rows["h2o+compiled"]
    # inductor fuses the eager step's small ops into its own kernels: fewer aten ops, and the time
    # compiled code pays besides them, each part seen by the profiler
    assert compiled["ops_per_token"] < lean["ops_per_token"] / 2
    assert compiled["profiled_ms_guards"] > 0 and compiled["profiled_ms_wrapper"] > 0 and compiled["profiled_ms_kernels"] > 0
    assert lean["profiled_ms_guards"] == lean["profiled_ms_wrapper"] == lean["profiled_ms_kernels"] == 0


def test_count_ops_sees_every_kind_of_host_sync():
    import torch

    x = torch.ones(3)

    def step():
        x.sum().item()  # aten::_local_scalar_dense
        bool(x.max() > 0)  # is_nonzero -> _local_scalar_dense
        x.tolist()  # counted by the patched method
        x.numpy()

    ops_per_step, syncs, names, split = ops.count_ops(step, 2)
    assert syncs == 4 and ops_per_step > 0 and names["aten::sum"] == 2
    assert split["matmul"] == split["attention"] == 0 and split["rest"] > 0
    assert torch.Tensor.tolist(x) == [1.0, 1.0, 1.0]  # the patch is gone afterwards


@pytest.mark.skipif(llamacpp.find_python() is None, reason="no llama.cpp venv (xllamacpp)")
@pytest.mark.embedded
@pytest.mark.live
@pytest.mark.slow
def test_llamacpp_server_starts_answers_with_timings_and_refuses_past_its_context(tmp_path):
    from h2o_chat.bench.peers.llamacpp import LlamaCppError, find_python, start_server
    from h2o_chat.models.load import embedded_gguf_path

    with start_server(find_python(), embedded_gguf_path(), threads=1, n_ctx=128, log=tmp_path / "log") as server:
        assert server.url.startswith("http://127.0.0.1:")
        prompt = [1, 504, 3060, 198] * 5
        first = server.complete(prompt, 4)
        assert first["usage"]["prompt_tokens"] == 20 and 1 <= first["usage"]["completion_tokens"] <= 4
        assert first["timings"]["prompt_ms"] > 0 and first["timings"]["predicted_n"] >= 1
        again = server.complete(prompt + [198, 504], 4)  # the prompt cache serves the shared prefix
        assert again["timings"]["cache_n"] >= 19 and again["timings"]["prompt_n"] <= 3
        with pytest.raises(LlamaCppError, match="refused"):
            server.complete([504] * 400, 4)  # n_ctx 128 is rounded up to 256, no further
        process = server.process
    assert process.poll() is not None  # stopped with the block


def parsed(main, module, command, argv, monkeypatch):
    """The arguments `main(argv)` hands `module.command`, which is replaced so nothing runs."""
    seen = []
    monkeypatch.setattr(module, command, seen.append)
    main(argv)
    (args,) = seen
    return args


@pytest.mark.parametrize("main, module, command, sub", [
    (cli.main, dialogue, "run", "dialogue"), (cli.main, prefill, "run", "prefill"),
    (evaluate.main, ppl, "run", "ppl"), (evaluate.main, compress, "run", "compress")])
def test_shared_options_are_taken_before_and_after_the_subcommand(main, module, command, sub, monkeypatch, tmp_path):
    before = parsed(main, module, command, ["--out", str(tmp_path / "a"), "--model", "m1", sub, "--quick"], monkeypatch)
    after = parsed(main, module, command, [sub, "--quick", "--out", str(tmp_path / "b"), "--model", "m2"], monkeypatch)
    assert (before.out, before.model) == (str(tmp_path / "a"), "m1")
    assert (after.out, after.model) == (str(tmp_path / "b"), "m2")
    neither = parsed(main, module, command, [sub], monkeypatch)
    assert (neither.out, neither.model) == ("bench-out", None)  # the top-level defaults, not SUPPRESS's absence


def test_bench_text_is_taken_after_the_subcommand(monkeypatch):
    assert parsed(cli.main, prefill, "run", ["prefill", "--text", "t.txt"], monkeypatch).text == "t.txt"
    assert parsed(cli.main, prefill, "run", ["--text", "t.txt", "prefill"], monkeypatch).text == "t.txt"


@pytest.mark.slow
@pytest.mark.parametrize("shape,block_type,weights", [
    ("tiny", "Q4_0", "int4: GGUF Q4_0 as stored (15)"),
    ("tiny-k", "Q4_K_M", "int4: GGUF Q4_K as stored (12), Q6_K quantized to int8 (3)")])
def test_bench_user_gguf_each_arm_in_its_own_process(tmp_path, shape, block_type, weights):
    """A tiny random Q4_0 file, and llama.cpp's Q4_K_M mix: int4 from its blocks and dequantized,
    each loaded in a fresh process (peak RSS is the load's alone); llama.cpp beside them where
    its venv is here."""
    argv = ["--out", str(tmp_path), "user-gguf", "--shape", shape, "--block-type", block_type, "--quick", "--new-tokens", "6"]
    if shape == "tiny-k":  # the command reuses a file that is there: seed 0's greedy reply is a lone UTF-8
        # continuation byte, which never shows as text (no first-text time, so no decode speed)
        write_random_gguf(tmp_path / f"random-{shape}-{block_type}.gguf", TINY_K, block_type, seed=1)
    if llamacpp.find_python() is not None:
        argv.append("--llamacpp")
    cli.main(argv)
    data = read_results(tmp_path, "user-gguf", plot=False)
    rows = {r["arm"]: r for r in data["rows"]}
    assert rows["h2o auto"]["weights"] == weights and rows["h2o none"]["weights"] in ("bf16", "fp32")
    assert rows["h2o none"]["rss_vs_none"] == "100%" and rows["h2o auto"]["peak_rss_MiB"] > 100
    assert all(r["decode_tok_s"] > 0 and r["new_tokens"] > 0 for r in rows.values())
    assert (tmp_path / f"random-{shape}-{block_type}.gguf").is_file() and data["meta"]["file_MiB"] < 2
    if "llama.cpp" in rows:
        assert rows["llama.cpp"]["new_tokens"] == 6 and rows["h2o auto"]["speed_vs_llamacpp"].endswith("x")
