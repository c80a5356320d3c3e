"""Speculative generation, one engine for any number of prompts: draft -> verify -> commit -> resync, plus the plain
autoregressive loop on the same harness (the fair baseline).

A call decodes B prompts (one prompt is a batch of one) in rounds: **draft** one tree per row (`strategies`: one
drafter step per tree level for all rows, with a Mamba or a Transformer drafter) -> **verify** every row in one target
forward (one prompt: `target.TargetState` through `target.OneRow`, with its static cache and captured verification on
CUDA; several: `target.BatchTargetState`, left-padded rows sharing slots), then the verifier decides each row ->
**commit** each row's path -> **resync** the drafter. A row stops at its own EOS / max_new_tokens and leaves the batch
(target cache and drafter state), so finished rows cost no more work. The policy picks one tree shape per round for
the whole batch and is rewarded with the batch's tokens per second (time reward) or the paper reward on the rows'
mean accepted length. A `none` round is one plain decoding step of every row and leaves the drafter alone: the next
drafted round feeds it the tokens it missed in one call. One prompt may also stream, verify prompt-lookup proposals
(`lookup_tokens`) and draft chains with prompt lookup (`prompt_lookup`).

Per row the output is what `generate` gives that prompt alone: token-identical to the target's greedy decoding at
temperature 0, and at temperature > 0 row b draws all its randomness (drafting and verification) from its own
generator seeded `seed + b` (equal draws; outputs equal up to the batched forward's rounding). Stats bookkeeping and
phase timing live in `recorder`, what every call shares (stats, results, input checks) in `calls`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tree_search.bandit import UCBBandit
from tree_search.calls import (
    BatchGenerateResult, GenerateResult, GenerateStats, batch_prompts, check_batch_limits, check_drafter,
    check_drafter_room, check_options, check_prompt, default_lookup_tokens, eos_set, is_batch, make_policy,
    truncate,
)
from tree_search.prompt_lookup import NgramLookup
from tree_search.recorder import DONE, DRAFT, RESYNC, VERIFIED, VERIFY, Recorder
from tree_search.sampling import SamplingParams, logits_to_probs, make_generator, resolve_sampling
from tree_search.strategies import Draft, drafting_strategy
from tree_search.target import BatchTargetState, OneRow, TargetState, target_vocab_size
from tree_search.tree import TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, get_verifier
from tree_search.verifiers.greedy import GreedyVerifier, greedy_walk
from tree_search.verifiers.sampling import SamplingVerifier

_PLAIN = VerifyResult(path=[], next_token=0)  # what a plain decoding step counts as (no lossy accepts, no info)


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    drafter,
    input_ids,
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    tree: TreeConfig | str | tuple[int, ...] | UCBBandit = "auto",
    verifier: str | Verifier | None = None,
    verifier_params: dict | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    tokenizer=None,
    streamer=None,
    prompt_lookup: bool = False,
    lookup_tokens: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> GenerateResult | BatchGenerateResult:
    """Tree speculative decoding of one prompt (-> GenerateResult) or of a batch (-> BatchGenerateResult).

    input_ids: (1, L) / (L,) for one prompt; a list of token lists, or left-padded (B, L) ids + `attention_mask`,
    for a batch (one tree per row, one target forward for all rows; row b seeded seed + b).

    tree: a TreeConfig / "3,2,2,1,1" / tuple (fixed shape), "auto" (the target device's default, reset per call:
    on a CPU the measured-time bandit over none / 1,1 / 1,1,1 / 2,1, elsewhere the paper's), "bandit" (UCB over the
    paper's arms) or a UCBBandit / FixedPolicy instance (persistent=True keeps its statistics across calls). "none" (as a
    shape or a bandit arm) is no speculation: that round is one plain target decoding step, what every verifier
    would pick on a root-only tree (the argmax, or a sample of the target's processed distribution).
    temperature / top_p / top_k: None takes the target's generation_config, as `target.generate` does
    (tree_search.sampling.resolve_sampling): greedy unless it sets do_sample; then its top_k (50 unless set) applies.
    verifier: None is "greedy" when the resolved sampling is greedy, else "sampling" (both lossless).
    eos_token_id: None takes the target's generation_config (as `target.generate` does).
    One prompt only: `streamer`; `prompt_lookup` (FLy's multi-level acceleration for chains at temperature 0:
    prompt-lookup n-gram proposals pre-verified by the drafter give the same greedy chain in fewer drafter calls when
    the text repeats itself, more when proposals keep failing: stats.drafter_calls_saved); `lookup_tokens` K > 0
    (prompt-lookup rounds: when the last 2-4 committed tokens, prompt included, occurred before, the <= K tokens that
    followed them are verified instead of a drafted tree; the drafter reads the committed tokens when it next drafts;
    the policy picks shapes for the other rounds. Any verifier: the proposal is deterministic, a point-mass draft
    distribution, so lossless sampling stays exact). lookup_tokens None: 8 with tree "auto" for one prompt
    on a CPU without `prompt_lookup`, else 0 (`calls.default_lookup_tokens`).
    All inputs are validated before any model runs.
    """
    if drafter is None:
        raise TypeError("generate needs a drafter; generate_autoregressive is the baseline without one")
    batch = is_batch(input_ids, attention_mask)
    if lookup_tokens is None:
        lookup_tokens = default_lookup_tokens(tree, next(target.parameters()).device, batch, prompt_lookup)
    if batch and (streamer is not None or prompt_lookup or lookup_tokens):
        raise ValueError("a batch of prompts takes no streamer, prompt_lookup or lookup_tokens; pass one prompt "
                         "for those")
    return speculate(target, drafter, input_ids, attention_mask, batch, max_new_tokens, temperature, top_p, top_k,
                     tree, verifier, verifier_params, eos_token_id, seed, tokenizer, streamer, prompt_lookup,
                     lookup_tokens)


@torch.no_grad()
def generate_batch(target: torch.nn.Module, drafter, prompts, *, attention_mask: torch.Tensor | None = None,
                   max_new_tokens: int, temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, tree: TreeConfig | str | tuple[int, ...] | UCBBandit = "auto",
                   verifier: str | Verifier | None = None, verifier_params: dict | None = None,
                   eos_token_id: int | list[int] | None = None, seed: int | None = None,
                   tokenizer=None) -> BatchGenerateResult:
    """`generate` for B prompts, always as a batch (even of one): a list of token-id lists / 1-D tensors (left-padded
    here), or left-padded input_ids (B, L) with their attention_mask (None: no padding). Stats: `result.stats` for the
    batch (its `accepted_lengths` are every row-round's, so its τ is the batch's), `result.rows[b].stats` per row
    (times and target forwards are batch-level only)."""
    if drafter is None:
        raise TypeError("generate_batch needs a drafter; generate_autoregressive_batch is the baseline without one")
    return speculate(target, drafter, prompts, attention_mask, True, max_new_tokens, temperature, top_p, top_k, tree,
                     verifier, verifier_params, eos_token_id, seed, tokenizer, None, False, 0)


def speculate(target, drafter, prompts, attention_mask, batch: bool, max_new_tokens, temperature, top_p, top_k, tree,
              verifier, verifier_params, eos_token_id, seed, tokenizer, streamer, prompt_lookup: bool,
              lookup_tokens: int) -> GenerateResult | BatchGenerateResult:
    """The engine: one round after another for all rows until each has finished (see the module docstring)."""
    run = prepare(target, prompts, attention_mask, batch, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                  seed, streamer, drafter=drafter, tree=tree, verifier=verifier, verifier_params=verifier_params,
                  tokenizer=tokenizer, prompt_lookup=prompt_lookup, lookup_tokens=lookup_tokens)
    params, verifier, policy = run.params, run.verifier, run.policy
    mode = "sample" if verifier.draft_mode == "sample" and not params.greedy else "topk"
    record_probs = not params.greedy or verifier.needs_draft_probs
    # Greedy decisions need only each node's argmax: one batched argmax and one host copy instead of B verifier calls.
    walk = params.greedy and type(verifier) in (GreedyVerifier, SamplingVerifier)
    lm_head = target.get_output_embeddings() if verifier.needs_hidden else None
    speculates = any(arm.depth for arm in policy.arms)  # tree="none" never needs the drafter
    widest = max(lookup_tokens, *(a.num_nodes for a in policy.arms)) + 1
    policy.start_call()
    rec = run.start()
    target_state = run.target_state(target, widest)
    target_state.prefill(run.ids[:, :-1], run.mask[:, :-1])  # each row's last prompt token is its first root
    strategy = drafting_strategy(drafter, prompt_lookup, run.batch * widest, target_vocab_size(target), params, mode,
                                 record_probs, max_tokens=run.ids.shape[1] + max_new_tokens)
    strategy.skip(run.ids[:, -1:], catch_up=False)  # the roots; the drafter reads the prompts when it first drafts
    lookup = NgramLookup(run.ids[0].tolist(), lookup_tokens) if lookup_tokens else None
    logits = None  # the drafter's logits after each root (None until its prefill; never, if only none runs)
    while True:
        rows, gens = len(run.active), run.generators
        proposal = lookup.propose() if lookup is not None else None
        arm = None if proposal else policy.select()  # a lookup round is no arm's: the policy learns from its own
        drafts = arm is not None and policy.arms[arm].depth > 0
        if drafts and logits is None:  # once per call: not charged to this round's arm
            logits = strategy.prefill(run.ids[run.active], run.mask[run.active])
        rec.mark(DRAFT)
        if proposal or drafts:
            if proposal:
                draft = strategy.proposal(proposal)
            else:
                logits = strategy.catch_up(logits)  # after rounds that left the drafter alone
                draft = strategy.draft(policy.arms[arm], logits, gens)
            rec.mark(VERIFY)
            results, proposed = verify(target_state, verifier, draft, params, gens, mode, record_probs, walk, lm_head)
        else:  # no speculation: one plain decoding step of every row (what any verifier picks on a root-only tree)
            rec.mark(VERIFY)
            following = next_tokens(target_state.decode(strategy.roots(rows)), params, gens)
            results, proposed = [_PLAIN] * rows, [[t] for t in following.tolist()]  # the round's one host transfer
        rec.mark(VERIFIED)
        committed, finished = run.emit(proposed, results, verifier.name)
        if lookup is not None:
            lookup.extend(committed[0])
            run.stats.lookup_rounds += bool(proposal)
        tokens_out = sum(map(len, proposed))
        # paper reward: on the rows' mean accepted length; time reward: the batch's tokens per second
        reward_tokens = tokens_out if policy.reward == "time" else tokens_out / rows
        if all(finished):
            times = rec.round_times(finished=True)
            if arm is not None:
                policy.update(arm, reward_tokens, *times)
            break
        if proposal or drafts:
            target_state.commit([r.path for r in results])
        keep = [b for b, done in enumerate(finished) if not done]
        if len(keep) < rows:
            target_state.drop_rows(keep)
        rec.mark(RESYNC)
        if drafts:
            logits = strategy.resync(draft, results, proposed)
        elif proposal:  # the drafter catches up in one call when it next drafts
            strategy.skip(torch.tensor([proposed[0]], device=run.ids.device), catch_up=speculates)
        else:
            strategy.skip(following[:, None], catch_up=speculates)
        if len(keep) < rows:
            run.keep(keep)
            strategy.compact(keep)
            logits = logits[keep] if logits is not None else None
        rec.mark(DONE)
        # The policy is charged the whole round: committing to the target cache and resyncing the drafter too.
        times = rec.round_times(finished=False)
        if arm is not None:
            policy.update(arm, reward_tokens, *times)
    return run.finish(target_state, drafter_calls=strategy.calls, drafter_calls_saved=strategy.calls_saved,
                      drafter_state_bytes=strategy.state_bytes if logits is not None else 0, arms=policy.summary())


def verify(target_state, verifier: Verifier, draft: Draft, params: SamplingParams, generators, mode: str,
           record_probs: bool, walk: bool, lm_head) -> tuple[list[VerifyResult], list[list[int]]]:
    """One target forward over every row's tree, the verifier's decision per row -> (results, each row's proposed
    tokens: accepted path + next token), with the round's one device -> host transfer (the trees' tokens, a few
    dozen per row, come over at once, so no index tensor has to go the other way first)."""
    scores, hidden = target_state.tree_forward(draft.tokens, draft.tree, want_hidden=verifier.needs_hidden)
    if walk:
        n = len(draft.tree)
        host = torch.cat([draft.tokens, scores.argmax(-1)], dim=1).tolist()
        tokens = [row[:n] for row in host]
        results = [VerifyResult(*greedy_walk(draft.tree, row[:n], row[n:])) for row in host]
    else:
        results = [verifier.verify(VerifyInput(
            tree=draft.tree, tokens=draft.tokens[b], target_logits=scores[b],
            draft_probs=draft.probs[b] if record_probs else None,
            hidden=hidden[b] if hidden is not None else None, lm_head=lm_head, sampling=params,
            generator=generators[b] if generators else None, draft_mode=mode)) for b in range(scores.shape[0])]
        tokens = draft.tokens.tolist()
    return results, [[row[node] for node in r.path] + [int(r.next_token)] for row, r in zip(tokens, results)]


@torch.no_grad()
def generate_autoregressive(
    target: torch.nn.Module,
    input_ids,
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    streamer=None,
    attention_mask: torch.Tensor | None = None,
) -> GenerateResult | BatchGenerateResult:
    """One target forward per token (for all rows) on the same cache, sampling and stats code as `generate` (the
    baseline). Sampling arguments left None take the target's generation_config, as in `generate`. A batch (as in
    `generate`) decodes all rows in one forward per token, row b sampling from its own generator seeded seed + b."""
    batch = is_batch(input_ids, attention_mask)
    if batch and streamer is not None:
        raise ValueError("a batch of prompts takes no streamer; pass one prompt to stream")
    return decode_plainly(target, input_ids, attention_mask, batch, max_new_tokens, temperature, top_p, top_k,
                          eos_token_id, seed, streamer)


@torch.no_grad()
def generate_autoregressive_batch(target: torch.nn.Module, prompts, *, attention_mask: torch.Tensor | None = None,
                                  max_new_tokens: int, temperature: float | None = None, top_p: float | None = None,
                                  top_k: int | None = None, eos_token_id: int | list[int] | None = None,
                                  seed: int | None = None) -> BatchGenerateResult:
    """`generate_autoregressive` for B prompts, always as a batch (the baseline of `generate_batch`)."""
    return decode_plainly(target, prompts, attention_mask, True, max_new_tokens, temperature, top_p, top_k,
                          eos_token_id, seed, None)


def decode_plainly(target, prompts, attention_mask, batch: bool, max_new_tokens, temperature, top_p, top_k,
                   eos_token_id, seed, streamer) -> GenerateResult | BatchGenerateResult:
    run = prepare(target, prompts, attention_mask, batch, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                  seed, streamer)
    rec = run.start()
    target_state = run.target_state(target, 1)
    # each row's last prompt token goes through the first decoding step, as speculation's first root does: every
    # position after the prefilled ones is computed by the same kind of forward in both (mamba_draft.row_blocks)
    target_state.prefill(run.ids[:, :-1], run.mask[:, :-1])
    logits = target_state.decode(run.ids[:, -1])
    while True:
        tokens = next_tokens(logits, run.params, run.generators)
        proposed = [[t] for t in tokens.tolist()]  # the round's one device -> host transfer
        _, finished = run.emit(proposed, [_PLAIN] * len(proposed), "autoregressive")
        if all(finished):
            break
        keep = [b for b, done in enumerate(finished) if not done]
        if len(keep) < len(finished):
            target_state.drop_rows(keep)
            run.keep(keep)
            tokens = tokens[keep]
        rec.mark(VERIFY)
        logits = target_state.decode(tokens)
        rec.mark(VERIFIED)
        rec.decode_time()
    return run.finish(target_state)


def next_tokens(logits: torch.Tensor, params: SamplingParams, generators: list | None) -> torch.Tensor:
    """Each row's next token (B,) from the target's logits (B, V): argmax, or a sample of the processed distribution
    with row b's noise from generators[b] (as `sampling.sample` draws it for that row alone)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, params)
    noise = torch.empty_like(probs)
    if generators is None:
        noise.exponential_()
    else:
        for row, generator in zip(noise, generators):
            row.exponential_(generator=generator)
    return (probs / noise).argmax(-1)


