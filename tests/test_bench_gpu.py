"""`python -m h2o_chat.bench gpu`: prepared for a session with a GPU; here it runs on this CPU
(`--device cpu --quick`, a tiny random Q4_0 file, inductor without CUDA graphs), and its
compiled == eager check is shown to fail when the compiled step computes something else. Without
CUDA (and no --device cpu) it says so: tests/test_bench.py."""

import pytest
import torch

from h2o_chat.bench import cli, gpu
from h2o_chat.models.compile import StepCompiler
from tests.conftest import make_tiny_llama, read_results
from tests.test_compile import WAIT_S, Traced


def test_the_check_passes_for_the_compiled_step_and_fails_for_a_wrong_one():
    # the traced graph runs the eager step's ops: the check passes; the same compiled step with
    # its logits off by 1e-3 (only where it ran compiled) fails it
    model = make_tiny_llama(torch.float32)
    assert gpu.check(model, StepCompiler(model, backend=Traced()), 40, 12, 20, 1e-5, WAIT_S)["ok"]
    wrong = StepCompiler(model, backend=Traced())
    run = wrong.run

    def off(*args):
        logits, compiled = run(*args)
        return (logits + 1e-3 if compiled else logits), compiled

    wrong.run = off
    found = gpu.check(model, wrong, 40, 12, 20, 1e-5, WAIT_S)
    assert not found["ok"] and found["compiled_steps"] == 39 and found["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert found["evicted_per_head"] > 0


@pytest.mark.slow
def test_bench_gpu_runs_end_to_end_on_this_cpu(tmp_path):
    # the command as a GPU session runs it, on a tiny random Q4_0 file on this CPU (inductor's C++
    # kernels compile: minutes on a loaded machine)
    cli.main(["--out", str(tmp_path), "gpu", "--device", "cpu", "--quick"])
    data = read_results(tmp_path, "gpu", plot=False)
    rows = data["rows"]
    assert [(r["batch"], r["arm"]) for r in rows] == [(b, a) for b in (1, 2) for a in ("eager", "compiled", "dynamic")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["ran"] == "compiled" and r["to_compiled_s"] > 0 for r in rows if r["arm"] == "compiled")
    (check,) = data["meta"]["checks"]
    assert check["ok"] and check["kept_ids_equal"] and check["compiled_steps"] == 59 and check["evicted_per_head"] > 0
