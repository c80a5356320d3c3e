"""CPU attention kernels: grouped attention is eager's arithmetic; row attention (the C kernel of
mamba_draft/targets/row_attention.c) gives a query row, bit for bit, the output it gets alone, whatever rows, keys,
threads or hidden keys share its call (the real-target check is tests/test_invariance.py)."""
from __future__ import annotations

import pytest
import torch

from mamba_draft import devices
from mamba_draft.targets import cpu_attention, native, row_attention
from mamba_draft.targets.cpu_attention import grouped_attention
from mamba_draft.targets.row_attention import KernelUnavailable
from mamba_draft.tree import Tree

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention shape
row = row_attention.row_attention


def reference(query, key, value, visible, softcap=None, sinks=None):
    """transformers' eager attention in float64: key heads repeated, softcap, masked softmax, sinks."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2)


def additive(visible, dtype):
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None]


def tree_visible(tree: Tree, prefix: int, batch: int = 1) -> torch.Tensor:
    n = len(tree)
    visible = torch.ones(batch, n, prefix + n, dtype=torch.bool)
    visible[..., prefix:] = torch.as_tensor(tree.ancestor_mask)
    return visible


def lineage(tree: Tree, node: int) -> list[int]:
    """The node's ancestors from its root, then the node."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("attention", [grouped_attention, row])
@pytest.mark.parametrize("batch,prefix", [(1, 0), (1, 70), (2, 130)])
def test_matches_eager_attention(attention, batch, prefix):
    torch.manual_seed(0)
    tree = Tree((-1, 0, 0, 1, 2, 2))
    visible = tree_visible(tree, prefix, batch)
    if batch > 1:
        visible[1, :, :3] = False  # a left-padded row
    n, keys = len(tree), visible.shape[-1]
    query = torch.randn(batch, HEADS, n, DIM)
    key, value = torch.randn(batch, KV_HEADS, keys, DIM), torch.randn(batch, KV_HEADS, keys, DIM)
    out, _ = attention(None, query, key, value, additive(visible, torch.float32))
    torch.testing.assert_close(out.double(), reference(query, key, value, visible), atol=1e-5, rtol=1e-5)
    out_bool, _ = attention(None, query, key, value, visible[:, None])
    torch.testing.assert_close(out_bool, out)


