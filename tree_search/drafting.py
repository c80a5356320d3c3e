"""Batched tree drafting on the Mamba state: one drafter step per level over all of that level's rows.

Node i's drafter state lives in state row i (row 0 = root = state after the last committed token). A level
forks its parents' rows into its own rows (`gather_`) and steps them together, so the drafter holds the
state after every non-leaf node; leaves are never stepped (their state is only needed if one is accepted,
and then `resync` steps it). Every fork + step goes through a `graphs.StepRunner`: on CUDA each row range is a
captured graph reused across rounds, calls and tree shapes.

Chains at temperature 0 can instead be drafted with prompt lookup (`draft_chain_lookup`, eager, host-driven): it
drafts on scratch rows 1-2 and leaves row 0 committed, so `resync_extend` continues row 0 in one call.

A drafter with a draft vocabulary (`drafter.draft_ids`, EAGLE-3's d2t) scores only those target ids: logit column j
is target id draft_ids[j]. Everything leaving this module is in target ids: drafted tokens are mapped through
draft_ids, and a recorded draft distribution q is scattered into the full target-vocabulary buffer (exactly zero
outside the subset), which is all the lossless rejection sampling needs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tree_search.graphs import StepRunner, drafter_key
from tree_search.prompt_lookup import LookupDraft, advance, draft_chain_with_lookup
from tree_search.sampling import SamplingParams, logits_to_probs, sample_without_replacement
from tree_search.tree import Tree, TreeConfig

_SOFTMAX = SamplingParams(temperature=1.0)
LOOKUP_ROWS = 3  # row 0 committed, rows 1-2 the lookup drafter's live + snapshot scratch rows


@dataclass
class DraftTree:
    """Preallocated buffers of one tree shape, refilled every round."""

    config: TreeConfig
    tree: Tree
    parent_rows: list[torch.Tensor]  # per level 1..γ: (B_i,) state row of each node's parent
    tokens: torch.Tensor  # (T+1,) token at each node; tokens[0] = root
    probs: torch.Tensor  # (T+1, V_target) draft distribution each node's children came from (when recorded)


class TreeDrafter:
    """Owns the drafter's state (one row per tree node) and the per-shape buffers; reuse it across calls."""

    def __init__(self, drafter, max_rows: int, out_vocab: int) -> None:
        self.drafter = drafter
        self.device = drafter.device
        self.out_vocab = out_vocab  # width of the probs buffers (the target's vocabulary)
        # Draft column -> target id, fixed for this TreeDrafter. None = identity (column j is id j): no extra op.
        self.draft_ids = drafter.draft_ids
        if self.draft_ids is None:
            self.vocab = min(int(drafter.vocab_size), out_vocab)  # draft tokens are chosen among ids < vocab
        else:
            if int(self.draft_ids.max()) >= out_vocab:
                raise ValueError(f"draft vocabulary id {int(self.draft_ids.max())} is outside the target's "
                                 f"vocabulary [0, {out_vocab})")
            self.vocab = self.draft_ids.numel()  # every column is a valid target id
        # The drafter reads every token the target commits. check_vocab guarantees that for every real token (the
        # target's vocabulary, or the tokenizer's when given), but a target head padded wider than the drafter's
        # embedding (e.g. Pythia's 50304 rows vs a 50280-token Mamba drafter) can still sample a padding id at
        # temperature > 0. Refusing such pairs would lock out standard target/drafter pairs, so those ids are
        # clamped to the drafter's last readable id instead: they are no tokenizer's tokens, and only what the
        # drafter reads changes (later drafts may be accepted less), never what the target verifies, so the output
        # stays exact. Drafted tokens are always readable; only committed target tokens go through the clamp.
        readable = int(drafter.input_vocab_size)
        self.read_limit = readable - 1 if readable < out_vocab else None
        self.state = drafter.allocate_state(max_rows)
        self.row_index = torch.arange(max_rows, device=self.device)
        self.one_token = torch.zeros(1, dtype=torch.long, device=self.device)  # last committed token (next root)
        # What the drafter reads of it: the same buffer unless padding ids must be clamped.
        self.drafter_token = self.one_token if self.read_limit is None else torch.zeros_like(self.one_token)
        self.trees: dict[TreeConfig, DraftTree] = {}
        self.runner = StepRunner(drafter, self.state)  # runner.use_graphs: the CUDA-graph switch
        self.calls = 0  # sequential drafter invocations (prefill, step, extend) since construction

    @classmethod
    def for_drafter(cls, drafter, max_rows: int, out_vocab: int) -> TreeDrafter:
        """The cached TreeDrafter of `drafter` (state, buffers and graphs survive across generate calls).

        Rebuilt, graphs dropped, when the drafter moved, changed dtype or backend, reallocated its weights
        (`drafter_key`), got a new vocabulary map, or when more rows or another output width are needed.
        """
        cached = _CACHE.get(drafter)
        if (cached is None or cached.state.max_batch < max_rows or cached.out_vocab != out_vocab
                or cached.draft_ids is not drafter.draft_ids or cached.runner.key != drafter_key(drafter)):
            if cached is not None:
                cached.runner.invalidate()  # its graphs read the old weights / state / kernels
            cached = cls(drafter, max_rows, out_vocab)
            _CACHE[drafter] = cached
        return cached

    def buffers(self, config: TreeConfig) -> DraftTree:
        if config not in self.trees:
            tree = config.build()
            if len(tree) > self.state.max_batch:
                raise ValueError(f"tree {config} needs {len(tree)} state rows, only {self.state.max_batch} allocated")
            parents = torch.tensor(tree.parents, device=self.device)
            rows = [parents[start:stop] for start, stop in tree.levels[1:]]
            self.trees[config] = DraftTree(
                config=config,
                tree=tree,
                parent_rows=rows,
                tokens=torch.zeros(len(tree), dtype=torch.long, device=self.device),
                probs=torch.zeros(len(tree), self.out_vocab, dtype=torch.float32, device=self.device),
            )
        return self.trees[config]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Encode the prompt (1, L) into row 0; returns the logits for the next token (V,)."""
        if self.read_limit is not None:
            input_ids = input_ids.clamp(max=self.read_limit)  # padding ids the drafter cannot read (see __init__)
        logits, _ = self.drafter.prefill(input_ids, state=self.state)
        self.calls += 1
        return logits[0]

    @torch.no_grad()
    def draft(
        self,
        config: TreeConfig,
        root_token: torch.Tensor,
        root_logits: torch.Tensor,
        params: SamplingParams,
        mode: str,
        record_probs: bool,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """Fill the tree's tokens level by level (and, if recorded, each node's draft distribution).

        mode "topk": the N most likely distinct tokens per node. mode "sample" (temperature > 0): N draws without
        replacement from the processed draft distribution q, which is then always recorded. With a draft vocabulary
        both happen in draft space (temperature / top-k / top-p over the subset) and are then mapped to target ids.
        """
        buf = self.buffers(config)
        tree, vocab = buf.tree, self.vocab
        sampled = mode == "sample" and not params.greedy
        buf.tokens[0] = root_token
        logits = root_logits.view(1, -1)
        for level, n in enumerate(config.branching, start=1):
            (prev_start, prev_stop), (start, stop) = tree.levels[level - 1], tree.levels[level]
            logits = logits[:, :vocab]
            if sampled or record_probs:
                q = logits_to_probs(logits, params if not params.greedy else _SOFTMAX)
                self._record(buf.probs[prev_start:prev_stop], q)
            kids = sample_without_replacement(q, n, generator) if sampled else torch.topk(logits, n, dim=-1).indices
            buf.tokens[start:stop] = self._to_target(kids).reshape(-1)
            if level < config.depth:
                logits = self._step(buf.tokens[start:stop], start, stop, buf.parent_rows[level - 1])
        return buf

    def _to_target(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft logit columns -> target token ids (a gather, no sync)."""
        return columns if self.draft_ids is None else self.draft_ids[columns]

    def _record(self, rows: torch.Tensor, q: torch.Tensor) -> None:
        """Write draft distributions q (B, vocab) into probs rows (B, V_target); other columns stay zero."""
        if self.draft_ids is None:
            rows[:, : self.vocab] = q
        else:
            rows.index_copy_(1, self.draft_ids, q)

    @torch.no_grad()
    def resync(self, buf: DraftTree, path: list[int], next_token: int) -> torch.Tensor:
        """Move the deepest accepted node's state to row 0 and step the next token; returns the next logits (V,).

        No re-encoding: non-leaf nodes already have their state; an accepted leaf is stepped from its parent's row.
        The logits stay valid until the next `resync` (the next step over row 0).
        """
        node = path[-1] if path else 0
        token = int(next_token)
        self.one_token.fill_(token)
        if self.drafter_token is not self.one_token:
            self.drafter_token.fill_(min(token, self.read_limit))  # a padding id it cannot read (see __init__)
        if node and not buf.tree.children[node] and buf.tree.depths[node] == buf.config.depth:
            parent = buf.tree.parents[node]  # a drafted token: always readable
            self._step(buf.tokens[node : node + 1], 0, 1, self.row_index[parent : parent + 1])
            return self._step(self.drafter_token, 0, 1)[0]
        return self._step(self.drafter_token, 0, 1, self.row_index[node : node + 1])[0]

    @torch.no_grad()
    def draft_chain_lookup(
        self, config: TreeConfig, root_token: torch.Tensor, root_logits: torch.Tensor, context: torch.Tensor,
        record_probs: bool,
    ) -> tuple[DraftTree, LookupDraft]:
        """Fill a chain with the drafter's greedy tokens, skipping steps with prompt lookup (temperature 0 only).

        context: (L,) committed tokens up to the root. Row 0 (the committed state) is copied to scratch row 1 and
        left untouched; follow with `resync_extend`. Same tokens (and recorded probs) as `draft` on a chain.
        """
        buf = self.buffers(config)
        self.state.gather_(1, self.row_index[:1])
        if self.read_limit is not None:  # look up in what the drafter read, so proposals are readable (see __init__)
            context = context.clamp(max=self.read_limit)
        lookup = draft_chain_with_lookup(self.drafter, self.state.rows(1, LOOKUP_ROWS), root_logits, context,
                                         config.depth, vocab=self.vocab, keep_logits=record_probs,
                                         draft_ids=self.draft_ids)
        self.calls += lookup.drafter_calls
        buf.tokens[0] = root_token
        buf.tokens[1:] = lookup.tokens
        if record_probs:
            self._record(buf.probs[: config.depth], logits_to_probs(lookup.logits[:, : self.vocab], _SOFTMAX))
        return buf, lookup

    @torch.no_grad()
    def resync_extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row 0 holds the state after the root: extend it by the accepted tokens + next token (1-D) in one call.

        Returns the next logits (V,); `one_token` holds the next token (the new root).
        """
        self.one_token.copy_(tokens[-1:])
        self.calls += 1
        if self.read_limit is not None:
            tokens = tokens.clamp(max=self.read_limit)  # the committed next token may be a padding id (see __init__)
        return advance(self.drafter, tokens, self.state.rows(0, 1))

    def _step(self, tokens: torch.Tensor, start: int, stop: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start:stop] <- rows `parents` (if given), then one drafter step with `tokens` (stop - start,).

        The logits stay valid until the next step over any of these rows (`StepRunner.run`)."""
        self.calls += 1
        return self.runner.run(start, stop, tokens, parents)


_CACHE: "weakref.WeakKeyDictionary[object, TreeDrafter]" = weakref.WeakKeyDictionary()
