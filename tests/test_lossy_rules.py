"""Lossy verifier rules on hand-built trees and logits, with decisions worked out from the papers."""
from __future__ import annotations

import math

import pytest
import torch

from mamba_draft.tree import Tree, TreeConfig
from tests.helpers.tree_models import tiny_llama
from tree_search.autojudge.classifier import JudgeHead
from tree_search.sampling import SamplingParams
from tree_search.verifiers import get_verifier, verifier_class
from tree_search.verifiers.autojudge import AutoJudgeVerifier
from tree_search.verifiers.base import VerifyInput
from tree_search.verifiers.combine import AnyOf
from tree_search.verifiers.dropmatch import (
    DropMatchVerifier, dropout_head_logits, js_accept, js_divergence, naive_accept,
)
from tree_search.verifiers.fly import FLyVerifier, target_entropy
from tree_search.verifiers.greedy import GreedyVerifier
from tree_search.verifiers.topk import TopKVerifier

V = 8
GREEDY = SamplingParams()


def peaked(token: int) -> torch.Tensor:
    """Confident target: top-3 entropy ~0.005, far below θ = 0.3."""
    logits = torch.zeros(V)
    logits[token] = 10.0
    return logits


def flat(token: int) -> torch.Tensor:
    """Uncertain target: three near-equal candidates (top-3 entropy ~1.1), argmax = token."""
    logits = torch.zeros(V)
    logits[token], logits[(token + 1) % V], logits[(token + 2) % V] = 5.0, 4.9, 4.8
    return logits


def make_input(tree: Tree, tokens, logits_rows, hidden=None, lm_head=None, draft_probs=None, sampling=GREEDY, generator=None):
    return VerifyInput(
        tree=tree,
        tokens=torch.tensor(tokens),
        target_logits=torch.stack(logits_rows),
        draft_probs=draft_probs,
        hidden=hidden,
        lm_head=lm_head,
        sampling=sampling,
        generator=generator,
    )


def chain(depth: int) -> Tree:
    return TreeConfig((1,) * depth).build()


def chain_case(mismatch: dict[int, str], depth: int = 8):
    """Chain whose target wants token 1 everywhere; `mismatch` maps path positions to 'peaked'/'flat' mismatches.

    The kind says how confident the target was at the *parent* of that position (node = position + 1).
    """
    tokens = [0] + [1] * depth
    rows = [peaked(1) for _ in range(depth + 1)]
    for pos, kind in mismatch.items():
        tokens[pos + 1] = 2
        rows[pos] = flat(1) if kind == "flat" else peaked(1)
    return make_input(chain(depth), tokens, rows)


# ---------------------------------------------------------------- FLy


def test_fly_entropy_is_reference_top3():
    probs = torch.softmax(flat(1), -1)
    top3 = probs.topk(3).values
    assert target_entropy(probs[None])[0].item() == pytest.approx(float(-(top3 * top3.log()).sum()))
    uniform = torch.full((1, V), 1.0 / V)
    assert target_entropy(uniform, "normalized")[0].item() == pytest.approx(1.0)
    assert target_entropy(torch.softmax(peaked(1), -1)[None])[0].item() < 0.3 < target_entropy(probs[None])[0].item()


def test_fly_low_entropy_mismatch_rejected():
    result = FLyVerifier(theta=0.3, window=3).verify(chain_case({1: "peaked"}))
    assert result.path == [1] and result.next_token == 1 and result.lossy_accepts == 0


def test_fly_high_entropy_mismatch_followed_by_window_matches_accepted():
    result = FLyVerifier(theta=0.3, window=3).verify(chain_case({1: "flat"}))
    assert result.path == list(range(1, 9))  # the mismatch at position 1 plus everything after it
    assert result.lossy_accepts == 1 and result.info["lossy_accepts_by"] == {"fly": 1}
    assert result.next_token == 1


