"""The 'fused' backend (mamba_draft/fused_step.py: our Triton kernels, a few a layer) run without a GPU, in Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors, against the torch step; and the kernels a step launches.

The interpreter executes the kernels' own code, so what they compute from their arguments (layouts, strides, masks,
dtypes) is checked here; it runs a launch's programs one after another, so what only a GPU shows (races between
programs, compilation, speed, CUDA graphs) is not: mamba_draft/benchmarks/gpu_timings.py times and profiles it on a GPU.
Tolerances are tests/test_kernels_triton.py's (see its docstring): fp32 within FP32_TOLERANCE of the torch step
(measured: at most 3.8e-6 apart on logits of ~20); bf16 no further from the fp32 drafter (the same bf16-rounded
weights, upcast) than BF16_FACTOR times the bf16 torch step is. The fused step keeps fp32 between its launches, but
the interpreter rounds fp32 to bf16 toward zero (a GPU to nearest), so its bf16 stores (the conv state, a bf16 SSM
state or residual stream) can be a whole bf16 step off: measured, at most 1.8 times the torch step's distance.
Wrong kernels tried: D dropped from y moved the fp32 logits by 1.4 (Mamba-1) and 9 (Mamba-2); Mamba-2 reading the
B/C group of head h as h % ngroups (not h // heads per group) by 1.3: 10^4 times the fp32 bound, over 20 times the
bf16 torch step's distance.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mamba_draft
from mamba_draft import MambaConfig, MambaDrafter
from tests.test_kernels_triton import BF16_FACTOR, FP32_TOLERANCE
from tests.test_kernels_triton import drafter as kernel_check_drafter

REPO = Path(__file__).resolve().parents[1]
VOCAB = 64
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (scripts/setup.sh installs the kernel-check extra)")
# Triton decides at its first import whether its kernels run interpreted (an earlier test of a suite may have imported
# it compiled), so the kernels run in a fresh process that starts with TRITON_INTERPRET=1.
FRESH = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not FRESH,
                                 reason="run in a fresh process by test_interpreted_checks_in_a_fresh_process")


def test_interpreted_checks_in_a_fresh_process():
    if FRESH:
        pytest.skip("this is the fresh process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", __file__],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.startswith("15 passed, 1 skipped"), summary  # every check ran; only this test skipped there


def drafter(arch: str, dtype: torch.dtype = torch.float32, state_dtype: torch.dtype | None = torch.float32,
            **options) -> MambaDrafter:
    """tests/test_kernels_triton.py's random drafter (its parameters all matter), with an active dt_limit for
    Mamba-2 unless `options` say otherwise."""
    return kernel_check_drafter(arch, dtype, state_dtype, **({"dt_limit": (0.004, 0.05)} | options))


def drafting_run(model: MambaDrafter, backend: str) -> dict[str, torch.Tensor]:
    """Prefill 3 rows of an 8-row state (torch either way), step rows [0:3] twice, fork rows [3:8] from them and
    step those (a row range at an offset, 5 rows: two blocks of rows), then rows [0:3] again. Returns every step's
    logits and the final conv and SSM states (all 8 rows: rows a step does not own must stay untouched)."""
    model.set_backend(backend)
    g = torch.Generator().manual_seed(1)
    ids = lambda rows: torch.randint(0, VOCAB, (rows,), generator=g)  # noqa: E731
    state = model.allocate_state(8)
    out = {"prefill": model.prefill(torch.randint(0, VOCAB, (3, 6), generator=g), state=state)[0]}
    for i in range(2):
        out[f"step {i}"] = model.step(ids(3), state)
    state.gather_(3, torch.tensor([0, 1, 2, 2, 0]))
    out["step on rows [3:8]"] = model.step(ids(5), state.rows(3, 8))
    out["last step"] = model.step(ids(3), state)
    model.set_backend("torch")
    return {**out, "conv state": state.conv, "SSM state": state.ssm}


def options_run(model: MambaDrafter, backend: str) -> dict[str, torch.Tensor]:
    """Steps of a drafter that reads the target: the target's features for some rows' steps, the stand-in for
    others, with the final-norm states ('own' features) and a draft vocabulary's logits."""
    model.set_backend(backend)
    g = torch.Generator().manual_seed(3)
    hidden = model.config.target_hidden_size
    state = model.allocate_state(4)
    model.prefill(torch.randint(0, VOCAB, (3, 5), generator=g), state=state)
    out = {}
    for i, features in enumerate([torch.randn(3, hidden, generator=g).to(model.dtype), None]):
        out[f"logits {i}"], out[f"hidden {i}"] = model.step(torch.randint(0, VOCAB, (3,), generator=g), state,
                                                             features=features, with_hidden=True)
    model.set_backend("torch")
    return {**out, "conv state": state.conv, "SSM state": state.ssm}


