"""Batch-invariant target forwards by construction (mamba_draft.targets.exact: row blocks + row attention): in low
precision on a CPU, a position's logits are the same bits however many tokens share its forward (a decoding step,
a tree, a batch), so speculative output equals plain decoding token for token on any CPU kind. Exactness is the
contract: every comparison here is `torch.equal`.

`scripts/kernel_sweep.sh` runs this file under every narrower kernel path a machine can force; the adversarial
kernels below (a linear layer and an sdpa whose rounding follows the call's shape) stand in for the paths no machine
here can reach (AMX on an AMD CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from mamba_draft.heldout import is_heldout, read_spec_bench
from mamba_draft.targets import (
    default_attention, load_causal_lm, load_tokenizer, row_attention, row_blocks,
)
from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.facts import UnsupportedTargetError, cache_keyword
from mamba_draft.targets.exact import prefilling, prepare_target
from mamba_draft.targets.row_blocks import (agreeing_classes, make_row_invariant, pick_sizes, row_block,
                                            unblocked_forward)
from mamba_draft.tree import Tree
from tests.helpers.tree_models import random_drafter, tiny_llama
from tree_search.generate import SpeculativeDecoder, generate, generate_autoregressive
from tree_search.prompts import encode_prompt

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)

CHUNKS = (1, 2, 3, 5, 8, 17, 64, 300)  # rows per forward: decoding, trees, lookup rounds, a long forward


def bf16_target(seed: int = 0, vocab: int = 64, hidden: int = 64):
    model = tiny_llama(vocab=vocab, hidden=hidden, seed=seed, head_scale=0.3).to(torch.bfloat16)
    model.set_attn_implementation(row_attention.register())
    return model


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Every position's logits, the sequence fed `chunk` tokens per forward through one KV cache."""
    cache = DynamicCache(config=model.config)
    kwargs = {cache_keyword(model): cache, "use_cache": True}
    return torch.cat([model(input_ids=ids[:, i:i + chunk], **kwargs).logits[0] for i in range(0, ids.shape[1], chunk)])


def assert_nodes_get_the_decoding_steps_logits(target, ids: torch.Tensor, nodes: torch.Tensor, tree: Tree) -> None:
    """Each node's logits from one tree forward equal, bit for bit, those of plain decoding of the root, the node's
    ancestors and the node after the same prefix."""
    state = TargetCache(target)
    state.prefill(ids)
    tree_logits, _ = state.tree_forward(nodes[None], tree)
    for node in range(len(tree)):
        plain = TargetCache(target)
        plain.prefill(ids)
        for i in [0, *tree.path_to(node)]:
            logits = plain.decode(nodes[i].view(1))
        assert torch.equal(logits[0], tree_logits[0, node]), node


class RowCountRounding(nn.Linear):
    """An adversarial kernel: its rounding depends on how many rows a product has, as AMX's does, at counts a probe
    of powers of two never sees. A power-of-two row count is one bf16 product; any other count adds the K
    reduction in four bf16 partial sums, so the same row rounds differently in a forward of 3 or 5 rows than alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows & (rows - 1) == 0:
            return F.linear(x, self.weight, self.bias)
        out = None
        for part in torch.chunk(torch.arange(self.in_features), 4):
            piece = F.linear(x[..., part], self.weight[:, part])
            out = piece if out is None else out + piece
        return out if self.bias is None else out + self.bias


def adversarial(model):
    for layer in model.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = RowCountRounding
    return model


def test_the_adversarial_kernel_rounds_by_row_count():
    """The double is what it claims: the same row, alone and among two other rows, gives other bits."""
    layer = adversarial(nn.Sequential(nn.Linear(64, 64))).bfloat16()[0]
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        assert not torch.equal(layer(x)[:1], layer(x[:1]))
        assert torch.equal(layer(x[:2])[:1], layer(x[:1]))  # powers of two agree: a probe of them sees nothing


@pytest.mark.parametrize("kernel", ["library", "adversarial"])
def test_every_row_count_gives_the_same_bits(kernel, monkeypatch, tmp_path):
    """Logits of 300 positions fed 1, 2, 3, 5, 8, 17, 64 or 300 tokens per forward: the same bits, under this
    machine's kernels and under a kernel whose rounding follows the row count."""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    model = bf16_target()
    if kernel == "adversarial":
        adversarial(model)
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    sizes = make_row_invariant(model)
    assert row_block(model) == sizes
    reference = chunked_logits(model, ids, 1)
    for chunk in CHUNKS[1:]:
        assert torch.equal(chunked_logits(model, ids, chunk), reference), chunk
    with prefilling(model):  # a prefill is the same call in every path: it need only repeat itself
        assert torch.equal(chunked_logits(model, ids, 300), chunked_logits(model, ids, 300))
    assert torch.equal(chunked_logits(model, ids, 300), reference)  # the blocks are back after the prefill


