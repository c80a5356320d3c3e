"""Importing the package selects MKL's CPU-specific kernels before any GEMM, and never overrides the user."""
import os
import subprocess
import sys

import pytest

PROBE = "import os, mamba_draft; print(os.environ.get('MKL_CBWR'))"


def _probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if env_value is not None:
        env["MKL_CBWR"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("preset, expected", [(None, "AUTO"), ("COMPATIBLE", "COMPATIBLE")])
def test_import_sets_mkl_dispatch_unless_user_chose(preset, expected):
    assert _probe(preset) == expected


def test_cli_entry_sets_it_before_torch_runs_a_gemm():
    # the console script imports mamba_draft.commands.cli, so mamba_draft's __init__ runs first
    code = "import os, mamba_draft.commands.cli; print(os.environ.get('MKL_CBWR'))"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "AUTO"
