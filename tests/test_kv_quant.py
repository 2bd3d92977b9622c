"""int8 keys and values (CacheConfig.kv_quant="int8"): exact where the codes can be, close to the
full width where they cannot, half the bytes, and the same setting wherever a user sets it.

The kept sets are proved against the slow reference in test_cache.py (test_int8_slots_same_as_reference);
the lean step against the model's own forward in test_decode.py; batched rows against alone in
test_batch.py."""

import json
import math

import pytest
import torch
from transformers import DynamicCache

from h2o_chat import CacheConfig, H2OCache
from h2o_chat.bench.common import SHAKESPEARE
from h2o_chat.cache import kv_int8
from h2o_chat.cache.kv_int8 import dequantize, quantize
from h2o_chat.cache.step import IDS, KEY, N_ACC, N_META, DecodeStep, Eviction, StepRows
from h2o_chat.chat.conversation import cache_config
from h2o_chat.chat.saved_kv import config_text, tag
from h2o_chat.chat.session import ChatSession
from h2o_chat.serve import cli as server
from h2o_chat.serve.requests import ApiError, read_cache
from h2o_chat.ui import draw
from h2o_chat.ui import settings as ui_settings
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_on_the_grid_come_back_exactly(dtype):
    # every code 0..255 once, at a power-of-two step from a zero point: x = zero + code * step
    codes = torch.arange(256)[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    steps, zeros = torch.tensor([2.0**-4, 2.0**3, 2.0**-20]), torch.tensor([0.5, -1024.0, 3 * 2.0**-18])
    x = (zeros[:, None] + codes * steps[:, None]).to(dtype)  # [3 vectors, 256]
    got_codes, scale, zero = quantize(x, dtype)
    assert torch.equal(got_codes, codes.to(kv_int8.CODES).expand(3, -1))
    assert torch.equal(scale.to(dtype), steps.to(dtype)) and torch.equal(zero.to(dtype), zeros.to(dtype))
    assert scale.dtype == zero.dtype == torch.float16  # the width they are stored at
    assert torch.equal(dequantize(got_codes, scale, zero, dtype), x)


def test_any_vector_comes_back_within_half_a_step():
    # half a step of the exact scale, plus the float16 rounding of the pair: at most 2^-11 of the
    # scale for each of the 255 steps, and of the zero point
    x = torch.randn(500, 64, generator=torch.Generator().manual_seed(1)) * torch.rand(500, 1) * 10
    x[0] = 3.25  # a constant vector: the smallest step, exact
    codes, scale, zero = quantize(x)
    error = (dequantize(codes, scale, zero, torch.float32) - x).abs()
    rounding = 2.0**-11 * (256 * scale.float() + zero.float().abs())
    assert torch.all(error <= scale.float()[:, None] * 0.5 + rounding[:, None] + 1e-6)
    assert torch.equal(dequantize(codes[:1], scale[:1], zero[:1], torch.float32), x[:1])
    assert torch.all(codes.amin(-1)[1:] == 0) and torch.all(codes.amax(-1)[1:] == 255)  # the extremes use the extreme codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_quantizes_the_new_token_as_quantize_does(dtype):
    b, h, cap, d, acc = 2, 3, 5, 8, torch.float32
    kv = torch.zeros(2, b, h, cap, d, dtype=kv_int8.CODES)
    meta, acc_buf = torch.zeros(N_META, b, h, cap, dtype=torch.int32), torch.zeros(N_ACC, b, h, cap)
    qp = torch.zeros(kv_int8.N_ROWS, b, h, cap, dtype=kv_int8.QP_DTYPE)
    wide = kv_int8.WideScratch().for_slots(kv, acc)
    step = DecodeStep.over(kv, acc_buf, qp, 2, dtype, 1.0, wide)
    g = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(b, h, 1, d, generator=g).to(dtype) * 4 for _ in range(2))
    step.write_spare(keys, values)
    Eviction.over(kv[None], meta[None], acc_buf[None], qp[None]).prepare(
        StepRows.make([7] * b, [False] * b, [True] * b, h, 2, n_recent=1, decay=1.0, meta_dtype=torch.int32,
                      acc_dtype=acc, device="cpu"), CacheConfig())
    codes, scale, zero = quantize(torch.stack((keys, values)), acc)
    assert torch.equal(kv[:, :, :, -1:], codes)
    assert torch.equal(qp[kv_int8.SCALES, :, :, -1:], scale) and torch.equal(qp[kv_int8.ZEROS, :, :, -1:], zero)
    assert torch.all(meta[IDS, :, :, -1] == 7) and torch.all(meta[KEY, :, :, -1] == 7)
    assert torch.all(acc_buf[:2, :, :, -1] == 0)  # score and query count start at zero


