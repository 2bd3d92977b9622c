"""Random-weight LLaMA GGUF files, written with the `gguf` package: a user's model stand-in.

    write_random_gguf(path, LLAMA_1B, "Q4_0")     # Llama-3.2-1B-shaped, 656 MB: what a user brings
    write_random_gguf(path, TINY, "Q8_0")         # tests: milliseconds

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


def _can_quantize(gguf, kind, cols):
    try:
        gguf.quants.quantize(np.zeros((1, cols), dtype=np.float32), kind)
        return True
    except NotImplementedError:
        return False


def write_random_gguf(path, shape: Shape = TINY, block_type="Q4_0", seed=0, embed_type=None, override=None):
    """Write a random LLaMA GGUF of `shape` with its linear weights as `block_type` (any type
    gguf.quants can quantize: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, F32); the token table as
    `embed_type` (default: block_type). override: {tensor name: block type} for some tensors (a
    type gguf cannot quantize gets random bytes; None leaves the tensor out), for tests of files
    a loader must refuse. Returns the path."""
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
        kind = (override or {}).get(name, kind)
        if kind is None:
            return
        if kind not in ("F32", "F16") and not _can_quantize(gguf, Q[kind], cols):
            block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
            writer.add_tensor(name, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8), raw_dtype=Q[kind])
            return
        parts = []
        for start in range(0, rows, CHUNK_ROWS):
            values = rng.standard_normal((min(CHUNK_ROWS, rows - start), cols), dtype=np.float32) * 0.02
            parts.append(gguf.quants.quantize(values, Q[kind]) if kind not in ("F32", "F16") else values.astype(
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
