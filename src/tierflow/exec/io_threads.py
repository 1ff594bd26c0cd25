"""The threads that move bytes between tiers, beside the compute: one way to make them.

A transfer thread is a Python thread: between its system calls (a read or write per tensor,
a copy into a bounce buffer) it needs the interpreter lock, which the compute thread holds
whenever it runs Python (module code, saved-tensor hooks, the plan's dispatch). The
interpreter hands the lock over only every ``sys.getswitchinterval()`` seconds, 5 ms by
default, so each system call of a transfer could wait up to 5 ms to go on. Measured on a
2-core AMD EPYC (``benchmarks/lock_wait.py``): a 28 MB stage read by direct I/O (9 tensors)
took 13.6 ms alone and 70.8 ms beside a thread running Python; with a 0.5 ms interval
20.7 ms, and the thread running Python lost nothing measurable. In W1 at 25% (every weight, state and tape on the disk) the compute
waited on those reads: 16.1 s of compute per step against 13.7 s at 0.5 ms, the 13.75 s the
plan predicts.

So making a transfer thread lowers the process's switch interval to ``SWITCH_INTERVAL_S``
(never raises it): a process-wide setting, like the ``THP_MEM_ALLOC_ENABLE`` that importing
tierflow sets, kept for the rest of the process.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

SWITCH_INTERVAL_S = 0.0005


def responsive_switching() -> None:
    """Lower the interpreter's switch interval to ``SWITCH_INTERVAL_S`` if it is longer."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


def transfer_thread(name: str) -> ThreadPoolExecutor:
    """A single thread for one kind of transfer (its threads are named ``name``-N), with the
    interpreter switching often enough for it to keep up with the disk."""
    responsive_switching()
    return ThreadPoolExecutor(1, thread_name_prefix=name)