def test_fly_high_entropy_mismatch_followed_by_new_mismatch_rejected():
    # a second (confident) mismatch inside the window: the target "self-corrects", position 1 is rejected
    result = FLyVerifier(theta=0.3, window=3).verify(chain_case({1: "flat", 3: "peaked"}))
    assert result.path == [1]


def test_fly_window_running_past_the_path_rejected():
    # depth 8 = positions 0..7; W = 3 needs positions j+1..j+3 to exist
    assert FLyVerifier(theta=0.3, window=3).verify(chain_case({4: "flat"})).path == list(range(1, 9))
    assert FLyVerifier(theta=0.3, window=3).verify(chain_case({5: "flat"})).path == [1, 2, 3, 4, 5]
    assert FLyVerifier(theta=0.3, window=3).verify(chain_case({7: "flat"})).path == list(range(1, 8))


def test_fly_theta_infinity_is_greedy_and_theta_zero_disables_gate():
    case = chain_case({1: "flat"})
    greedy = GreedyVerifier().verify(case)
    assert FLyVerifier(theta=math.inf, window=3).verify(case).path == greedy.path == [1]
    assert FLyVerifier(theta=0.0, window=3).verify(chain_case({1: "peaked"})).path == list(range(1, 9))


def test_fly_on_tree_keeps_longest_accepted_path():
    # root -> a (node 1, matches) and b (node 2, flat mismatch); each continues as a chain of 4
    parents = (-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8)
    tree = Tree(parents)
    tokens = [0, 1, 2, 1, 1, 1, 1, 3, 1, 1, 1]  # path a: 1,3,5,7,9 -> confident mismatch at node 7
    rows = [flat(1)] + [peaked(1)] * 10
    case = make_input(tree, tokens, rows)
    # greedy: only path a matches, up to node 5 (node 7's token 3 != 1)
    assert GreedyVerifier().verify(case).path == [1, 3, 5]
    result = FLyVerifier(theta=0.3, window=3).verify(case)
    assert result.path == [2, 4, 6, 8, 10] and result.lossy_accepts == 1


# ---------------------------------------------------------------- Top-K


def test_topk_accepts_within_target_top_k():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0, -2.0, -3.0, -4.0])
    case = lambda tok: make_input(chain(1), [0, tok], [logits, logits])  # noqa: E731
    assert TopKVerifier(k=2).verify(case(2)).path == [1]
    assert TopKVerifier(k=2).verify(case(3)).path == []
    assert TopKVerifier(k=3).verify(case(3)).path == [1]
    assert TopKVerifier(k=1).verify(case(2)).path == []
    result = TopKVerifier(k=2).verify(case(2))
    assert result.lossy_accepts == 1 and result.next_token == 1


# ---------------------------------------------------------------- DropMatch