@pytest.mark.parametrize("tree", ["1,1", "2,2", "3,1"])
def test_speculation_equals_plain_decoding_under_the_adversarial_kernel(tree, monkeypatch, tmp_path):
    """The tree engine on a target whose kernel rounds by row count (trees of 3 and 5 rows, plain decoding 1):
    every tree node's logits are the decoding step's, bit for bit, and greedy output is plain decoding's. Before
    row blocks a probed row floor of 1 (the probe tries powers of two) let both differ."""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    target = prepare_target(adversarial(bf16_target(seed=3)))
    drafter = random_drafter(tmp_path / "drafter", vocab=64, hidden=32, layers=1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 64, (1, 9), generator=g)
        plain = generate_autoregressive(target, ids, max_new_tokens=24, temperature=0).new_tokens[0].tolist()
        spec = generate(target, drafter, ids, max_new_tokens=24, temperature=0, tree=tree).new_tokens[0].tolist()
        assert spec == plain
    assert_nodes_get_the_decoding_steps_logits(target, ids, torch.randint(0, 64, (5,), generator=g),
                                               Tree((-1, 0, 0, 1, 2)))


def shape_rounding_sdpa(real, calls: list):
    """An adversarial sdpa: its rounding follows the number of query rows and keys of the call (a relative nudge of
    2^-7 to 2^-10 by shape), as a library that picks its kernel by shape may round."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(query.shape[-2])
        out = real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
        return (out.float() * (1 + 2.0 ** -(7 + (3 * query.shape[-2] + key.shape[-2]) % 4))).to(out.dtype)
    return sdpa


def test_the_adversarial_sdpa_rounds_by_shape(monkeypatch, tmp_path):
    """The double is what it claims: a bf16 target in row blocks that keeps sdpa gives other bits fed 1 or 3 tokens
    per forward."""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(F, "scaled_dot_product_attention", shape_rounding_sdpa(F.scaled_dot_product_attention, []))
    model = tiny_llama(vocab=64, hidden=64, seed=2, head_scale=0.3).to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    make_row_invariant(model)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(chunked_logits(model, ids, 3), chunked_logits(model, ids, 1))


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1"])
def test_speculation_equals_plain_decoding_under_the_adversarial_sdpa(tree, monkeypatch, tmp_path):
    """Under an sdpa that rounds by shape (which prefills run on), speculative output equals plain decoding, a tree
    node gets the decoding step's logits, and batch rows decode as their prompts alone: decoding and verification
    never call it, and a prefill is the same call in every path."""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", shape_rounding_sdpa(F.scaled_dot_product_attention, calls))
    target = tiny_llama(vocab=64, hidden=64, seed=4, head_scale=0.3).to(torch.bfloat16)  # as a user builds it: sdpa
    drafter = random_drafter(tmp_path / "drafter", vocab=64, hidden=32, layers=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 4, 13)]
    plain = generate_autoregressive(target, prompts, max_new_tokens=20, temperature=0)
    spec = generate(target, drafter, prompts, max_new_tokens=20, temperature=0, tree=tree)
    assert calls, "the prefill ran on the adversarial sdpa"
    for b, prompt in enumerate(prompts):
        alone = generate_autoregressive(target, torch.tensor([prompt]), max_new_tokens=20, temperature=0)
        assert plain.rows[b].new_tokens[0].tolist() == alone.new_tokens[0].tolist(), b
        assert spec.rows[b].new_tokens[0].tolist() == alone.new_tokens[0].tolist(), b
    # unprepared, the compiled step decoded it; prepared, transformers' forward verifies as exactly
    assert_nodes_get_the_decoding_steps_logits(prepare_target(target), torch.tensor([prompts[0]]),
                                               torch.randint(0, 64, (5,), generator=g), Tree((-1, 0, 0, 1, 2)))


def test_a_batch_row_gets_the_logits_of_its_prompt_alone(monkeypatch, tmp_path):
    """Left-padded prompts of different lengths in one cache: each row's tree logits equal those of its prompt in a
    cache of its own (a batch of one), bit for bit (other rows share every product and attention call of the
    forward)."""
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    target = prepare_target(bf16_target(seed=5))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (7, 3, 12)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    shape = Tree((-1, 0, 0, 1))
    nodes = torch.randint(0, 64, (len(prompts), len(shape)), generator=g)
    batch = TargetCache(target)
    batch.prefill(ids, mask)
    batched, _ = batch.tree_forward(nodes, shape)
    paths = [[1, 3], [2], []]
    batch.commit(paths)
    after = batch.decode(nodes[:, 0])
    for b, prompt in enumerate(prompts):
        alone = TargetCache(target)
        alone.prefill(prompt[None])
        logits, _ = alone.tree_forward(nodes[b][None], shape)
        assert torch.equal(logits[0], batched[b]), b
        alone.commit([paths[b]])
        assert torch.equal(alone.decode(nodes[b, 0].view(1))[0], after[b]), b


def test_pick_sizes_takes_the_rows_that_come_nearly_free():
    """Costs of one block (ms) as measured on the kinds: AMX-like flat products take 16-row blocks, a memory-bound
    fp32 product 2 (a 4-row product costs 1.6x), emulated bf16 single rows; where counts from 2 up agree (AMD's
    AVX512-BF16), a ladder: a decoding step in 2 rows, a 16-token tree in one block of 16."""
    each = [(1,), (2,), (4,), (8,), (16,)]
    assert pick_sizes({1: 12.3, 2: 12.4, 4: 12.6, 8: 12.8, 16: 13.1}, each) == (16,)
    assert pick_sizes({1: 20.4, 2: 21.9, 4: 34.1, 8: 42.7, 16: 46.1}, each) == (2,)
    assert pick_sizes({1: 23.5, 2: 36.5, 4: 48.4, 8: 66.0, 16: 103.9}, each) == (1,)
    amd = {1: 10.5, 2: 10.8, 4: 10.2, 8: 11.4, 16: 13.2}
    assert pick_sizes(amd, [(1,), (2, 4, 8, 16)]) == (2, 4, 8, 16)
    assert pick_sizes(amd, [(1,), (2, 4, 8, 16)], slack=1.01) == (1,)  # a step may not cost 3 % more here


def test_one_row_never_joins_a_ladder():
    """A one-row product is a matrix-vector kernel: even where it agrees with 2-row blocks on the probe's random rows
    (as on ATen's scalar path), real activations can round otherwise, so 1 stays a ladder of its own."""
    layer = nn.Sequential(nn.Linear(64, 64)).bfloat16()
    classes = agreeing_classes(row_blocks._shapes(layer), (1, 2, 4, 8, 16))
    assert classes[0] == (1,) and all(1 not in c for c in classes[1:])


def test_a_ladder_multiplies_each_forward_in_its_smallest_fitting_blocks():
    """Blocks of the ladder only: 1 row in a block of 2, 3 in 4, 16 in one 16, 37 in 16 + 16 + 8 (padded)."""
    layer = nn.Sequential(nn.Linear(8, 8)).bfloat16()
    make_row_invariant(layer, rows=(2, 4, 8, 16))
    counts = []
    original = nn.Linear.forward
    nn.Linear.forward = lambda self, x: counts.append(x.shape[0]) or original(self, x)
    try:
        with torch.no_grad():
            for n in (1, 3, 16, 37):
                layer(torch.randn(n, 8).bfloat16())
    finally:
        nn.Linear.forward = original
    assert counts == [2, 4, 16, 16, 16, 8]


class PlaceDependent(nn.Linear):
    """A kernel whose last row of a block rounds differently: row blocks must not trust such a block size."""

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if x.shape[0] > 1:
            out[-1] = out[-1] + out[-1].abs() * 2 ** -7
        return out


def test_choose_rows_keeps_its_choice_and_refuses_blocks_a_row_is_not_free_in(monkeypatch, tmp_path):
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(64, 64)).bfloat16()
    model[0].__class__ = PlaceDependent
    monkeypatch.setattr(row_blocks, "block_costs", lambda m: {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0})
    assert make_row_invariant(model) == (1,)  # every larger block fails the position check
    other = nn.Sequential(nn.Linear(32, 32)).bfloat16()
    chosen = make_row_invariant(other)
    assert chosen[-1] == 16  # equal costs: a forward of 16 rows in one block
    assert (tmp_path / "row_blocks.json").is_file()
    monkeypatch.setattr(row_blocks, "block_costs", lambda m: pytest.fail("the kept choice is measured again"))
    assert make_row_invariant(nn.Sequential(nn.Linear(32, 32)).bfloat16()) == chosen
    monkeypatch.setenv(row_blocks.ROWS_ENV, "4")
    assert make_row_invariant(nn.Sequential(nn.Linear(32, 32)).bfloat16()) == (4,)
    monkeypatch.setenv(row_blocks.ROWS_ENV, "8,2")
    assert make_row_invariant(nn.Sequential(nn.Linear(32, 32)).bfloat16()) == (2, 8)


