"""The drafter's step runner (mamba_draft/graphs.py), the TreeDrafter kept on the drafter, and Mamba-2's dt_limit.

CUDA capture itself is tested in tests/test_gpu.py. Everything around it runs here on CPU: `fake_graphs` swaps the
runner's capture for one whose "replay" runs the captured body eagerly, so keying, sharing across tree shapes,
static-buffer ownership, output lifetime and invalidation go through the same code as on CUDA.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import mamba_draft.model as model_module
from mamba_draft import MambaDrafter
from mamba_draft.config import MambaConfig
from mamba_draft.graphs import StepRunner, drafter_key, weights_key
from mamba_draft.model import _conv_step
from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import aligned_drafter, hf_greedy, random_drafter, tiny_llama
from tree_search.tree_drafter import TreeDrafter
from tree_search.generate import SpeculativeDecoder, generate
from tree_search.sampling import SamplingParams

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


class FakeCapture:
    """Stands in for `StepRunner._capture` on CPU: the "graph" replays the captured body eagerly."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, int]] = []

    def __call__(self, body, start: int, stop: int):
        self.captured.append((start, stop))
        return SimpleNamespace(replay=body)


def fake_graphs(runner: StepRunner) -> FakeCapture:
    capture = FakeCapture()
    runner.use_graphs = True
    runner._capture = capture
    return capture


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"), vocab=VOCAB)


def prefilled(drafter, rows: int = 12):
    state = drafter.allocate_state(rows)
    drafter.prefill(torch.tensor([[5, 9, 2, 40, 7]]), state=state)
    return state


# ---------------------------------------------------------------- runner: eager and graph mode equal direct steps


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_runner_equals_direct_fork_and_step_bit_for_bit(drafter, graphs):
    state = prefilled(drafter)
    reference = state.clone()
    runner = StepRunner(drafter, state)
    assert runner.use_graphs is False  # CPU: the switch defaults to off
    if graphs:
        fake_graphs(runner)
    # level 1 forks the root into rows 1..3, level 2 forks rows 1 and 3 into rows 4..5, then row 0 steps unforked
    for start, stop, tokens, parents in ((1, 4, [3, 17, 60], [0, 0, 0]), (4, 6, [8, 8], [1, 3]), (0, 1, [21], None)):
        tokens, parents = torch.tensor(tokens), None if parents is None else torch.tensor(parents)
        got = runner.run(start, stop, tokens, parents)
        if parents is not None:
            reference.gather_(start, parents)
        want = drafter.step(tokens, reference.rows(start, stop))
        assert torch.equal(got, want)
        assert torch.equal(state.conv, reference.conv) and torch.equal(state.ssm, reference.ssm)


def walk(drafts: TreeDrafter, configs, rounds: int = 8):
    """Draft and resync `rounds` rounds of one prompt (a batch of one), alternating tree shapes and accepted path
    lengths (leaves included)."""
    root_logits = drafts.prefill(torch.tensor([[1, 2, 3, 4]]))
    seen = []
    for r in range(rounds):
        config = configs[r % len(configs)]
        buf = drafts.draft(config, drafts.roots[:1], root_logits, GREEDY, "topk", False, None)
        leaf = buf.tree.levels[-1][0] + r % (buf.tree.levels[-1][1] - buf.tree.levels[-1][0])
        path = buf.tree.path_to(leaf)[: r % (config.depth + 1)]
        next_token = (7 * r + 3) % VOCAB
        seen.append(buf.tokens.clone())
        root_logits = drafts.resync(buf, [path[-1] if path else 0], [next_token])
        seen.append(root_logits.clone())
        assert drafts.roots[0] == next_token
    return seen


