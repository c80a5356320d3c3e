"""The compiled CPU step of Mamba-2 drafters (`mamba_draft.cpu_drafter`, the 'compiled' backend `auto` picks on a
CPU): logits, final-norm states and the conv / SSM state rows follow the torch step within float rounding, for one
row and many, with and without the target's hidden state, a draft vocabulary and weights edited in place; other
drafters keep the torch step."""
import pytest
import torch

from mamba_draft import MambaDrafter, cpu_drafter
from mamba_draft.config import MambaConfig
from mamba_draft.targets import cpu_step
from tests.helpers.drafters import save_tiny_hf_mamba


def _drafter(tmp_path, dtype=torch.float32, target_hidden: int = 0, **overrides) -> MambaDrafter:
    if target_hidden:  # a drafter that reads the target (`MambaDrafter.embed`), built from a config
        torch.manual_seed(0)
        config = MambaConfig(arch="mamba2", d_model=32, n_layer=2, vocab_size=96, d_state=8, expand=2, headdim=8,
                             ngroups=2, target_hidden_size=target_hidden, **overrides)
        model = MambaDrafter(config, backend="torch")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(tmp_path / "d")
    else:
        save_tiny_hf_mamba(tmp_path / "d", "mamba2", **overrides)
    return MambaDrafter.from_pretrained(str(tmp_path / "d"), dtype=dtype)


def _steps(drafter, backend: str, tokens: torch.Tensor, features: list, integer: bool = True) -> tuple:
    drafter.set_backend(backend)
    if backend == "compiled":
        drafter.compiled = cpu_drafter.CompiledStep(integer=integer)
    state = drafter.allocate_state(tokens.shape[1] + 2)
    outputs = [drafter.step(tokens[t], state, features[t], with_hidden=True) for t in range(tokens.shape[0])]
    return outputs, state


@pytest.mark.parametrize("integer", [False, True], ids=["float-products", "int8-products"])
@pytest.mark.parametrize("target_hidden", [0, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_step_follows_the_torch_step(tmp_path, dtype, target_hidden, integer):
    drafter = _drafter(tmp_path, dtype, target_hidden)
    assert drafter.backend == "compiled"  # auto's choice on a CPU
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (6, 5), generator=g)  # 6 steps of 5 rows
    features = [torch.randn(5, target_hidden, generator=g) if target_hidden and t % 2 else None for t in range(6)]
    torch_out, torch_state = _steps(drafter, "torch", tokens, features)
    ours, state = _steps(drafter, "compiled", tokens, features, integer)
    assert drafter.compiled.layers[0].in_proj.integer == integer  # widths of whole 32-input groups
    # float products: float rounding; 8-bit codes: about 1 % of each product
    tol = 0.05 if integer else 1e-4 if dtype == torch.float32 else 0.1
    for (logits, normed), (want_logits, want_normed) in zip(ours, torch_out):
        assert logits.dtype == dtype and logits.shape == want_logits.shape
        assert (logits.float() - want_logits.float()).abs().max() <= tol * (1 + want_logits.float().abs().max())
        assert (normed.float() - want_normed.float()).abs().max() <= tol * (1 + want_normed.float().abs().max())
    for mine, want in ((state.conv, torch_state.conv), (state.ssm, torch_state.ssm)):
        assert (mine.float() - want.float()).abs().max() <= tol * (1 + want.float().abs().max())
    if dtype == torch.float32 and not integer:
        assert all(torch.equal(a[0].argmax(-1), b[0].argmax(-1)) for a, b in zip(ours, torch_out))


def test_a_row_alone_equals_the_row_among_others_and_edits_are_seen(tmp_path):
    drafter = _drafter(tmp_path)
    state = drafter.allocate_state(4)
    together = drafter.step(torch.tensor([5, 9, 17, 3]), state)
    alone = drafter.step(torch.tensor([17]), drafter.allocate_state(1))
    assert torch.equal(together[2], alone[0])  # integer products: a row's bits are its own
    with torch.no_grad():  # an in-place edit (an optimizer step) is packed again
        drafter.backbone.layers[1].mixer.out_proj.weight.mul_(2.0)
    edited = drafter.step(torch.tensor([17]), drafter.allocate_state(1))
    drafter.set_backend("torch")
    reference = drafter.step(torch.tensor([17]), drafter.allocate_state(1))
    assert (edited - reference).abs().max() < 0.05 * (1 + reference.abs().max())
    assert (edited - reference).abs().max() < 0.5 * (edited - alone).abs().max()  # the edit, not the old weights


def test_a_draft_vocabulary_restricts_the_compiled_head(tmp_path):
    drafter = _drafter(tmp_path)
    drafter.set_draft_vocab(torch.tensor([3, 7, 11, 40, 41, 90]))
    logits = drafter.step(torch.tensor([5, 9]), drafter.allocate_state(2))
    drafter.set_backend("torch")
    reference = drafter.step(torch.tensor([5, 9]), drafter.allocate_state(2))
    assert logits.shape == (2, 6) and (logits - reference).abs().max() < 0.05 * (1 + reference.abs().max())


def test_other_drafters_and_the_switch_keep_the_torch_step(tmp_path, monkeypatch):
    save_tiny_hf_mamba(tmp_path / "m1", "mamba1")
    assert MambaDrafter.from_pretrained(str(tmp_path / "m1")).backend == "torch"  # Mamba-1
    monkeypatch.setenv(cpu_step.SWITCH, "0")
    assert _drafter(tmp_path).backend == "torch"
    with pytest.raises(RuntimeError, match="backend='compiled' needs"):
        _drafter(tmp_path).set_backend("compiled")
