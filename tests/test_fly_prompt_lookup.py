"""Prompt lookup: `NgramLookup` (proposals the target verifies) and FLy's multi-level acceleration (proposals
pre-verified by the Mamba drafter), alone and as a proposer on the TreeDrafter's batch-of-one buffers
(`LookupChainProposer`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import random_drafter
from tree_search.tree_drafter import LOOKUP_ROWS, TreeDrafter
from tree_search.prompt_lookup import NgramLookup, draft_chain_with_lookup
from tree_search.sampling import SamplingParams
from tree_search.proposers import Round
from tree_search.proposers.lookup_chain import LookupChainProposer
from tree_search.proposers.plain import PlainStep
from tree_search.proposers.tree import TreeProposer
from tree_search.verifiers import VerifyResult

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)
Q_CLOSE = dict(atol=1e-5, rtol=1e-4)  # extend and step scan the same recurrence in another order (float32)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"), vocab=VOCAB)


def greedy_chain(drafter, context: torch.Tensor, n: int) -> list[int]:
    """The drafter's greedy chain, one step per token (the reference)."""
    logits, state = drafter.prefill(context.view(1, -1))
    token, out = logits[0].argmax(), []
    for _ in range(n):
        out.append(int(token))
        token = drafter.step(token.view(1), state)[0].argmax()
    return out


def lookup_chain(drafter, context: torch.Tensor, n: int):
    state = drafter.allocate_state(2)
    logits, _ = drafter.prefill(context.view(1, -1), state=state)
    return draft_chain_with_lookup(drafter, state, logits[0], context, n)


def test_ngram_lookup_proposes_after_the_latest_occurrence_of_the_longest_ngram():
    lookup = NgramLookup([1, 2, 3, 4, 9, 1, 2, 3, 7, 2, 3], num_tokens=3)
    assert lookup.propose() == [7, 2, 3]  # (2, 3) last occurred before 7; the 4-gram and 3-gram never recurred
    lookup.extend([4])  # (2, 3, 4) occurred once: the 3-gram wins over the 2-gram (3, 4)
    assert lookup.propose() == [9, 1, 2]
    assert NgramLookup([1, 2, 3, 4, 9, 1, 2, 3, 4], num_tokens=8).propose() == [9, 1, 2, 3, 4]  # up to the end
    assert NgramLookup([5, 6, 7, 8], num_tokens=4).propose() == []
    assert NgramLookup([5, 6, 5, 6], num_tokens=4, min_ngram=3).propose() == []
    assert NgramLookup([7, 5, 8, 5], num_tokens=2, min_ngram=1).propose() == [8, 5]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramLookup([1], num_tokens=0)


def test_lookup_chain_is_the_drafters_greedy_chain(drafter):
    context = torch.tensor([3, 17, 9, 40])
    for n in (1, 7, 25):
        assert lookup_chain(drafter, context, n).tokens.tolist() == greedy_chain(drafter, context, n)


def test_lookup_saves_drafter_calls_on_repetitive_text(drafter):
    """This random drafter's greedy output falls into a cycle; once the cycle is in context, lookup predicts it."""
    prompt = torch.tensor([3, 17, 9, 40])
    context = torch.cat([prompt, torch.tensor(greedy_chain(drafter, prompt, 40))])
    draft = lookup_chain(drafter, context, 25)
    assert draft.tokens.tolist() == greedy_chain(drafter, context, 25)
    assert draft.accepted > 0 and draft.drafter_calls < 24  # sequential drafting needs 24 steps


def test_lookup_chain_needs_a_snapshot_row(drafter):
    context = torch.tensor([3, 17])
    state = drafter.allocate_state(1)
    logits, _ = drafter.prefill(context.view(1, -1), state=state)
    with pytest.raises(ValueError, match="at least 2 rows"):
        draft_chain_with_lookup(drafter, state, logits[0], context, 5)


def repetitive_context(drafter) -> torch.Tensor:
    """A prompt followed by the drafter's own greedy text, which falls into a cycle: lookup has proposals to check."""
    prompt = torch.tensor([3, 17, 9, 40])
    return torch.cat([prompt, torch.tensor(greedy_chain(drafter, prompt, 40))])


# ---------------------------------------------------------------- on the TreeDrafter: the batch-of-one buffers