@pytest.fixture(scope="module")
def held_out(embedded_model):
    """(model, 1,024 tokens of Tiny Shakespeare [1, n], the full cache's logits [n, vocab])."""
    model, tokenizer = embedded_model
    ids = tokenizer(SHAKESPEARE.read_text()[:6000], return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        return model, ids, model(ids, cache=DynamicCache()).logits[0].float()


@pytest.mark.embedded
@pytest.mark.slow
def test_nothing_evicted_stays_close_to_the_full_width(held_out):
    # the stated tolerance, on the embedded model in float32 over held-out text (measured: mean
    # |delta logit| 0.052, top-1 0.992, perplexity -0.1%): the error of rounding every key and
    # value to 256 levels of its own range, once
    model, ids, full = held_out
    cache = H2OCache(model, policy="h2o", budget=2048, kv_quant="int8")  # never reached: nothing evicted
    with torch.no_grad():
        logits = model(ids, cache=cache).logits[0].float()
    assert cache.layers[0].n_slots == ids.shape[1]
    delta = (logits - full).abs()
    nll = [torch.nn.functional.cross_entropy(x[:-1], ids[0, 1:]).item() for x in (logits, full)]
    assert delta.mean() < 0.1 and delta.max() < 2
    assert (logits.argmax(-1) == full.argmax(-1)).float().mean() > 0.98
    assert abs(math.exp(nll[0] - nll[1]) - 1) < 0.005


@pytest.mark.embedded
@pytest.mark.slow
def test_the_decode_step_over_int8_slots_stays_close_to_the_same_cache_in_float(held_out):
    # the steady state (full layers, evicting every token, the decode step's int8 attention)
    # against the same settings at float width, fed the same tokens; the float cache's own kept
    # sets may differ slightly (its scores differ), so this compares what the model predicts
    model, ids, _ = held_out
    caches = {q: H2OCache(model, policy="h2o", budget=256, kv_quant=q) for q in ("none", "int8")}
    logits = {q: [] for q in caches}
    with torch.no_grad():
        for q, cache in caches.items():
            model(ids[:, :512], cache=cache)
            for t in range(512, 576):
                logits[q].append(model(ids[:, t : t + 1], cache=cache).logits[0, -1].float())
    assert caches["int8"].layers[0].step is not None  # the decode step ran over int8 slots
    a, b = torch.stack(logits["int8"]), torch.stack(logits["none"])
    assert (a - b).abs().mean() < 0.15
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


def test_a_rolled_int8_key_attends_as_the_rerotated_float_key_would():
    # positions="rolling" re-lays the kept keys every ~budget tokens: an int8 key is widened,
    # rotated and rounded again each time. "sink" keeps the same tokens in both caches (no scores),
    # so each slot's key can be compared after 12 re-lays: the sinks, held from the first token,
    # went through all of them
    model = make_tiny_llama(torch.float32)
    caches = {q: H2OCache(model, policy="sink", budget=16, n_sink=4, positions="rolling", kv_quant=q) for q in ("none", "int8")}
    ids = torch.randint(0, 128, (1, 220), generator=torch.Generator().manual_seed(5))
    queries = torch.randn(64, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for cache in caches.values():
            model(ids[:, :20], cache=cache)
            for t in range(20, 220):
                model(ids[:, t : t + 1], cache=cache)
    float_layer, int8_layer = caches["none"].layers[1], caches["int8"].layers[1]
    assert int8_layer.roll_floor > 150 and torch.equal(float_layer.token_ids, int8_layer.token_ids)
    float_keys, int8_keys = float_layer.keys, int8_layer.widened(torch.float32)[0]
    # each re-lay rounds each element by at most half a step of the key's range (a hair more: the
    # scale and zero point are stored at float16), in either direction: after 12 re-lays the
    # error is a random walk, about sqrt(12 / 12) = 1 step rms, and never near 12 half steps
    # (measured: rms 1.03 steps, worst element 3.6; with float32 scales 0.96 and 2.8)
    step = (float_keys.amax(-1, keepdim=True) - float_keys.amin(-1, keepdim=True)) / 255  # [b, h, slots, 1]
    error = (int8_keys - float_keys).abs() / step
    assert error.pow(2).mean().sqrt() < 1.5 and error.max() < 6
    logits_float, logits_int8 = queries @ float_keys[0].transpose(-1, -2), queries @ int8_keys[0].transpose(-1, -2)
    scale = logits_float.abs().mean()
    assert (logits_int8 - logits_float).abs().mean() < 0.02 * scale


def test_int8_slots_take_136_bytes_a_token_and_head_where_bf16_takes_256():
    model = make_tiny_llama(torch.bfloat16)  # head_dim 16: 2 x 16 bytes of codes + 4 float16 of scales and zeros
    caches = {q: H2OCache(model, budget=24, kv_quant=q) for q in ("none", "int8")}
    with torch.no_grad():
        for cache in caches.values():
            model(torch.arange(40)[None] % 128, cache=cache)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert caches["none"].kv_bytes() == layers * heads * 24 * 2 * 16 * 2
    assert caches["int8"].kv_bytes() == layers * heads * 24 * (2 * 16 + 4 * 2)
    assert caches["int8"].full_kv_bytes() == caches["none"].full_kv_bytes() == layers * heads * 40 * 2 * 16 * 2
    assert (caches["int8"].kv_width, caches["none"].kv_width) == ("int8", "bfloat16")


def test_the_stats_line_and_the_memory_chart_show_the_width(tiny_chat):
    model, tokenizer = tiny_chat
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=48, n_sink=2, kv_quant="int8"),
                          temperature=0, max_new_tokens=40)
    "".join(session.send("tell me about the lighthouse keeper and the storm"))
    stats, shown = session.stats, draw.panel(session, maps=False)
    assert stats["tokens_seen"] > 48 and stats["kv_width"] == "int8" and stats["model_width"] == "float32"
    assert "in int8 (a full cache: " in shown["stats"] and " MiB in float32, " in shown["stats"]
    session.configure(cache=dict(policy="h2o", budget=48, n_sink=2))  # the model's width: said once
    stats_line = draw.panel(session, maps=False)["stats"]
    assert " in float32 (a full cache: " in stats_line and stats_line.count("float32") == 1
    this = {r["tokens seen"]: r["KV MiB"] for r in shown["memory"] if r["cache"] == draw.SERIES[0]}
    full = {r["tokens seen"]: r["KV MiB"] for r in shown["memory"] if r["cache"] == draw.SERIES[1]}
    # the knee at this cache's own bytes a slot (int8 codes and four floats), not the full width's
    assert this[48] == round(stats["kv_bytes"] / 2**20, 3) < full[48]