def assert_fused_step_matches_torch_step(model: MambaDrafter, run) -> None:
    """`run`'s tensors by the fused step against the torch step's: within FP32_TOLERANCE for fp32 weights; for bf16
    weights, no further from the fp32 drafter than BF16_FACTOR times the bf16 torch step is."""
    got, want = run(model, "fused"), run(model, "torch")
    assert got.keys() == want.keys()
    if model.dtype == torch.float32:
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE,
                                       msg=lambda m: f"{name}: {m}")
        return
    exact = run(copy.deepcopy(model).float(), "torch")
    for name in got:
        fused_error, torch_error = ((t.float() - exact[name]).abs().max().item() for t in (got[name], want[name]))
        assert fused_error <= BF16_FACTOR * torch_error + FP32_TOLERANCE, (
            f"{name}: the fused step is {fused_error:.3g} from the fp32 drafter, the torch step {torch_error:.3g}")


@interpreted
@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, None)], ids=["fp32", "bf16", "bf16-state"])
@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_fused_step_matches_torch_step(arch, dtype, state_dtype):
    """Mamba-1 and Mamba-2 (2 groups, a dt_limit inside the drafter's dt range: the clamp is active), fp32 and bf16
    weights with an fp32 state, and a state in the weights' bf16 (loaded and stored in bf16, computed in fp32)."""
    assert_fused_step_matches_torch_step(drafter(arch, dtype, state_dtype), drafting_run)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_fused_step_options_match_torch_step(arch, dtype):
    """The config options the torch step handles, flipped from their defaults: projection biases on, the conv's
    off, the residual stream in the weights' dtype, an untied head; a drafter that reads the target (its `embed` in
    torch, the first layer reading that), a draft vocabulary, and the final-norm states returned."""
    model = drafter(arch, dtype, bias=True, conv_bias=False, residual_in_fp32=False, tie_embeddings=False,
                    target_hidden_size=8)
    model.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:20])
    assert_fused_step_matches_torch_step(model, options_run)


class ComputeOps(TorchDispatchMode):
    """The aten ops that launch a kernel (`ops`: not views, not allocations, which go to `allocations`), none
    inside a Triton launch (there the interpreter copies its arguments: `counting_launches` pauses the count)."""

    ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.allocations: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (self.paused or func.is_view):
            (self.allocations if func in self.ALLOCATIONS else self.ops).append(str(func))
        return func(*args, **(kwargs or {}))


@interpreted
@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_kernels_per_step(arch, monkeypatch):
    """One step of a 24-layer bf16 drafter: its Triton launches plus the torch ops that launch a kernel (the head:
    the fp32 norm's cast and the matmul; the compiled CPU head turned off, as it is off a CPU) are the plan's count,
    at most 150. Narrow (2 heads for Mamba-2), so that each launch is few programs for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from mamba_draft.fused_step import FusedStep

    monkeypatch.setenv("MAMBA_DRAFT_CPU_STEP", "0")
    narrow = dict(d_model=8, d_state=8, **({"ngroups": 1} if arch == "mamba2" else {}))
    model = drafter(arch, torch.bfloat16, n_layer=24, **narrow)
    model.set_backend("fused")
    state, tokens = model.allocate_state(1), torch.tensor([5])
    model.step(tokens, state)  # the first step makes the scratch (and a CPU's head its packed weight)
    launches, counter, launch = [], ComputeOps(), InterpretedFunction.run

    def counting_launches(kernel, *args, **kwargs):
        launches.append(kernel.__name__)
        counter.paused = True
        try:
            return launch(kernel, *args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(InterpretedFunction, "run", counting_launches)
    with counter:
        model.step(tokens, state)
    assert len(counter.ops) == 2 and counter.ops[0] == "aten._to_copy.default"  # the head: cast, product
    assert counter.allocations == ["aten.empty.memory_format"]  # the norm it returns
    assert len(launches) + len(counter.ops) == FusedStep.kernels_per_step(model.config, model.dtype) <= 150


def test_the_130m_shape_launches_at_most_150_kernels():
    from mamba_draft.fused_step import FusedStep

    shape = dict(d_model=768, n_layer=24, vocab_size=50280)
    assert FusedStep.kernels_per_step(MambaConfig(arch="mamba1", **shape), torch.bfloat16) == 99
    assert FusedStep.kernels_per_step(MambaConfig(arch="mamba2", **shape), torch.bfloat16) == 75


def test_fused_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs the drafter on a CUDA device"):
        drafter("mamba1").set_backend("fused")


def test_fused_backend_needs_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "mamba_draft.fused_step", raising=False)
    monkeypatch.delattr(mamba_draft, "fused_step", raising=False)
    with pytest.raises(RuntimeError, match="needs triton"):
        drafter("mamba1").set_backend("fused")
