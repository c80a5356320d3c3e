"""MambaDrafter numerics: stepping == full forward == transformers, forking == independent runs, dtypes."""
import pytest
import torch

from mamba_draft import MambaDrafter
from tests.helpers.drafters import save_tiny_hf_mamba, tiny_hf_mamba

ARCHS = ["mamba1", "mamba2"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(arch, HF model, our drafter loaded from the HF checkpoint) on the torch step, the reference (the compiled CPU
    step of Mamba-2, `auto`'s choice on a CPU, is held to it in tests/test_cpu_drafter.py)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_mamba(request.param)
    hf.save_pretrained(directory)
    return request.param, hf, MambaDrafter.from_pretrained(directory, backend="torch")


def test_forward_matches_transformers(pair):
    _, hf, drafter = pair
    # 300 positions: several scan chunks of the prefill path
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(drafter.forward(ids), expected, atol=1e-4, rtol=0)


def test_prefill_then_steps_match_full_forward(pair):
    _, hf, drafter = pair
    ids = torch.randint(0, 96, (3, 72), generator=torch.Generator().manual_seed(2))
    full = drafter.forward(ids)
    with torch.no_grad():
        hf_full = hf(ids).logits
    logits, state = drafter.prefill(ids[:, :8], max_batch=4)
    assert state.max_batch == 4
    worst = (logits - full[:, 7]).abs().max()
    for t in range(8, ids.shape[1]):  # 64 single-token steps
        logits = drafter.step(ids[:, t], state)
        worst = max(worst, (logits - full[:, t]).abs().max(), (logits - hf_full[:, t]).abs().max())
    assert worst <= 1e-4, f"step-by-step logits drift from the full forward by {worst}"


def test_extend_continues_from_state(pair):
    _, _, drafter = pair
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    full = drafter.forward(ids)
    _, state = drafter.prefill(ids[:, :15])
    torch.testing.assert_close(drafter.extend(ids[:, 15:], state), full[:, 15:], atol=1e-4, rtol=0)


def test_fork_equals_independent_runs(pair):
    _, _, drafter = pair
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 96, (1, 12), generator=gen)
    k = 5
    continuations = torch.randint(0, 96, (k, 6), generator=gen)
    _, state = drafter.prefill(prompt, max_batch=k)
    state.gather_(0, torch.zeros(k, dtype=torch.long))  # fork: every row <- row 0
    for t in range(continuations.shape[1]):
        forked = drafter.step(continuations[:, t], state)
    for row in range(k):
        alone = drafter.forward(torch.cat([prompt, continuations[row:row + 1]], dim=1))[:, -1]
        torch.testing.assert_close(forked[row:row + 1], alone, atol=1e-4, rtol=0)


def test_gather_select_and_views(pair):
    _, _, drafter = pair
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 96, (3, 10), generator=gen)
    _, state = drafter.prefill(prompts, max_batch=8)
    snapshot = state.clone()
    # rows 3..5 <- rows [2, 0, 2]; then rows [1, 2] <- rows [2, 1] (overlapping source and destination)
    state.gather_(3, torch.tensor([2, 0, 2]))
    torch.testing.assert_close(state.ssm[:, 3:6], snapshot.ssm[:, [2, 0, 2]])
    state.gather_(1, torch.tensor([2, 1]))
    torch.testing.assert_close(state.conv[:, 1:3], snapshot.conv[:, [2, 1]])
    # a view writes through, and stepping on it only touches its rows
    view = state.rows(3, 6)
    before = state.ssm[:, :3].clone()
    drafter.step(torch.tensor([1, 2, 3]), view)
    torch.testing.assert_close(state.ssm[:, :3], before)
    assert not torch.equal(state.ssm[:, 3:6], snapshot.ssm[:, [2, 0, 2]])
    state.gather_(0, torch.tensor(4).reshape(1))  # row 0 <- row 4 (a 0-d tensor's row: no host sync)
    torch.testing.assert_close(state.conv[:, 0], state.conv[:, 4])
    state.reset_()
    assert state.conv.abs().sum() == 0 and state.ssm.abs().sum() == 0