def test_the_kv_width_means_the_same_on_the_page_the_command_line_and_the_api():
    base = dict(policy="h2o", budget=64, n_sink=4, n_recent=None, score="sum", positions="rolling")
    args = server.parse_args(["--kv-quant", "int8"])
    by = {"library": CacheConfig(**base, kv_quant="int8"),
          "command line": cache_config({name: getattr(args, name) for name in ("kv_quant",)} | base),
          "api": cache_config(read_cache({"h2o": {"kv_quant": "int8"}}, base, 0, 1)[0]),
          "page": cache_config(ui_settings.cache_settings({**base, "n_recent": "", "kv_quant": "int8"}))}
    assert {where: c.kv_quant for where, c in by.items()} == dict.fromkeys(by, "int8")
    assert server.parse_args([]).kv_quant == CacheConfig().kv_quant == "none"


def test_an_unknown_width_is_refused_in_words():
    with pytest.raises(ValueError, match="unknown kv_quant 'int4'; choose one of none, int8"):
        CacheConfig(kv_quant="int4")
    with pytest.raises((ApiError, ValueError), match="int4"):
        cache_config(read_cache({"h2o": {"kv_quant": "int4"}}, {}, 0, 1)[0])


def test_a_cache_saved_before_the_setting_existed_still_matches_its_settings():
    # the settings tag in a saved cache's file name: older versions wrote it without kv_quant, so
    # the default (none) leaves it out, and a story saved then is still found
    assert tag(config_text(CacheConfig())) == "3faf30a2ff4d"
    assert "kv_quant" not in json.loads(config_text(CacheConfig()))
    assert json.loads(config_text(CacheConfig(kv_quant="int8")))["kv_quant"] == "int8"


def saved_int8_state(model):
    """An int8 cache fed 30 tokens, and its state as a saved file holds it: (cache, tensors, info)."""
    saved = H2OCache(model, budget=16, kv_quant="int8")
    with torch.no_grad():
        model(torch.arange(30)[None] % 128, cache=saved)
    return saved, *saved.export_state(saved.snapshot())


def test_an_int8_state_is_refused_by_a_float_cache_in_words():
    model = make_tiny_llama(torch.float32)
    saved, tensors, info = saved_int8_state(model)
    same = H2OCache(model, budget=16, kv_quant="int8")
    same.restore(same.import_state(tensors, info))
    assert all(torch.equal(a.kv, b.kv) and torch.equal(a.acc, b.acc) and torch.equal(a.qp, b.qp)
               for a, b in zip(saved.layers, same.layers))
    assert tensors["layer.0.qp"].dtype == torch.float16
    with pytest.raises(ValueError, match="buffers of torch.uint8 / torch.int32, the cache stores torch.float32"):
        H2OCache(model, budget=16).import_state(tensors, info)


def test_an_int8_state_with_float32_scales_from_an_older_version_is_refused_in_words():
    # before float16 scales, a layer's int8 scales and zero points were four more rows of its
    # packed meta tensor and there was no qp tensor: such a file is refused (the chat is replayed)
    model = make_tiny_llama(torch.float32)
    _, tensors, info = saved_int8_state(model)
    for i in range(model.config.num_hidden_layers):
        qp = tensors.pop(f"layer.{i}.qp").float()
        tensors[f"layer.{i}.meta"] = torch.cat((tensors[f"layer.{i}.meta"], qp.view(torch.int32)))
    with pytest.raises(ValueError, match="it holds int8 scales at float32, as h2o-chat stored them before float16"):
        H2OCache(model, budget=16, kv_quant="int8").import_state(tensors, info)
