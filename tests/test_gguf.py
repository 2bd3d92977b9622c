"""A user's GGUF file read at its own width (models/gguf.py through load_model): tiny random-weight
LLaMA files written here with the `gguf` package, each loaded in well under a second."""

import gc
import logging
import weakref

import pytest
import torch

from h2o_chat import H2OCache
from h2o_chat.bench.random_gguf import TINY, write_random_gguf
from h2o_chat.models import packed as packed_mod
from h2o_chat.models.decode import Decoder
from h2o_chat.models.gguf import GGUFWeights, read_header
from h2o_chat.models.load import ModelLoadError, load_model
from h2o_chat.models.packed import Int4Linear, Int8Linear, PackedEmbedding
from h2o_chat.models.quantize import weights_label


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {kind: write_random_gguf(folder / f"tiny-{kind}.gguf", TINY, kind) for kind in ("Q4_0", "Q8_0", "Q5_0", "F16")}


def logits(model, tokenizer, text="Hello there, how are you today?"):
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("kind,repeats", [("Q4_0", 1), ("Q8_0", 2)])
def test_a_gguf_loads_at_its_own_width(files, kind, repeats):
    """Every linear stays the file's blocks (Q8_0: two exact int4 halves), the tied lm_head too, and
    the embedding reads its rows; its logits are transformers' dequantized model's (which undoes
    llama.cpp's q/k row order itself: a loader that did not would disagree everywhere)."""
    model, tokenizer = load_model(files[kind], dtype="float32")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert not linears and len(packed) == 2 * 7 + 1 and all(m.repeats == repeats for m in packed)
    embed = model.get_input_embeddings()
    assert isinstance(embed, PackedEmbedding) and embed.table is model.lm_head
    assert weights_label(model) == f"int4: GGUF {kind} {'as stored' if repeats == 1 else 'as two exact int4 halves'} (15)"

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


def test_other_block_types_are_quantized_again_with_one_log_line(files, caplog):
    with caplog.at_level(logging.WARNING, logger="h2o_chat"):
        model, _ = load_model(files["Q5_0"])
    lines = [r.getMessage() for r in caplog.records if r.name == "h2o_chat"]
    assert lines == ["h2o-chat: tiny-Q5_0.gguf: 15 Q5_0 weights have no exact int4 path; quantized again to int4 "
                     "group 32 (the lm_head among them to int8 per row)"]
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
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
    assert "Q4_0, Q4_1, Q8_0 at their own width, F32, F16, BF16 as floats" in message and "Q6_K" in message


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
