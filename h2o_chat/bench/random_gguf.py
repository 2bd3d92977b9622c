"""Random-weight LLaMA GGUF files, written with the `gguf` package: a user's model stand-in.

    write_random_gguf(path, LLAMA_1B, "Q4_0")     # Llama-3.2-1B-shaped, 656 MB: what a user brings
    write_random_gguf(path, LLAMA_1B, "Q4_K_M")   # the same as the K-quant mix most files are
    write_random_gguf(path, TINY, "Q8_0")         # tests: milliseconds
    rewrite_gguf(source, path, "Q5_0")            # a real model's weights in another block type

K-quant blocks (Q4_K, Q5_K, Q6_K) come from kquants.py (the gguf package cannot write them); a
K_M mix is llama.cpp's choice of type per tensor (`block_type_for`).

The tokenizer is a byte-level BPE with one merge (256 byte tokens, then unused fillers up to the
vocabulary, two ChatML specials at its end), so transformers and llama.cpp both read it quickly;
its chat template is ChatML. Weights are Gaussian (std 0.02, norms 1), quantized by gguf's own
numpy code. (A loader must undo llama.cpp's q/k row order on any LLaMA GGUF, random or not: the
file's rows are whatever it holds, and transformers' dequantizing loader undoes that order.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import kquants


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int = 8192
    tied: bool = True  # no output.weight: the lm_head is token_embd (Llama-3.2-1B ties them)


LLAMA_1B = Shape(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256, context=131072)
TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=288, context=512)
TINY_K = Shape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=288, context=512)  # K-quant rows: 256s

MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # llama.cpp's K_M files: this type, and Q6_K where they spend more
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for rows that are not whole super-blocks

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHUNK_ROWS = 8192  # rows drawn and quantized at a time: a large table never exists in float32 whole


def byte_tokens(vocab):
    """(tokens, types, merges): the 256 bytes as GPT-2's printable characters, one merge ("a b":
    readers want merges, and derive them from scores a byte-level file does not have), unused
    fillers, then ChatML's two specials."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord) + ["ab"]
    fillers = [f"<unused{i}>" for i in range(vocab - len(tokens) - 2)]
    types = [1] * len(tokens) + [5] * len(fillers) + [3, 3]  # normal, unused, control
    return tokens + fillers + ["<|im_start|>", "<|im_end|>"], types, ["a b"]


def _can_quantize(kind, cols):
    try:
        kquants.quantize(np.zeros((1, cols), dtype=np.float32), kind)
        return True
    except (NotImplementedError, ValueError):
        return False


def use_more_bits(layer, layers):
    """llama.cpp's layers that get more bits in a K_M file: the first and last eighth, and every
    third one between (llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def block_type_for(name, block_type, cols, layers, tied):
    """The block type of tensor `name` (cols values a row) in a file of `block_type`: itself, or
    for a K_M mix llama.cpp's choice: Q6_K for the output (the token table when they are tied)
    and for attn_v and ffn_down of the `use_more_bits` layers, the mix's type elsewhere. A
    K-quant whose rows are not whole super-blocks of 256 falls back as llama.cpp's does."""
    kind = MIXES.get(block_type, block_type)
    if block_type in MIXES:
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            kind = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
            kind = "Q6_K"
    return FALLBACK[kind] if kind in FALLBACK and cols % kquants.QK_K else kind


def written(file, shape: Shape, block_type) -> Path:
    """`file` (a Path), a random GGUF of `shape` in `block_type` written there first if it is not
    there yet: the benches' files, made once per output folder."""
    if not file.is_file():
        file.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {file} ({block_type})", flush=True)
        write_random_gguf(file, shape, block_type)
    return file