def test_tree_drafting_through_graphs_equals_eager_and_shares_graphs_across_shapes(drafter):
    configs = [TreeConfig((3, 2, 1)), TreeConfig((3, 1, 1)), TreeConfig((1, 1, 1, 1))]
    eager = TreeDrafter(drafter, 16, VOCAB)
    graphed = TreeDrafter(drafter, 16, VOCAB)
    capture = fake_graphs(graphed.runner)
    want, got = walk(eager, configs), walk(graphed, configs)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # One capture per (start, stop, fork), however many shapes and rounds use it: (3, 2, 1) and (3, 1, 1) both
    # fork + step rows 1..3 at level 1; resync forks + steps row 0, after an accepted leaf (rounds 3 and 7) first
    # stepping it from its parent into the last level's first row ((3, 2, 1): row 10, (3, 1, 1): row 7).
    assert sorted(graphed.runner.graphs) == sorted({(1, 4, True), (4, 10, True), (4, 7, True), (1, 2, True),
                                                    (2, 3, True), (3, 4, True), (0, 1, True), (10, 11, True),
                                                    (7, 8, True)})
    assert len(capture.captured) == len(graphed.runner.graphs)


# ---------------------------------------------------------------- static buffers and output lifetime


def test_graphs_are_keyed_by_rows_and_read_the_runners_own_buffers(drafter):
    state = prefilled(drafter)
    runner = StepRunner(drafter, state)
    capture = fake_graphs(runner)
    buffers = (runner.tokens.data_ptr(), runner.parents.data_ptr())
    reference = state.clone()
    for tokens, parents in ((torch.tensor([3, 4]), torch.tensor([0, 0])),
                            (torch.tensor([50, 8]), torch.tensor([0, 2]))):
        # a fresh input tensor every call (another address): same graph, reading the new values
        got = runner.run(2, 4, tokens.clone(), parents.clone())
        reference.gather_(2, parents)
        assert torch.equal(got, drafter.step(tokens, reference.rows(2, 4)))
    assert capture.captured == [(2, 4)]
    assert (runner.tokens.data_ptr(), runner.parents.data_ptr()) == buffers


def test_logits_stay_valid_until_a_run_over_the_same_rows(drafter):
    runner = StepRunner(drafter, prefilled(drafter))
    fake_graphs(runner)
    level = runner.run(1, 4, torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]))
    kept = level.clone()
    runner.run(4, 8, torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 3]))  # other rows, other graphs
    runner.run(0, 1, torch.tensor([9]))
    assert torch.equal(level, kept)
    runner.run(1, 3, torch.tensor([30, 31]), torch.tensor([0, 0]))  # overlapping rows: documented to overwrite
    assert not torch.equal(level, kept)


def test_invalidate_drops_graphs_and_the_pool(drafter):
    runner = StepRunner(drafter, prefilled(drafter))
    capture = fake_graphs(runner)
    runner.run(1, 3, torch.tensor([3, 4]), torch.tensor([0, 0]))
    runner.pool = "pool"  # what the first CUDA capture sets
    runner.invalidate()
    assert runner.graphs == {} and runner.pool is None
    runner.run(1, 3, torch.tensor([3, 4]), torch.tensor([0, 0]))
    assert capture.captured == [(1, 3), (1, 3)]


# ---------------------------------------------------------------- the TreeDrafter a decoder keeps


def test_a_kept_tree_drafter_is_reused_while_it_serves(drafter):
    first = TreeDrafter.reuse(None, drafter, 8, VOCAB)
    assert TreeDrafter.reuse(first, drafter, 8, VOCAB) is first
    assert TreeDrafter.reuse(first, drafter, 4, VOCAB) is first  # fewer rows fit
    bigger = TreeDrafter.reuse(first, drafter, 9, VOCAB)
    assert bigger is not first and bigger.state.max_batch == 9
    assert TreeDrafter.reuse(bigger, drafter, 9, VOCAB + 1) is not bigger  # another output width


