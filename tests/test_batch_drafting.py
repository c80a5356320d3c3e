"""Tree drafting for B prompts (tree.Forest, TreeDrafter.prefill / draft / resync / compact), B = 1 included.

The reference is a single-prompt tree drafter (tests/helpers/drafting_reference.py, independent of TreeDrafter): for
every batch row, the forest must give exactly the tokens (and the recorded q) that drafting that prompt's tree alone
gives, round after round, whatever each row accepted. The
drafters' weights are float64, so batched and single-row matmuls agree far below any top-k tie; the SSM recurrence
and q are float32 whatever the weights, hence float32 tolerances on logits and q.
"""
from __future__ import annotations

import pytest
import torch

from mamba_draft.tree import Forest, TreeConfig
from tests.helpers.drafting_reference import SingleTreeDrafter
from tests.helpers.tree_models import random_drafter
from tests.test_graph_runner import fake_graphs
from tree_search.tree_drafter import TreeDrafter
from tree_search.sampling import SamplingParams

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=20)
PROMPTS = ([5, 9, 2, 40, 7], [3, 3, 11], [60, 1, 8, 8, 22, 13, 4], [17])
CONFIGS = (TreeConfig((3, 2, 1)), TreeConfig((2, 2)), TreeConfig((1, 1, 1)), TreeConfig((4,)))  # (4,): leaves on level 1
CLOSE = dict(rtol=1e-5, atol=1e-6)  # float32 rounding (see the module docstring)
ROWS = 4 * (max(c.num_nodes for c in CONFIGS) + 1)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"), vocab=VOCAB).to(torch.float64)


@pytest.fixture(scope="module")
def subset_drafter(tmp_path_factory):
    model = random_drafter(tmp_path_factory.mktemp("subset"), vocab=VOCAB, seed=3).to(torch.float64)
    model.set_draft_vocab(torch.arange(VOCAB - 1, 0, -3))  # 21 ids, column order unrelated to id order
    return model


def left_padded(prompts, pad: int = 0, extra: int = 0):
    width = max(map(len, prompts)) + extra
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    return ids, mask


def accepted_node(config: TreeConfig, r: int, b: int) -> int:
    """A different accepted node per round and row: none, inner nodes and last-level leaves all come up."""
    tree = config.build()
    return (3 * r + 5 * b) % len(tree)


def single(drafter, prompt) -> SingleTreeDrafter:
    """One prompt through the single-tree reference."""
    reference = SingleTreeDrafter(drafter, ROWS, VOCAB)
    reference.prefill(prompt)
    return reference


def check_walk(drafter, prompts, rounds: int = 6, params=GREEDY, mode="topk", generators=None, drop=None,
               graphs: bool = False):
    """Draft `rounds` rounds for all prompts batched and one by one; compare every row, every round.

    drop: (round, rows kept) compacts the batch after that round. Accepted nodes alternate host lists and tensors."""
    singles = [single(drafter, p) for p in prompts]
    batched = TreeDrafter(drafter, ROWS, VOCAB)
    if graphs:
        fake_graphs(batched.runner)
    ids, mask = left_padded(prompts)
    logits = batched.prefill(ids, mask)
    alive = list(range(len(prompts)))
    for r in range(rounds):
        config = CONFIGS[r % len(CONFIGS)]
        batch = len(alive)
        gen = None if generators is None else [generators[1][b] for b in alive]
        buf = batched.draft(config, batched.roots[:batch], logits, params, mode, True, gen)
        nodes, tokens = [], []
        for row, b in enumerate(alive):
            want_tokens, want_probs = singles[b].draft(config, params, mode, True,
                                                       None if generators is None else generators[0][b])
            assert torch.equal(buf.tokens[row], want_tokens), f"round {r} row {b}"
            torch.testing.assert_close(buf.probs[row], want_probs, rtol=1e-5, atol=1e-8)  # q is float32
            nodes.append(accepted_node(config, r, b))
            tokens.append((7 * r + 3 * b + 1) % VOCAB)
            singles[b].resync(nodes[-1], tokens[-1])
        accepted = nodes if r % 2 == 0 else torch.tensor(nodes)
        logits = batched.resync(buf, accepted, tokens)
        for row, b in enumerate(alive):
            torch.testing.assert_close(logits[row], singles[b].logits, **CLOSE)
            assert int(batched.roots[row]) == int(singles[b].root)
        if drop is not None and r == drop[0]:
            keep = [row for row, b in enumerate(alive) if b in drop[1]]
            batched.compact(keep)
            logits, alive = logits[keep], [alive[row] for row in keep]
    return batched


# ---------------------------------------------------------------- the forest layout