def write_random_gguf(path, shape: Shape = TINY, block_type="Q4_0", seed=0, embed_type=None, override=None):
    """Write a random LLaMA GGUF of `shape` with its linear weights as `block_type` (any type
    gguf.quants can quantize: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, F32; kquants.py's Q4_K, Q5_K,
    Q6_K; a mix, Q4_K_M or Q5_K_M: `block_type_for`); the token table as `embed_type` (default:
    block_type's choice). override: {tensor name: block type} for some tensors (a type nothing
    here can write gets random bytes; None leaves the tensor out), for tests of files a loader
    must refuse or requantize. Returns the path."""
    import gguf

    Q = gguf.GGMLQuantizationType
    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("random-llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_vocab_size(shape.vocab)
    tokens, types, merges = byte_tokens(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(shape.vocab - 2)
    writer.add_eos_token_id(shape.vocab - 1)
    writer.add_chat_template(CHATML)

    def weight(name, rows, cols, kind):
        kind = block_type_for(name, kind, cols, shape.layers, shape.tied)
        kind = (override or {}).get(name, kind)
        if kind is None:
            return
        if kind not in ("F32", "F16") and not _can_quantize(kind, cols):
            block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
            writer.add_tensor(name, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8), raw_dtype=Q[kind])
            return
        parts = []
        for start in range(0, rows, CHUNK_ROWS):
            values = rng.standard_normal((min(CHUNK_ROWS, rows - start), cols), dtype=np.float32) * 0.02
            parts.append(kquants.quantize(values, kind) if kind not in ("F32", "F16") else values.astype(
                np.float16 if kind == "F16" else np.float32))
        writer.add_tensor(name, np.concatenate(parts), raw_dtype=Q[kind] if kind not in ("F32", "F16") else None)

    d = shape.hidden // shape.heads
    weight("token_embd.weight", shape.vocab, shape.hidden, embed_type or block_type)
    for i in range(shape.layers):
        ones = np.ones(shape.hidden, dtype=np.float32)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        weight(f"blk.{i}.attn_q.weight", shape.heads * d, shape.hidden, block_type)
        weight(f"blk.{i}.attn_k.weight", shape.kv_heads * d, shape.hidden, block_type)
        weight(f"blk.{i}.attn_v.weight", shape.kv_heads * d, shape.hidden, block_type)
        weight(f"blk.{i}.attn_output.weight", shape.hidden, shape.heads * d, block_type)
        weight(f"blk.{i}.ffn_gate.weight", shape.intermediate, shape.hidden, block_type)
        weight(f"blk.{i}.ffn_up.weight", shape.intermediate, shape.hidden, block_type)
        weight(f"blk.{i}.ffn_down.weight", shape.hidden, shape.intermediate, block_type)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    if not shape.tied:
        weight("output.weight", shape.vocab, shape.hidden, block_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite_gguf(source, path, block_type, only=None, rest=None):
    """Write `source`'s model into `path` with its weights in `block_type` (as write_random_gguf
    takes it: a type or a K_M mix): the same metadata and tokenizer, each matrix dequantized by
    the gguf package and quantized again (vectors, the norms, stay as they were). only: names
    (substrings, "ffn_down") of the matrices to write so; the others become `rest` ("F16", None:
    as they were). For perplexity per block type on a real model (the embedded one's 576-wide
    rows are no K-quant's: only its ffn_down, 1536 wide, is). Returns the path."""
    import gguf

    reader = gguf.GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{architecture}.block_count"].contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    writer = gguf.GGUFWriter(path, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        cols = int(tensor.shape[0])
        if len(tensor.shape) < 2:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tuple(reversed(tensor.shape.tolist())),
                              raw_dtype=tensor.tensor_type)
            continue
        chosen = only is None or any(part in tensor.name for part in only)
        kind = block_type_for(tensor.name, block_type, cols, layers, tied) if chosen else rest
        if kind is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(-1, cols)
        if kind in ("F32", "F16"):
            writer.add_tensor(tensor.name, values.astype(np.float16 if kind == "F16" else np.float32))
        else:
            writer.add_tensor(tensor.name, kquants.quantize(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv=None):
    """python -m h2o_chat.bench.random_gguf OUT.gguf --block-type Q4_K_M [--source FILE --only ffn_down --rest F16]"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m h2o_chat.bench.random_gguf", description=main.__doc__)
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--block-type", default="Q4_0", help="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, "
                        "Q4_K_M, Q5_K_M, F16")
    parser.add_argument("--source", default=None, help="a GGUF whose model to rewrite ('embedded': the embedded "
                        "model's); default: random weights of --shape")
    parser.add_argument("--shape", default="tiny", choices=("tiny", "tiny-k", "llama-1b"))
    parser.add_argument("--only", default=None, help="with --source: only matrices whose names hold one of these "
                        "(comma-separated) take --block-type")
    parser.add_argument("--rest", default=None, help="with --only: the other matrices' type (default: as they were)")
    args = parser.parse_args(argv)
    if args.source:
        from ..models.load import embedded_gguf_path

        source = embedded_gguf_path() if args.source == "embedded" else args.source
        rewrite_gguf(source, args.out, args.block_type, args.only.split(",") if args.only else None, args.rest)
    else:
        write_random_gguf(args.out, {"tiny": TINY, "tiny-k": TINY_K, "llama-1b": LLAMA_1B}[args.shape], args.block_type)
    print(args.out)


if __name__ == "__main__":
    main()
