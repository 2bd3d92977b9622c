"""Torch's intra-op threads belong to the thread that runs the model (models/threads.py): the main
thread runs no parallel op, and the model loads on a thread whose OpenMP team leaves with it.
Counted in a fresh interpreter (a team, once made, lives as long as its thread), in OS threads."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import os, threading, torch
from h2o_chat.models.threads import on_own_thread, single_threaded_here

def os_threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():  # large enough for torch to split it over its intra-op threads
    return torch.ones(4_000_000).add_(1).sum().item()

def settled(want, deadline_s=10):  # a team's workers exit just after their thread does
    import time
    end = time.monotonic() + deadline_s
    while os_threads() != want and time.monotonic() < end:
        time.sleep(0.05)
    return os_threads()

{body}
"""


def probe(body):
    code = PROBE.format(body=textwrap.dedent(body))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_parallel_op_on_the_main_thread_leaves_a_team_behind():
    # what the app did: the model's load ran parallel ops on the main thread, whose worker stays
    before, after = probe("""
        before = os_threads()
        parallel_op()
        print(before, os_threads())
    """)
    assert int(after) > int(before)


def test_a_load_on_its_own_thread_leaves_none():
    threads, value, main_threads, before, after = probe("""
        threads = single_threaded_here()
        before = os_threads()
        value = on_own_thread(parallel_op, threads)
        print(threads, value, torch.get_num_threads(), before, settled(before))
    """)
    assert (threads, float(value), main_threads) == ("2", 8_000_000.0, "1")
    assert after == before  # the loader and its team are gone


def test_a_load_that_fails_raises_on_the_caller():
    (message,) = probe("""
        def fail():
            raise ValueError("no-such-model")
        try:
            on_own_thread(fail, 2)
        except ValueError as e:
            print(e)
    """)
    assert message == "no-such-model"
