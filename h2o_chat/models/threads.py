"""Torch's intra-op threads belong to one thread of the app: the one that runs the model.

Why: torch's OpenMP (libgomp on Linux) gives every Python thread that runs a parallel op a team of
worker threads of its own, kept until that thread exits. After each parallel region the workers
spin a while, so the next op starts without waking them; but once the process holds more such
threads than CPUs, libgomp barely spins ("throttled"), and every op pays a wake-up. The app loaded
the model on its main thread (one team, kept for the life of the process) and decoded on the
batcher's thread (a second): on 2 cores a decode step of the embedded model took 24.6 ms instead
of 15.2, and a reply streamed at ~36 tokens/s where the same session alone makes ~59
(`tests/test_threads.py` holds the rule; docs/engine.md has the measurements).

So the main thread never runs a parallel op (`single_threaded_here` before any torch work), the
model loads on a thread that exits with its team (`on_own_thread`), and the batcher's thread runs
every forward with the CPU's threads (chat/batch.py).
"""

import threading

import torch


def single_threaded_here():
    """Make this thread run torch ops on one thread, before it has run any in parallel; returns the
    intra-op threads torch would have used (what the model's own thread should get)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def on_own_thread(work, threads):
    """work() on a new thread running `threads` intra-op threads, which then exits; its result, or
    its exception raised here."""
    result = {}

    def run():
        torch.set_num_threads(threads)
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            result["error"] = e

    thread = threading.Thread(target=run, name="h2o-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
