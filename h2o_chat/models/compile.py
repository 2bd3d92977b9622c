"""The compiled decode step, compiled off the user's path: a session starts on the eager step and
switches to the compiled one when it is ready.

    Compilation.compile           "auto" | "on" | "off": the one declaration of the setting (the
                                  app's --compile, ChatSession's and Batcher's compile=)
    step_compiler(model, mode, data_dir)  -> StepCompiler, or None for the eager step (one log line
                                  per model and reason when it is not the user's own "off")
    compiler.step()               -> CompiledStep: what a Decoder runs for a step of static shapes
                                  (Decoder.switch_to); its `kind` is what the stats line shows

What runs where:

- One StepCompiler per model, held by the model (every Decoder of it shares it: Dynamo's compiled code hangs on the
  code of `layers_step` and is guarded on the decoder it was traced with, the compiler's own).
- A step of a shape it has not compiled (`cache.step_shape()`: one conversation alone, or n
  stacked with some sitting out; the budget, the slots' dtype) runs eagerly, and asks the
  compiler's thread to compile that shape on a *replica* of the cache (`cache.replica()`: the same
  shapes, its own buffers), so Dynamo and inductor do their work on a throwaway, never on the
  user's thread and never on the user's buffers. The replica is made on the thread that runs the
  step, under the same grad/inference mode and intra-op threads (Dynamo guards on the mode;
  inductor writes the thread count into its C++ kernels).
- Once the compiled code for a shape exists, the compiler adds the shape to `ready` (one reference
  assignment of a new frozenset). A step reads `ready` once: a shape in it runs through
  `torch._dynamo.run`, which runs compiled code whose guards pass and never compiles (a cache that
  differs in something the shape does not say runs eagerly, and `kind` says "eager": the count of
  compiled graphs run on this thread says what ran, not the shape). Dynamo installs a compiled
  entry only after the compile has finished, and `ready` gains the shape after that, so no step
  can see half a compile. Dynamo's frame hook is per thread: the compiler's thread compiling does
  not make the user's thread trace anything (tests/test_compile.py checks both).
- Compiled artifacts go to `<data_dir>/compiled` (inductor's cache folder, TORCHINDUCTOR_CACHE_DIR,
  unless the environment sets one): a second start finds its kernels there (inductor's FX graph
  and AOTAutograd caches; Dynamo's tracing is done again, in the background).
- "auto" compiles on CUDA only, with CUDA graphs (mode="reduce-overhead"): on this project's CPU
  inductor's step ran at 0.89x the eager one (docs/engine.md), so a CPU stays eager and says so
  in one log line. "on" compiles on any device. A model the lean step cannot run
  (Decoder.why_not), or whose first compile fails, stays eager with one log line; a shape that
  fails after another compiled stays eager alone, also said once (`StepCompiler.fail`).

On CUDA the buffers a step writes in place (the cache's slots, the decode step's and the norms'
scratch) are marked static inputs (`torch._dynamo.mark_static_address`, unguarded), or CUDA graphs
would be skipped for mutating inputs; a buffer at a new address (another conversation's cache)
makes cudagraph trees record again (not compile again). The compiled step's logits are cloned out
of the graph's output buffer, which the next replay overwrites. None of this has run on a GPU yet:
`python -m h2o_chat.bench gpu` is the check.
"""

import collections
import logging
import os
import threading
import time
import types
import weakref
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..cache.config import check_fields, setting
from .decode import Decoder, unsupported

MODES = ("auto", "on", "off")
CACHE_FOLDER = "compiled"  # inside the app's data folder
log = logging.getLogger("h2o_chat")


@dataclass(frozen=True)
class Compilation:
    """Whether the decode step is compiled: the one declaration of the setting (see cache.config.setting)."""

    compile: str = setting("auto", "compile the decode step in the background and switch to it when it is ready: "
                           "auto on a CUDA GPU only (CUDA graphs; on a CPU the compiled step was slower), on for any "
                           "device, off never", label="Compile", choices=MODES)

    def __post_init__(self):
        check_fields(self)