def test_blocks_leave_parameters_state_dict_and_training_alone():
    model = tiny_llama(vocab=64, hidden=32).bfloat16()
    keys = list(model.state_dict())
    make_row_invariant(model, rows=4)
    assert list(model.state_dict()) == keys and row_block(model) == (4,)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, nn.Linear) and unblocked_forward(layer).__self__ is layer
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # with gradients: a plain product, differentiable
    assert x.grad is not None


def test_fp32_targets_are_left_as_transformers_builds_them(monkeypatch):
    """fp32 moves a product's last bit of 24 with the row count, far below a logit gap; blocks there would cost a
    memory-bound product a weight pass per block, so only bf16/fp16 CPU targets get them."""
    model = tiny_llama(vocab=64, hidden=32)
    TargetCache(model)
    assert row_block(model) is None
    monkeypatch.setenv(row_blocks.ROWS_ENV, "4")  # no block-cost measurement
    bf16 = tiny_llama(vocab=64, hidden=32).to(torch.bfloat16)
    with pytest.raises(UnsupportedTargetError, match="not prepared"):  # transformers' forward would verify it
        TargetCache(bf16)
    assert row_block(bf16) is None and bf16.config._attn_implementation == "sdpa"  # left as it was
    prepare_target(bf16)  # a low-precision CPU target gets its row blocks when prepared, explicitly
    assert row_block(bf16) == (4,) and bf16.config._attn_implementation == "row_stable"
    TargetCache(bf16)
    assert default_attention(torch.bfloat16, "cpu") == "row_stable" and default_attention(torch.float32, "cpu") == "sdpa"


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    target = load_causal_lm("smollm2", dtype=torch.bfloat16)
    drafter = random_drafter(tmp_path_factory.mktemp("drafter"), vocab=49152, hidden=64, layers=1)
    return target, drafter, load_tokenizer("smollm2")


