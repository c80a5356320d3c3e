"""A drafter's few-row products on the compiled kernel: close to F.linear, a row's bits the same alone or in a batch,
no stale copy after an in-place edit, and the module's own forward for training, prompts and the switch."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mamba_draft.row_linear import MAX_ROWS, RowKernelLinear, use_row_kernel
from mamba_draft.targets import cpu_step

pytestmark = pytest.mark.skipif(not cpu_step.available(), reason="no C compiler builds the kernel here")


def _linear(dtype: torch.dtype, outs: int = 50, bias: bool = True) -> RowKernelLinear:
    torch.manual_seed(0)
    return RowKernelLinear.wrap(nn.Linear(64, outs, bias=bias).to(dtype).requires_grad_(False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_are_close_to_f_linear_and_the_same_alone_or_batched(dtype):
    layer = _linear(dtype)  # 50 outputs: padded to whole 16-row blocks inside
    x = torch.randn(5, 64).to(dtype)
    out = layer(x)
    assert out.shape == (5, 50) and out.dtype == dtype
    assert torch.allclose(out.float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05, rtol=0.02)
    assert layer.rows.weight is not None  # the kernel ran, on its copy of the weight
    for row in range(5):
        assert torch.equal(layer(x[row : row + 1]), out[row : row + 1])
    assert layer(x[None]).shape == (1, 5, 50)  # leading dimensions kept


def test_an_in_place_edit_and_the_fallbacks():
    layer = _linear(torch.float32, bias=False)
    x = torch.randn(3, 64)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # the packed copy is made again
    assert torch.allclose(layer(x), 2 * before, atol=1e-5)
    assert layer.rows.key[1] == layer.weight._version
    many = torch.randn(MAX_ROWS + 1, 64)
    assert torch.equal(layer(many), F.linear(many, layer.weight))  # a prompt's block: the library's kernel
    layer.weight.requires_grad_(True)
    assert torch.equal(layer(x), F.linear(x, layer.weight))  # training
    layer.weight.requires_grad_(False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_step.SWITCH, "0")
        assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_use_row_kernel_keeps_parameters_ties_and_state_dict():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    names = list(model.state_dict())
    weight = model[0].weight
    use_row_kernel(model)
    assert type(model[0]) is RowKernelLinear and model[0].weight is weight and list(model.state_dict()) == names
    x = torch.randn(2, 32)
    with torch.no_grad():
        reference = F.linear(torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
        assert torch.allclose(model(x), reference, atol=1e-5)


def test_a_drafters_step_runs_its_products_on_the_kernel(tmp_path, monkeypatch):
    from tests.helpers.tree_models import random_drafter

    drafter = random_drafter(tmp_path)
    assert type(drafter.backbone.layers[0].mixer.in_proj) is RowKernelLinear
    tokens = torch.tensor([3, 9])
    logits = []
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_step.SWITCH, switch)
        state = drafter.allocate_state(2)
        drafter.extend(torch.tensor([[5, 7, 1], [2, 2, 8]]), state)
        logits.append(drafter.step(tokens, state))
    assert drafter.head_rows.weight is not None
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_machine_without_the_kernel_asks_once_and_keeps_f_linear(monkeypatch):
    from mamba_draft.targets import native

    calls = []

    def missing():
        calls.append(1)
        raise native.KernelUnavailable("no compiler")

    monkeypatch.setattr(cpu_step, "library", missing)
    cpu_step.available.cache_clear()
    try:
        layer, x = _linear(torch.float32), torch.randn(2, 64)
        for _ in range(3):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(calls) == 1  # a failed build is not retried on every product
    finally:
        cpu_step.available.cache_clear()