def check_mode(mode):
    """`mode` if it is one of MODES, else ValueError naming the choices."""
    return Compilation(mode).compile


OWNED_AS = "_h2o_step_compiler"  # the model's attribute holding its StepCompiler (it lives and dies with the model)
_said = weakref.WeakKeyDictionary()  # model -> the reasons already logged for it
_made = threading.Lock()


def step_compiler(model, mode, data_dir=None, **options):
    """The model's StepCompiler when `mode` compiles it on its device; None: the eager step (with one
    log line per model and reason, unless `mode` is "off"). options: StepCompiler's, for the call
    that makes it (tests give a backend)."""
    why = eager_reason(model, check_mode(mode))
    if why is not None:
        if mode != "off":
            say_once(model, f"h2o-chat: the decode step stays eager: {why}")
        return None
    with _made:
        compiler = getattr(model, OWNED_AS, None)
        if compiler is None:
            compiler = StepCompiler(model, data_dir, **options)
            setattr(model, OWNED_AS, compiler)
    return compiler if compiler.failed is None else None


def eager_reason(model, mode):
    """Why `mode` leaves `model`'s decode step eager (None: it compiles)."""
    if mode == "off":
        return "compile is off"
    why_not = unsupported(model)
    if why_not is not None:
        return f"the lean step cannot run this model ({why_not})"
    compiler = getattr(model, OWNED_AS, None)
    if compiler is not None and compiler.failed is not None:
        return compiler.failed
    device = next(model.parameters()).device.type
    if mode == "auto" and device == "cpu":
        return ("compile auto compiles on a CUDA GPU only: on a CPU inductor's compiled step ran at 0.89x the "
                "eager one's speed (docs/engine.md); compile on compiles anyway")
    if mode == "auto" and device != "cuda":
        return f"compile auto compiles on a CUDA GPU only, and the model is on {device}; compile on compiles anyway"
    return None


def say_once(model, line):
    said = _said.setdefault(model, set())
    if line not in said:
        said.add(line)
        log.warning(line)


def use_cache_folder(data_dir):
    """Inductor's on-disk cache in `data_dir`/compiled, unless the user named one in the environment
    (inductor writes its default, a folder in /tmp, back into the variable at its first use: that
    one is not the user's). It is read per compile, process-wide: the first data folder keeps it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if data_dir is None or (named is not None and os.path.abspath(named) != os.path.abspath(default_cache_dir())):
        return
    folder = Path(data_dir).expanduser() / CACHE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def own_code(method):
    """`method` (a bound method) over a copy of its function's code object. Dynamo keeps compiled
    code per code object, and stops compiling one after recompile_limit (8) entries: each
    compiler's (one per model) are then its own, not shared with every other model's."""
    f = method.__func__
    return types.MethodType(types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                                               f.__closure__), method.__self__)


_ran = threading.local()  # .graphs: compiled graphs this thread has run (what `CompiledStep.kind` reads)


def graphs_run():
    return getattr(_ran, "graphs", 0)


def counting(backend):
    """`backend` (a torch.compile backend), whose compiled graphs count their runs on the running thread."""

    def compile_graph(graph, example_inputs):
        run = backend(graph, example_inputs)

        def counted(*args):
            _ran.graphs = graphs_run() + 1
            return run(*args)

        counted._boxed_call = getattr(run, "_boxed_call", False)  # called as `run` is (a list of inputs, or *args)
        return counted

    return compile_graph


@dataclass
class Job:
    """A shape to compile: a replica of the cache it was asked for, with the step's inputs."""

    shape: tuple
    token_ids: torch.Tensor  # [rows, 1]
    positions: torch.Tensor  # [rows]
    cache: object  # the replica
    inference: bool  # the step ran under torch.inference_mode
    grad: bool  # and with grad mode on (Dynamo guards on both)
    threads: int  # its intra-op threads
    steps_inference: bool  # the user's decode steps (cache.begin's) are inference tensors
    scratch_inference: bool  # and the user's norm scratch


