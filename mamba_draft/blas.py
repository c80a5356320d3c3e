"""CPU BLAS setup that has to happen before the first matrix multiply of the process."""
from __future__ import annotations

import os

# Why: on AMD CPUs MKL's default dispatch runs skinny GEMMs (2-16 rows: a tree verification, a few drafter
# rows) on a slow generic path; with conditional numerical reproducibility set to AUTO it takes its much faster AVX2
# path, while 1-row and large (training-sized) GEMMs stay within noise. MKL reads the variable at its first call,
# so setting it when the package is imported is early enough.
MKL_SETTING = ("MKL_CBWR", "AUTO")


def prefer_fast_mkl_paths() -> None:
    """Select MKL's CPU-specific kernels unless the user chose a setting (their MKL_CBWR always wins)."""
    name, value = MKL_SETTING
    os.environ.setdefault(name, value)