@dataclass
class Run:
    """One call's validated inputs, per-row committed tokens and stats (what both loops share)."""

    ids: torch.Tensor  # (B, L) left-padded prompts on the target's device
    mask: torch.Tensor  # (B, L) 1 on prompt tokens, 0 on the padding
    lengths: list[int]
    batched: bool  # the caller passed a batch (-> BatchGenerateResult), even of one
    max_new_tokens: int
    params: SamplingParams
    eos: set[int]
    stats: GenerateStats
    row_stats: list[GenerateStats]
    generators: list[torch.Generator] | None  # active rows' generators (None: torch's global RNG)
    streamer: object = None
    verifier: Verifier | None = None
    policy: UCBBandit | None = None
    out: list[list[int]] = field(default_factory=list)  # committed new tokens per prompt
    active: list[int] = field(default_factory=list)  # batch row i holds prompt active[i]
    recorder: Recorder | None = None
    counters: list[Recorder] = field(default_factory=list)  # per prompt; only their `count` is used

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    def start(self) -> Recorder:
        """Start the clock, stream the prompt; returns the batch's recorder (phase times, rounds)."""
        self.out = [[] for _ in self.lengths]
        self.active = list(range(self.batch))
        self.counters = [Recorder(stats, torch.device("cpu")) for stats in self.row_stats]
        self.recorder = Recorder(self.stats, self.ids.device)
        if self.streamer is not None:
            self.streamer.put(self.ids[0].cpu())
        return self.recorder

    def target_state(self, target: torch.nn.Module, widest: int):
        """One prompt: a TargetState (static cache and captured verification on CUDA; on CPU the dynamic cache, faster
        there) holding prompt + max_new_tokens + the widest tree, in batched shapes. Several: a BatchTargetState."""
        if self.batch > 1 or self.batched:
            return BatchTargetState(target)
        return OneRow(TargetState.for_model(target, max_len=self.ids.shape[1] + self.max_new_tokens + widest,
                                            graphs=True))  # graphs apply only where the cache is static (CUDA)

    def emit(self, proposed: list[list[int]], results: list[VerifyResult], name: str
             ) -> tuple[list[list[int]], list[bool]]:
        """Commit each active row's round up to its first EOS (kept) or its budget -> (committed, which finished)."""
        committed, finished = [], []
        for prompt, tokens, result in zip(self.active, proposed, results):
            out = self.out[prompt]
            kept, done = truncate(tokens, self.max_new_tokens - len(out), self.eos)
            out.extend(kept)
            self.counters[prompt].count(name, result, len(kept), len(tokens))
            committed.append(kept)
            finished.append(done)
        self.stats.rounds += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor(committed[0]))
        return committed, finished

    def keep(self, rows: list[int]) -> None:
        """Only batch rows `rows` go on (finished rows dropped)."""
        self.active = [self.active[b] for b in rows]
        if self.generators is not None:
            self.generators = [self.generators[b] for b in rows]

    def finish(self, target_state, **stats) -> GenerateResult | BatchGenerateResult:
        """Fill the batch's and the rows' stats (the total waits for the device), end the stream -> the committed
        sequences: one GenerateResult for one prompt, else a BatchGenerateResult."""
        total = self.stats
        total.total_time = self.recorder.total_time()
        total.target_forwards = target_state.forwards
        for name, value in stats.items():
            setattr(total, name, value)
        rows = []
        width = self.ids.shape[1]
        for b, (length, out, row) in enumerate(zip(self.lengths, self.out, self.row_stats)):
            row.new_tokens = len(out)
            total.new_tokens += row.new_tokens
            total.accepted_lengths += row.accepted_lengths
            total.cut_tokens += row.cut_tokens
            total.lossy_accepts += row.lossy_accepts
            total.round_info += row.round_info
            for rule, n in row.lossy_accepts_by.items():
                total.lossy_accepts_by[rule] = total.lossy_accepts_by.get(rule, 0) + n
            tokens = torch.cat([self.ids[b, width - length:], torch.tensor(out, dtype=torch.long,
                                                                           device=self.ids.device)])
            rows.append(GenerateResult(tokens[None], row))
        if self.streamer is not None:
            self.streamer.end()
        if self.batched:
            return BatchGenerateResult(rows, total)
        return GenerateResult(rows[0].tokens, total)


