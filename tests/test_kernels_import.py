"""The optional kernels' import: a Triton-only mamba-ssm install (its package __init__ fails) still gives the step."""
from __future__ import annotations

import sys
import textwrap

import pytest

from mamba_draft import kernels


def _fake_packages(root, scan_builds: bool) -> None:
    """mamba_ssm whose __init__ needs the compiled scan (present only if `scan_builds`), with a Triton step module
    that imports a sibling, and a causal_conv1d."""
    triton = root / "mamba_ssm" / "ops" / "triton"
    triton.mkdir(parents=True)
    (root / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda\n" if not scan_builds else "")
    (root / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (triton / "__init__.py").write_text("")
    (triton / "softplus.py").write_text("def softplus(x):\n    return ('softplus', x)\n")
    (triton / "selective_state_update.py").write_text(textwrap.dedent("""
        from mamba_ssm.ops.triton.softplus import softplus
        def selective_state_update(x):
            return softplus(x)
    """))
    (triton / "layer_norm.py").write_text("def rms_norm_fn(x):\n    return ('norm', x)\n")
    (root / "causal_conv1d").mkdir()
    (root / "causal_conv1d" / "__init__.py").write_text("def causal_conv1d_update(x):\n    return ('conv', x)\n")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """A sys.path with the fakes first, no cached kernels or modules before and after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = lambda: [n for n in sys.modules if n.split(".")[0] in ("mamba_ssm", "causal_conv1d")]  # noqa: E731
    for name in names():
        monkeypatch.delitem(sys.modules, name)
    kernels.load_kernels.cache_clear()
    yield tmp_path
    for name in names():
        del sys.modules[name]
    kernels.load_kernels.cache_clear()


@pytest.mark.parametrize("scan_builds", [True, False])
def test_step_kernel_loads_with_or_without_the_compiled_scan(isolated, scan_builds):
    _fake_packages(isolated, scan_builds)
    loaded = kernels.load_kernels()
    assert loaded is not None
    step, conv, norm = loaded
    assert step(3) == ("softplus", 3) and conv(4) == ("conv", 4) and norm(5) == ("norm", 5)


def test_no_kernels_without_the_step_module(isolated):
    _fake_packages(isolated, scan_builds=False)
    (isolated / "mamba_ssm" / "ops" / "triton" / "selective_state_update.py").unlink()
    assert kernels.load_kernels() is None
    assert not [n for n in sys.modules if n.startswith("mamba_ssm.")]  # nothing half-imported left behind


def test_no_kernels_without_causal_conv1d(isolated):
    _fake_packages(isolated, scan_builds=True)
    (isolated / "causal_conv1d" / "__init__.py").write_text("import causal_conv1d_cuda\n")
    assert kernels.load_kernels() is None