def test_a_decoder_sets_no_attribute_on_the_models_it_is_given(tmp_path):
    """What lives across calls (drafter state rows, static cache, verify costs, probe verdicts) is the decoder's."""
    target = tiny_llama(vocab=VOCAB, seed=4)
    drafter = aligned_drafter(tmp_path, target)
    before = {name: set(vars(model)) for name, model in (("target", target), ("drafter", drafter))}
    decoder = SpeculativeDecoder(target, drafter)
    for _ in range(2):
        decoder.generate(torch.tensor([[3, 14, 15, 9, 2]]), max_new_tokens=12)
    generate(target, drafter, torch.tensor([[3, 14, 15]]), max_new_tokens=4, tree="2,1")
    assert {name: set(vars(model)) for name, model in (("target", target), ("drafter", drafter))} == before
    assert decoder.drafts is not None and decoder.tree_mask_ok


def test_weights_key_follows_every_weights_address_dtype_and_device():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    key = weights_key(module)
    assert weights_key(module) == key and len(key) == 4 + 3  # four parameters, three buffers
    assert key[0] == (module[0].weight.data_ptr(), torch.float32, torch.device("cpu"))
    module[1].running_mean = module[1].running_mean.clone()  # one buffer reallocated
    assert weights_key(module) != key
    key = weights_key(module)
    assert weights_key(module.to(torch.float64)) != key


@pytest.mark.parametrize("change", ["backend", "weights", "state_dtype", "dtype"])
def test_cache_and_graphs_are_dropped_when_the_drafter_changes(tmp_path, change):
    drafter = random_drafter(tmp_path, vocab=VOCAB)
    first = TreeDrafter.reuse(None, drafter, 8, VOCAB)
    fake_graphs(first.runner)
    first.draft(TreeConfig((2, 2)), first.roots[:1], first.prefill(torch.tensor([[1, 2]])), GREEDY, "topk", False,
                None)
    assert first.runner.graphs
    old = drafter.lm_head.weight
    if change == "backend":
        drafter.backend = "kernels"  # what set_backend does on CUDA (it refuses 'kernels' on CPU)
    elif change == "weights":  # reallocated in place of the old ones (load_state_dict(assign=True), .to() round trips)
        drafter.lm_head.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    elif change == "dtype":
        drafter.to(torch.float64)
    else:
        drafter.state_dtype = torch.float64
    assert drafter_key(drafter) != first.runner.key
    second = TreeDrafter.reuse(first, drafter, 8, VOCAB)
    assert second is not first and first.runner.graphs == {}
    assert second.runner.key == drafter_key(drafter)
    assert TreeDrafter.reuse(second, drafter, 8, VOCAB) is second


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_changing_the_drafters_dtype_after_a_generate_stays_lossless(tmp_path, dtype):
    """A decoder's kept TreeDrafter follows the drafter's dtype (its state, and on CUDA its graphs, are rebuilt)."""
    target = tiny_llama(vocab=VOCAB, seed=4)
    drafter = aligned_drafter(tmp_path, target)
    prompt = torch.tensor([[3, 14, 15, 9, 2]])
    reference = hf_greedy(target, prompt, 24)
    decoder = SpeculativeDecoder(target, drafter, tree="3,2,1", verifier="greedy")
    for step_dtype in (torch.float32, dtype, torch.float32):
        drafter.to(step_dtype)
        result = decoder.generate(prompt, max_new_tokens=24, temperature=0.0)
        assert torch.equal(result.tokens, reference)
        assert decoder.drafts.state.conv.dtype == step_dtype
        assert result.stats.mean_accepted > 1  # the drafter really drafted, in every dtype


# ---------------------------------------------------------------- Mamba-2 dt_limit on both step paths


def ref_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """mamba_ssm's `selective_state_update` semantics in torch, for checking the kernel path's arguments on CPU."""
    dt_bias.stride(-1)  # the Triton wrapper reads dt_bias's strides unconditionally: None fails there
    if state.dim() == 3:  # Mamba-1: no head dimension
        out = ref_selective_state_update(state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0),
                                         B.unsqueeze(1), C.unsqueeze(1), D.unsqueeze(0), z.unsqueeze(1),
                                         dt_bias.unsqueeze(0), dt_softplus)
        return out.squeeze(1)
    dt = dt.float() + dt_bias.float()
    dt = F.softplus(dt) if dt_softplus else dt
    rep = state.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1).float(), C.repeat_interleave(rep, dim=1).float()
    new = state.float() * torch.exp(dt[..., None] * A.float()) + (dt * x.float())[..., None] * B[:, :, None, :]
    state.copy_(new)
    out = (new * C[:, :, None, :]).sum(-1)
    if D is not None:
        out = out + x.float() * D.float()
    if z is not None:
        out = out * F.silu(z.float())
    return out.to(x.dtype)