@pytest.mark.parametrize("batch", [1, 3])
def test_forest_is_level_major_and_ordered_by_batch_row_then_tree_order(batch):
    tree = TreeConfig((3, 2, 1)).build()
    forest = Forest(tree, batch)
    rows = forest.rows
    assert rows.shape == (batch, len(tree)) and len(forest) == batch * len(tree)
    assert sorted(rows.flatten().tolist()) == list(range(len(forest)))  # every state row used once
    assert rows[:, 0].tolist() == list(range(batch))  # the B roots first
    for depth, ((start, stop), (lo, hi)) in enumerate(zip(tree.levels, forest.levels)):
        level = rows[:, start:stop]
        assert (lo, hi) == (batch * start, batch * stop)
        assert level.flatten().tolist() == list(range(lo, hi))  # batch row, then the tree's order (by parent)
        if depth:
            parents = torch.tensor(tree.parents[start:stop])
            assert forest.parent_rows[depth - 1].tolist() == rows.gather(1, parents.expand(batch, -1)).flatten().tolist()
    with pytest.raises(ValueError, match="positive integer batch"):
        Forest(tree, 0)


# ---------------------------------------------------------------- batched == single prompt, row by row


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_batched_drafting_equals_single_prompt_drafting_every_row_every_round(drafter, batch):
    check_walk(drafter, PROMPTS[:batch])


def test_batched_levels_go_through_graphs_keyed_by_row_range(drafter):
    batched = check_walk(drafter, PROMPTS[:2], rounds=5, graphs=True)
    keys = set(batched.runner.graphs)
    # (3, 2, 1) for 2 prompts: levels 1 and 2 are rows [2, 8) and [8, 20); resync steps rows [0, 2), and after an
    # accepted leaf first the last level's first 2 rows: [20, 22), and [2, 4) for (4,), whose leaves are level 1
    assert {(2, 8, True), (8, 20, True), (0, 2, True), (20, 22, True), (2, 4, True)} <= keys


def test_sampled_drafting_with_one_generator_per_row_reproduces_each_prompt_alone(drafter):
    def generators(seed):
        return [torch.Generator().manual_seed(seed + b) for b in range(3)]

    check_walk(drafter, PROMPTS[:3], rounds=4, params=SAMPLED, mode="sample", generators=(generators(7), generators(7)))


def test_sampled_drafting_with_one_generator_draws_distinct_children_from_q(drafter):
    drafts = TreeDrafter(drafter, ROWS, VOCAB)
    ids, mask = left_padded(PROMPTS[:3])
    logits = drafts.prefill(ids, mask)
    config = TreeConfig((4, 3))
    buf = drafts.draft(config, drafts.roots[:3], logits, SAMPLED, "sample", False, torch.Generator().manual_seed(0))
    for row in range(3):
        for node, kids in enumerate(buf.tree.children):
            if kids:
                drawn = buf.tokens[row, list(kids)]
                assert len(set(drawn.tolist())) == len(kids)
                assert bool((buf.probs[row, node, drawn] > 0).all())  # q is recorded in sample mode, draws in support
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        drafts.draft(config, drafts.roots[:3], logits, SAMPLED, "sample", False, [torch.Generator()] * 2)


def test_a_draft_vocabulary_maps_every_rows_tokens_and_q(subset_drafter):
    check_walk(subset_drafter, PROMPTS[:3], rounds=4)
    drafts = TreeDrafter(subset_drafter, ROWS, VOCAB)
    ids, mask = left_padded(PROMPTS[:3])
    buf = drafts.draft(CONFIGS[0], drafts.roots[:3], drafts.prefill(ids, mask), GREEDY, "topk", True, None)
    allowed = set(subset_drafter.draft_ids.tolist())
    assert set(buf.tokens[:, 1:].flatten().tolist()) <= allowed
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset_drafter.draft_ids] = False
    assert bool((buf.probs[:, :, outside] == 0).all())


# ---------------------------------------------------------------- padding, dropped rows, resync cost


def test_left_padding_never_enters_a_rows_state(drafter):
    states, logits = [], []
    for pad, extra in ((0, 0), (63, 3)):
        drafts = TreeDrafter(drafter, ROWS, VOCAB)
        ids, mask = left_padded(PROMPTS, pad=pad, extra=extra)
        logits.append(drafts.prefill(ids, mask))
        states.append(drafts.state.rows(0, len(PROMPTS)).clone())
    assert torch.equal(logits[0], logits[1])  # other pad ids, more padding: bit for bit the same rows
    assert torch.equal(states[0].conv, states[1].conv) and torch.equal(states[0].ssm, states[1].ssm)
    for b, prompt in enumerate(PROMPTS):  # and each row is the prompt encoded alone
        alone = SingleTreeDrafter(drafter, 1, VOCAB)
        torch.testing.assert_close(logits[0][b], alone.prefill(prompt), **CLOSE)
        torch.testing.assert_close(states[0].ssm[:, b], alone.state.ssm[:, 0], **CLOSE)


