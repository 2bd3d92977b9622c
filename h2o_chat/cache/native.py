"""One new token's attention as one C function (attend_one.c), for a bf16 model's decode step on a
CPU, over bf16 or 8-bit slots: the op `torch.ops.h2o_chat.attend_one`, which step.py's `attend`
runs in place of its aten ops.

Why: a decode step's attention on a CPU is small work in many launches; measured on the embedded
model (2 cores, budget 512), these ops took 82-130 us a layer, the C function 38, and a whole
token 1.25x less time (docs/engine.md).

How it gets here: at the first use in a process (a bf16 model's `Decoder`, made when the app
starts), attend_one.c is compiled by the system's C compiler (`$CC`, else `cc`; ~1.5 s at -O3,
whose kernel is 1.2x -O2's) for this machine (-march=native) into a private temporary
folder, loaded with ctypes, and the folder removed (the loaded library stays mapped). Where there
is no compiler, the compile fails, or the CPU is not x86-64 or ARM64, `attend_one()` is None, one
log line says why, and the aten ops run; H2O_CHAT_NATIVE=0 chooses them (the same results within
rounding: tests/test_native.py).

The op is registered with torch (a schema that says which tensors it writes), so the profiler
counts it as one op and torch.compile treats it as one opaque call.
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attend_one.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]  # no -ffast-math: see attend_one.c
OPENMP = "-fopenmp"  # heads in parallel on torch's own OpenMP threads; a compiler without it builds one thread
MAX_GROUP, MAX_DIM, LANES = 16, 256, 16  # attend_one.c's limits
log = logging.getLogger("h2o_chat")
_loading = threading.Lock()  # one compile a process, whichever thread asks first (the others wait for it)


def attend_one():
    """The op (torch.ops.h2o_chat.attend_one.default), or None: H2O_CHAT_NATIVE=0 is set (read at each
    call: a cache makes its layers' steps once, not once a token), or the C function is not available."""
    if os.environ.get("H2O_CHAT_NATIVE", "1") == "0":
        return None
    with _loading:
        return loaded()


@functools.cache
def loaded():
    """The op, compiled and registered at the first call in a process; None, said once, where it cannot be."""
    why = why_not_native()
    if why is None:
        try:
            function = compiled()
        except (OSError, subprocess.SubprocessError) as e:
            why = f"compiling attend_one.c failed ({type(e).__name__}: {first_line(e)})"
    if why is not None:
        log.warning("h2o-chat: attention runs as aten ops: %s", why)
        return None
    return register(function)


def why_not_native():
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"no native attention for {platform.machine()}"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')})"
    return None


def first_line(error):
    text = getattr(error, "stderr", None) or str(error)
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    return text.strip().splitlines()[0] if text.strip() else ""


def compiled():
    """attend_one.c compiled and loaded: its C function, with ctypes' argument types."""
    folder = tempfile.mkdtemp(prefix="h2o-chat-native-")  # private (0700): nobody else can swap the library
    try:
        library = Path(folder) / "attend_one.so"
        compiler = os.environ.get("CC", "cc")
        try:
            subprocess.run([compiler, *FLAGS, OPENMP, str(SOURCE), "-o", str(library)], check=True,
                           capture_output=True, timeout=120)
        except subprocess.CalledProcessError:  # no OpenMP (Clang without libomp): the same kernel, one thread
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(library)], check=True, capture_output=True,
                           timeout=120)
        function = ctypes.CDLL(str(library)).attend_one
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [i32, i32, i32, i32, i32, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_float, ptr, i64, ptr, ptr]
    function.restype = i32
    return function


_library = None  # the torch.library.Library that defines the op, once a process (kept alive with it)
_function = None  # the C function it calls: the latest one compiled


def register(function):
    """torch.ops.h2o_chat.attend_one over the C function (CPU), and a no-op for tracing (Meta)."""
    global _library, _function
    _function = function
    if _library is None:
        _library = torch.library.Library("h2o_chat", "DEF")
        _library.define("attend_one(Tensor query, Tensor kv, Tensor? qp, Tensor(a!) scores, Tensor weights, "
                        "Tensor? empty, float scale, Tensor(b!) probs, Tensor(c!) out) -> ()")
        _library.impl("attend_one", run, "CPU")
        _library.impl("attend_one", lambda *args: None, "Meta")
    return torch.ops.h2o_chat.attend_one.default


def run(query, kv, qp, scores, weights, empty, scale, probs, out):
    """The op on a CPU: query [b, h * g, 1, d] bf16 (a row's heads adjacent), kv [2, b, h, cap, d]
    (keys then values, each contiguous: bf16, or uint8 codes with qp [4, b, h, cap] float16, each
    row contiguous), scores [b * h, 1, cap], weights [b * h, 1, g], empty [b or 1, 1, cap] or None,
    probs [b * h, g, cap], out [b * h, g, d]: attend_one.c's arguments."""
    _, b, h, cap, d = kv.shape
    if query.stride(1) != d or query.stride(-1) != 1:
        raise ValueError("attend_one: a row's query heads must be adjacent")
    values = kv.data_ptr() + kv.stride(0) * kv.element_size()
    status = _function(b, h, weights.shape[-1], cap, d, query.data_ptr(), query.stride(0), kv.data_ptr(), values,
                       None if qp is None else qp.data_ptr(), 0 if qp is None else qp.stride(0),
                       scores.data_ptr(), weights.data_ptr(), scale, None if empty is None else empty.data_ptr(),
                       0 if empty is None or empty.shape[0] == 1 else empty.stride(0), probs.data_ptr(), out.data_ptr())
    if status != 0:
        raise ValueError(f"attend_one: unsupported shapes (head_dim {d}, group {weights.shape[-1]})")


def serves(kv, qp, dtype, group):
    """Whether the op can run a layer's step: a bf16 model on a CPU, its slots bf16 or 8-bit (qp their
    scales and zero points), laid out as attend_one.c reads them (keys then values each contiguous, and
    each of qp's rows: a cache's own buffers, or a batch's first rows), the shapes it handles."""
    _, b, h, cap, d = kv.shape
    width = kv.dtype == torch.bfloat16 or (kv.dtype == torch.uint8 and qp is not None and qp.dtype == torch.float16
                                            and all(row.is_contiguous() for row in qp))
    return (dtype == torch.bfloat16 and width and kv.device.type == "cpu" and kv[0].is_contiguous()
            and kv[1].is_contiguous() and group <= MAX_GROUP and d % LANES == 0 and LANES <= d <= MAX_DIM)