def test_step_does_not_reallocate_state(pair):
    _, _, drafter = pair
    _, state = drafter.prefill(torch.tensor([[1, 2, 3]]), max_batch=4)
    pointers = (state.conv.data_ptr(), state.ssm.data_ptr())
    state.gather_(0, torch.tensor([0, 0, 0, 0]))
    drafter.step(torch.tensor([4, 5, 6, 7]), state)
    assert (state.conv.data_ptr(), state.ssm.data_ptr()) == pointers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(arch, dtype, tmp_path):
    directory = save_tiny_hf_mamba(tmp_path, arch)
    ref = MambaDrafter.from_pretrained(directory)
    half = MambaDrafter.from_pretrained(directory, dtype=dtype, state_dtype=torch.float32)
    assert half.dtype == dtype and half.allocate_state(1).ssm.dtype == torch.float32
    assert half.allocate_state(1).conv.dtype == dtype
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(6))
    _, s_ref = ref.prefill(ids[:, :8])
    _, s_half = half.prefill(ids[:, :8])
    for t in range(8, 24):
        l_ref, l_half = ref.step(ids[:, t], s_ref), half.step(ids[:, t], s_half)
    assert l_half.dtype == dtype
    assert (l_half.float() - l_ref).abs().max() < 0.1
    assert (l_half.float().argmax(-1) == l_ref.argmax(-1)).all()
    # the state may also live in the weights' half precision
    low = MambaDrafter.from_pretrained(directory, dtype=dtype)
    assert low.allocate_state(1).ssm.dtype == dtype
    assert torch.isfinite(low.prefill(ids)[0]).all()
    # ... and steps on it (updated out of place in fp32, rounded once) track the fp32-state drafter's steps
    _, s_low = low.prefill(ids[:, :8])
    for t in range(8, 24):
        l_low = low.step(ids[:, t], s_low)
    assert s_low.ssm.dtype == dtype and (l_low.float() - l_half.float()).abs().max() < 0.1


def test_padded_vocab_is_sliced(tmp_path):
    hf = tiny_hf_mamba("mamba1", vocab_size=104)
    hf.config.real_vocab_size = 100  # e.g. a tokenizer of 100 tokens padded to a multiple of 8
    hf.save_pretrained(tmp_path)
    drafter = MambaDrafter.from_pretrained(tmp_path)
    assert drafter.vocab_size == 100
    ids = torch.tensor([[5, 6, 7]])
    logits = drafter.forward(ids)
    assert logits.shape[-1] == 100
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(ids).logits[..., :100], atol=1e-4, rtol=0)
    assert drafter.step(torch.tensor([3]), drafter.prefill(ids)[1]).shape == (1, 100)


def test_backend_selection_on_cpu(pair, tmp_path):
    arch, hf, drafter = pair
    hf.save_pretrained(tmp_path)
    # 'auto' never picks CUDA kernels on CPU: the compiled step for Mamba-2, the torch step for Mamba-1
    assert MambaDrafter.from_pretrained(tmp_path).backend == ("compiled" if arch == "mamba2" else "torch")
    with pytest.raises(RuntimeError, match="CUDA"):
        drafter.set_backend("kernels")
    with pytest.raises(ValueError, match="unknown backend"):
        drafter.set_backend("triton")


def test_bad_inputs(pair):
    _, _, drafter = pair
    _, state = drafter.prefill(torch.tensor([[1, 2]]), max_batch=2)
    with pytest.raises(ValueError, match="exceeds the state's preallocated max_batch=2"):
        drafter.step(torch.tensor([1, 2, 3]), state)
    with pytest.raises(ValueError, match="max_batch"):
        drafter.prefill(torch.ones(3, 4, dtype=torch.long), state=state)
    with pytest.raises(TypeError, match="int64/int32"):
        drafter.step(torch.tensor([1.0, 2.0]), state)
    with pytest.raises(TypeError, match="integer"):
        drafter.prefill(torch.tensor([[1.5, 2.0]]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 96\)"):
        drafter.prefill(torch.tensor([[1, 500]]))
    with pytest.raises(ValueError, match="at least one token"):
        drafter.prefill(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(IndexError):
        state.rows(1, 5)
