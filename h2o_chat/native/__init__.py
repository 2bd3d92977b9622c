"""C kernels for a bf16 or 4-bit decode step on a CPU, compiled on the user's machine at first use:

    attend_one.c  one new token's attention over a layer's slots, bf16 or 8-bit (cache/step.py's
                  `attend`): torch.ops.h2o_chat.attend_one
    rotate_one.c  its queries and keys rotated, its keys and values into a bf16 layer's spare slot
                  (models/decode.py's step): torch.ops.h2o_chat.rotate_one
    int4_mm.c     one row times a 4-bit weight in torch's CPU layout (models/packed.py's Int4Linear):
                  torch.ops.h2o_chat.int4_mm
    dequant_int4.c  a 4-bit weight as bf16 W.T for a prefill's matmul (Int4Linear.weight_t), the
                  same bits as torch's ops: torch.ops.h2o_chat.dequant_int4
    rms_tail.c    a bf16 RMSNorm's steps after the sum of squares (models/decode.py's rms_norm),
                  the same bits: torch.ops.h2o_chat.rms_tail

Why: a decode step on a CPU is small work in many launches. Measured on the embedded model (2
cores, budget 512): the attention's aten ops took 82-130 us a layer, attend_one 38, and a whole
token 1.25x less time; rotate_one stands for ~18 aten ops a layer, and a token's 121
int4 matmuls take 1.2-1.4x less time than aten's kernel's; a token, all three, 1.2-1.26x;
rms_tail stands for 6 aten ops a norm (1.03x a token); a 4-bit weight's dequantization for a
prefill 2-5x (docs/engine.md).

How they get here: at the first use in a process (a bf16 model's `Decoder`, made when the app
starts, or the first int4 layer), the C files are compiled by the system's C compiler (`$CC`, else
`cc`; ~2 s at -O3) for this machine (-march=native) into one library in a private temporary
folder, loaded with ctypes, and the folder removed (the loaded library stays mapped). Where there
is no compiler, the compile fails, or the CPU is not x86-64 or ARM64, the ops are None, one log
line says why, and the aten ops run; int4_mm is also None where the CPU has no AVX2. H2O_CHAT_NATIVE=0
chooses the aten ops (the same results within rounding, rotate_one's bit for bit:
tests/test_native.py, test_int4_mm.py, test_decode.py).

Each op is registered with torch (a schema that says which tensors it writes), so torch.compile
treats it as one opaque call; eager code calls the C function without torch's dispatcher
(`direct`), and the profiler still counts it as one op.
"""

import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("attend_one.c", "rotate_one.c", "int4_mm.c", "dequant_int4.c", "rms_tail.c")]
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]  # no -ffast-math: see attend_one.c
LIBRARIES = ["-lm"]
OPENMP = "-fopenmp"  # heads in parallel on torch's own OpenMP threads; a compiler without it builds one thread
MAX_GROUP, MAX_DIM, LANES = 16, 256, 16  # attend_one.c's limits
log = logging.getLogger("h2o_chat")
_loading = threading.Lock()  # one compile a process, whichever thread asks first (the others wait for it)


@dataclass(frozen=True)
class Ops:
    """The ops of one compiled library, each as `direct` makes it (None: not for this CPU)."""

    attend_one: object
    rotate_one: object
    int4_mm: object | None
    dequant_int4: object
    rms_tail: object


def attend_one():
    """torch.ops.h2o_chat.attend_one.default as `direct` calls it, or None: H2O_CHAT_NATIVE=0 is set
    (read at each call: a cache makes its layers' steps once, not once a token), or the library is
    not available. The other getters below alike."""
    return _op("attend_one")


def rotate_one():
    """torch.ops.h2o_chat.rotate_one.default, or None."""
    return _op("rotate_one")


def int4_mm():
    """torch.ops.h2o_chat.int4_mm.default, or None (also on a CPU without AVX2)."""
    return _op("int4_mm")


def dequant_int4():
    """torch.ops.h2o_chat.dequant_int4.default, or None."""
    return _op("dequant_int4")


def rms_tail():
    """torch.ops.h2o_chat.rms_tail.default, or None."""
    return _op("rms_tail")


def _op(name):
    ops = _ops()
    return None if ops is None else getattr(ops, name)


