"""Prompt lookup: the tokens that followed an earlier occurrence of the context's last n-gram, as a draft.

Two uses of `NgramLookup`: proposing them to the target directly (`generate(lookup_tokens=K)`, prompt-lookup
decoding), and FLy's multi-level acceleration (`draft_chain_with_lookup`), where the drafter checks a whole proposal
in one call and keeps the prefix equal to its own greedy choices: the chain is exactly the drafter's greedy chain, in
fewer drafter calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOOKUP_NGRAM = 4  # the drafter's chain looks up its context's last 4..1 tokens
PROPOSED_TOKENS = 6  # ... and checks up to 6 that followed them in one drafter call


class NgramLookup:
    """A growing token list with, for every n-gram (n = min_ngram..max_ngram), where the token after its most recent
    occurrence sits: a proposal costs a few dict lookups, however long the context (one pass over the prompt)."""

    def __init__(self, tokens: list[int], num_tokens: int, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and num_tokens >= 1, got {min_ngram}, {max_ngram}, "
                             f"{num_tokens}")
        self.num_tokens, self.sizes = num_tokens, range(max_ngram, min_ngram - 1, -1)
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in self.sizes:
                if end >= n:
                    self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def propose(self) -> list[int]:
        """Up to num_tokens tokens that followed the latest earlier occurrence of the longest recurring final n-gram
        ([] when none recurs)."""
        end = len(self.tokens)
        for n in self.sizes:
            start = self.follows.get(tuple(self.tokens[end - n:])) if end >= n else None
            if start is not None:
                return self.tokens[start:start + self.num_tokens]
        return []


@dataclass
class LookupDraft:
    tokens: torch.Tensor  # (num_tokens,) the drafter's greedy chain
    drafter_calls: int  # sequential drafter invocations (step or extend) it took
    proposed: int  # lookup tokens offered to the drafter
    accepted: int  # lookup tokens the drafter agreed with
    logits: torch.Tensor | None = None  # (num_tokens, V) the logits each token was chosen from (if keep_logits)


@torch.no_grad()
def draft_chain_with_lookup(drafter, state, logits: torch.Tensor, context: torch.Tensor, num_tokens: int,
                            vocab: int | None = None, keep_logits: bool = False,
                            draft_ids: torch.Tensor | None = None) -> LookupDraft:
    """Draft the drafter's greedy chain of `num_tokens` tokens, using prompt lookup to skip drafter steps.

    state: a `DrafterState` with >= 2 rows whose row 0 holds the state after `context` (both are left in a drafted
    state: resync from the committed one). logits: (V,) the drafter's logits after `context` (L,). vocab: greedy
    choices among logit columns < vocab. keep_logits: also return the logits each token was chosen from.
    draft_ids: the drafter's draft vocabulary (column j is target id draft_ids[j]), so drafted tokens are target ids
    like the proposals. Host-side control flow (one sync per proposal): meant for the CPU / eager path.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if state.max_batch < 2:
        raise ValueError("draft_chain_with_lookup needs a DrafterState with at least 2 rows (live + snapshot)")
    vocab = vocab or logits.shape[-1]
    live = state.rows(0, 1)
    snapshot_row = torch.tensor([0], device=context.device)
    restore_row = torch.tensor([1], device=context.device)

    def greedy_ids(rows: torch.Tensor) -> torch.Tensor:
        """The drafter's greedy choice(s) as target ids."""
        columns = rows[..., :vocab].argmax(-1)
        return columns if draft_ids is None else draft_ids[columns]

    chooser = [logits.view(1, -1)]  # chooser[i]: the logits token i was the argmax of
    tokens = [int(greedy_ids(logits))]
    history = NgramLookup(context.tolist() + tokens, PROPOSED_TOKENS, LOOKUP_NGRAM, min_ngram=1)
    calls = proposed = accepted = 0
    while len(tokens) < num_tokens:
        last = torch.tensor([tokens[-1]], device=context.device)
        found = history.propose()[: num_tokens - len(tokens)]
        if not found:
            step_logits = drafter.step(last, live)
            tokens.append(int(greedy_ids(step_logits[0])))
            history.extend(tokens[-1:])
            chooser.append(step_logits)
            calls += 1
            continue
        proposal = torch.tensor(found, device=context.device)
        state.gather_(1, snapshot_row)  # keep the pre-proposal state in case the drafter disagrees
        block = drafter.extend(torch.cat([last, proposal]).view(1, -1), live)[0]
        greedy = greedy_ids(block)
        calls += 1
        agree = int((proposal == greedy[:-1]).long().cumprod(0).sum())
        proposed, accepted = proposed + proposal.numel(), accepted + agree
        tokens += found[:agree] + [int(greedy[agree])]
        history.extend(tokens[-agree - 1:])
        chooser.append(block[: agree + 1])
        if agree < proposal.numel() and len(tokens) < num_tokens:  # live row ran past the agreed prefix: rebuild
            state.gather_(0, restore_row)
            rebuilt = torch.cat([last, proposal[:agree]])
            if rebuilt.numel() == 1:  # a step is cheaper than a 1-token extend
                drafter.step(rebuilt, live)
            else:
                drafter.extend(rebuilt.view(1, -1), live, last_only=True)
            calls += 1
    kept = torch.cat(chooser)[:num_tokens] if keep_logits else None
    return LookupDraft(torch.tensor(tokens[:num_tokens], device=context.device), calls, proposed, accepted, kept)
