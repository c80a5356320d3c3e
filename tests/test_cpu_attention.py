"""CPU attention kernels: grouped attention is eager's arithmetic; row-stable attention gives a tree node, bit for bit,
the output the decoding step computes for the same token after the same context (the real-target check is
tests/test_invariance.py; here random tensors, with contexts that cross the kernel's block boundaries)."""
from __future__ import annotations

import pytest
import torch

from mamba_draft.targets.cpu_attention import BLOCK, LOOP_SUM_MIN, _blocks_sum, grouped_attention, row_stable_attention
from tree_search.tree import Tree

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention shape


def reference(query, key, value, visible):
    """transformers' eager attention in float64: key heads repeated, masked softmax."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


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


@pytest.mark.parametrize("attention", [grouped_attention, row_stable_attention])
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


@pytest.mark.parametrize("prefix", [0, 5, BLOCK - 2, BLOCK, 2 * BLOCK - 1, 3 * BLOCK + 7])
@pytest.mark.parametrize("parents", [(-1, 0, 0, 1, 2), (-1, 0, 0, 0, 1, 2, 2, 4, 6)])
def test_a_tree_row_equals_the_decoding_step_bit_for_bit(prefix, parents):
    """bf16: node i of a tree forward == the real row of a decoding forward (that row + one dummy leaf, as
    tree_search pads it) over [prefix, ancestors of i] with i's query, whatever masked siblings sit between."""
    torch.manual_seed(prefix)
    tree = Tree(parents)
    keys = prefix + len(tree)
    query = torch.randn(1, HEADS, len(tree), DIM).bfloat16()
    key, value = torch.randn(1, KV_HEADS, keys, DIM).bfloat16(), torch.randn(1, KV_HEADS, keys, DIM).bfloat16()
    visible = tree_visible(tree, prefix)
    tree_out, _ = row_stable_attention(None, query, key, value, additive(visible, torch.bfloat16))
    for node in range(len(tree)):
        context = [*range(prefix), *(prefix + i for i in lineage(tree, node))]  # ends with the node itself
        k, v = key[:, :, context], value[:, :, context]
        # the decoding step: the node's row, then a dummy leaf under it (its key appended, seen by the dummy only)
        k = torch.cat([k, torch.randn(1, KV_HEADS, 1, DIM).bfloat16()], dim=2)
        v = torch.cat([v, torch.randn(1, KV_HEADS, 1, DIM).bfloat16()], dim=2)
        q = torch.cat([query[:, :, node:node + 1], torch.randn(1, HEADS, 1, DIM).bfloat16()], dim=2)
        step_visible = torch.ones(1, 2, len(context) + 1, dtype=torch.bool)
        step_visible[0, 0, -1] = False
        step_out, _ = row_stable_attention(None, q, k, v, additive(step_visible, torch.bfloat16))
        assert torch.equal(step_out[:, 0], tree_out[:, node]), (prefix, node)


def test_a_mask_changed_in_place_is_planned_again():
    """The plan (where each row's keys sit) is reused across a forward's layers, never for a mask that changed."""
    torch.manual_seed(0)
    tree = Tree((-1, 0, 0))
    visible = tree_visible(tree, 10)
    query, key, value = torch.randn(1, HEADS, 3, DIM), torch.randn(1, KV_HEADS, 13, DIM), torch.randn(1, KV_HEADS, 13, DIM)
    mask = additive(visible, torch.float32)
    row_stable_attention(None, query, key, value, mask)
    visible[0, 2, :5] = False
    mask.copy_(additive(visible, torch.float32))
    out, _ = row_stable_attention(None, query, key, value, mask)
    torch.testing.assert_close(out.double(), reference(query, key, value, visible), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [70, 300])
def test_a_prefill_row_equals_the_decoding_step_bit_for_bit(length):
    """Speculation feeds a prompt's last token through the first tree forward, plain decoding through the prefill:
    the cache they leave must agree, so a causal prefill's row rounds as the decoding step over the same keys."""
    torch.manual_seed(length)
    query = torch.randn(1, HEADS, length, DIM).bfloat16()
    key, value = torch.randn(1, KV_HEADS, length, DIM).bfloat16(), torch.randn(1, KV_HEADS, length, DIM).bfloat16()
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    prefill, _ = row_stable_attention(None, query, key, value, additive(causal, torch.bfloat16))
    for row in (0, 63, 64, 127, 128, 200, length - 1):  # blocks and chunks (CHUNK rows) begin at 64, 128
        if row >= length:
            continue
        step, _ = row_stable_attention(None, query[:, :, row:row + 1], key[:, :, :row + 1], value[:, :, :row + 1], None)
        assert torch.equal(step[:, 0], prefill[:, row]), row


@pytest.mark.parametrize("rows", [6, 2 * LOOP_SUM_MIN // 64])
def test_block_sums_by_cumsum_and_by_loop_agree_bit_for_bit(rows):
    """Small block sums take one cumsum, large ones (prefills) a loop of float64 adds: the same bits, so a prefill
    row and a decoding step still agree (the row-level check is the prefill test above)."""
    torch.manual_seed(rows)
    parts = (torch.randn(1, 3, rows, 9, 3, DIM) * torch.rand(1, 3, 1, 9, 1, 1) * 100).bfloat16()  # (.., n, nb, G, D)
    by_cumsum = torch.cumsum(parts, 3, dtype=torch.float32)[:, :, :, -1]
    assert torch.equal(_blocks_sum(parts), by_cumsum)


@pytest.mark.parametrize("name", ["row_stable", "grouped"])
def test_a_left_padded_generate_equals_each_prompt_alone(name):
    """transformers' `generate` on a left-padded batch: a pad's query sees no key. Its attention must stay finite,
    or the NaN becomes the pad's key and value in the next layer and every row's output (row-stable attention gave
    all-NaN logits here, so `regenerate` wrote empty replies in bf16)."""
    from mamba_draft.targets.cpu_attention import register
    from tests.helpers.tree_models import tiny_llama

    model = tiny_llama(vocab=64, hidden=32, layers=2, seed=1)
    model.set_attn_implementation(register(name))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5]]
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 5:]
    for row, prompt in zip(batched.tolist(), prompts):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert row == alone[0, len(prompt):].tolist()