def test_dropout_heads_p_zero_reproduce_lm_head_and_are_seeded():
    head = torch.nn.Linear(6, V, bias=False)
    hidden = torch.randn(4, 6)
    generator = torch.Generator().manual_seed(0)
    exact = dropout_head_logits(hidden, head, 0.0, 3, generator)
    # the contract at p = 0 is exactness (no dropout = the target's head): the same call on the same shape, so it
    # holds on every kernel path; and no mask is drawn
    assert torch.equal(exact, head(hidden).expand(3, -1, -1))
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())
    draw = lambda seed: dropout_head_logits(hidden, head, 0.5, 5, torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
    heads = draw(3)
    assert not torch.equal(heads[0], heads[1])  # independent masks per head


def test_dropout_is_inverted_dropout_on_hidden_only():
    identity = torch.nn.Identity()
    hidden = torch.ones(1, 4000)
    heads = dropout_head_logits(hidden, identity, 0.25, 2, torch.Generator().manual_seed(0))
    assert torch.allclose(heads.unique(), torch.tensor([0.0, 1.0 / 0.75]))
    assert heads.mean().item() == pytest.approx(1.0, abs=0.05)  # expectation preserved


def test_dropmatch_naive_accepts_any_head_choice():
    choices = torch.tensor([[1, 1], [1, 4], [1, 1]])  # (K=3, N=2)
    assert naive_accept(torch.tensor([1, 4]), choices).tolist() == [True, True]
    assert naive_accept(torch.tensor([4, 5]), choices).tolist() == [False, False]


def test_dropmatch_js_and_majority_criteria():
    head_logits = torch.tensor([[[2.0, 1.0, 0.0]], [[2.0, 1.2, 0.0]], [[1.8, 1.0, 0.0]]])  # K=3, N=1, V=3
    choices = head_logits.argmax(-1)  # all heads pick token 0 (majority 0)
    centroid = torch.softmax(head_logits.mean(0), -1)
    spread = js_divergence(torch.softmax(head_logits, -1), centroid).amax(0)
    assert 0 < spread.item() < 0.01
    near = centroid.clone()  # JS(q, c) = 0 <= spread: accepted whatever the token (Eq. 6)
    far = torch.tensor([[0.05, 0.05, 0.9]])  # JS(q, c) >> spread
    assert js_accept(torch.tensor([1]), head_logits, choices, near, GREEDY).tolist() == [True]
    assert js_accept(torch.tensor([1]), head_logits, choices, far, GREEDY).tolist() == [False]
    assert js_accept(torch.tensor([0]), head_logits, choices, far, GREEDY).tolist() == [True]  # majority (Eq. 7)


def test_dropmatch_verifier_on_chain_with_identity_head():
    # lm_head = identity, hidden = target logits: heads are dropout copies of the target logits
    rows = [torch.tensor([0.0, 5.0, 4.999, 0, 0, 0, 0, 0]), peaked(1)]
    hidden = torch.stack(rows)
    case = make_input(chain(1), [0, 2], rows, hidden=hidden, lm_head=torch.nn.Identity())
    assert DropMatchVerifier(p=0.0, criterion="naive").verify(case).path == []  # p = 0: heads = argmax = 1
    # strong dropout on a near-tie: some head picks token 2 with overwhelming probability over 64 heads
    loose = DropMatchVerifier(p=0.5, num_heads=64, criterion="naive", seed=0).verify(case)
    assert loose.path == [1] and loose.lossy_accepts == 1


# ---------------------------------------------------------------- AutoJudge


def judge_head(hidden_size: int = 2, threshold: float | None = None) -> JudgeHead:
    weight = torch.zeros(hidden_size)
    weight[0] = 1.0
    info = {} if threshold is None else {"threshold": threshold}
    return JudgeHead(torch.zeros(hidden_size), torch.ones(hidden_size), weight, torch.zeros(1), info)


def test_autojudge_threshold_both_sides():
    rows = [peaked(1)] * 3
    hidden = torch.tensor([[0.0, 0.0], [-2.0, 0.0], [2.0, 0.0]])  # P(important): node1 0.12, node2 0.88
    case = make_input(chain(2), [0, 2, 3], rows, hidden=hidden)
    assert AutoJudgeVerifier(judge_head(), threshold=0.5).verify(case).path == [1]  # 0.12 < 0.5 <= 0.88
    assert AutoJudgeVerifier(judge_head(), threshold=0.1).verify(case).path == []  # 0.12 >= 0.1
    assert AutoJudgeVerifier(judge_head(), threshold=0.9).verify(case).path == [1, 2]
    assert AutoJudgeVerifier(judge_head(), threshold=0.0).verify(case).path == []
    assert AutoJudgeVerifier(judge_head(threshold=0.5)).threshold == 0.5  # the file's suggestion


def test_autojudge_wrong_hidden_size_is_a_clear_error():
    case = make_input(chain(1), [0, 2], [peaked(1)] * 2, hidden=torch.zeros(2, 3))
    verifier = AutoJudgeVerifier(judge_head(2), threshold=0.5)
    with pytest.raises(ValueError, match="hidden size 2"):
        verifier.verify(case)
    target = tiny_llama(vocab=V)  # hidden size 32: refused up front, before any generation work
    with pytest.raises(ValueError, match="LlamaForCausalLM has hidden size 32"):
        verifier.check_target(target)
    with pytest.raises(ValueError, match="hidden size 32"):
        AnyOf([TopKVerifier(), verifier]).check_target(target)
    AutoJudgeVerifier(judge_head(32), threshold=0.5).check_target(target)


# ---------------------------------------------------------------- composition


def test_anyof_accepts_when_either_rule_accepts_and_attributes_counts():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0, -2.0, -3.0, -4.0])
    hidden = torch.tensor([[0.0, 0.0], [5.0, 0.0], [-5.0, 0.0]])
    # node1 token 2: in top-2, judged important; node2 token 5: outside top-2, judged unimportant
    case = make_input(chain(2), [0, 2, 5], [logits] * 3, hidden=hidden)
    topk, judge = TopKVerifier(k=2), AutoJudgeVerifier(judge_head(), threshold=0.5)
    assert topk.verify(case).path == [1] and judge.verify(case).path == []
    both = AnyOf([topk, judge])
    result = both.verify(case)
    assert result.path == [1, 2] and result.lossy_accepts == 2
    assert result.info["lossy_accepts_by"] == {"topk": 1, "autojudge": 1}
    assert both.name == "topk+autojudge" and both.needs_hidden and not both.lossless


