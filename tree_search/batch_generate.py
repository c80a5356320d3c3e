"""Tree speculative decoding of B prompts at once (`generate_batch`) and its baseline (`generate_autoregressive_batch`).

One round for the whole batch: **draft** one tree per row (`TreeDrafter.draft_batch`: one drafter step per level for
all rows) -> **verify** every row in one target forward (`target.BatchTargetState`), then the single-prompt verifier
decides each row on that row's tokens / logits / q -> **commit** each row's path (ragged) -> **resync** all rows
(`resync_batch`). A row stops at its own EOS / max_new_tokens and is dropped from both the target cache and the
drafter state, so finished rows cost no more work (measured against keeping B fixed and masking finished rows, tiny
Llama on CPU, EOS finishing rows at scattered rounds: B=16 0.39 s vs 0.51 s, B=64 0.97 s vs 1.65 s; on CUDA each new
batch size captures its own drafter graphs, once per size). The policy picks one tree shape per round for the whole batch and
is rewarded with the batch's tokens per second (time reward) or the paper reward on the rows' mean accepted length.
A no-speculation round (the `none` arm) is one batched target decoding step and leaves the drafter alone: the next
drafted round feeds the (B, k) tokens of the k none rounds before it in one drafter call (`extend_batch`).

Per row the output is what `generate` gives that prompt alone: token-identical to the target's greedy decoding at
temperature 0, and at temperature > 0 row b draws all its randomness (drafting and verification) from its own
generator seeded `seed + b`, as `generate(..., seed=seed + b)` does (equal draws; outputs equal up to the batched
forward's rounding).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from tree_search.bandit import UCBBandit
from tree_search.drafting import TreeDrafter
from tree_search.calls import (
    GenerateResult, GenerateStats, check_drafter, check_options, eos_set, make_policy, truncate,
)
from tree_search.recorder import DONE, DRAFT, RESYNC, VERIFIED, VERIFY, Recorder
from tree_search.sampling import SamplingParams, logits_to_probs, make_generator, resolve_sampling
from tree_search.target import BatchTargetState, check_batch_prompts, max_positions, target_vocab_size, window_capacity
from tree_search.tree import TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, get_verifier
from tree_search.verifiers.greedy import GreedyVerifier, greedy_walk
from tree_search.verifiers.sampling import SamplingVerifier

_PLAIN = VerifyResult(path=[], next_token=0)  # what a plain decoding step counts as (no lossy accepts, no info)


@dataclass
class BatchGenerateResult:
    rows: list[GenerateResult]  # per prompt, in input order: tokens (1, prompt + new) and that row's own stats
    stats: GenerateStats  # the whole batch: all rows' new tokens, batched rounds, target forwards, times, arms

    @property
    def new_tokens(self) -> list[list[int]]:
        return [row.new_tokens[0].tolist() for row in self.rows]

    @property
    def mean_accepted(self) -> list[float]:
        """Per-row τ (tokens committed per round the row took part in)."""
        return [row.stats.mean_accepted for row in self.rows]


@torch.no_grad()
def generate_batch(
    target: torch.nn.Module,
    drafter,
    prompts,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    tree: TreeConfig | str | tuple[int, ...] | UCBBandit = "bandit",
    verifier: str | Verifier | None = None,
    verifier_params: dict | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    tokenizer=None,
) -> BatchGenerateResult:
    """`generate` for B prompts: a list of token-id lists / 1-D tensors (left-padded here), or left-padded
    input_ids (B, L) with their attention_mask (None: no padding). Other arguments as in `generate`; seed: row b
    uses seed + b. Stats: `result.stats` for the batch (its `accepted_lengths` are every row-round's, so its τ is the
    batch's), `result.rows[b].stats` per row (times and target forwards are batch-level only).
    All inputs are validated before any model runs."""
    if drafter is None:
        raise TypeError("generate_batch needs a drafter; generate_autoregressive_batch is the baseline without one")
    run = prepare_batch(target, prompts, attention_mask, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                        seed, drafter=drafter, tree=tree, verifier=verifier, verifier_params=verifier_params,
                        tokenizer=tokenizer)
    params, verifier, policy = run.params, run.verifier, run.policy
    mode = "sample" if verifier.draft_mode == "sample" and not params.greedy else "topk"
    record_probs = not params.greedy or verifier.needs_draft_probs
    # Greedy decisions need only each node's argmax: one batched argmax and one host copy instead of B verifier calls.
    walk = params.greedy and type(verifier) in (GreedyVerifier, SamplingVerifier)
    lm_head = target.get_output_embeddings() if verifier.needs_hidden else None
    speculates = any(arm.depth for arm in policy.arms)  # tree="none" never needs the drafter
    policy.start_call()
    rec = run.start()
    target_state = BatchTargetState(target)
    target_state.prefill(run.ids[:, :-1], run.mask[:, :-1])  # each row's last prompt token is its first root
    drafts = TreeDrafter.for_drafter(drafter, run.batch * (max(a.num_nodes for a in policy.arms) + 1),
                                     target_vocab_size(target))
    first_call = drafts.calls
    drafts.roots[: run.batch] = run.ids[:, -1]
    logits = None  # the drafter reads the prompts at the first drafted round (never, if every round is none)
    behind: list[torch.Tensor] = []  # each none round's (B,) tokens, not yet read by the drafter
    while True:
        arm = policy.select()
        config = policy.arms[arm]
        batch, gens = len(run.active), run.generators
        if config.depth and logits is None:  # once per call: not charged to this round's arm
            logits = drafts.prefill_batch(run.ids[run.active], run.mask[run.active])
        rec.mark(DRAFT)
        if config.depth:
            if behind:  # after no-speculation rounds the drafter reads what they committed, in one call
                logits, behind = drafts.extend_batch(torch.stack(behind, dim=1)), []
            buf = drafts.draft_batch(config, drafts.roots[:batch], logits, params, mode, record_probs, gens)
            rec.mark(VERIFY)
            scores, hidden = target_state.tree_forward(buf.tokens, buf.tree, want_hidden=verifier.needs_hidden)
            if walk:
                n = len(buf.tree)
                host = torch.cat([buf.tokens, scores.argmax(-1)], dim=1).tolist()  # the round's one host transfer
                tokens = [row[:n] for row in host]
                results = [VerifyResult(*greedy_walk(buf.tree, row[:n], row[n:])) for row in host]
            else:
                results = [verifier.verify(VerifyInput(
                    tree=buf.tree, tokens=buf.tokens[b], target_logits=scores[b],
                    draft_probs=buf.probs[b] if record_probs else None,
                    hidden=hidden[b] if hidden is not None else None, lm_head=lm_head, sampling=params,
                    generator=gens[b] if gens else None, draft_mode=mode)) for b in range(batch)]
                tokens = buf.tokens.tolist()
            proposed = [[row[node] for node in r.path] + [int(r.next_token)] for row, r in zip(tokens, results)]
        else:  # no speculation: one plain decoding step of every row (what any verifier picks on a root-only tree)
            rec.mark(VERIFY)
            following = next_tokens(target_state.decode(drafts.roots[:batch]), params, gens)
            results, proposed = [_PLAIN] * batch, [[t] for t in following.tolist()]
        rec.mark(VERIFIED)
        finished = run.emit(proposed, results, verifier.name)
        tokens_out = sum(map(len, proposed))
        # paper reward: on the rows' mean accepted length; time reward: the batch's tokens per second
        reward_tokens = tokens_out if policy.reward == "time" else tokens_out / batch
        if all(finished):
            policy.update(arm, reward_tokens, *rec.round_times(finished=True))
            break
        if config.depth:
            target_state.commit([r.path for r in results])
        keep = [b for b, done in enumerate(finished) if not done]
        if len(keep) < batch:
            target_state.drop_rows(keep)
        rec.mark(RESYNC)
        if config.depth:
            logits = drafts.resync_batch(buf, [r.path[-1] if r.path else 0 for r in results], [p[-1] for p in proposed])
        else:
            drafts.roots[:batch] = following
            behind += [following] if speculates else []  # tree="none" never drafts: nothing to catch up on
        if len(keep) < batch:
            run.keep(keep)
            drafts.compact(keep)
            logits = logits[keep] if logits is not None else None
            behind = [tokens[keep] for tokens in behind]
        rec.mark(DONE)
        # The policy is charged the whole round: committing to the target cache and resyncing the drafter too.
        policy.update(arm, reward_tokens, *rec.round_times(finished=False))
    return run.finish(target_state, drafter_calls=drafts.calls - first_call, arms=policy.summary())


@torch.no_grad()
def generate_autoregressive_batch(
    target: torch.nn.Module,
    prompts,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
) -> BatchGenerateResult:
    """One batched target forward per token for B prompts (the baseline of `generate_batch`, same harness and stats;
    finished rows are dropped the same way). Row b samples from its own generator seeded seed + b."""
    run = prepare_batch(target, prompts, attention_mask, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                        seed)
    rec = run.start()
    target_state = BatchTargetState(target)
    logits = target_state.prefill(run.ids, run.mask)
    while True:
        tokens = next_tokens(logits, run.params, run.generators)
        proposed = [[t] for t in tokens.tolist()]  # the round's one device -> host transfer
        finished = run.emit(proposed, [_PLAIN] * len(proposed), "autoregressive")
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
class BatchRun:
    """One batched call's validated inputs, per-row committed tokens and stats (what both loops share)."""

    ids: torch.Tensor  # (B, L) left-padded prompts on the target's device
    mask: torch.Tensor  # (B, L) 1 on prompt tokens, 0 on the padding
    lengths: list[int]
    max_new_tokens: int
    params: SamplingParams
    eos: set[int]
    stats: GenerateStats
    row_stats: list[GenerateStats]
    generators: list[torch.Generator] | None  # active rows' generators (None: torch's global RNG)
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
        """Start the clock; returns the batch's recorder (phase times, rounds)."""
        self.out = [[] for _ in self.lengths]
        self.active = list(range(self.batch))
        self.counters = [Recorder(stats, torch.device("cpu")) for stats in self.row_stats]
        self.recorder = Recorder(self.stats, self.ids.device)
        return self.recorder

    def emit(self, proposed: list[list[int]], results: list[VerifyResult], name: str) -> list[bool]:
        """Commit each active row's round up to its first EOS (kept) or its budget -> which rows finished."""
        finished = []
        for prompt, tokens, result in zip(self.active, proposed, results):
            out = self.out[prompt]
            committed, done = truncate(tokens, self.max_new_tokens - len(out), self.eos)
            out.extend(committed)
            self.counters[prompt].count(name, result, len(committed), len(tokens))
            finished.append(done)
        self.stats.rounds += 1
        return finished

    def keep(self, rows: list[int]) -> None:
        """Only batch rows `rows` go on (finished rows dropped)."""
        self.active = [self.active[b] for b in rows]
        if self.generators is not None:
            self.generators = [self.generators[b] for b in rows]

    def finish(self, target_state: BatchTargetState, **stats) -> BatchGenerateResult:
        """Fill the batch's and the rows' stats (the total waits for the device) -> the committed sequences."""
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
            for rule, n in row.lossy_accepts_by.items():
                total.lossy_accepts_by[rule] = total.lossy_accepts_by.get(rule, 0) + n
            tokens = torch.cat([self.ids[b, width - length:], torch.tensor(out, dtype=torch.long,
                                                                           device=self.ids.device)])
            rows.append(GenerateResult(tokens[None], row))
        return BatchGenerateResult(rows, total)


def prepare_batch(target: torch.nn.Module, prompts, attention_mask, max_new_tokens: int, temperature, top_p, top_k,
                  eos_token_id, seed, *, drafter=None, tree=None, verifier=None, verifier_params=None,
                  tokenizer=None) -> BatchRun:
    """Validate a batched call's inputs, before any model runs -> its BatchRun. drafter None: the baseline."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer (row b uses seed + b) or None, got {seed!r}")
    params = resolve_sampling(target, temperature, top_p, top_k)
    policy = None
    if drafter is not None:
        if verifier is None:
            verifier = "greedy" if params.greedy else "sampling"
        verifier = get_verifier(verifier, **(verifier_params or {}))
        policy = make_policy(tree)
        check_options(verifier, policy, params, False)
    ids, mask, lengths = batch_prompts(prompts, attention_mask)
    arms = policy.arms if policy is not None else ()
    check_batch_limits(target, ids, lengths, max_new_tokens, tree_depth=max((a.depth for a in arms), default=0),
                       tree_nodes=max((a.num_nodes for a in arms), default=0))
    if drafter is not None:
        check_drafter_room(drafter, len(lengths), max(a.num_nodes for a in arms) + 1, target_vocab_size(target),
                           max(lengths) + max_new_tokens + max(a.depth for a in arms))
        check_drafter(target, drafter, tokenizer, verifier, policy)
    device = next(target.parameters()).device
    name, lossless = (verifier.name, verifier.lossless) if verifier is not None else ("autoregressive", True)
    stats = GenerateStats(prompt_tokens=sum(lengths), verifier=name, lossless=lossless, sampling=asdict(params))
    rows = [GenerateStats(prompt_tokens=n, verifier=name, lossless=lossless, sampling=asdict(params)) for n in lengths]
    generators = None if seed is None else [make_generator(seed + b, device) for b in range(len(lengths))]
    return BatchRun(ids.to(device), mask.to(device), lengths, max_new_tokens, params, eos_set(target, eos_token_id),
                    stats, rows, generators, verifier, policy)


def batch_prompts(prompts, attention_mask) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A list of prompts (left-padded here) or left-padded ids (B, L) + attention_mask -> (ids, mask, lengths)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"batched input_ids must have shape (B, L), got {tuple(prompts.shape)}; "
                             "or pass a list of prompts")
        lengths = check_batch_prompts(prompts, attention_mask)  # shapes, 0/1, left padding, no empty prompt
        mask = torch.ones_like(prompts) if attention_mask is None else attention_mask
        return prompts.long(), mask.to(device=prompts.device, dtype=torch.long), lengths
    if attention_mask is not None:
        raise ValueError("attention_mask goes with left-padded (B, L) input_ids; a list of prompts is padded here")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists or a left-padded (B, L) tensor")
    rows = []
    for b, prompt in enumerate(prompts):
        row = torch.as_tensor(prompt)
        if row.dim() == 2 and row.shape[0] == 1:  # a (1, L) prompt, as `generate` takes it
            row = row[0]
        if row.numel() == 0:  # first: torch reads [] as float
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        if row.dim() != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
            raise ValueError(f"prompt {b} must be a list or 1-D tensor of integer token ids, got "
                             f"{row.dtype} {tuple(row.shape)}")
        rows.append(row)
    lengths = [row.numel() for row in rows]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # pad id 0: masked out, but the target embeds it
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.numel():] = row.cpu()
        mask[b, width - row.numel():] = 1
    return ids, mask, lengths


def check_batch_limits(target: torch.nn.Module, ids: torch.Tensor, lengths: list[int], max_new_tokens: int,
                       tree_depth: int = 0, tree_nodes: int = 0) -> None:
    """`check_prompt`'s limits for a batch: budget, token ids (pads too: the target embeds them), positions per row,
    and the sliding window, which the batch cache's shared slots (the padded width, then every round's longest
    path) fill at least as fast as the longest row."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = target_vocab_size(target)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token ids (pads included) must lie in [0, {vocab}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    longest = max(lengths)
    limit = max_positions(target)
    if limit is not None and longest + max_new_tokens + tree_depth > limit:
        raise ValueError(f"the longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) + tree depth "
                         f"({tree_depth}) exceeds the target's {limit} max positions")
    window = window_capacity(target)
    if window is not None and ids.shape[1] + max_new_tokens + tree_nodes > window:
        raise ValueError(f"the padded prompts ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree nodes "
                         f"({tree_nodes}) exceed the {window} tokens {type(target).__name__}'s sliding-window cache "
                         "holds exactly")


def check_drafter_room(drafter, batch: int, tree_rows: int, out_vocab: int, context: int) -> None:
    """Refuse a batch whose drafter state (one row per node of every row's largest tree, each holding up to `context`
    tokens for a Transformer drafter), step logits and recorded draft distributions would not fit in the drafter
    device's whole memory (a clear error instead of an OOM)."""
    weight_size = torch.tensor([], dtype=drafter.dtype).element_size()
    per_node = drafter.row_bytes(context) + int(drafter.vocab_size) * weight_size + out_vocab * 4
    need = batch * tree_rows * per_node
    device = drafter.device
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    elif hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return
    if need > total:
        raise ValueError(f"a batch of {batch} prompts needs {batch * tree_rows} drafter state rows "
                         f"({need / 2**30:.1f} GiB with their logits and draft distributions), more than the "
                         f"{total / 2**30:.1f} GiB of {device}; use smaller batches or trees")