def test_the_real_target_gives_every_row_count_the_same_bits(bf16_pair):
    """SmolLM2-135M in bf16, 70 positions fed 1, 2, 3, 5, 8, 17, 64 or 70 tokens per forward: the same bits."""
    target, _, _ = bf16_pair
    assert row_block(target) is not None and target.config._attn_implementation == "row_stable"
    ids = torch.randint(100, 20000, (1, 70), generator=torch.Generator().manual_seed(0))
    reference = chunked_logits(target, ids, 1)
    for chunk in (2, 3, 5, 8, 17, 64, 70):
        assert torch.equal(chunked_logits(target, ids, chunk), reference), chunk


def test_bf16_speculation_equals_plain_decoding_on_the_real_target(bf16_pair):
    """SmolLM2-135M in bf16: tree and chain outputs equal plain (autoregressive) decoding token for token."""
    target, drafter, tokenizer = bf16_pair
    questions = [r["turns"][0] for r in read_spec_bench() if not is_heldout(r)][::80][:2]
    # decoders kept over the questions, as a stream of calls keeps them (one static cache and packed step each)
    plain_decoder = SpeculativeDecoder(target)
    decoders = {tree: SpeculativeDecoder(target, drafter, tree=tree) for tree in ("3,2,1", "1,1")}
    for text in questions:
        ids = torch.tensor([encode_prompt(tokenizer, text)])[:, -200:]
        plain = plain_decoder.generate(ids, max_new_tokens=24, temperature=0).new_tokens[0].tolist()
        for tree, decoder in decoders.items():
            spec = decoder.generate(ids, max_new_tokens=24, temperature=0).new_tokens[0].tolist()
            assert spec == plain, (text[:40], tree)