def test_anyof_built_by_name_routes_parameters(tmp_path):
    path = tmp_path / "judge.safetensors"
    judge_head().save(path)
    built = AnyOf("autojudge+dropmatch", judge=str(path), threshold=0.3, p=0.2, **{"dropmatch.criterion": "js"})
    judge, drop = built.verifiers
    assert judge.threshold == 0.3 and drop.p == 0.2 and drop.criterion == "js" and drop.num_heads == 5
    assert built.needs_draft_probs and not AnyOf("autojudge+dropmatch", judge=str(path), threshold=0.3).needs_draft_probs
    assert get_verifier("anyof", verifiers=["topk", "fly"], k=3, theta=0.5).verifiers[0].k == 3
    with pytest.raises(ValueError, match="not accepted by any"):
        AnyOf("topk+fly", bogus=1)
    with pytest.raises(ValueError, match="lossless"):
        AnyOf("topk+greedy")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DropMatchVerifier(p=1.0), r"p must be in \[0, 1\)"),
        (lambda: DropMatchVerifier(p=-0.1), r"p must be in \[0, 1\)"),
        (lambda: DropMatchVerifier(num_heads=0), "K must be an integer >= 1"),
        (lambda: DropMatchVerifier(criterion="cosine"), "unknown criterion"),
        (lambda: FLyVerifier(window=0), "window W must be an integer >= 1"),
        (lambda: FLyVerifier(theta=-0.1), "theta must be a number >= 0"),
        (lambda: FLyVerifier(entropy="renyi"), "unknown entropy"),
        (lambda: TopKVerifier(k=0), "K must be an integer >= 1"),
        (lambda: AutoJudgeVerifier(judge_head(), threshold=1.5), r"threshold must be in \[0, 1\]"),
        (lambda: AutoJudgeVerifier(judge_head(), threshold=-0.01), r"threshold must be in \[0, 1\]"),
        (lambda: AutoJudgeVerifier(judge_head()), "suggests no threshold"),
        (lambda: AutoJudgeVerifier(), "needs judge="),
    ],
)
def test_bad_parameters_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_missing_or_foreign_judge_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoJudgeVerifier(judge=tmp_path / "nope.safetensors", threshold=0.5)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        AutoJudgeVerifier(judge=junk, threshold=0.5)