def ref_causal_conv1d_update(x, conv_state, weight, bias, activation):
    assert activation == "silu"
    return _conv_step(x, conv_state, weight, bias)


def ref_rms_norm(x, weight, bias, residual=None, prenorm=False, residual_in_fp32=False, eps=1e-6):
    """mamba_ssm's `rms_norm_fn` semantics: RMSNorm of x + residual in fp32, rounded once; with prenorm, also that
    sum, the residual stream (in the residual's dtype, else fp32 with residual_in_fp32, else x's)."""
    assert bias is None
    summed = x.float() if residual is None else x.float() + residual.float()
    out = (summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    stream = residual.dtype if residual is not None else torch.float32 if residual_in_fp32 else x.dtype
    return (out, summed.to(stream)) if prenorm else out


@pytest.fixture
def reference_kernels(monkeypatch):
    """Make backend 'kernels' run the reference kernels above (the real ones need CUDA)."""
    monkeypatch.setattr(model_module, "load_kernels", lambda: model_module.Kernels(
        ref_selective_state_update, ref_causal_conv1d_update, ref_rms_norm))


def tiny_drafter(arch: str, dt_limit=(0.0, math.inf)) -> MambaDrafter:
    torch.manual_seed(0)
    extra = dict(headdim=8, ngroups=2, dt_limit=dt_limit) if arch == "mamba2" else {}
    drafter = MambaDrafter(MambaConfig(arch=arch, d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8, **extra),
                           backend="torch")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter.eval().requires_grad_(False)


def run_steps(drafter, backend: str, tokens=(5, 9, 33, 2, 60, 11)) -> torch.Tensor:
    """Prefill 3 tokens, then step the rest one at a time on 2 rows; all logits, stacked."""
    drafter.backend = backend  # set_backend refuses 'kernels' on CPU
    state = drafter.allocate_state(2)
    prompt = torch.tensor([list(tokens[:3]), list(tokens[:3])[::-1]])
    out = [drafter.prefill(prompt, state=state)[0]]
    for t in tokens[3:]:
        out.append(drafter.step(torch.tensor([t, (t * 5) % VOCAB]), state))
    drafter.backend = "torch"
    return torch.stack(out)


@pytest.mark.parametrize("arch, dt_limit", [("mamba1", None), ("mamba2", (0.0, math.inf)), ("mamba2", (0.05, 0.2))])
def test_kernel_path_equals_torch_path(reference_kernels, arch, dt_limit):
    """The kernel path's arguments, checked with reference kernels: before the fix, Mamba-2's kernel path ignored a
    non-default dt_limit (no clamp) while the torch path applied it."""
    drafter = tiny_drafter(arch, dt_limit or (0.0, math.inf))
    torch.testing.assert_close(run_steps(drafter, "kernels"), run_steps(drafter, "torch"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_mamba2_honours_a_non_default_dt_limit(reference_kernels, backend):
    """dt_limit (c, c) pins dt = c, so dt_bias (which only enters through dt) stops mattering: on prefill and on
    every step, in both paths. Without the limit, the same change of dt_bias changes the logits."""
    for dt_limit, bias_matters in (((0.0, math.inf), True), ((0.3, 0.3), False)):
        drafter = tiny_drafter("mamba2", dt_limit)
        before = run_steps(drafter, backend)
        for layer in drafter.backbone.layers:
            layer.mixer.dt_bias.add_(torch.linspace(-2.0, 2.0, layer.mixer.dt_bias.numel()))
        after = run_steps(drafter, backend)
        assert torch.equal(before, after) is not bias_matters
