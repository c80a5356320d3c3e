"""CPU BLAS setup that has to happen before the first matrix multiply of the process."""
from __future__ import annotations

import os

# Why: on AMD CPUs MKL's default dispatch runs skinny GEMMs (2-16 rows: a tree verification, a few drafter
# rows) on a slow generic path. With conditional numerical reproducibility set to AUTO it takes its AVX2 path:
# on a 2-core EPYC the SmolLM2-135M head (49152 x 576) at 2 / 4 / 8 rows went 22 / 23 / 21 ms -> 13 / 14 / 15 ms
# and a 2-token target forward 119 -> 77 ms, while 1-row and large (training-sized) GEMMs stay within noise.
# MKL reads the variable at its first call, so setting it when the package is imported is early enough.
MKL_SETTING = ("MKL_CBWR", "AUTO")


def prefer_fast_mkl_paths() -> None:
    """Select MKL's CPU-specific kernels unless the user chose a setting (their MKL_CBWR always wins)."""
    name, value = MKL_SETTING
    os.environ.setdefault(name, value)