class StepCompiler:
    """One model's decode step (`Decoder.layers_step`) compiled in a thread of its own, shape by
    shape, as steps ask for them (see the module's notes). busy: its thread is compiling; ready:
    the shapes compiled; compiles: (shape, seconds) each; failed: None, or why it stopped (the
    sentence logged: every step is eager from then on). A shape asked for and not ready once the
    thread is idle failed on its own and stays eager (`fail`)."""

    def __init__(self, model, data_dir=None, **options):
        self.model, self.decoder = model, Decoder(model)
        self.cudagraphs = next(model.parameters()).device.type == "cuda"
        use_cache_folder(data_dir)
        backend = options.pop("backend", None)
        if backend is None:  # inductor, as torch.compile makes it (CUDA graphs on a GPU)
            backend = torch._TorchCompileInductorWrapper("reduce-overhead" if self.cudagraphs else None, None, False)
        self.compiled = torch.compile(own_code(self.decoder.layers_step), backend=counting(backend), dynamic=False,
                                      fullgraph=True, **options)
        self.run_only = torch._dynamo.run(self.compiled)  # compiled code where its guards pass, else eager; never compiles
        self.ready = frozenset()  # shapes whose compiled code exists: replaced whole, never changed in place
        self.asked = set()  # shapes asked for (read and written under _lock)
        self.compiles = []  # (shape, seconds) per compiled shape
        self.failed = None
        self.busy = False  # the compiler's thread is running (it runs while jobs are queued)
        self._lock = threading.Lock()  # guards asked, busy and _jobs
        self._jobs = collections.deque()

    def step(self):
        """A CompiledStep for one Decoder (Decoder.switch_to)."""
        return CompiledStep(self)

    def run(self, token_ids, positions, cache, scratch):
        """`layers_step` for a cache with static shapes: (logits [rows, vocab] float32, compiled: bool)."""
        shape = (cache.step_shape(), token_ids.shape[0], torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        if self.failed is None and shape in self.ready:  # one read of `ready`: a shape is in it or not
            before = graphs_run()
            logits = self.run_only(token_ids, positions, cache, scratch)
            if graphs_run() > before:
                return (logits.clone() if self.cudagraphs else logits), True  # the graph's buffer is the next replay's
            return logits, False
        self.ask(shape, token_ids, positions, cache, scratch)
        return self.decoder.layers_step(token_ids, positions, cache, scratch), False

    def ask(self, shape, token_ids, positions, cache, scratch):
        """Compile `shape` in the compiler's thread (once), on a replica of `cache` made here."""
        with self._lock:
            if self.failed is not None or shape in self.asked:
                return
            if len(self.asked) >= torch._dynamo.config.recompile_limit:  # Dynamo compiles no more for this code
                return
            self.asked.add(shape)
        try:  # each copy an inference tensor where its original is one (Dynamo guards on the dispatch keys)
            with torch.inference_mode(cache.decode_steps()[0].values.is_inference()):
                replica = cache.replica()
            token_ids, positions = (copied(x) for x in (token_ids, positions))
        except Exception as e:  # never the user's step's failure: it runs eagerly
            self.fail(e, shape)
            return
        # Decoder.step makes the decode steps' views (cache.begin) and the norms' scratch before it
        # enters inference_mode for the tensor work: the replica's are made as the user's were
        made_inference = (cache.decode_steps()[0].out.is_inference(), scratch.wide.is_inference())
        job = Job(shape, token_ids, positions, replica, torch.is_inference_mode_enabled(), torch.is_grad_enabled(),
                  torch.get_num_threads(), *made_inference)
        with self._lock:
            self._jobs.append(job)
            if not self.busy:  # the thread ends when it has nothing left (so a dropped model can be freed)
                self.busy = True
                threading.Thread(target=self._loop, daemon=True, name="h2o-compile").start()

    def _loop(self):
        while True:
            with self._lock:
                if not self._jobs:
                    self.busy = False
                    return
                job = self._jobs.popleft()
            try:
                self._compile(job)
            except Exception as e:  # any model, dtype, device or shape it cannot compile: eager, said once
                self.fail(e, job.shape)

    def fail(self, error, shape):
        """A compile of `shape` failed. Before any shape has compiled, that is taken to be about the
        model, dtype or device (no compiler, an op inductor cannot lower): every step stays eager,
        and nothing is compiled again. After one has, it is about the shape: that shape stays eager
        (it is never asked for again) and the compiled ones keep running."""
        error = getattr(error, "inner_exception", None) or error  # Dynamo's wrapper says only "backend raised"
        first_line = str(error).splitlines()[0] if str(error) else ""
        why = f"compiling it failed ({type(error).__name__}: {first_line})"
        if self.ready:
            say_once(self.model, f"h2o-chat: one shape of the decode step stays eager ({describe(shape)}): {why}")
            return
        self.failed = why
        say_once(self.model, f"h2o-chat: the decode step stays eager: {self.failed}")

    def _compile(self, job):
        if torch.get_num_threads() != job.threads:
            torch.set_num_threads(job.threads)
        start = time.perf_counter()
        cache, rows = job.cache, job.token_ids.shape[0]
        with torch.inference_mode(job.scratch_inference), torch.no_grad():  # inference_mode(False) turns grad on
            scratch = self.decoder.scratch(rows, job.token_ids.device)
        with torch.inference_mode(job.steps_inference), torch.no_grad():
            cache.begin(1)
        if not cache.static_step:
            raise RuntimeError("the replica of a cache with static shapes has none")
        if self.cudagraphs:
            mark_static(cache, scratch)
        with torch.inference_mode(job.inference), torch.set_grad_enabled(job.grad):
            self.compiled(job.token_ids, job.positions, cache, scratch)
        with torch.inference_mode(job.steps_inference), torch.no_grad():
            cache.end()
        self.compiles.append((job.shape, time.perf_counter() - start))
        self.ready = self.ready | {job.shape}  # after Dynamo installed the code: the switch, one assignment

    def wait(self, timeout):
        """Block until nothing is being compiled (True) or `timeout` seconds pass (False): for tests
        and benchmarks; the app never waits."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.busy


class CompiledStep:
    """What one Decoder runs for a step of static shapes (Decoder.switch_to): the model's compiled
    step where it is ready, else the eager one. `kind`: what ran at this decoder's last such step,
    "compiled", or "compiling" (eager, while the compiler works), or "eager"."""

    def __init__(self, compiler):
        self.compiler, self.ran_compiled = compiler, False

    def __call__(self, token_ids, positions, cache, scratch):
        logits, self.ran_compiled = self.compiler.run(token_ids, positions, cache, scratch)
        return logits

    @property
    def kind(self):
        if self.ran_compiled:
            return "compiled"
        return "compiling" if self.compiler.busy else "eager"


def describe(shape):
    """StepCompiler.run's shape key in words, for a log line: the cache's kind and the rows."""
    cache_shape, rows = shape[0], shape[1]
    return f"{cache_shape[0]}, {rows} row{'s' if rows != 1 else ''}"


def copied(x):
    """A contiguous copy of `x` (as the app's tokens come: a [1, 1] view of a longer row has other
    strides, a guard), an inference tensor where `x` is one."""
    with torch.inference_mode(x.is_inference()):
        return x.clone(memory_format=torch.contiguous_format)


def step_kind(decoder):
    """Which step `decoder` runs: "eager", "compiling" or "compiled" (CompiledStep.kind)."""
    return getattr(decoder.compiled, "kind", "eager")


def mark_static(cache, scratch):
    """CUDA graphs: the tensors a step writes in place (every DecodeStep's and Eviction's, the norms' scratch) are
    static inputs, unguarded (a new address records the graph again; it does not compile again)."""
    steps, evictions = cache.decode_steps(), cache.evictions()
    for holder in [*steps, *(s.int8 for s in steps if s.int8 is not None), *evictions,
                   *(m for e in evictions for m in e.moves), scratch]:
        for f in fields(holder):
            value = getattr(holder, f.name)
            if isinstance(value, torch.Tensor):
                torch._dynamo.mark_static_address(value, guard=False)