def test_a_lookup_chain_fills_the_same_buffers_as_draft_and_leaves_row_0_committed(drafter):
    context = repetitive_context(drafter)
    config = TreeConfig((1,) * 12)
    drafts = TreeDrafter(drafter, config.num_nodes + 1, VOCAB)
    logits = drafts.prefill(context.view(1, -1))
    committed = drafts.state.rows(0, 1).clone()
    calls = drafts.calls
    buf, lookup = drafts.draft_chain_lookup(config, drafts.roots[:1], logits, context, record_probs=True)
    assert buf is drafts.buffers(config, 1) and buf.tokens.shape == (1, 13)
    assert drafts.calls - calls == lookup.drafter_calls < config.depth - 1 and lookup.accepted > 0
    assert torch.equal(drafts.state.ssm[:, :1], committed.ssm) and torch.equal(drafts.state.conv[:, :1], committed.conv)
    tokens, probs = buf.tokens.clone(), buf.probs.clone()
    assert tokens[0].tolist() == [int(context[-1])] + greedy_chain(drafter, context, 12)
    stepped = drafts.draft(config, drafts.roots[:1], logits, GREEDY, "topk", True, None)
    assert torch.equal(stepped.tokens, tokens)
    torch.testing.assert_close(stepped.probs, probs, **Q_CLOSE)


def test_an_ngram_proposal_is_a_point_mass_chain_in_the_proposers_own_buffers():
    """Prompt-lookup rounds need no drafter: the tokens that followed the context's last n-gram, as a chain after the
    root, each with a point-mass q, in buffers the proposer owns (the same storage every round)."""
    from tree_search.draft import Draft
    from tree_search.proposers.ngram import NgramProposer

    context = [4, 8, 15, 16, 23, 42, 7, 4, 8, 15]  # "4 8 15" recurs: 16 23 42 7 followed it
    call = SimpleNamespace(ids=torch.tensor([context]), lookup_tokens=3, stats=SimpleNamespace(lookup_rounds=0))
    proposer = NgramProposer(call, True, VOCAB)
    assert proposer.offer(SimpleNamespace(lookup_length=lambda offered: offered))
    draft = proposer.propose(None, torch.tensor([15]), call)
    assert isinstance(draft, Draft) and call.stats.lookup_rounds == 1
    assert draft.tokens.tolist() == [[15, 16, 23, 42]] and draft.tree == TreeConfig((1, 1, 1)).build()
    assert torch.equal(draft.probs[0, :3], torch.nn.functional.one_hot(torch.tensor([16, 23, 42]), VOCAB).float())
    assert draft.tokens.data_ptr() == proposer.tokens.data_ptr() and draft.probs.data_ptr() == proposer.probs.data_ptr()
    assert NgramProposer(call, False, VOCAB).probs is None  # nothing recorded where the call records no q


def test_the_lookup_chain_proposer_drafts_the_tree_proposers_chains_and_counts_the_calls_it_saves(drafter):
    """The two proposers generate picks between for one greedy prompt, round for round on the same commits (drafted
    rounds accepting every depth, leaves included, and rounds another proposer made, which the drafter reads when it
    next drafts): the same chains and q, the same root logits, and lookup's calls plus the calls it saved are the
    tree proposer's calls."""
    context = repetitive_context(drafter)
    config = TreeConfig((1,) * 8)
    rows = config.num_nodes + 1
    tree = TreeProposer(TreeDrafter(drafter, rows, VOCAB), GREEDY, "topk", True)
    lookup = LookupChainProposer(TreeDrafter(drafter, max(rows, LOOKUP_ROWS), VOCAB), True, len(context) + 100)
    proposers = (tree, lookup)
    ids = context.view(1, -1)
    call = SimpleNamespace(ids=ids, mask=torch.ones_like(ids), active=[0], generators=None)
    roots = ids[:, -1]
    for s in proposers:
        s.prepare(call)
    for r, accepted in enumerate((0, 8, None, 3, 8, None, 5, 1)):  # accepted nodes; None: another's round
        if accepted is None:  # three tokens committed by a round neither drafted
            proposed = [[5, 6, (3 * r) % VOCAB]]
            other = Round(PlainStep().propose(None, roots, call), PlainStep(), [VerifyResult([1, 2], proposed[0][-1])],
                          proposed, proposed, torch.tensor([proposed[0][-1]]), None, None)
            for s in proposers:
                s.accept(other)
            roots = other.next_tokens
            continue
        drafts = [s.propose(config, roots, call) for s in proposers]
        assert torch.equal(drafts[0].tokens, drafts[1].tokens), f"round {r}"
        torch.testing.assert_close(drafts[0].probs[:, :-1], drafts[1].probs[:, :-1], **Q_CLOSE)
        proposed = [drafts[0].tokens[0, 1 : accepted + 1].tolist() + [(7 * r + 3) % VOCAB]]
        result = VerifyResult(list(range(1, accepted + 1)), proposed[0][-1])
        roots = torch.tensor([proposed[0][-1]])
        for s, d in zip(proposers, drafts):
            s.accept(Round(d, s, [result], proposed, proposed, roots, None, None))
        torch.testing.assert_close(tree.logits, lookup.logits, **Q_CLOSE)
    assert lookup.calls_saved > 0
    assert lookup.calls + lookup.calls_saved == tree.calls
