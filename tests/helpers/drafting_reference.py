"""A single-prompt tree drafter, eager and independent of `TreeDrafter`: the reference the forest is checked against.

It is the one-tree drafting the package used to keep beside the batched path: node i's drafter state in state row i
(row 0 = the root), each level forked from its parents' rows and stepped as one drafter call, leaves never stepped,
and `resync` moving the accepted node's state to row 0 (stepping an accepted leaf from its parent first). Draft
vocabularies (`drafter.draft_ids`) and ids the drafter cannot read are handled as `TreeDrafter` documents them.
"""
from __future__ import annotations

import torch

from mamba_draft.tree import TreeConfig
from tree_search.sampling import SamplingParams, logits_to_probs, sample_without_replacement

_SOFTMAX = SamplingParams(temperature=1.0)


class SingleTreeDrafter:
    """One prompt: `prefill(prompt)`, then `draft(...)` and `resync(node, token)` round after round."""

    def __init__(self, drafter, rows: int, out_vocab: int) -> None:
        self.drafter, self.out_vocab = drafter, out_vocab
        self.draft_ids = drafter.draft_ids
        self.vocab = min(int(drafter.vocab_size), out_vocab) if self.draft_ids is None else self.draft_ids.numel()
        readable = int(drafter.input_vocab_size)
        self.read_limit = readable - 1 if readable < out_vocab else None
        self.state = drafter.allocate_state(rows)
        self.root: int | None = None
        self.logits: torch.Tensor | None = None  # (V,) the drafter's logits after the root
        self.tree = self.tokens = None  # the last drafted tree and its tokens (T+1,)

    def readable(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens if self.read_limit is None else tokens.clamp(max=self.read_limit)

    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Encode the prompt into row 0; returns (and keeps) the logits for the next token (V,)."""
        logits, _ = self.drafter.prefill(self.readable(torch.tensor([prompt])), state=self.state)
        self.root, self.logits = prompt[-1], logits[0]
        return self.logits

    @torch.no_grad()
    def draft(self, config: TreeConfig, params: SamplingParams, mode: str, record_probs: bool = True,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's tokens (T+1,) and recorded draft distributions (T+1, V_target), level by level."""
        tree = self.tree = config.build()
        tokens = self.tokens = torch.zeros(len(tree), dtype=torch.long)
        probs = torch.zeros(len(tree), self.out_vocab)
        sampled = mode == "sample" and not params.greedy
        tokens[0] = self.root
        logits = self.logits.view(1, -1)
        for level, n in enumerate(config.branching, start=1):
            (prev_start, prev_stop), (start, stop) = tree.levels[level - 1], tree.levels[level]
            logits = logits[:, : self.vocab]
            if sampled or record_probs:
                q = logits_to_probs(logits, params if not params.greedy else _SOFTMAX)
                if self.draft_ids is None:
                    probs[prev_start:prev_stop, : self.vocab] = q
                else:
                    probs[prev_start:prev_stop, self.draft_ids] = q
            kids = sample_without_replacement(q, n, generator) if sampled else torch.topk(logits, n, dim=-1).indices
            tokens[start:stop] = (kids if self.draft_ids is None else self.draft_ids[kids]).reshape(-1)
            if level < config.depth:
                self.state.gather_(start, torch.tensor(tree.parents[start:stop]))
                logits = self.drafter.step(tokens[start:stop], self.state.rows(start, stop))
        return tokens, probs

    @torch.no_grad()
    def resync(self, node: int, next_token: int) -> torch.Tensor:
        """Node `node` of the last tree was the deepest accepted (0: none), `next_token` follows it: row 0 <- that
        node's state stepped with the next token; returns (and keeps) the next logits (V,)."""
        tree, token = self.tree, self.readable(torch.tensor([next_token]))
        if node and not tree.children[node] and tree.depths[node] == tree.depth:  # a never-stepped leaf
            self.state.gather_(0, torch.tensor([tree.parents[node]]))
            self.drafter.step(self.tokens[node : node + 1], self.state.rows(0, 1))
        else:
            self.state.gather_(0, torch.tensor([node]))
        self.root, self.logits = int(next_token), self.drafter.step(token, self.state.rows(0, 1))[0]
        return self.logits
