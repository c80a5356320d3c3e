"""`sampling`: lossless multi-candidate recursive rejection sampling over the tree (MCSD / SpecInfer rule)."""
from __future__ import annotations

import torch

from tree_search.sampling import logits_to_probs, sample
from tree_search.verifiers.base import Verifier, VerifyInput, VerifyResult, register_verifier
from tree_search.verifiers.greedy import greedy_walk


def accept_among_children(p: torch.Tensor, q: torch.Tensor | None, candidates: list[int],
                          generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """Try candidates x1..xk against the target p: drawn from q without replacement (in draw order), or, q None,
    deterministic ones (top-k), each a point mass (the EAGLE-2 rule).

    Accept xi with prob min(1, p_i(xi)/q_i(xi)); on rejection p_{i+1} = norm(max(p_i − q_i, 0)) and q_{i+1} = q_i
    without xi, renormalised (a point mass: p_{i+1} = norm(p_i without xi)). Returns (the accepted candidate's index or
    None, the final residual to sample from). Candidates with zero remaining draft mass were never drawn (padding of a
    small support) and point masses the target gives no mass can never pass: both are skipped, drawing nothing.
    """
    p = p.clone()
    q = None if q is None else q.clone()
    for i, x in enumerate(candidates):
        qx = 1.0 if q is None else q[x].item()
        if qx <= 0.0 or (q is None and p[x].item() <= 0.0):
            continue
        u = torch.rand((), generator=generator, device=p.device).item()
        if u * qx < p[x].item():  # u < p/q without dividing
            return i, p
        if q is None:
            p[x] = 0.0
            p = p / p.sum()
            continue
        residual = torch.clamp(p - q, min=0.0)
        mass = residual.sum()
        if mass.item() > 0.0:  # mass 0 only if p == q up to rounding, where rejection has probability 0
            p = residual / mass
        q[x] = 0.0
        q_mass = q.sum()
        q = q / q_mass if q_mass.item() > 0.0 else q
    return None, p


@register_verifier
class SamplingVerifier(Verifier):
    """Lossless at any temperature; at temperature 0 it is exactly the greedy verifier."""

    name = "sampling"
    lossless = True
    draft_mode = "sample"

    def __init__(self, keyed: bool = True) -> None:
        # keyed: a seeded call draws by (seed, position) instead (`sampling.keyed_choice`, the engine's greedy walk
        # over those draws: the same tokens whatever the batch, tree or load); False keeps this rule for it too
        self.keyed = keyed

    def walks_argmax(self, sampling) -> bool:  # a subclass that decides otherwise is asked per row
        return sampling.greedy and type(self).verify is SamplingVerifier.verify

    def verify(self, inp: VerifyInput) -> VerifyResult:
        tokens = inp.tokens.tolist()
        if inp.sampling.greedy:
            return greedy_walk(inp.tree, tokens, torch.argmax(inp.target_logits, -1).tolist())
        if inp.draft_probs is None and len(inp.tree) > 1:  # a root-only tree has no child to test against q
            raise ValueError("the sampling verifier needs draft_probs (the distribution each node's children came from)")
        # Host syncs per tried child: the accept/reject walk is inherently sequential Python on a few nodes.
        target_probs = logits_to_probs(inp.target_logits, inp.sampling)
        node, path = 0, []
        while True:
            kids = inp.tree.children[node]
            candidates = [tokens[c] for c in kids]
            q = inp.draft_probs[node].float() if inp.draft_mode == "sample" else None  # topk: point masses
            pick, p = accept_among_children(target_probs[node], q, candidates, inp.generator)
            if pick is None:
                return VerifyResult(path, int(sample(p, inp.generator).item()), info={"rejected_children": len(kids)})
            node = kids[pick]
            path.append(node)