def test_dropmatch_needs_hidden_and_draft_probs():
    case = make_input(chain(1), [0, 2], [peaked(1)] * 2)
    with pytest.raises(ValueError, match="hidden states"):
        DropMatchVerifier(criterion="naive").verify(case)
    case.hidden, case.lm_head = torch.stack([peaked(1)] * 2), torch.nn.Identity()
    with pytest.raises(ValueError, match="draft distributions"):
        DropMatchVerifier(criterion="js").verify(case)


def test_registered_and_flagged_lossy():
    for name in ("dropmatch", "fly", "topk", "autojudge", "anyof"):
        assert verifier_class(name).lossless is False
    assert verifier_class("greedy").lossless is True
    with pytest.raises(ValueError, match="unknown verifier 'exact'.*available: .*greedy"):
        verifier_class("exact")


# ---------------------------------------------------------------- properties shared by every lossy rule


def random_case(seed: int, branching=(3, 2, 2, 1)):
    g = torch.Generator().manual_seed(seed)
    tree = TreeConfig(branching).build()
    logits = torch.randn(len(tree), V, generator=g) * 2
    tokens = torch.randint(0, V, (len(tree),), generator=g)
    for node, kids in enumerate(tree.children):  # distinct siblings, and often the target's own choice first
        order = torch.randperm(V, generator=g)
        if torch.rand((), generator=g) < 0.6:
            order = torch.cat([logits[node].argmax().view(1), order[order != logits[node].argmax()]])
        tokens[list(kids)] = order[: len(kids)]
    hidden = logits.clone()  # lm_head = identity
    return make_input(tree, tokens.tolist(), list(logits), hidden=hidden, lm_head=torch.nn.Identity(),
                      draft_probs=torch.softmax(torch.randn(len(tree), V, generator=g), -1))


LOOSE = [
    lambda: FLyVerifier(theta=0.0, window=1),
    lambda: TopKVerifier(k=3),
    lambda: DropMatchVerifier(p=0.5, criterion="naive"),
    lambda: DropMatchVerifier(p=0.3, criterion="js"),
    lambda: AutoJudgeVerifier(JudgeHead(torch.zeros(V), torch.ones(V), torch.randn(V), torch.zeros(1)), threshold=0.5),
]


@pytest.mark.parametrize("build", LOOSE)
def test_lossy_path_is_a_valid_prefix_at_least_as_long_as_greedy(build):
    verifier, grew = build(), 0
    for seed in range(40):
        case = random_case(seed)
        exact, loose = GreedyVerifier().verify(case), verifier.verify(case)
        parents = case.tree.parents
        assert all(parents[b] == a for a, b in zip([0] + loose.path, loose.path))
        assert len(loose.path) >= len(exact.path)
        last = loose.path[-1] if loose.path else 0
        assert loose.next_token == int(case.target_logits[last].argmax())
        natives = sum(int(case.tokens[n]) == int(case.target_logits[parents[n]].argmax()) for n in loose.path)
        assert loose.lossy_accepts == len(loose.path) - natives
        grew += len(loose.path) > len(exact.path)
    assert grew > 0


def test_sampling_with_the_rule_off_is_lossless_and_with_it_on_is_not():
    """T = 1, children 3 and 5 drafted: the first committed token must follow the target softmax exactly."""
    from scipy.stats import chisquare

    logits = torch.tensor([1.0, 0.5, -0.5, 2.0, 0.0, 1.5, -1.0, 0.2])
    tree = Tree((-1, 0, 0))
    sampling = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    case = make_input(tree, [0, 3, 5], [logits] * 3, sampling=sampling, generator=generator)
    expected = torch.softmax(logits, -1) * 1000

    def first_tokens(verifier):
        counts = torch.zeros(V)
        for _ in range(1000):
            result = verifier.verify(case)
            counts[int(case.tokens[result.path[0]]) if result.path else result.next_token] += 1
        return counts

    assert chisquare(first_tokens(FLyVerifier(theta=math.inf)), expected).pvalue > 1e-3
    assert chisquare(first_tokens(TopKVerifier(k=8)), expected).pvalue < 1e-6  # accepts child 3 always
