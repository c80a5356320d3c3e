"""Batched target verification: B left-padded prompts in one `TargetCache` give, per row, the logits and the KV cache
of that prompt alone (a cache of its own holding a batch of one, re-encoding), through greedy tree rounds with ragged
accepted paths, finished rows dropped, and the plain batched decode step, in dynamic and static storage; bad batches
are refused before any model runs (`plan.check_batch_prompts`)."""
import pytest
import torch

from mamba_draft.targets.cache import TargetCache
from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import encoded_cache, hf_greedy, tiny_causal_lm
from tree_search.plan import check_batch_prompts

VOCAB = 64
TREES = [TreeConfig((2, 2, 1)).build(), TreeConfig((3, 1, 1)).build()]  # both depth 3, used in turn
CLOSE = dict(atol=1e-5, rtol=1e-4)
MAX_LEN = 96  # static storage: the widest padded prompt (9) + 15 rounds of at most 4 slots + the widest tree (11)


def target(kind: str, attn: str):
    model = tiny_causal_lm(kind, sliding_window=64) if kind == "mistral" else tiny_causal_lm(kind)
    model.set_attn_implementation(attn)
    return model


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids (pads hold a real token id, 7, so a pad that leaks changes the logits) and their mask."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), 7)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
    return ids, mask