def test_dropping_rows_keeps_the_others_identical(drafter):
    check_walk(drafter, PROMPTS, rounds=6, drop=(1, {0, 2, 3}))
    check_walk(drafter, PROMPTS[:3], rounds=5, drop=(2, {2}))  # down to one row, which was not row 0
    drafts = TreeDrafter(drafter, ROWS, VOCAB)
    drafts.prefill(*left_padded(PROMPTS[:3]))
    before = drafts.state.rows(0, 3).clone()
    drafts.compact([1, 2])
    assert torch.equal(drafts.state.ssm[:, :2], before.ssm[:, 1:3])
    assert drafts.roots[:2].tolist() == [PROMPTS[1][-1], PROMPTS[2][-1]]


def test_resync_steps_accepted_leaves_in_one_extra_batched_step_only_when_needed(drafter):
    drafts = TreeDrafter(drafter, ROWS, VOCAB)
    logits = drafts.prefill(*left_padded(PROMPTS[:3]))
    config = TreeConfig((2, 2))
    buf = drafts.draft(config, drafts.roots[:3], logits, GREEDY, "topk", False, None)
    assert not buf.leaf[:3].any() and buf.leaf[3:].all()
    calls = drafts.calls
    drafts.resync(buf, [0, 1, 2], [4, 5, 6])  # no leaf: one B-row step
    assert drafts.calls - calls == 1
    buf = drafts.draft(config, drafts.roots[:3], logits, GREEDY, "topk", False, None)
    calls = drafts.calls
    drafts.resync(buf, [0, 6, 1], [4, 5, 6])  # a leaf in row 1: the leaf step first, for all rows at once
    assert drafts.calls - calls == 2
    calls = drafts.calls
    drafts.resync(buf, torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6]))  # device tensors: never a sync
    assert drafts.calls - calls == 2


def test_bad_batched_inputs_get_one_line_errors(drafter):
    drafts = TreeDrafter(drafter, 8, VOCAB)
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="prompt 1 is not left-padded"):
        drafts.prefill(ids, mask.flip(1))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\)"):
        drafts.prefill(ids, mask[:, 1:])
    with pytest.raises(ValueError, match=r"a \(B, L\) tensor"):
        drafts.prefill(ids[0], None)
    with pytest.raises(ValueError, match="9 prompts exceeds the 8 state rows"):
        drafts.prefill(torch.ones(9, 2, dtype=torch.long))
    logits = drafts.prefill(ids, mask)
    with pytest.raises(ValueError, match="2 trees \\(3,2,1\\) need 32 state rows, only 8"):
        drafts.draft(CONFIGS[0], drafts.roots[:2], logits, GREEDY, "topk", False, None)
    buf = drafts.draft(TreeConfig((2,)), drafts.roots[:2], logits, GREEDY, "topk", False, None)
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        drafts.resync(buf, [0, 3], [1, 1])
    with pytest.raises(ValueError, match="expected 2 values, one per batch row, got 1"):
        drafts.resync(buf, [0], [1, 1])


def test_ids_a_narrow_drafter_cannot_read_are_clamped_per_row_as_in_the_single_path(tmp_path):
    narrow = random_drafter(tmp_path, vocab=48).to(torch.float64)  # a target head padded to 64 may commit ids >= 48
    prompts = ([50, 7, 63, 20], [5, 9])
    batched = TreeDrafter(narrow, ROWS, VOCAB)
    assert batched.read_limit == 47
    logits = batched.prefill(*left_padded(prompts))
    assert batched.roots[:2].tolist() == [20, 9]
    buf = batched.draft(CONFIGS[1], batched.roots[:2], logits, GREEDY, "topk", True, None)
    logits = batched.resync(buf, [0, 6], [60, 3])
    assert batched.roots[:2].tolist() == [60, 3]  # the roots stay the real tokens
    for b, prompt in enumerate(prompts):
        alone = single(narrow, prompt)
        assert alone.read_limit == 47
        tokens, _ = alone.draft(CONFIGS[1], GREEDY, "topk")
        assert torch.equal(buf.tokens[b], tokens)
        alone.resync([0, 6][b], [60, 3][b])
        torch.testing.assert_close(logits[b], alone.logits, **CLOSE)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_root_only_tree_resync_steps_each_root_once(drafter, as_tensor):
    """A no-speculation round resyncs through the root-only tree: its root is not an unstepped leaf, so each row
    steps its next token exactly once (host list or device tensor alike), as the reference's resync of none."""
    config = TreeConfig(())
    singles = [single(drafter, p) for p in PROMPTS]
    batched = TreeDrafter(drafter, ROWS, VOCAB)
    batched.prefill(*left_padded(PROMPTS))
    for r in range(3):
        buf = batched.buffers(config, len(PROMPTS))
        tokens = [(5 * r + 7 * b + 2) % VOCAB for b in range(len(PROMPTS))]
        accepted = torch.zeros(len(PROMPTS), dtype=torch.long) if as_tensor else [0] * len(PROMPTS)
        calls = batched.calls
        logits = batched.resync(buf, accepted, tokens)
        assert batched.calls - calls == 1
        for b, alone in enumerate(singles):
            alone.draft(config, GREEDY, "topk")
            alone.resync(0, tokens[b])
            torch.testing.assert_close(logits[b], alone.logits, **CLOSE)