def _ops():
    if os.environ.get("H2O_CHAT_NATIVE", "1") == "0":
        return None
    with _loading:
        return loaded()


@functools.cache
def loaded():
    """The ops, compiled and registered at the first call in a process; None, said once, where they cannot be."""
    why = why_not_native()
    if why is None:
        try:
            library = compiled()
        except (OSError, subprocess.SubprocessError) as e:
            why = f"compiling {', '.join(s.name for s in SOURCES)} failed ({type(e).__name__}: {first_line(e)})"
    if why is not None:
        log.warning("h2o-chat: attention and int4 matmuls run as aten ops: %s", why)
        return None
    return register(library)


def why_not_native():
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"no native kernels for {platform.machine()}"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')})"
    return None


def first_line(error):
    text = getattr(error, "stderr", None) or str(error)
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    return text.strip().splitlines()[0] if text.strip() else ""


def compiled(extra_flags=()):
    """Both C files compiled into one library and loaded (ctypes.CDLL), their functions' argument
    types set. extra_flags: a test's (-mno-avx512vnni builds int4_mm.c's AVX2 path)."""
    folder = tempfile.mkdtemp(prefix="h2o-chat-native-")  # private (0700): nobody else can swap the library
    try:
        path = Path(folder) / "h2o_chat_native.so"
        command = [os.environ.get("CC", "cc"), *FLAGS, *extra_flags, *map(str, SOURCES), "-o", str(path), *LIBRARIES]
        try:
            subprocess.run([*command, OPENMP], check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError:  # no OpenMP (Clang without libomp): the same kernels, one thread
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        library = ctypes.CDLL(str(path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    library.attend_one.argtypes = [i32, i32, i32, i32, i32, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_float,
                                   ptr, i64, ptr, ptr]
    library.rotate_one.argtypes = [i32, i32, i32, i32, i32, ptr, i64, i32, i32, i32, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    library.int4_mm.argtypes = [i32, i32, i32, ptr, i64, ptr, ptr, ptr, ptr, i64]
    library.dequant_int4.argtypes = [i32, i32, ptr, ptr, ptr]
    library.rms_tail.argtypes = [i32, i32, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr]
    library.rms_tail.restype = None
    library.attend_one.restype = library.rotate_one.restype = library.int4_mm.restype = library.dequant_int4.restype = i32
    return library


_torch_library = None  # the torch.library.Library that defines the ops, once a process (kept alive with it)
_c = None  # the C library the ops call: the latest one compiled


def register(library):
    """The ops over the C library's functions (CPU), with shape-only versions for tracing (Meta)."""
    global _torch_library, _c
    _c = library
    if _torch_library is None:
        _torch_library = torch.library.Library("h2o_chat", "DEF")
        _torch_library.define("attend_one(Tensor query, Tensor kv, Tensor? qp, Tensor(a!) scores, Tensor weights, "
                              "Tensor? empty, float scale, Tensor(b!) probs, Tensor(c!) out) -> ()")
        _torch_library.impl("attend_one", run_attend_one, "CPU")
        _torch_library.impl("attend_one", lambda *args: None, "Meta")
        _torch_library.define("rotate_one(Tensor y, int q_start, int k_start, int v_start, Tensor cos, "
                              "Tensor sin_flip, Tensor(a!) query, Tensor(b!) kv) -> ()")
        _torch_library.impl("rotate_one", run_rotate_one, "CPU")
        _torch_library.impl("rotate_one", lambda *args: None, "Meta")
        _torch_library.define("int4_mm(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor? scales_by_block=None) -> Tensor")
        _torch_library.impl("int4_mm", run_int4_mm, "CPU")
        _torch_library.impl("int4_mm", lambda x, packed, *scales: x.new_empty(x.shape[0], packed.shape[0]), "Meta")
        _torch_library.define("dequant_int4(Tensor packed, Tensor scales_and_zeros) -> Tensor")
        _torch_library.impl("dequant_int4", run_dequant_int4, "CPU")
        _torch_library.impl("dequant_int4", lambda packed, sz: sz.new_empty(packed.shape[1] * 2, packed.shape[0]), "Meta")
        _torch_library.define("rms_tail(Tensor x, Tensor sum_sq, Tensor weight, float count, float eps, Tensor(a!) out) -> ()")
        _torch_library.impl("rms_tail", run_rms_tail, "CPU")
        _torch_library.impl("rms_tail", lambda *args: None, "Meta")
    has_avx2 = library.int4_mm(0, 0, 0, None, 0, None, None, None, None, 0) != 1  # 1: built without AVX2
    ops = torch.ops.h2o_chat
    return Ops(direct(ops.attend_one.default, run_attend_one), direct(ops.rotate_one.default, run_rotate_one),
               direct(ops.int4_mm.default, run_int4_mm) if has_avx2 else None,
               direct(ops.dequant_int4.default, run_dequant_int4), direct(ops.rms_tail.default, run_rms_tail))


def direct(op, run):
    """The registered `op` as a plain function that eager code calls without torch's dispatcher:
    `run`, its CPU implementation, straight away (~2.3 us less a call, against 8.3 through the
    dispatcher for a small int4 matmul; 121 int4 matmuls and 60 other calls a token: a token of
    the embedded model 1.06-1.07x faster, docs/engine.md). While torch.compile traces, the op
    itself (opaque, with its Meta shapes); under the profiler, `run` inside a record_function
    named as the op, so `bench ops` still counts it."""
    name = op.name()

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(name):
                return run(*args)
        return run(*args)
    call.op = op
    return call


def run_attend_one(query, kv, qp, scores, weights, empty, scale, probs, out):
    """The op on a CPU: query [b, h * g, 1, d] bf16 (a row's heads adjacent), kv [2, b, h, cap, d]
    (keys then values, each contiguous: bf16, or uint8 codes with qp [4, b, h, cap] float16, each
    row contiguous), scores [b * h, 1, cap], weights [b * h, 1, g], empty [b or 1, 1, cap] or None,
    probs [b * h, g, cap], out [b * h, g, d]: attend_one.c's arguments."""
    _, b, h, cap, d = kv.shape
    if query.stride(1) != d or query.stride(-1) != 1:
        raise ValueError("attend_one: a row's query heads must be adjacent")
    values = kv.data_ptr() + kv.stride(0) * kv.element_size()
    status = _c.attend_one(b, h, weights.shape[-1], cap, d, query.data_ptr(), query.stride(0), kv.data_ptr(), values,
                           None if qp is None else qp.data_ptr(), 0 if qp is None else qp.stride(0),
                           scores.data_ptr(), weights.data_ptr(), scale, None if empty is None else empty.data_ptr(),
                           0 if empty is None or empty.shape[0] == 1 else empty.stride(0), probs.data_ptr(),
                           out.data_ptr())
    if status != 0:
        raise ValueError(f"attend_one: unsupported shapes (head_dim {d}, group {weights.shape[-1]})")


def run_rotate_one(y, q_start, k_start, v_start, cos, sin_flip, query, kv):
    """The op on a CPU: y [rows, width] bf16 (the q/k/v matmul's result, rows dense), the columns
    where q, k and v start, cos and sin_flip [rows, 1, 1, d] bf16 dense, query [rows, q_heads, 1,
    d] bf16 dense (written), kv [2, rows, kv_heads, cap, d] bf16, its last dim dense (slot cap - 1
    written): rotate_one.c's arguments."""
    rows, q_heads, _, d = query.shape
    _, kv_rows, kv_heads, cap, kv_d = kv.shape
    dense = cos.is_contiguous() and sin_flip.is_contiguous() and query.is_contiguous() and y.stride(-1) == kv.stride(-1) == 1
    if not dense or kv_rows != rows or kv_d != d or y.shape[0] != rows or y.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError("rotate_one: bf16 tensors of matching rows and head_dim, dense where it says so")
    if _c.rotate_one(rows, q_heads, kv_heads, d, cap, y.data_ptr(), y.stride(0), q_start, k_start, v_start,
                     cos.data_ptr(), sin_flip.data_ptr(), query.data_ptr(), kv.data_ptr(), *kv.stride()[:4]) != 0:
        raise ValueError(f"rotate_one: unsupported head_dim {d}")


def run_int4_mm(x, packed, scales_and_zeros, scales_by_block=None):
    """The op on a CPU: x [n, k] bf16 (rows dense), packed uint8 [out_pad, k / 2] in torch's CPU
    layout, scales_and_zeros bf16 [k / 32, out_pad, 2] (contiguous) -> [n, out_pad] bf16:
    aten._weight_int4pack_mm_for_cpu's arguments and result, group 32. scales_by_block: a
    symmetric weight's scales in the order the kernel reads them (packed.py), read instead of
    the pairs; the same result."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or not (packed.is_contiguous() and scales_and_zeros.is_contiguous()):
        raise ValueError("int4_mm: x must be bf16 with dense rows, the weight and its scales contiguous")
    if scales_by_block is not None and (scales_by_block.dtype != torch.bfloat16 or not scales_by_block.is_contiguous() or
                                        tuple(scales_by_block.shape) != (packed.shape[0] // 64, x.shape[1] // 32, 64)):
        raise ValueError("int4_mm: scales_by_block must be bf16 [out_pad / 64, k / 32, 64], contiguous")
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16)
    status = _c.int4_mm(x.shape[0], x.shape[1], packed.shape[0], x.data_ptr(), x.stride(0), packed.data_ptr(),
                        scales_and_zeros.data_ptr(), None if scales_by_block is None else scales_by_block.data_ptr(),
                        out.data_ptr(), out.stride(0))
    if status != 0:
        raise ValueError(f"int4_mm: unsupported shapes {tuple(x.shape)} x {tuple(packed.shape)} (status {status})")
    return out


def run_dequant_int4(packed, scales_and_zeros):
    """The op on a CPU: packed uint8 [out_pad, width / 2] in torch's CPU layout, scales_and_zeros
    bf16 [width / 32, out_pad, 2] -> W.T [width, out_pad] bf16: Int4Linear.weight_t's result."""
    out_pad, width = packed.shape[0], packed.shape[1] * 2
    if (packed.dtype != torch.uint8 or scales_and_zeros.dtype != torch.bfloat16 or not packed.is_contiguous()
            or not scales_and_zeros.is_contiguous() or tuple(scales_and_zeros.shape) != (width // 32, out_pad, 2)):
        raise ValueError("dequant_int4: a contiguous packed uint8 weight and its bf16 [width / 32, out_pad, 2] pairs")
    wt = torch.empty(width, out_pad, dtype=torch.bfloat16)
    if _c.dequant_int4(out_pad, width, packed.data_ptr(), scales_and_zeros.data_ptr(), wt.data_ptr()) != 0:
        raise ValueError(f"dequant_int4: unsupported shape {tuple(packed.shape)}")
    return wt


def run_rms_tail(x, sum_sq, weight, count, eps, out):
    """The op on a CPU: x [rows, hidden] float32 and sum_sq [rows] float32 (each row's sum of
    squares), weight [hidden] bf16 -> out [rows, hidden] bf16, all dense: rms_tail.c's arguments."""
    rows, hidden = x.shape
    if (x.dtype != torch.float32 or sum_sq.dtype != torch.float32 or weight.dtype != torch.bfloat16
            or out.dtype != torch.bfloat16 or sum_sq.numel() != rows or weight.numel() != hidden or out.shape != x.shape
            or not (x.is_contiguous() and sum_sq.is_contiguous() and weight.is_contiguous() and out.is_contiguous())):
        raise ValueError("rms_tail: dense float32 rows and sums, a bf16 weight and output of the rows' shape")
    _c.rms_tail(rows, hidden, x.data_ptr(), sum_sq.data_ptr(), count, eps, weight.data_ptr(), out.data_ptr())


def serves(kv, qp, dtype, group):
    """Whether attend_one can run a layer's step: a bf16 model on a CPU, its slots bf16 or 8-bit (qp their
    scales and zero points), laid out as attend_one.c reads them (keys then values each contiguous, and
    each of qp's rows: a cache's own buffers, or a batch's first rows), the shapes it handles."""
    _, b, h, cap, d = kv.shape
    width = kv.dtype == torch.bfloat16 or (kv.dtype == torch.uint8 and qp is not None and qp.dtype == torch.float16
                                            and all(row.is_contiguous() for row in qp))
    return (dtype == torch.bfloat16 and width and kv.device.type == "cpu" and kv[0].is_contiguous()
            and kv[1].is_contiguous() and group <= MAX_GROUP and d % LANES == 0 and LANES <= d <= MAX_DIM)