@pytest.mark.parametrize("tree,tokens", [((-1, 0, 0), 3), ((-1, 0, 0, 0, 2), 5), ((-1, 0, 0, 1, 2), 5)])
def test_a_node_behind_masked_siblings_gets_the_decoding_steps_logits(bf16_pair, tree, tokens):
    """bf16 SmolLM2: the logits of a tree node equal, bit for bit, those plain decoding computes for the same token
    after the same context, though masked siblings sit between the node and its ancestors in the forward."""
    target, _, tokenizer = bf16_pair
    tree = Tree(tree)
    questions = [r["turns"][0] for r in read_spec_bench() if not is_heldout(r)][5::60][:2]
    g = torch.Generator().manual_seed(0)
    for text in questions:
        ids = torch.tensor([encode_prompt(tokenizer, text)])[:, -120:]
        assert_nodes_get_the_decoding_steps_logits(target, ids, torch.randint(100, 20000, (tokens,), generator=g), tree)


def test_a_real_batch_decodes_every_row_as_its_prompt_alone(bf16_pair):
    """SmolLM2-135M in bf16, six prompts of different lengths in one batch: plain and speculative decoding of the
    batch give every row the tokens of its prompt decoded alone."""
    target, drafter, tokenizer = bf16_pair
    texts = [r["turns"][0] for r in read_spec_bench() if not is_heldout(r)][3::13][:6]
    prompts = [encode_prompt(tokenizer, text)[-120:] for text in texts]
    assert len({len(p) for p in prompts}) > 3
    plain_decoder = SpeculativeDecoder(target)
    plain = plain_decoder.generate(prompts, max_new_tokens=16, temperature=0)
    spec = generate(target, drafter, prompts, max_new_tokens=16, temperature=0, tree="3,2,1")
    for b, prompt in enumerate(prompts):
        alone = plain_decoder.generate(torch.tensor([prompt]), max_new_tokens=16, temperature=0)
        assert plain.rows[b].new_tokens[0].tolist() == alone.new_tokens[0].tolist(), b
        assert spec.rows[b].new_tokens[0].tolist() == alone.new_tokens[0].tolist(), b
