"""The drafter's CUDA kernel step, run without a GPU: mamba-ssm's Triton `selective_state_update` and fused
add + RMSNorm (`rms_norm_fn`) in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, loaded by
`mamba_draft.kernels` and called by the model's own kernel step, against the torch step.

Before this the kernel call was only exercised through torch stand-ins (tests/test_graph_runner.py), which check the
arguments against our reading of the kernel; the real kernel reads strides, groups, tied head dimensions and dtypes
its own way, and a layout it reads differently would first show on a user's GPU. The interpreter executes the
kernel's own code (on numpy arrays), so what it computes from the arguments is what the kernel computes. What it
cannot show is what only a GPU does (compilation, alignment, fast exp, CUDA graphs): tests/test_gpu.py, on a GPU.

Needs `triton` and mamba-ssm's / causal-conv1d's Python sources (their sdists, not installed: mamba-ssm does not
install on a CPU torch). `bash scripts/setup.sh` puts both in place (the `kernel-check` extra, sources under
`.kernel-sources/`, or `$MAMBA_DRAFT_KERNEL_SOURCES`); without them every test here skips with the reason.
causal-conv1d's update is a compiled CUDA kernel, so the conv runs causal-conv1d's own pure-torch reference
(`causal_conv1d_update_ref`, what upstream tests its kernel against), called with the product's arguments.

Tolerance. Drafts only decide speed, never output: the target verifies every drafted token, so a kernel step that
rounds differently from the torch step changes at most which tokens are proposed, never what is generated. The
bound only has to separate rounding from a wrong layout, and must, since a wrong layout is silent in every lossless
test (the output stays right, only acceptance falls):
- fp32 weights: 1e-4 absolute and relative, on every step's logits and the final conv and SSM states. Both paths
  evaluate the same fp32 expression in another order (exp/softplus implementations, the sum over d_state):
  measured at most 2.4e-6 apart on logits of magnitude ~20.
- bf16 weights: the kernel step must be no further from the fp32 drafter (the same bf16-rounded weights, upcast)
  than BF16_FACTOR = 3 times the bf16 torch step is. The paths round at different places (the torch step adds
  dt + dt_bias in bf16, the kernel in fp32; outputs round to bf16 at different points), so they differ by about one
  bf16 step of the logits (0.03-0.125 on logits of ~15-24); measured, the kernel step was at most 1.16 times as far
  from fp32 as the torch step on logits and 1.44 times on a bf16 SSM state (3 leaves room for other CPUs' bf16
  kernels). A bound relative to the shipped torch path's own rounding needs no guess of the logits' scale.
Wrong layouts tried (Mamba-2's dt_bias dropped, its B/C groups read transposed, Mamba-1's softplus off) moved the
logits by 0.8-1.4, or to NaN: 14-23 times the bf16 torch step's distance, 10^4 times the fp32 bound.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from mamba_draft import MambaConfig, MambaDrafter, kernels
from mamba_draft import model as model_module

REPO = Path(__file__).resolve().parents[1]
SOURCES = Path(os.environ.get("MAMBA_DRAFT_KERNEL_SOURCES", REPO / ".kernel-sources"))
STEP_SOURCE = "mamba_ssm-*/mamba_ssm/ops/triton/selective_state_update.py"
CONV_SOURCE = "causal_conv1d-*/causal_conv1d/causal_conv1d_interface.py"
VOCAB = 64
FP32_TOLERANCE = 1e-4
BF16_FACTOR = 3.0


def _source_root(pattern: str) -> Path | None:
    """The extracted sdist holding `pattern` (the newest version when several are there), or None."""
    found = sorted(SOURCES.glob(pattern))
    return found[-1].parents[len(Path(pattern).parts) - 2] if found else None


def _missing() -> str | None:
    for module in ("triton", "einops", "packaging"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (bash scripts/setup.sh installs the kernel-check extra)"
    for pattern in (STEP_SOURCE, CONV_SOURCE):
        if _source_root(pattern) is None:
            return f"no {pattern} under {SOURCES} (bash scripts/setup.sh fetches mamba-ssm's / causal-conv1d's sdists)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
# Triton decides at its first import whether its kernels run interpreted; in a suite some earlier test (torch.compile,
# DeepSpeed) has imported it compiled, and a kernel then fails to call its @triton.jit helpers. So the checks below
# run in a fresh process that starts with TRITON_INTERPRET=1 (`test_interpreted_checks_in_a_fresh_process`).
FRESH = os.environ.get("TRITON_INTERPRET") == "1"


def test_interpreted_checks_in_a_fresh_process():
    if FRESH:
        pytest.skip("this is the fresh process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.startswith("7 passed, 1 skipped"), summary  # every check ran; only this test skipped there


def _kernel_modules() -> list[str]:
    return [n for n in sys.modules if n.split(".")[0] in ("mamba_ssm", "causal_conv1d")]


def _causal_conv1d_reference(root: Path) -> None:
    """A `causal_conv1d` package whose `causal_conv1d_update` is upstream's pure-torch `causal_conv1d_update_ref`.

    The interface module imports the compiled extension's wrappers (`cpp_functions`, which import
    `causal_conv1d_cuda`) at the top; they are stubbed, as nothing here calls them."""
    package = types.ModuleType("causal_conv1d")
    package.__path__ = [str(root / "causal_conv1d")]
    compiled = types.ModuleType("causal_conv1d.cpp_functions")
    for name in ("causal_conv1d_fwd_function", "causal_conv1d_bwd_function", "causal_conv1d_update_function"):
        setattr(compiled, name, None)
    sys.modules.update({"causal_conv1d": package, "causal_conv1d.cpp_functions": compiled})
    interface = importlib.import_module("causal_conv1d.causal_conv1d_interface")
    package.causal_conv1d_update = interface.causal_conv1d_update_ref


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """`mamba_draft.kernels.load_kernels()` as the product calls it on CUDA, finding mamba-ssm's sdist sources first
    on sys.path (its package `__init__` fails without the compiled scan, so this is the Triton-only install's path),
    with every Triton kernel interpreted on CPU. Yields the loaded `Kernels`.

    The wrapper enters `torch.cuda.device(x.device.index)`, whose index is None for a CPU tensor: that context is
    made a no-op for the test. MAMBA_DETERMINISTIC=1 makes mamba-ssm's autotuned SSD kernels keep one config (the
    interpreter would run every config of an autotune); the step kernel is not autotuned."""
    if not FRESH:
        pytest.skip("run in a fresh process by test_interpreted_checks_in_a_fresh_process")
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    for name in _kernel_modules():  # e.g. the real packages on a CUDA machine: restored afterwards
        monkeypatch.delitem(sys.modules, name)
    step_root = _source_root(STEP_SOURCE)
    monkeypatch.syspath_prepend(str(step_root))
    _causal_conv1d_reference(_source_root(CONV_SOURCE))
    kernels.load_kernels.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failing package __init__'s own import warnings
            loaded = kernels.load_kernels()
        assert loaded is not None, "mamba_draft.kernels could not load the step from mamba-ssm's sources"
        for function, kernel_name in ((loaded.selective_state_update, "_selective_scan_update_kernel"),
                                      (loaded.rms_norm, "_layer_norm_fwd_1pass_kernel")):
            module = sys.modules[function.__module__]
            assert Path(module.__file__).is_relative_to(step_root)
            kernel = getattr(module, kernel_name)
            while type(kernel).__name__ in ("Heuristics", "Autotuner"):  # triton's decorators around the @jit
                kernel = kernel.fn
            assert type(kernel).__name__ == "InterpretedFunction"  # not compiled: run by the interpreter
        yield loaded
    finally:
        kernels.load_kernels.cache_clear()
        for name in _kernel_modules():
            del sys.modules[name]


def drafter(arch: str, dtype: torch.dtype, state_dtype: torch.dtype | None = torch.float32,
            dt_limit=(0.0, math.inf), **options) -> MambaDrafter:
    """A random drafter (2 layers, d_model 16, unless `options` say otherwise) whose parameters all matter: dt_bias
    (Mamba-2) / the dt projection's bias (Mamba-1) as trained models have them (softplus(bias) = dt in [1e-3, 1e-1],
    far from 0), D random per channel, Mamba-2 with 4 heads of dim 8 in 2 groups (the group of head h is h // 2) and
    d_state 16. Small, because the interpreter runs each of a kernel's programs (rows x heads) in Python."""
    torch.manual_seed(0)
    extra = dict(headdim=8, ngroups=2, dt_limit=dt_limit) if arch == "mamba2" else {}
    shape = {"d_model": 16, "n_layer": 2, "d_state": 16, **extra, **options}
    config = MambaConfig(arch=arch, vocab_size=VOCAB, **shape)
    model = MambaDrafter(config, backend="torch", state_dtype=state_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for layer in model.backbone.layers:
            mixer = layer.mixer
            bias = mixer.dt_proj.bias if arch == "mamba1" else mixer.dt_bias
            dt = torch.exp(torch.empty_like(bias).uniform_(math.log(1e-3), math.log(1e-1)))
            bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus, as mamba-ssm initialises it
            mixer.D.copy_(torch.randn_like(mixer.D))
    return model.to(dtype).eval().requires_grad_(False)


# Tree-drafting-like levels after a 3-row prefill and step: which rows each forks from (row i <- row parents[i]).
LEVELS = ([0, 0, 1, 2, 2], [4, 3, 3, 1, 0, 2])


def drafting_run(model: MambaDrafter, backend: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Prefill 3 rows (torch either way), step them once, then fork rows and step every level of LEVELS on a state
    of 8 rows, wider than any level (rows past a step's batch must stay untouched). Returns every step's logits and
    the final conv and SSM state."""
    model.backend = backend  # set_backend refuses 'kernels' off CUDA
    g = torch.Generator().manual_seed(1)
    state = model.allocate_state(8)
    logits = [model.prefill(torch.randint(0, VOCAB, (3, 6), generator=g), state=state)[0]]
    logits.append(model.step(torch.randint(0, VOCAB, (3,), generator=g), state))
    for parents in LEVELS:
        state.gather_(0, torch.tensor(parents))  # fork: row i <- row parents[i]
        logits.append(model.step(torch.randint(0, VOCAB, (len(parents),), generator=g), state))
    model.backend = "torch"
    return logits, state.conv, state.ssm


def assert_kernel_step_matches_torch_step(arch: str, dtype: torch.dtype, **kwargs) -> None:
    """Every step's logits and the final conv and SSM states of the kernel step against the torch step's: within
    FP32_TOLERANCE for fp32 weights; for bf16 weights, no further from the fp32 drafter (the same bf16-rounded
    weights, upcast) than BF16_FACTOR times the bf16 torch step is."""
    model = drafter(arch, dtype, **kwargs)
    got, want = drafting_run(model, "kernels"), drafting_run(model, "torch")
    names = [f"logits of step {i}" for i in range(len(got[0]))] + ["conv state", "SSM state"]
    pairs = zip(names, [*got[0], *got[1:]], [*want[0], *want[1:]], strict=True)
    if dtype == torch.float32:
        for name, g, w in pairs:
            torch.testing.assert_close(g, w, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE, msg=lambda m: f"{name}: {m}")
        return
    exact = drafting_run(drafter(arch, dtype, **kwargs).float(), "torch")
    for (name, g, w), e in zip(pairs, [*exact[0], *exact[1:]], strict=True):
        kernel_error, torch_error = ((t.float() - e).abs().max().item() for t in (g, w))
        assert kernel_error <= BF16_FACTOR * torch_error + FP32_TOLERANCE, (
            f"{name}: the kernel step is {kernel_error:.3g} from the fp32 drafter, the torch step {torch_error:.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_triton_step_matches_torch_step(interpreted_kernels, arch, dtype):
    """Mamba-1 (no heads, per-channel dt_bias through the kernel's dt_bias, D and z in the kernel) and Mamba-2
    (4 heads of dim 8 in 2 groups, per-head scalars tied over the head dim, dt_bias + softplus in the kernel, z
    through the gated norm), fp32 and bf16 weights with an fp32 state, 3-6 rows with forked rows."""
    assert_kernel_step_matches_torch_step(arch, dtype)


def test_triton_step_with_a_dt_limit_matches_torch_step(interpreted_kernels):
    """A non-default Mamba-2 dt_limit: the kernel cannot clamp, so the step clamps dt itself and hands the kernel a
    zero bias and no softplus (the other branch of the call). The limit sits inside the drafter's dt range, so the
    clamp is active."""
    assert_kernel_step_matches_torch_step("mamba2", torch.float32, dt_limit=(0.004, 0.05))


def test_triton_step_with_a_bf16_state_matches_torch_step(interpreted_kernels):
    """A state in the weights' bf16 (state_dtype None): the kernel loads and stores it in bf16, computing in fp32
    in between, as the torch step does (`_ssm_update`)."""
    assert drafter("mamba2", torch.bfloat16, state_dtype=None).allocate_state(1).ssm.dtype == torch.bfloat16
    assert_kernel_step_matches_torch_step("mamba2", torch.bfloat16, state_dtype=None)


@pytest.mark.filterwarnings("ignore:Deterministic mode")  # mamba-ssm's note on MAMBA_DETERMINISTIC's autotuning
def test_triton_ssd_chunk_scan_matches_torch_prefill(interpreted_kernels, monkeypatch):
    """mamba-ssm's Triton SSD chunk scan (`mamba_chunk_scan_combined`) against the torch prefill's scan.

    The drafter's prefill does not call it (on CUDA too it runs `_ssd_scan`, the same SSD matmuls in torch), so
    this swaps it in for `_ssd_scan` and compares whole-model logits and state: a prefill of 2 rows, then an
    extend continuing from that state (the kernel's `initial_states`), in chunks of 8 so both cross chunk ends;
    one layer, as each scan is five kernels of many programs (1-2 s a scan in the interpreter).
    What it checks is the torch prefill's math against upstream's kernel, and that the kernel is a drop-in should
    the prefill ever use it. fp32 only: the scan runs on fp32 inputs either way. `_ssd_scan` gets dt already biased,
    softplus'd and clamped (so a dt_limit changes nothing here) and B, C repeated per head (one group per head)."""
    ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")

    def triton_scan(x, dt, A, B, C, state, chunk=model_module.SCAN_SLICE):
        return ssd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=8, initial_states=state,
                                             return_final_states=True)

    model = drafter("mamba2", torch.float32, n_layer=1)
    g = torch.Generator().manual_seed(2)
    prompt, more = torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 10), generator=g)
    runs = []
    for scan in (model_module._ssd_scan, triton_scan):
        monkeypatch.setattr(model_module, "_ssd_scan", scan)
        state = model.allocate_state(2)
        first = model.prefill(prompt, state=state)[0]
        runs.append((first, model.extend(more, state), state.ssm.clone()))
    for got, want in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE)