def test_softcap_sinks_and_low_precision_match_eager_attention():
    """Gemma-2's softcap and gpt-oss's sinks as transformers' eager computes them; bf16 and fp16 within one rounding
    of the output."""
    torch.manual_seed(1)
    visible = tree_visible(Tree((-1, 0, 0, 1)), 40, 2)
    query, key, value = torch.randn(2, HEADS, 4, DIM), torch.randn(2, KV_HEADS, 44, DIM), torch.randn(2, KV_HEADS, 44, DIM)
    sinks = torch.randn(HEADS)
    out, _ = row(None, query, key, value, visible[:, None], softcap=2.0, s_aux=sinks)
    torch.testing.assert_close(out.double(), reference(query, key, value, visible, 2.0, sinks), atol=1e-5, rtol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t.to(dtype) for t in (query, key, value))
        low, _ = row(None, q, k, v, visible[:, None])
        assert low.dtype == dtype
        torch.testing.assert_close(low.double(), reference(q, k, v, visible), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("prefix", [0, 5, 14, 16, 17, 131])
@pytest.mark.parametrize("parents", [(-1, 0, 0, 1, 2), (-1, 0, 0, 0, 1, 2, 2, 4, 6)])
def test_a_tree_row_equals_the_decoding_step_bit_for_bit(prefix, parents):
    """bf16: node i of a tree forward == the real row of a decoding forward (that row + one dummy leaf) over
    [prefix, ancestors of i] with i's query, whatever masked siblings sit between (prefixes cross the 16 lanes)."""
    torch.manual_seed(prefix)
    tree = Tree(parents)
    keys = prefix + len(tree)
    query = torch.randn(1, HEADS, len(tree), DIM).bfloat16()
    key, value = torch.randn(1, KV_HEADS, keys, DIM).bfloat16(), torch.randn(1, KV_HEADS, keys, DIM).bfloat16()
    tree_out, _ = row(None, query, key, value, tree_visible(tree, prefix)[:, None])
    for node in range(len(tree)):
        context = [*range(prefix), *(prefix + i for i in lineage(tree, node))]  # ends with the node itself
        k = torch.cat([key[:, :, context], torch.randn(1, KV_HEADS, 1, DIM).bfloat16()], dim=2)
        v = torch.cat([value[:, :, context], torch.randn(1, KV_HEADS, 1, DIM).bfloat16()], dim=2)
        q = torch.cat([query[:, :, node:node + 1], torch.randn(1, HEADS, 1, DIM).bfloat16()], dim=2)
        step_visible = torch.ones(1, 2, len(context) + 1, dtype=torch.bool)
        step_visible[0, 0, -1] = False
        step_out, _ = row(None, q, k, v, additive(step_visible, torch.bfloat16))  # additive masks alike
        assert torch.equal(step_out[:, 0], tree_out[:, node]), (prefix, node)


@pytest.mark.parametrize("length", [70, 300])
def test_a_causal_row_equals_the_decoding_step_bit_for_bit(length):
    """A causal forward without a mask (sdpa's is_causal) gives row i what a decoding step over keys 0..i gives."""
    torch.manual_seed(length)
    query = torch.randn(1, HEADS, length, DIM).bfloat16()
    key, value = torch.randn(1, KV_HEADS, length, DIM).bfloat16(), torch.randn(1, KV_HEADS, length, DIM).bfloat16()
    causal, _ = row(None, query, key, value, None)
    for i in (0, 15, 16, 63, 200, length - 1):
        if i < length:
            step, _ = row(None, query[:, :, i:i + 1], key[:, :, :i + 1], value[:, :, :i + 1], None)
            assert torch.equal(step[:, 0], causal[:, i]), i


def test_threads_task_shapes_and_neighbours_leave_a_row_alone(monkeypatch):
    """One thread or two, tasks of one head or of a key head's group, a batch of 4 or the row's batch row alone, other
    rows' queries changed: the same bits."""
    torch.manual_seed(2)
    visible = torch.rand(4, 6, 90) < 0.7
    query = torch.randn(4, HEADS, 6, DIM).bfloat16()
    key, value = torch.randn(4, KV_HEADS, 90, DIM).bfloat16(), torch.randn(4, KV_HEADS, 90, DIM).bfloat16()
    reference_out, _ = row(None, query, key, value, visible[:, None])
    for serial in (0, 1 << 40):  # always threaded / always one thread
        monkeypatch.setattr(row_attention, "SERIAL_WORK", serial)
        out, _ = row(None, query, key, value, visible[:, None])
        assert torch.equal(out, reference_out)
        alone, _ = row(None, query[2:3, :, 4:5], key[2:3], value[2:3], visible[2:3, None, 4:5])
        assert torch.equal(alone[0, 0], reference_out[2, 4])
    other = query.clone()
    other[:, :, :4] = torch.randn_like(other[:, :, :4])
    assert torch.equal(row(None, other, key, value, visible[:, None])[0][:, 4:], reference_out[:, 4:])


def test_a_row_that_sees_no_key_is_zero_not_nan():
    """A left pad's query (transformers' generate on a padded batch) sees nothing: zeros, not NaN."""
    visible = torch.zeros(1, 2, 5, dtype=torch.bool)
    visible[0, 1, :3] = True
    out, _ = row(None, torch.randn(1, HEADS, 2, DIM), torch.randn(1, KV_HEADS, 5, DIM), torch.randn(1, KV_HEADS, 5, DIM),
                 visible[:, None])
    assert torch.equal(out[0, 0], torch.zeros(HEADS, DIM)) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["row_stable", "grouped"])
def test_a_left_padded_generate_equals_each_prompt_alone(name):
    """transformers' `generate` on a left-padded batch: a pad's query sees no key. Its attention must stay finite,
    or the NaN becomes the pad's key and value in the next layer and every row's output."""
    from tests.helpers.tree_models import tiny_llama

    model = tiny_llama(vocab=64, hidden=32, layers=2, seed=1)
    model.set_attn_implementation(row_attention.register() if name == "row_stable" else cpu_attention.register())
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5]]
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 5:]
    for row_tokens, prompt in zip(batched.tolist(), prompts):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert row_tokens == alone[0, len(prompt):].tolist()


def test_the_kernel_is_built_once_and_a_missing_compiler_is_one_line(monkeypatch, tmp_path):
    """The library is compiled into the cache once (a second process loads it); without a compiler, loading says
    what to do in one line. (The compiled target step's library is built by the same `native.build`.)"""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    row_attention.library.cache_clear()
    try:
        row_attention.library()
        built = list((tmp_path / "kernels").glob("row_attention-*.so"))
        assert len(built) == 1
        row_attention.library.cache_clear()
        run = native.subprocess.run

        def no_build(command, **kwargs):
            assert "-shared" not in command, "built again"
            return run(command, **kwargs)

        monkeypatch.setattr(native.subprocess, "run", no_build)
        row_attention.library()
        monkeypatch.undo()
        monkeypatch.setattr(native, "c_compiler", lambda: None)
        monkeypatch.setattr(devices, "c_compiler", lambda: None)
        row_attention.library.cache_clear()
        with pytest.raises(KernelUnavailable, match="needs a C compiler") as err:
            row_attention.library()
        assert "\n" not in str(err.value)
        assert not row_attention.available()
        assert devices.default_dtype("cpu") == torch.float32  # --dtype auto: fp32, which needs no kernel
    finally:
        monkeypatch.undo()
        row_attention.library.cache_clear()
