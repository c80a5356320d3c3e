"""Tree drafting on the drafter's state (Mamba or Transformer) for B prompts at once: one drafter step per level.

The B trees form a `tree.Forest`, rows 0..B-1 holding each row's state after its last committed token. A level forks
its parents' rows into its own and steps them together (`graphs.StepRunner`), so the drafter holds the state after
every non-leaf node; leaves are never stepped (`resync` steps an accepted one). Per row the forest gives the same
tokens and q as drafting that prompt's tree alone. A call reads `prefill` -> `draft` -> `resync` -> ...

With a draft vocabulary (`drafter.draft_ids`, EAGLE-3's d2t) logit column j is target id draft_ids[j]; everything
leaving this module is in target ids, a recorded q scattered into the full target vocabulary (zero outside).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mamba_draft.checkpoint import check_draft_ids
from mamba_draft.graphs import StepRunner, drafter_key, to_device
from mamba_draft.tree import Forest, Tree, TreeConfig, equal_runs
from tree_search.draft import Draft
from tree_search.plan import check_batch_prompts
from tree_search.prompt_lookup import LookupDraft, draft_chain_with_lookup
from tree_search.sampling import SamplingParams, sample_without_replacement, soft_probs

LOOKUP_ROWS = 3  # row 0 committed, rows 1-2 the lookup drafter's live + snapshot scratch rows


@dataclass(kw_only=True)
class DraftTree(Draft):
    """Buffers of one tree shape for B prompts, refilled every round: the `Draft` (tokens / probs per batch row in
    the tree's node order, what the target verifies) and the drafter state in the forest's layout."""

    config: TreeConfig
    forest: Forest
    rows: torch.Tensor  # (B, T+1) state row of each node of each batch row (forest.rows on the device)
    parent_rows: list[torch.Tensor]  # per level 1..γ: (B·B_l,) state row of each level row's parent
    parents: torch.Tensor  # (T+1,) parent node of each node (the root's is 0, never used)
    leaf: torch.Tensor  # (T+1,) bool: node on the last level (drafting never steps its state)
    scratch: torch.Tensor  # (B,) rows where resync steps accepted leaves: the last level's first B rows (unused)


class TreeDrafter:
    """Owns the drafter's state (one row per forest node) and the per-shape buffers; reuse it across calls
    (`reuse`: `SpeculativeDecoder` keeps one)."""

    def __init__(self, drafter, max_rows: int, out_vocab: int) -> None:
        if getattr(drafter, "reads_target", False) and drafter.config.drafted_features != "stand_in":
            raise ValueError(f"this drafter reads its own state beside drafted tokens (drafted_features "
                             f"{drafter.config.drafted_features!r}); tree drafting feeds them the stand-in: use a "
                             "drafter trained with drafted_features 'stand_in'")
        self.drafter, self.device, self.draft_ids = drafter, drafter.device, drafter.draft_ids
        self.out_vocab = out_vocab  # width of the probs buffers (the target's vocabulary)
        if self.draft_ids is None:
            self.vocab = min(int(drafter.vocab_size), out_vocab)  # draft tokens are chosen among ids < vocab
        else:  # every column is a valid target id
            self.vocab = check_draft_ids(self.draft_ids, out_vocab, vocab_name="the target's vocabulary ").numel()
        # A target head padded wider than the drafter's embedding (Pythia's 50304 rows vs a 50280-token drafter) may
        # sample a padding id at temperature > 0: committed ids the drafter cannot read are clamped to its last one
        # (`_readable`). Only what the drafter reads changes, never what the target verifies: the output stays exact.
        readable = int(drafter.input_vocab_size)
        self.read_limit = readable - 1 if readable < out_vocab else None
        self.state = drafter.allocate_state(max_rows)
        self.roots = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # row b's root (its last token)
        self.first_row = torch.zeros(1, dtype=torch.long, device=self.device)  # row 0's index (the lookup's fork)
        # per shape, sized for the largest batch seen: smaller batches (after `compact`) view its first rows
        self.trees: dict[tuple[TreeConfig, int], DraftTree] = {}
        self.storage: dict[TreeConfig, tuple[torch.Tensor, torch.Tensor]] = {}
        self.runner = StepRunner(drafter, self.state)  # runner.use_graphs: the CUDA-graph switch
        self.calls = 0  # sequential drafter invocations (prefill, step, extend) since construction

    @classmethod
    def reuse(cls, kept: TreeDrafter | None, drafter, max_rows: int, out_vocab: int) -> TreeDrafter:
        """`kept` (an earlier call's, which the caller keeps) while it serves: rebuilt, graphs dropped, for another
        drafter, when its weights, dtype or backend (`drafter_key`) or vocabulary map changed, or when more rows or
        another output width are needed."""
        if (kept is None or kept.drafter is not drafter or kept.state.max_batch < max_rows
                or kept.out_vocab != out_vocab or kept.draft_ids is not drafter.draft_ids
                or kept.runner.key != drafter_key(drafter)):
            if kept is not None:
                kept.runner.invalidate()  # its graphs read the old weights / state / kernels
            kept = cls(drafter, max_rows, out_vocab)
        return kept

    def buffers(self, config: TreeConfig, batch: int) -> DraftTree:
        """The buffers and index tensors of `batch` trees of shape `config`, built once per (config, batch)."""
        key = (config, batch)
        if key not in self.trees:
            tree = config.build()
            forest = Forest(tree, batch)
            if len(forest) > self.state.max_batch:
                raise ValueError(f"{batch} trees {config} need {len(forest)} state rows, only "
                                 f"{self.state.max_batch} allocated")
            tokens, probs = self.storage.get(config, (None, None))
            if tokens is None or tokens.shape[0] < batch:
                tokens = torch.zeros(batch, len(tree), dtype=torch.long, device=self.device)
                probs = torch.zeros(batch, len(tree), self.out_vocab, dtype=torch.float32, device=self.device)
                self.storage[config] = tokens, probs
                self.trees = {k: v for k, v in self.trees.items() if k[0] != config}  # views of the old storage
            device, scratch = self.device, forest.levels[-1][0]
            self.trees[key] = DraftTree(
                config=config, tree=tree, forest=forest, rows=forest.rows.to(device),
                parent_rows=[p.to(device) for p in forest.parent_rows],
                parents=torch.tensor((0,) + tree.parents[1:], device=device),
                leaf=(torch.tensor(tree.depths, device=device) == config.depth) & (config.depth > 0),  # root: never
                scratch=torch.arange(scratch, scratch + batch, device=device), tokens=tokens[:batch],
                probs=probs[:batch])
        return self.trees[key]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode B left-padded prompts (B, L) into state rows 0..B-1 -> each row's next-token logits (B, V).
        A Mamba state has no mask: each row is encoded from its unpadded tokens, one call per run of equal lengths."""
        ids = torch.as_tensor(input_ids)
        lengths = check_batch_prompts(ids, attention_mask)  # (B, L) integer ids, left padding, no empty prompt
        batch, width = ids.shape
        if batch > self.roots.shape[0]:
            raise ValueError(f"a batch of {batch} prompts exceeds the {self.roots.shape[0]} state rows allocated")
        ids = ids.to(device=self.device, dtype=torch.long)
        readable, logits = self._readable(ids), []
        for start, stop in equal_runs(lengths):
            part, _ = self.drafter.prefill(readable[start:stop, width - lengths[start]:],
                                           state=self.state.rows(start, stop))
            logits.append(part)
            self.calls += 1
        self.roots[:batch] = ids[:, -1]
        return torch.cat(logits)

    @torch.no_grad()
    def draft(self, config: TreeConfig, roots: torch.Tensor, root_logits: torch.Tensor, params: SamplingParams,
              mode: str, record_probs: bool, generator: torch.Generator | Sequence[torch.Generator] | None
              ) -> DraftTree:
        """Fill B trees' tokens level by level (and, if recorded, each node's draft distribution) from root states
        in rows 0..B-1. mode "topk": the N most likely distinct tokens per node; "sample": N draws without
        replacement from the processed q, then always recorded. generator: one, or B (row b draws from generator b).
        """
        batch = roots.shape[0]
        buf = self.buffers(config, batch)
        tree, vocab = buf.tree, self.vocab
        sampled = mode == "sample" and not params.greedy
        if sampled and isinstance(generator, Sequence) and len(generator) != batch:
            raise ValueError(f"draft got {len(generator)} generators for a batch of {batch} prompts")
        buf.tokens[:, 0] = roots
        logits = root_logits
        for level, n in enumerate(config.branching, start=1):
            (prev_start, prev_stop), (start, stop) = tree.levels[level - 1], tree.levels[level]
            logits = logits[:, :vocab]
            if sampled or record_probs:
                q = soft_probs(logits, params)
                self._record(buf.probs[:, prev_start:prev_stop], q.view(batch, prev_stop - prev_start, vocab))
            kids = sample_without_replacement(q, n, generator) if sampled else torch.topk(logits, n, dim=-1).indices
            # kids (B·B_{l-1}, n) row-major is batch row, parent, child: each batch row's level in tree order
            buf.tokens[:, start:stop] = (kids if self.draft_ids is None else self.draft_ids[kids]).view(batch, -1)
            if level < config.depth:
                logits = self._step(buf.tokens[:, start:stop], *buf.forest.levels[level], buf.parent_rows[level - 1])
        return buf

    @torch.no_grad()
    def draft_chain_lookup(self, config: TreeConfig, roots: torch.Tensor, root_logits: torch.Tensor,
                           context: torch.Tensor, record_probs: bool) -> tuple[DraftTree, LookupDraft]:
        """One prompt's greedy chain (roots (1,), root_logits (1, V)) skipping steps with prompt lookup: the same
        tokens and q as `draft` on a chain. context: (L,) committed tokens up to the root. Drafts on scratch rows
        from a copy of row 0, which stays committed: follow with `extend`."""
        buf = self.buffers(config, 1)
        self.state.gather_(1, self.first_row)
        lookup = draft_chain_with_lookup(self.drafter, self.state.rows(1, LOOKUP_ROWS), root_logits[0],
                                         self._readable(context),  # what the drafter read: proposals it can read
                                         config.depth, vocab=self.vocab, keep_logits=record_probs,
                                         draft_ids=self.draft_ids)
        self.calls += lookup.drafter_calls
        buf.tokens[:, 0] = roots
        buf.tokens[0, 1:] = lookup.tokens
        if record_probs:
            self._record(buf.probs[0, : config.depth], soft_probs(lookup.logits[:, : self.vocab], SamplingParams()))
        return buf, lookup

    def _readable(self, ids: torch.Tensor) -> torch.Tensor:
        """Committed ids clamped to what the drafter can read (see __init__)."""
        return ids if self.read_limit is None else ids.clamp(max=self.read_limit)

    def _record(self, rows: torch.Tensor, q: torch.Tensor) -> None:
        """Write draft distributions q (..., vocab) into probs rows (..., V_target); other columns stay zero."""
        if self.draft_ids is None:
            rows[..., : self.vocab] = q
        else:
            rows.index_copy_(rows.dim() - 1, self.draft_ids, q)

    @torch.no_grad()
    def resync(self, buf: DraftTree, accepted, next_tokens) -> torch.Tensor:
        """Row b's root row <- its deepest accepted node's row (accepted (B,), 0 = none), then every row steps its
        next token (next_tokens (B,)) -> the next root logits (B, V), valid until the next step of rows 0..B-1.

        An accepted leaf was never stepped: first every row steps its node's token from the parent's row into the
        last level's first B rows (unused by drafting); for host ints only when some row accepted a leaf.
        """
        batch = buf.tokens.shape[0]
        acc, nxt = self._as_rows(accepted, batch, len(buf.tree)), self._as_rows(next_tokens, batch, self.out_vocab)
        self.roots[:batch] = nxt
        source = buf.rows.gather(1, acc[:, None])[:, 0]
        last = buf.config.depth  # a root-only tree (no speculation) has no unstepped leaves
        if last and (isinstance(accepted, torch.Tensor) or any(buf.tree.depths[int(n)] == last for n in accepted)):
            parents = buf.rows.gather(1, buf.parents[acc][:, None])[:, 0]
            scratch = buf.forest.levels[-1][0]
            self._step(buf.tokens.gather(1, acc[:, None])[:, 0], scratch, scratch + batch, parents)
            source = torch.where(buf.leaf[acc], buf.scratch, source)
        return self._step(self._readable(nxt), 0, batch, source)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows 0..B-1 read their next (B, k) committed tokens in one drafter call -> the logits after them (B, V),
        valid until the next step of these rows; the last column becomes the roots."""
        batch = tokens.shape[0]
        self.roots[:batch] = tokens[:, -1]
        tokens = self._readable(tokens)
        if tokens.shape[1] == 1:
            return self._step(tokens[:, 0], 0, batch)  # a step (graph-captured on CUDA) is cheaper than a 1-token scan
        self.calls += 1
        return self.drafter.extend(tokens, self.state.rows(0, batch), last_only=True)

    @torch.no_grad()
    def read(self, tokens: list[list[int]], features: list[torch.Tensor]) -> torch.Tensor:
        """Rows 0..B-1 read their own committed tokens, each with its target states (m_b, H) (a drafter that reads
        the target), one drafter call per run of rows reading as many -> the logits after them (B, V)."""
        logits = []
        for start, stop in equal_runs([len(row) for row in tokens]):
            ids = self._readable(torch.tensor(tokens[start:stop], device=self.device))
            logits.append(self.drafter.extend(ids, self.state.rows(start, stop), last_only=True,
                                              features=torch.stack(features[start:stop])))
            self.calls += 1
        self.roots[: len(tokens)] = torch.tensor([row[-1] for row in tokens], device=self.device)
        return torch.cat(logits)

    @torch.no_grad()
    def compact(self, rows) -> None:
        """Keep only batch rows `rows` (in their new order): their root states and roots move to rows 0..len(rows)-1.
        Index the root logits the same way (`logits[rows]`)."""
        index = self._as_rows(rows, len(rows), self.roots.shape[0])
        self.state.gather_(0, index)
        self.roots[: len(rows)] = self.roots[index]

    def _as_rows(self, values, batch: int, limit: int) -> torch.Tensor:
        """(batch,) int64 on the device from a tensor (unchecked: no sync) or host ints (checked in [0, limit))."""
        if isinstance(values, torch.Tensor):
            if values.shape != (batch,):
                raise ValueError(f"expected {batch} values, one per batch row, got shape {tuple(values.shape)}")
            return values.to(device=self.device, dtype=torch.long)
        values = [int(v) for v in values]
        if len(values) != batch:
            raise ValueError(f"expected {batch} values, one per batch row, got {len(values)}")
        if any(not 0 <= v < limit for v in values):
            raise ValueError(f"values must lie in [0, {limit}), got {values}")
        return to_device(torch.tensor(values, dtype=torch.long), self.device)

    def _step(self, tokens: torch.Tensor, start: int, stop: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start:stop] <- rows `parents` (if given), then one drafter step with `tokens` (`StepRunner.run`)."""
        self.calls += 1
        return self.runner.run(start, stop, tokens, parents)
