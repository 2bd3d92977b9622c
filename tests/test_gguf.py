"""A user's GGUF file read at its own width (models/gguf.py through load_model): tiny random-weight
LLaMA files written here with the `gguf` package, each loaded in well under a second."""

import gc
import logging
import weakref

import pytest
import torch

from h2o_chat import H2OCache
from h2o_chat.bench.random_gguf import TINY, TINY_K, write_random_gguf
from h2o_chat.models import packed as packed_mod
from h2o_chat.models.decode import Decoder
from h2o_chat.models.gguf import GGUFWeights, read_header
from h2o_chat.models.load import ModelLoadError, load_model
from h2o_chat.models.packed import Int4Linear, Int8Linear, PackedEmbedding
from h2o_chat.models.quantize import weights_label


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny files of each block type; K-quants on TINY_K, whose rows are whole super-blocks of 256."""
    folder = tmp_path_factory.mktemp("gguf")
    made = {kind: write_random_gguf(folder / f"tiny-{kind}.gguf", TINY, kind) for kind in ("Q4_0", "Q8_0", "Q5_0", "Q5_1", "F16")}
    for kind in ("Q4_K", "Q5_K", "Q4_K_M"):
        made[kind] = write_random_gguf(folder / f"tiny-{kind}.gguf", TINY_K, kind)
    return made


def logits(model, tokenizer, text="Hello there, how are you today?"):
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("kind,repeats", [("Q4_0", 1), ("Q4_K", 1), ("Q8_0", 2), ("Q5_0", 2), ("Q5_1", 2), ("Q5_K", 2)])
def test_a_gguf_loads_at_its_own_width(files, kind, repeats):
    """Every linear stays the file's blocks (4-bit codes as stored, 5- and 8-bit as two exact int4
    halves), the tied lm_head too, and the embedding reads its rows; its logits are transformers'
    dequantized model's (which undoes llama.cpp's q/k row order itself: a loader that did not
    would disagree everywhere)."""
    model, tokenizer = load_model(files[kind], dtype="float32")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert not linears and len(packed) == 2 * 7 + 1 and all(m.repeats == repeats for m in packed)
    embed = model.get_input_embeddings()
    assert isinstance(embed, PackedEmbedding) and embed.table is model.lm_head
    assert weights_label(model) == f"int4: GGUF {kind} {'as stored' if repeats == 1 else 'as two exact int4 halves'} (15)"
    # a Q4_0 block's zero is 0: its scales are kept again as a decode step reads them (test_int4_mm.py)
    assert all((m.scales_by_block is not None) == (kind == "Q4_0" and packed_mod.native.int4_mm() is not None) for m in packed)

    dense, _ = load_model(files[kind], dtype="float32", quantization="none")
    ours, theirs = logits(model, tokenizer), logits(dense, tokenizer)
    # the kernels round activations to bf16: within bf16's rounding of the logits, nowhere near a misordered row
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0.02 * theirs.abs().max().item())


def test_int8_and_int4_of_a_gguf_and_the_lean_step(files):
    """quantization="int8" / "int4": every linear packed whatever the file holds; the lean step
    decodes the same tokens as the model's own forward."""
    model, tokenizer = load_model(files["Q8_0"], quantization="int8")
    layers = [m for m in model.model.layers.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(layers) == 14 and all(isinstance(m, Int8Linear) for m in layers)
    assert model.lm_head.repeats == 2  # the lm_head keeps its exact path
    assert weights_label(model) == "int8: GGUF Q8_0 quantized to int8 (14), Q8_0 as two exact int4 halves (1)"
    model, tokenizer = load_model(files["F16"], quantization="int4")
    assert weights_label(model) == "int4: GGUF F16 quantized to int4 (14), F16 kept (1)"
    own, lean = H2OCache(model, budget=32), H2OCache(model, budget=32)
    decoder = Decoder(model)
    assert decoder.why_not is None and decoder.packed
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(ids, cache=own).logits[:, -1:].argmax(-1)
        b = decoder.forward(ids, lean).argmax(-1, keepdim=True)
        for _ in range(12):
            assert torch.equal(a, b)
            a = model(a, cache=own).logits[:, -1:].argmax(-1)
            b = decoder.forward(b, lean).argmax(-1, keepdim=True)


def test_float_weights_stay_float_under_auto(files):
    model, _ = load_model(files["F16"], dtype="float32")
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    assert weights_label(model) == "float32: GGUF F16 kept (15)"
    assert model.get_input_embeddings().weight is model.lm_head.weight  # tied: one table


def test_a_q4_k_m_file_runs_its_q4_k_as_stored_and_its_q6_k_as_int8(files, caplog):
    """llama.cpp's most common mix (random_gguf.block_type_for): Q4_K for most linears, Q6_K for
    the tied token table / lm_head and for attn_v and ffn_down of layer 1 (its use_more_bits).
    Q4_K runs as stored, Q6_K (sub-blocks of 16: no exact path) as int8 per row, said on the
    label and in one log line; the logits are the dequantized model's, as the other GGUF files'
    are, and the lean step decodes the model's own tokens."""
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        model, tokenizer = load_model(files["Q4_K_M"], dtype="float32")
    assert weights_label(model) == "int4: GGUF Q4_K as stored (12), Q6_K quantized to int8 (3)"
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert lines == ["h2o-chat: tiny-Q4_K_M.gguf: weights with no exact int4 path, quantized again: 3 Q6_K to int8 per row"]
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.v_proj, Int4Linear) and isinstance(layers[1].self_attn.v_proj, Int8Linear)
    assert isinstance(layers[1].mlp.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    embed = model.get_input_embeddings()
    assert isinstance(embed, PackedEmbedding) and embed.table is model.lm_head

    dense, _ = load_model(files["Q4_K_M"], dtype="float32", quantization="none")
    ours, theirs = logits(model, tokenizer), logits(dense, tokenizer)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0.02 * theirs.abs().max().item())

    decoder, own, lean = Decoder(model), H2OCache(model, budget=32), H2OCache(model, budget=32)
    assert decoder.why_not is None and decoder.packed
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(ids, cache=own).logits[:, -1:].argmax(-1)
        b = decoder.forward(ids, lean).argmax(-1, keepdim=True)
        for _ in range(8):
            assert torch.equal(a, b)
            a = model(a, cache=own).logits[:, -1:].argmax(-1)
            b = decoder.forward(b, lean).argmax(-1, keepdim=True)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # random bytes: some fp16 scales are NaN