def prepare(target: torch.nn.Module, prompts, attention_mask, batched: bool, max_new_tokens: int, temperature, top_p,
            top_k, eos_token_id, seed, streamer, *, drafter=None, tree=None, verifier=None, verifier_params=None,
            tokenizer=None, prompt_lookup: bool = False, lookup_tokens: int = 0) -> Run:
    """Validate a call's inputs, before any model runs -> its Run. drafter None: the autoregressive baseline."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer (row b uses seed + b) or None, got {seed!r}")
    params = resolve_sampling(target, temperature, top_p, top_k)
    device = next(target.parameters()).device
    policy = None
    if drafter is not None:
        if verifier is None:
            verifier = "greedy" if params.greedy else "sampling"
        verifier = get_verifier(verifier, **(verifier_params or {}))
        policy = make_policy(tree, device)
        check_options(verifier, policy, params, prompt_lookup, lookup_tokens)
    arms = policy.arms if policy is not None else ()
    depth = max(lookup_tokens, *(a.depth for a in arms), 0)
    nodes = max(lookup_tokens, *(a.num_nodes for a in arms), 0)
    if batched:
        ids, mask, lengths = batch_prompts(prompts, attention_mask)
        check_batch_limits(target, ids, lengths, max_new_tokens, tree_depth=depth, tree_nodes=nodes)
    else:
        ids = check_prompt(target, prompts, max_new_tokens, tree_depth=depth, tree_nodes=nodes)
        mask, lengths = torch.ones_like(ids), [ids.shape[1]]
    if drafter is not None:
        check_drafter_room(drafter, len(lengths), nodes + 1, target_vocab_size(target),
                           max(lengths) + max_new_tokens + depth)
        check_drafter(target, drafter, tokenizer, verifier, policy)
    name, lossless = (verifier.name, verifier.lossless) if verifier is not None else ("autoregressive", True)
    stats = GenerateStats(prompt_tokens=sum(lengths), verifier=name, lossless=lossless, sampling=asdict(params))
    rows = [GenerateStats(prompt_tokens=n, verifier=name, lossless=lossless, sampling=asdict(params)) for n in lengths]
    generators = None if seed is None else [make_generator(seed + b, device) for b in range(len(lengths))]
    return Run(ids.to(device), mask.to(device), lengths, batched, max_new_tokens, params, eos_set(target, eos_token_id),
               stats, rows, generators, streamer, verifier, policy)
