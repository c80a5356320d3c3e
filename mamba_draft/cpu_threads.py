"""Letting a thread's OpenMP workers go, so that the thread that decodes next has the cores to itself.

torch's CPU kernels and the compiled steps share one OpenMP runtime (the libgomp torch loads), in which every thread
that runs a parallel region keeps a team of worker threads afterwards. Once the process holds more such threads than
it has cores (the thread that loaded the models, plus a server's engine thread, on 2 cores), libgomp stops spinning
between regions and puts workers to sleep at every one: a step of ~270 small regions ran 6x slower (4.4 -> 28 ms,
SmolLM2-135M, 2 cores) until the idle thread's team was released.
"""
from __future__ import annotations

import ctypes
import os

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: the calling thread's workers end, its next region starts new ones
RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so")


def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """The OpenMP runtimes this process has loaded by now (never a new one) that can pause: torch's, and another where
    a compiled step linked its own (asked each time: a runtime may load later; a lookup costs microseconds)."""
    found = []
    for name in RUNTIMES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):  # not loaded; os.RTLD_NOLOAD is missing off POSIX
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            found.append(lib)
    return tuple(found)


def release_openmp_workers() -> bool:
    """End the calling thread's idle OpenMP workers (call it outside any parallel region, when the thread is done
    computing for a while). Returns whether a runtime did so."""
    return any([lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0 for lib in _runtimes()])