def test_other_block_types_are_quantized_again_with_one_log_line(tmp_path, caplog):
    """Q3_K (random bytes: nothing here writes it) has no exact path: int4 group 32, the lm_head
    int8 per row; Q6_K int8 per row; one log line says so."""
    path = write_random_gguf(tmp_path / "q3_k.gguf", TINY_K, "Q3_K", override={"blk.0.ffn_down.weight": "Q6_K"})
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        model, _ = load_model(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert lines == ["h2o-chat: q3_k.gguf: weights with no exact int4 path, quantized again: 13 Q3_K to int4 group 32, "
                     "1 Q6_K to int8 per row, 1 Q3_K to int8 per row"]
    assert weights_label(model) == "int4: GGUF Q3_K quantized to int4 (13), Q6_K quantized to int8 (1), Q3_K quantized to int8 (1)"
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(model.get_input_embeddings(), PackedEmbedding)  # tied: its rows are the int8 lm_head's


def test_our_header_reader_agrees_with_gguf(files):
    import gguf

    reader = gguf.GGUFReader(files["Q4_0"])
    architecture, tensors = read_header(files["Q4_0"])
    assert architecture == "llama"
    assert [(n, k, o) for n, _, k, o in tensors] == [(t.name, int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    weights = GGUFWeights(files["Q4_0"])
    assert all(weights.tensors[t.name].rows * weights.tensors[t.name].row_bytes == t.n_bytes for t in reader.tensors)


def test_a_block_type_with_no_path_is_refused_naming_the_ones_read(tmp_path):
    path = write_random_gguf(tmp_path / "q8_1.gguf", TINY, "Q4_0", override={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert "blk.1.ffn_up.weight is stored as Q8_1, which h2o-chat cannot read" in message and "\n" not in message
    assert ("it reads Q4_0, Q4_1, Q4_K as stored, Q8_0, Q5_0, Q5_1, Q5_K as two exact int4 halves, F32, F16, BF16 "
            "as floats, and quantizes Q6_K again to int8 per row and ") in message and "Q3_K" in message


def test_a_load_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    """The last layer's down_proj is missing: by then every other layer is packed. After the
    error, none of those modules is alive (the error does not keep the half-built model)."""
    path = write_random_gguf(tmp_path / "short.gguf", TINY, "Q4_0", override={"blk.1.ffn_down.weight": None})
    made = []
    real_init = Int4Linear.__init__

    def counting_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(packed_mod.Int4Linear, "__init__", counting_init)
    with pytest.raises(ModelLoadError, match="the GGUF has no tensor for model.layers.1.mlp.down_proj") as info:
        load_model(path)
    assert info.value.__context__ is None and info.value.__cause__ is None
    gc.collect()
    assert len(made) >= 10 and not [ref for ref in made if ref() is not None]


def test_the_stats_line_and_v1_models_name_a_q4_k_m_files_mix(files, tmp_path):
    """A user serving a Q4_K_M file sees what runs: the page's stats line, and /v1/models through
    the real openai client on a live server, which also answers a chat on those weights."""
    import openai

    from h2o_chat.chat.session import ChatSession
    from h2o_chat.ui.draw import panel
    from tests.live import live_app

    model, tokenizer = load_model(files["Q4_K_M"])
    mix = "int4: GGUF Q4_K as stored (12), Q6_K quantized to int8 (3)"
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), max_new_tokens=4)
    "".join(session.send("Hi"))
    assert f"· weights {mix}" in panel(session)["stats"]
    with live_app(tmp_path, model, tokenizer, api=True) as (url, _):
        client = openai.OpenAI(base_url=url + "v1", api_key="unused", timeout=60, max_retries=0)
        (listed,) = client.models.list().data
        assert listed.weights == mix
        reply = client.chat.completions.create(model=listed.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.completion_tokens > 0


def test_a_gguf_rewritten_in_another_block_type(files, tmp_path):
    """bench's rewrite_gguf (the per-type perplexity files): the same metadata and tokenizer, the
    chosen matrices in the new type, the others as asked, the norms as they were."""
    import gguf

    from h2o_chat.bench.random_gguf import rewrite_gguf

    path = rewrite_gguf(files["Q4_K"], tmp_path / "down-q5_k.gguf", "Q5_K", only=["ffn_down"], rest="F16")
    source, rewritten = gguf.GGUFReader(files["Q4_K"]), gguf.GGUFReader(path)
    assert rewritten.fields["tokenizer.ggml.tokens"].contents() == source.fields["tokenizer.ggml.tokens"].contents()
    kinds = {t.name: t.tensor_type.name for t in rewritten.tensors}
    assert kinds["blk.1.ffn_down.weight"] == "Q5_K" and kinds["blk.1.ffn_up.weight"] == "F16"
    assert kinds["blk.1.ffn_norm.weight"] == "F32" and len(kinds) == len(source.tensors)
    before, after = (GGUFWeights(p) for p in (files["Q4_K"], path))
    a, b = (w.dequantized(w.tensors["blk.0.ffn_down.weight"]) for w in (before, after))
    assert 0 < (a - b).abs().max() < (a.max() - a.min()) / 31  # within a Q5 step of the source
    model, _ = load_model(path)
    assert weights_label(model) == "int4: GGUF F16 kept (13), Q5_K as two exact int4 halves (2)"