def random_prompts(lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def greedy_path(tree, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: follow the child holding the target's argmax -> (accepted path, next token)."""
    node, path = 0, []
    while True:
        best = int(logits[node].argmax())
        match = [c for c in tree.children[node] if int(tokens[c]) == best]
        if not match:
            return path, best
        node = match[0]
        path.append(node)


def committed(prompt: torch.Tensor, out: list[int]) -> torch.Tensor:
    """What a row's cache holds: its prompt and new tokens, minus the last one (the next round's root)."""
    return torch.cat([prompt, torch.tensor(out[:-1], dtype=torch.long)])


def cache(model, static: bool, max_len: int = MAX_LEN) -> TargetCache:
    return TargetCache(model, static=True, max_len=max_len) if static else TargetCache(model)


def assert_cache_is_reencoding(model, state: TargetCache, row: int, sequence: torch.Tensor) -> None:
    """Row `row`'s valid slots hold exactly the keys / values of encoding `sequence` alone, and nothing else."""
    assert int(state.positions[row]) == sequence.numel()
    slots = state.valid[row].nonzero().flatten()
    assert slots.numel() == sequence.numel()
    reference = encoded_cache(model, sequence[None])
    for ours, ref in zip(state.cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys[row][:, slots], ref.keys[0], **CLOSE)
        torch.testing.assert_close(ours.values[row][:, slots], ref.values[0], **CLOSE)


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("lengths", [(1, 6), (4, 9, 2), (3, 1, 7, 5)])
@pytest.mark.parametrize("static", [False, True, "tight"], ids=["dynamic", "static", "static-tight"])
def test_batched_greedy_rounds_equal_single_prompt_states(kind, attn, lengths, static):
    """Trees drafted from each row's own greedy continuation, cut at a random depth per row, so rows accept paths of
    different lengths every round; rows finish at different budgets and are dropped. The batch runs in dynamic or
    static storage, each prompt alone in a dynamic cache of its own. "tight": static storage of generate's size
    (padded prompt + new tokens + widest tree + 1), which the slow rows' holes overflow unless it compacts."""
    model = target(kind, attn)
    prompts = random_prompts(lengths, seed=len(lengths))
    budgets = [6 + 3 * b for b in range(len(prompts))]
    depth = TREES[0].depth
    refs = [hf_greedy(model, p[None], budget + depth)[0, p.numel():].tolist() for p, budget in zip(prompts, budgets)]
    ids, mask = left_pad(prompts)
    tight = ids.shape[1] + max(budgets) + depth + max(map(len, TREES)) + 1
    state = cache(model, bool(static), tight if static == "tight" else MAX_LEN)
    state.prefill(ids[:, :-1], mask[:, :-1])  # every row's last prompt token is its first root
    singles = []
    for p in prompts:
        singles.append(TargetCache(model))
        singles[-1].prefill(p[None, :-1])
    active = list(range(len(prompts)))  # batch row i holds prompt active[i]
    outs = [[] for _ in prompts]
    g = torch.Generator().manual_seed(0)
    accepted_lengths = set()
    for round_ in range(40):
        tree = TREES[round_ % 2]
        tokens = torch.randint(0, VOCAB, (len(active), len(tree)), generator=g)
        for i, b in enumerate(active):
            tokens[i, 0] = prompts[b][-1] if not outs[b] else outs[b][-1]
            node = 0
            for d in range(int(torch.randint(0, depth + 1, (), generator=g))):  # the chain of first children
                node = tree.children[node][0]
                tokens[i, node] = refs[b][len(outs[b]) + d]
        logits, _ = state.tree_forward(tokens, tree)
        assert logits.shape == (len(active), len(tree), VOCAB)
        paths, finished = [], []
        for i, b in enumerate(active):
            single, _ = singles[b].tree_forward(tokens[i][None], tree)
            torch.testing.assert_close(logits[i], single[0], **CLOSE)
            path, nxt = greedy_path(tree, tokens[i], logits[i])
            paths.append(path)
            singles[b].commit([path])
            outs[b] = (outs[b] + tokens[i, path].tolist() + [nxt])[: budgets[b]]
            if len(outs[b]) == budgets[b]:
                finished.append(i)
        accepted_lengths.add(tuple(map(len, paths)))
        state.commit(paths)
        for i, b in enumerate(active):
            if i not in finished:
                assert_cache_is_reencoding(model, state, i, committed(prompts[b], outs[b]))
        if finished:
            keep = [i for i in range(len(active)) if i not in finished]
            if not keep:
                break
            state.drop_rows(keep)
            active = [active[i] for i in keep]
            for i, b in enumerate(active):
                assert_cache_is_reencoding(model, state, i, committed(prompts[b], outs[b]))
    assert [outs[b] for b in range(len(prompts))] == [ref[:budget] for ref, budget in zip(refs, budgets)]
    assert any(len(set(ks)) > 1 for ks in accepted_lengths)  # rows really accepted different lengths in one round
    assert state.static == bool(static)


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("lengths", [(1, 5, 3), (1, 1)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_batched_decode_is_the_targets_greedy_per_row(kind, attn, lengths, static):
    """The batched autoregressive step; (1, 1) prefills nothing at all (both prefixes are empty)."""
    model = target(kind, attn)
    prompts = random_prompts(lengths, seed=3)
    ids, mask = left_pad(prompts)
    state = cache(model, static)
    assert (state.prefill(ids[:, :-1], mask[:, :-1]) is None) == (max(lengths) == 1)
    singles = [TargetCache(model) for _ in prompts]
    for single, p in zip(singles, prompts):
        single.prefill(p[None, :-1])
    tokens, outs = ids[:, -1], [[] for _ in prompts]
    for _ in range(8):
        logits = state.decode(tokens)
        for b, single in enumerate(singles):
            torch.testing.assert_close(logits[b], single.decode(tokens[b].view(1))[0], **CLOSE)
        tokens = logits.argmax(-1)
        for b, t in enumerate(tokens.tolist()):
            outs[b].append(t)
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(model, p[None], 8)[0, p.numel():].tolist()
    assert state.slots == ids.shape[1] - 1 + 8  # a root-only tree leaves no holes
    assert state.positions.tolist() == [n - 1 + 8 for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_drop_rows_keeps_the_other_rows_identical(kind, static):
    """Dropping the longest prompt's row and a row with holes: the rest keep their exact cache and positions, and
    later rounds match a cache that never dropped. The dynamic cache also compacts away the columns no remaining row
    uses; the static one moves the kept rows to the first rows of its storage and keeps its slots."""
    model = target(kind, "sdpa")
    prompts = random_prompts((9, 3, 4, 2), seed=5)
    ids, mask = left_pad(prompts)
    # the one that drops rows (static: within Mistral's 63-token window), the reference (dynamic)
    states = [cache(model, static, max_len=48), TargetCache(model)]
    for state in states:
        state.prefill(ids[:, :-1], mask[:, :-1])
    tree = TREES[0]
    g = torch.Generator().manual_seed(1)
    for paths in ([[1, 3, 7], [], [2, 5], [1]], [[], [2, 6, 10], [1, 4], [2]]):
        tokens = torch.randint(0, VOCAB, (4, len(tree)), generator=g)
        for state in states:
            state.tree_forward(tokens, tree)
            state.commit(paths)
    dropped, full = states
    keep = [1, 3]
    before = [(layer.keys[keep], layer.values[keep]) for layer in dropped.cache.layers]
    valid = dropped.valid[keep]
    dropped.drop_rows(keep)
    assert dropped.batch_size == 2 and dropped.positions.tolist() == full.positions[keep].tolist()
    if static:
        assert dropped.slots == full.slots and torch.equal(dropped.valid, valid)
        for (keys, values), layer in zip(before, dropped.cache.layers, strict=True):
            assert layer.rows == 2 and layer.keys.shape[2] == 48
            assert torch.equal(layer.keys[:2], keys) and torch.equal(layer.values[:2], values)
    else:
        assert dropped.slots < full.slots  # row 0's long prompt left pad columns only rows 1 and 3 had
        used = valid.any(dim=0)
        assert torch.equal(dropped.valid, valid[:, used])
        for (keys, values), layer in zip(before, dropped.cache.layers, strict=True):
            assert torch.equal(layer.keys, keys[:, :, used]) and torch.equal(layer.values, values[:, :, used])
    for round_, tree in enumerate(TREES * 2):
        tokens = torch.randint(0, VOCAB, (4, len(tree)), generator=g)
        ours, hidden = dropped.tree_forward(tokens[keep], tree, want_hidden=True)
        theirs, _ = full.tree_forward(tokens, tree)
        torch.testing.assert_close(ours, theirs[keep], **CLOSE)
        # the hidden states are what the head consumes (DropMatch / AutoJudge rely on it)
        torch.testing.assert_close(model.get_output_embeddings()(hidden), ours, **CLOSE)
        path = list(tree.leaf_paths[-1][: 1 + round_ % 3])
        dropped.commit([path, [] if round_ % 2 else [1]])
        full.commit([[], path, [], [] if round_ % 2 else [1]])
        assert dropped.positions.tolist() == full.positions[keep].tolist()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rows_dropped_before_any_forward_leave_the_others_decoding(static):
    """One-token prompts prefill nothing (no layer holds a key yet); dropping a row then must still work, and the
    kept rows decode as they would alone."""
    model = target("llama", "sdpa")
    state = cache(model, static)
    assert state.prefill(torch.zeros(3, 0, dtype=torch.long)) is None and state.forwards == 0
    state.drop_rows([0, 2])
    assert state.batch_size == 2 and state.positions.tolist() == [0, 0]
    logits = state.decode(torch.tensor([5, 9]))
    for row, token in enumerate((5, 9)):
        torch.testing.assert_close(logits[row], model(torch.tensor([[token]])).logits[0, -1], **CLOSE)


def test_bad_batches_are_refused_without_a_model():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3]])
    assert check_batch_prompts(ids, torch.tensor([[0, 1, 1], [1, 1, 1]])) == [2, 3]
    assert check_batch_prompts(ids, None) == [3, 3]
    cases = [
        (ids, torch.tensor([[1, 1, 0], [1, 1, 1]]), "prompt 0 is not left-padded"),
        (ids, torch.tensor([[1, 1, 1], [1, 0, 1]]), "prompt 1 is not left-padded"),
        (ids, torch.tensor([[0, 1, 1]]), r"attention_mask has shape \(1, 3\) but input_ids has shape \(2, 3\)"),
        (ids, torch.tensor([[0, 0, 0], [1, 1, 1]]), "prompt 0 is empty"),
        (ids, torch.tensor([[0, 2, 1], [1, 1, 1]]), "only 0 .pad. and 1"),
        (ids[0], None, r"must be a \(B, L\) tensor"),
        (ids[:0], None, "the batch is empty"),
    ]
    for bad_ids, bad_mask, message in cases:
        with pytest.raises(ValueError, match=message):
            check_batch_prompts(bad_ids, bad_mask)
    with pytest.raises(TypeError, match="integer token ids"):
        check_batch_prompts(ids.float(), None)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_bad_calls_on_a_batch_cache_are_refused(static):
    """Out-of-order calls, wrong shapes, paths and rows are refused before they touch the cache (the prompts
    themselves are checked by `check_batch_prompts`, before any model runs)."""
    model = target("llama", "sdpa")
    state = cache(model, static)
    state.prefill(torch.tensor([[1, 2], [3, 4]]))
    tree = TREES[0]
    with pytest.raises(ValueError, match="commit needs a tree_forward first"):
        state.commit([[], []])
    with pytest.raises(ValueError, match=r"tokens of shape \(2, 11\)"):
        state.tree_forward(torch.zeros(len(tree), dtype=torch.long), tree)
    state.tree_forward(torch.zeros(2, len(tree), dtype=torch.long), tree)
    with pytest.raises(ValueError, match="drop_rows after a tree_forward"):
        state.drop_rows([0])
    with pytest.raises(ValueError, match=r"one path per row \(2\)"):
        state.commit([[]])
    with pytest.raises(ValueError, match=r"path \[1, 5\] of row 1 is not a root-to-node path"):
        state.commit([[1, 3], [1, 5]])
    state.commit([[1, 3], [2, 5, 9]])
    assert state.positions.tolist() == [5, 6] and state.slots == 6
    with pytest.raises(ValueError, match="commit needs a tree_forward first"):
        state.commit([[], []])  # a tree forward is committed once
    for keep in ([], [1, 0], [2], [0, 0], [-1]):
        with pytest.raises(ValueError, match="drop_rows needs"):
            state.drop_rows(keep)
    assert state.batch_size == 2 and state.positions.tolist() == [5, 6]  # refusals changed nothing


def test_the_sliding_window_limit_is_enforced_in_slots():
    """Holes and pads use window slots too; past the window HF would drop the cache head the mask describes."""
    model = tiny_causal_lm("mistral", sliding_window=16)
    state = TargetCache(model)
    state.prefill(torch.ones(2, 8, dtype=torch.long))
    tree = TreeConfig((2, 1)).build()
    state.tree_forward(torch.ones(2, len(tree), dtype=torch.long), tree)  # 8 + 5 slots: fits in 15
    state.commit([[1, 3], []])
    with pytest.raises(ValueError, match="needs 16 slots, beyond the 15 that MistralForCausalLM's sliding-window"):
        state.tree_forward(torch.ones(2, len(tree), dtype=torch.long), tree)


def test_static_storage_of_generates_size_holds_rows_that_accept_at_different_rates():
    """Row 0 accepts the whole chain every round, row 1 nothing but its root: the shared slot count grows by 4 a
    round while row 1 gains 1, past generate's size (padded prompt + new tokens + widest tree + 1). The storage
    squeezes out the holes when full, and every row stays equal to encoding its sequence alone."""
    model = target("llama", "sdpa")
    prompts = random_prompts((4, 6), seed=5)
    budget, tree = 20, TreeConfig((1, 1, 1)).build()
    refs = [hf_greedy(model, p[None], budget + 3)[0, p.numel():].tolist() for p in prompts]
    ids, mask = left_pad(prompts)
    max_len = ids.shape[1] + budget + len(tree) + 1
    state = TargetCache(model, static=True, max_len=max_len)
    state.prefill(ids[:, :-1], mask[:, :-1])
    outs, active, uncompacted = [[], []], [0, 1], ids.shape[1] - 1  # slots the rounds would take without it
    while active:
        tokens = torch.zeros(len(active), len(tree), dtype=torch.long)
        for i, b in enumerate(active):
            tokens[i, 0] = prompts[b][-1] if not outs[b] else outs[b][-1]
            chain = refs[b][len(outs[b]): len(outs[b]) + 3]
            tokens[i, 1:] = torch.tensor(chain) if b == 0 else (torch.tensor(chain) + 1) % VOCAB
        logits, _ = state.tree_forward(tokens, tree)
        paths = []
        for i, b in enumerate(active):
            path, nxt = greedy_path(tree, tokens[i], logits[i])
            assert len(path) == (3 if b == 0 else 0)
            paths.append(path)
            outs[b] = (outs[b] + tokens[i, path].tolist() + [nxt])[:budget]
        state.commit(paths)
        uncompacted += 1 + max(map(len, paths))
        keep = [i for i, b in enumerate(active) if len(outs[b]) < budget]
        for i in keep:
            assert_cache_is_reencoding(model, state, i, committed(prompts[active[i]], outs[active[i]]))
        if keep and len(keep) < len(active):
            state.drop_rows(keep)
        active = [active[i] for i in keep]
    assert outs == [ref[:budget] for ref in refs]
    assert uncompacted > max_len
