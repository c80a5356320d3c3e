"""C kernels of the CPU target path, built with the machine's C compiler on first use (a second or two) and kept
under `cache_root()/kernels`, one library per source text, compiler, CPU and flags, so a second process loads the
library it finds. Loaded through ctypes; OpenMP links the libgomp torch already loaded, so the kernels run on
torch's own threads.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ..devices import c_compiler, cpu_info
from ..io import cache_root

FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
# speed only, each: the kernels' bits depend neither on the instructions picked nor on the threads; a compiler
# without -march=native or OpenMP still builds a portable or a one-thread kernel
ATTEMPTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())


class KernelUnavailable(RuntimeError):
    """No C compiler here, or the kernel did not build."""


def build(source: Path, purpose: str) -> ctypes.CDLL:
    """The library compiled from `source` (which may include other files of its directory), built once and cached;
    `purpose` names what needs it in the one-line error when no compiler can build it."""
    cc = c_compiler()
    if cc is None:
        raise KernelUnavailable(f"{purpose} on a CPU needs a C compiler (gcc or $CC) to build its kernel; install "
                                "gcc, or run the target in float32")
    texts = [p.read_bytes().hex() for p in sorted(source.parent.glob("*.c"))]  # the source and what it includes
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    identity = [source.name, texts, cc, version, FLAGS, ATTEMPTS, cpu_info("flags"), platform.machine()]
    digest = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    root = cache_root()
    directory = Path(tempfile.mkdtemp(prefix="mamba-draft-kernel-")) if root is None else root / "kernels"
    path = directory / f"{source.stem}-{digest}.so"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        for extra in ATTEMPTS:
            done = subprocess.run([cc, *FLAGS, *extra, "-I", str(source.parent), "-o", str(tmp), str(source), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, path)  # atomic: another process sees no library or a whole one
                if extra != ATTEMPTS[0]:  # slower kernels: say why, once (the library is then cached)
                    print(f"mamba-draft: the kernel for {purpose} built without {' '.join(ATTEMPTS[0])} (slower): "
                          f"{errors[:200]}", file=sys.stderr)
                break
            errors = " ".join(done.stderr.split())[:400]
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise KernelUnavailable(f"the kernel for {purpose} did not build with {cc}: {errors}")
    return ctypes.CDLL(str(path))


def loads(library: Callable[[], ctypes.CDLL]) -> bool:
    """Whether `library()` builds (or finds) its kernel and loads it here."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True
