"""Shared fixtures. A tiny random-weight LLaMA with GQA (4 query heads, 2 KV heads): fast, seeded, and small
enough for the slow reference. Each test gets a fresh model: H2OCache switches a model's
attention implementation, and comparisons against DynamicCache want an untouched one."""

import json
import threading
import time

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from h2o_chat.models.load import default_model_folder, load_model


def pytest_collection_modifyitems(config, items):
    """The markers (pyproject.toml) say what a test needs. They are written on each test; this only
    refuses a test that loads the embedded model without saying so, so that neither the fast loop
    (-m "not slow and not browser") nor -m "not embedded" ever loads it by surprise."""
    unmarked = [item.nodeid for item in items if "embedded_conversion" in item.fixturenames
                and not (item.get_closest_marker("embedded") and item.get_closest_marker("slow"))]
    if unmarked:
        raise pytest.UsageError("these tests load the embedded model: mark them embedded and slow: "
                                + ", ".join(unmarked))


def make_tiny_llama(dtype=torch.float32, max_position_embeddings=512, seed=0, vocab_size=128, kv_heads=2,
                    random_norms=False, **overrides):
    """kv_heads=1 gives the single-KV-head (MQA) variant. random_norms: the norms' weights random
    around 1 rather than transformers' ones, for the bit-for-bit tests of the decode step: with
    ones, a step that dropped a rounding before the weight's product, or read another layer's norm,
    computes the same bits. (Off by default: tests elsewhere are tuned to these weights, e.g. a
    logit bias that makes the model end its reply.)"""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    if random_norms:
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.copy_(1 + 0.2 * torch.randn(weight.shape))
    model = model.to(dtype)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def run_threads(target, n, deadline_s):
    """target(i) for i in range(n), each in a thread of its own, all started, then joined with a
    deadline on each: none may still run after it."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(deadline_s)
    assert not any(thread.is_alive() for thread in threads)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture
def tiny_llama64():
    """float64, for tests that compare which tokens are kept: ranking by scores that differ
    only by float32 rounding noise would make exact-set comparisons flaky."""
    return make_tiny_llama(torch.float64)


def save_tiny_llama(folder):
    """A random 2-layer GQA LLaMA with a byte-level tokenizer (256 tokens = 256 bytes)."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # No eos: generate always runs the full max_new_tokens, so lengths can be asserted exactly.
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.save_pretrained(folder)

    byte_vocab = {symbol: i for i, symbol in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def embedded_conversion():
    """Loads the embedded default once per session, converting it if this machine never has.
    Its float weights in fp32 (quantization="none", dtype float32), not the app's default (int4
    from the GGUF's blocks, bf16 activations): the tests that use it compare greedy tokens of two
    paths through the cache (batched and alone, replayed and re-prefilled), and fp32's margins
    keep ties from flipping a token. The int4 model has its own fixture, `embedded_int4`."""
    folder = default_model_folder()
    converted = not (folder / "config.json").is_file()
    start = time.perf_counter()
    model, tokenizer = load_model(dtype="float32", quantization="none")
    return {"model": model, "tokenizer": tokenizer, "folder": folder, "converted": converted,
            "seconds": time.perf_counter() - start}


@pytest.fixture(scope="session")
def embedded_model(embedded_conversion):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in fp32, shared by the whole session."""
    return embedded_conversion["model"], embedded_conversion["tokenizer"]


@pytest.fixture(scope="session")
def embedded_int4(embedded_conversion):
    """(model, tokenizer) as the app loads it by default: quantization="auto", int4 from the
    GGUF's own Q4_1 blocks, the Q8_0 lm_head as two exact int4 halves, dtype "auto"."""
    model, tokenizer = load_model()
    return model, tokenizer


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def char_tokenizer(template=CHATML):
    """A token per printable ASCII character (so whatever a random model says decodes to text and
    re-tokenizes to the same ids), ChatML's two special tokens, and `template`."""
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def make_tiny_chat(dtype=torch.float32, seed=0):
    """A tiny random LLaMA with a character-level tokenizer (printable ASCII, so whatever the
    random model says decodes to text and re-tokenizes to the same ids), ChatML's two special
    tokens and its chat template: everything a ChatSession needs, in milliseconds."""
    tokenizer = char_tokenizer()
    model = make_tiny_llama(dtype, seed=seed, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, tokenizer


@pytest.fixture
def tiny_chat():
    return make_tiny_chat()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run the tiny models hundreds of times: their matrices are so small that
    a second intra-op thread only adds synchronisation, and on a busy 2-core machine it makes
    them several times slower (measured: 277 s against 78 s for the hardening tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def play_text(tmp_path_factory):
    """A short play as a text file (4,800 characters): the tiny model's byte-level tokenizer reads
    each character as a token; numbered lines keep the text from repeating exactly."""
    path = tmp_path_factory.mktemp("text") / "play.txt"
    path.write_text("".join(f"ROMEO {i}: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
                            for i in range(60)))
    return path


def run_ppl(model_dir, text, out, *args, plot=True):
    """`python -m h2o_chat.bench.evaluate ppl` on `model_dir` over `text` with `args`, results in
    `out`: what it wrote (`read_results`)."""
    from h2o_chat.bench import evaluate

    evaluate.main(["--model", str(model_dir), "--out", str(out), "ppl", "--text", str(text), *args])
    return read_results(out, "ppl", plot=plot)


def read_results(out, name, plot=True):
    """What a bench/evaluate command wrote as `name`: the JSON (returned: rows and meta), a
    Markdown table naming the command, and (plot) a PNG."""
    data = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.md").read_text().startswith("Command: `python -m h2o_chat.")
    if plot:
        assert (out / f"{name}.png").stat().st_size > 0
    return data
