"""Speculative generation with a Mamba drafter: draft -> verify -> commit -> resync, plus the plain autoregressive
loop on the same harness (for fair baselines). How a round is drafted lives in `strategies` (the tree, or prompt-lookup
chains), the stats bookkeeping and phase timing in `recorder`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tree_search.bandit import FixedPolicy, UCBBandit
from tree_search.prompt_lookup import NgramLookup
from tree_search.recorder import DONE, DRAFT, RESYNC, VERIFIED, VERIFY, Recorder
from tree_search.sampling import SamplingParams, logits_to_probs, make_generator, resolve_sampling, sample
from tree_search.strategies import drafting_strategy
from tree_search.target import TargetState, check_tree_support, max_positions, target_vocab_size, window_capacity
from tree_search.tree import TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, get_verifier


@dataclass
class GenerateStats:
    """What one call did. accepted_lengths: tokens committed per round, bonus included (Spec-Bench)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    target_forwards: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    lossy_accepts: int = 0
    lossy_accepts_by: dict[str, int] = field(default_factory=dict)  # per rule; a node two rules accept counts twice
    cut_tokens: int = 0  # tokens the last round proposed beyond EOS / max_new_tokens (dropped)
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    drafter_calls: int = 0  # sequential drafter invocations (prefill, steps, extends)
    drafter_calls_saved: int = 0  # prompt lookup: calls the step-by-step chain path would have made more (can be < 0)
    lookup_rounds: int = 0  # rounds that verified a prompt-lookup proposal instead of a draft (lookup_tokens)
    arms: dict[str, dict[str, float]] = field(default_factory=dict)  # tree shape -> pulls, mean reward
    round_info: list[dict] = field(default_factory=list)  # the verifier's per-round info, where it gave any
    verifier: str = ""
    lossless: bool = True
    sampling: dict[str, float] = field(default_factory=dict)  # the resolved temperature, top_k, top_p

    @property
    def mean_accepted(self) -> float:
        """τ: mean tokens committed per target verification round (1.0 for autoregressive decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def other_time(self) -> float:
        """Prefill, cache compaction and bookkeeping: everything that is neither drafting nor verification."""
        return max(self.total_time - self.draft_time - self.verify_time, 0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(mean_accepted=self.mean_accepted, tokens_per_s=self.tokens_per_s, other_time=self.other_time)
        return out


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # (1, prompt + new) committed sequence
    stats: GenerateStats

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.stats.prompt_tokens :]


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    drafter,
    input_ids: torch.Tensor,
    *,
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
    streamer=None,
    prompt_lookup: bool = False,
    lookup_tokens: int = 0,
    attention_mask: torch.Tensor | None = None,
) -> GenerateResult:
    """Tree speculative decoding of one prompt, or of a batch (then a `batch_generate.BatchGenerateResult`).

    input_ids: (1, L) / (L,) for one prompt; a list of token lists, or left-padded (B, L) ids + `attention_mask`,
    for a batch (`tree_search.batch_generate.generate_batch`: one tree per row, one target forward for all rows).

    tree: a TreeConfig / "3,2,2,1,1" / tuple (fixed shape), "bandit" (UCB over the default arms, reset per
    call) or a UCBBandit / FixedPolicy instance (persistent=True keeps its statistics across calls). "none" (as a
    shape or a bandit arm) is no speculation: that round is one plain target decoding step, what every verifier
    would pick on a root-only tree (the argmax, or a sample of the target's processed distribution).
    temperature / top_p / top_k: None takes the target's generation_config, as `target.generate` does
    (tree_search.sampling.resolve_sampling): greedy unless it sets do_sample; then its top_k (50 unless set) applies.
    verifier: None is "greedy" when the resolved sampling is greedy, else "sampling" (both lossless).
    eos_token_id: None takes the target's generation_config (as `target.generate` does).
    prompt_lookup: FLy's multi-level acceleration for chains at temperature 0: prompt-lookup n-gram proposals
    pre-verified by the drafter give the same greedy chain (so the same output) in fewer drafter calls when the text
    repeats itself, more when proposals keep failing (stats.drafter_calls_saved). Host-driven, not graph-captured.
    lookup_tokens: K > 0 adds prompt-lookup rounds: when the last 2-4 committed tokens (prompt included) occurred
    before, the <= K tokens that followed them are verified instead of a drafted tree (the drafter reads the
    committed tokens when it next drafts; the policy picks shapes for the other rounds). Any verifier: the proposal
    is deterministic (a point-mass draft distribution), so lossless sampling stays exact. Host-driven; one prompt.
    All inputs are validated before any model runs.
    """
    if drafter is None:
        raise TypeError("generate needs a drafter; generate_autoregressive is the baseline without one")
    if is_batch(input_ids, attention_mask):
        if streamer is not None or prompt_lookup or lookup_tokens:
            raise ValueError("a batch of prompts takes no streamer, prompt_lookup or lookup_tokens; pass one prompt "
                             "for those")
        from tree_search.batch_generate import generate_batch  # builds on this module

        return generate_batch(target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, tree=tree, verifier=verifier,
                              verifier_params=verifier_params, eos_token_id=eos_token_id, seed=seed,
                              tokenizer=tokenizer)
    run = prepare(target, input_ids, max_new_tokens, temperature, top_p, top_k, eos_token_id, seed, streamer,
                  drafter=drafter, tree=tree, verifier=verifier, verifier_params=verifier_params,
                  tokenizer=tokenizer, prompt_lookup=prompt_lookup, lookup_tokens=lookup_tokens)
    ids, params, verifier, policy = run.ids, run.params, run.verifier, run.policy
    mode = "sample" if verifier.draft_mode == "sample" and not params.greedy else "topk"
    record_probs = not params.greedy or verifier.needs_draft_probs
    policy.start_call()
    target_state, _ = run.start(target, ids[:, :-1])  # the last prompt token is the first round's root
    strategy = drafting_strategy(drafter, prompt_lookup, max(lookup_tokens, *(a.num_nodes for a in policy.arms)) + 1,
                                 target_vocab_size(target), params, mode, record_probs, run.generator,
                                 max_tokens=ids.shape[1] + max_new_tokens)
    lookup = NgramLookup(ids[0].tolist(), lookup_tokens) if lookup_tokens else None
    root, logits = ids[0, -1], None  # the drafter reads the prompt when it first drafts (never, if only none runs)
    rec = run.recorder
    while True:
        proposal = lookup.propose() if lookup is not None else None
        arm = None if proposal else policy.select()  # a lookup round is no arm's: the policy learns from its own
        drafts = arm is not None and policy.arms[arm].depth > 0
        if drafts and logits is None:
            logits = strategy.prefill(ids)  # once per call: not charged to this round's arm
        rec.mark(DRAFT)
        if proposal or drafts:
            buf = strategy.proposal(root, proposal) if proposal else strategy.draft(policy.arms[arm], root, logits)
            rec.mark(VERIFY)
            result = verify_tree(target_state, verifier, buf, params, run.generator, mode, record_probs)
            rec.mark(VERIFIED)
            proposed = round_tokens(buf, result)  # the round's one device -> host transfer
        else:  # no speculation: the plain decode step (cheaper than a 1-node tree forward, and no drafter call)
            rec.mark(VERIFY)
            root = next_token(target_state.decode(root), params, run.generator)
            rec.mark(VERIFIED)
            result = VerifyResult(path=[], next_token=int(root))  # the round's one device -> host transfer
            proposed = [result.next_token]
        committed, finished = run.emit(proposed)
        rec.count(verifier.name, result, len(committed), len(proposed))
        if lookup is not None:
            lookup.extend(committed)
            run.stats.lookup_rounds += bool(proposal)
        if finished:
            times = rec.round_times(finished=True)
            if arm is not None:
                policy.update(arm, len(proposed), *times)
            break
        if proposal or drafts:
            target_state.commit(result.path, len(buf.tree))
        rec.mark(RESYNC)
        if drafts:
            logits = strategy.resync(buf, result, proposed)
            root = strategy.root
        else:
            strategy.skip(proposed)  # the drafter catches up in one call when it next drafts
            if proposal:
                root = buf.tokens.new_tensor(result.next_token)
        rec.mark(DONE)
        # The policy is charged the whole round: committing to the target cache and resyncing the drafter too.
        times = rec.round_times(finished=False)
        if arm is not None:
            policy.update(arm, len(proposed), *times)
    return run.finish(target_state, drafter_calls=strategy.calls, drafter_calls_saved=strategy.calls_saved,
                      arms=policy.summary())


@torch.no_grad()
def generate_autoregressive(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    streamer=None,
    attention_mask: torch.Tensor | None = None,
) -> GenerateResult:
    """One target forward per token on the same cache, sampling and stats code as `generate` (the baseline).
    Sampling arguments left None take the target's generation_config, as in `generate`. A batch (as in `generate`)
    decodes all rows in one forward per token (`batch_generate.generate_autoregressive_batch`)."""
    if is_batch(input_ids, attention_mask):
        if streamer is not None:
            raise ValueError("a batch of prompts takes no streamer; pass one prompt to stream")
        from tree_search.batch_generate import generate_autoregressive_batch  # builds on this module

        return generate_autoregressive_batch(target, input_ids, attention_mask=attention_mask,
                                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                             top_k=top_k, eos_token_id=eos_token_id, seed=seed)
    run = prepare(target, input_ids, max_new_tokens, temperature, top_p, top_k, eos_token_id, seed, streamer)
    target_state, logits = run.start(target, run.ids)
    params, rec = run.params, run.recorder
    while True:
        token = next_token(logits, params, run.generator)
        if run.emit([int(token)])[1]:  # the round's one device -> host transfer
            break
        rec.mark(VERIFY)
        logits = target_state.decode(token)
        rec.mark(VERIFIED)
        rec.decode_time()
    return run.finish(target_state, rounds=len(run.out), accepted_lengths=[1] * len(run.out))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The target's own next token (on the device): its argmax, or a sample of its processed distribution."""
    return logits.argmax(-1) if params.greedy else sample(logits_to_probs(logits, params), generator)


@dataclass
class Run:
    """One call's validated inputs, committed tokens and stats: what `generate` and `generate_autoregressive` share."""

    ids: torch.Tensor  # (1, L) prompt on the target's device
    max_new_tokens: int
    params: SamplingParams
    eos: set[int]
    stats: GenerateStats
    generator: torch.Generator | None
    streamer: object = None
    verifier: Verifier | None = None  # speculative calls only
    policy: UCBBandit | None = None
    out: list[int] = field(default_factory=list)  # committed new tokens
    recorder: Recorder | None = None  # set by `start`, which starts the clock
    lookup_tokens: int = 0  # the longest prompt-lookup proposal a round may verify

    def start(self, target: torch.nn.Module, prefix: torch.Tensor) -> tuple[TargetState, torch.Tensor | None]:
        """Start the clock, encode `prefix` (1, P) into a fresh target cache (-> its last logits), stream the prompt."""
        self.recorder = Recorder(self.stats, self.ids.device)
        widest = max(self.lookup_tokens, *(a.num_nodes for a in self.policy.arms)) if self.policy is not None else 0
        # auto: a preallocated static cache on CUDA (capturable verify), the dynamic cache on CPU (faster there)
        target_state = TargetState.for_model(target, max_len=self.ids.shape[1] + self.max_new_tokens + widest + 1)
        logits = target_state.prefill(prefix)
        if self.streamer is not None:
            self.streamer.put(self.ids[0].cpu())
        return target_state, logits

    def emit(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Commit a round's tokens up to the first EOS (kept) or the budget and stream them -> (committed, finished)."""
        committed, finished = truncate(tokens, self.max_new_tokens - len(self.out), self.eos)
        self.out.extend(committed)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(committed))
        return committed, finished

    def finish(self, target_state: TargetState, **stats) -> GenerateResult:
        """Fill the final stats (the total waits for the device), end the stream, return the committed sequence."""
        self.stats.total_time = self.recorder.total_time()
        self.stats.new_tokens, self.stats.target_forwards = len(self.out), target_state.forwards
        for name, value in stats.items():
            setattr(self.stats, name, value)
        if self.streamer is not None:
            self.streamer.end()
        tokens = torch.cat([self.ids, torch.tensor([self.out], device=self.ids.device)], dim=1)
        return GenerateResult(tokens, self.stats)


def is_batch(input_ids, attention_mask) -> bool:
    """A list of prompts, (B > 1, L) ids, or any ids with an attention mask (left-padded batches)."""
    if attention_mask is not None:
        return True
    if isinstance(input_ids, (list, tuple)):
        return bool(input_ids) and not isinstance(input_ids[0], int)
    return isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1


def prepare(target: torch.nn.Module, input_ids, max_new_tokens: int, temperature, top_p, top_k, eos_token_id, seed,
            streamer, *, drafter=None, tree=None, verifier=None, verifier_params=None, tokenizer=None,
            prompt_lookup: bool = False, lookup_tokens: int = 0) -> Run:
    """Validate a call's inputs, before any model runs -> its Run. drafter None: the autoregressive baseline."""
    params = resolve_sampling(target, temperature, top_p, top_k)
    policy = None
    if drafter is not None:
        if verifier is None:
            verifier = "greedy" if params.greedy else "sampling"
        verifier = get_verifier(verifier, **(verifier_params or {}))
        policy = make_policy(tree)
        check_options(verifier, policy, params, prompt_lookup, lookup_tokens)
    arms = policy.arms if policy is not None else ()
    ids = check_prompt(target, input_ids, max_new_tokens,
                       tree_depth=max(lookup_tokens, *(a.depth for a in arms), 0),
                       tree_nodes=max(lookup_tokens, *(a.num_nodes for a in arms), 0))
    if drafter is not None:
        check_drafter(target, drafter, tokenizer, verifier, policy)
    stats = GenerateStats(prompt_tokens=ids.shape[1], verifier=verifier.name if verifier else "autoregressive",
                          lossless=verifier.lossless if verifier else True, sampling=asdict(params))
    return Run(ids, max_new_tokens, params, eos_set(target, eos_token_id), stats, make_generator(seed, ids.device),
               streamer, verifier, policy, lookup_tokens=lookup_tokens)


def check_drafter(target: torch.nn.Module, drafter, tokenizer, verifier: Verifier, policy: UCBBandit) -> None:
    """Refuse a drafter / tree / verifier the target cannot be decoded with (vocabularies, tree width, attention)."""
    vocab = check_vocab(target, drafter, tokenizer)
    widest = max((n for a in policy.arms for n in a.branching), default=0)  # "none" has no level
    if widest > vocab:
        raise ValueError(f"a tree level asks for {widest} distinct children but the vocabulary has {vocab} tokens")
    verifier.check_target(target)
    check_tree_support(target)


def check_options(verifier: Verifier, policy: UCBBandit, params: SamplingParams, prompt_lookup: bool,
                  lookup_tokens: int = 0) -> None:
    """Refuse verifier / tree / sampling / prompt-lookup combinations that cannot work (no model needed)."""
    if verifier.greedy_only and not params.greedy:
        raise ValueError(
            f"verifier {verifier.name!r} is for temperature 0; "
            f"use verifier='sampling' for temperature {params.temperature}"
        )
    if not isinstance(prompt_lookup, bool):
        raise TypeError(f"prompt_lookup must be True or False, got {prompt_lookup!r}")
    if isinstance(lookup_tokens, bool) or not isinstance(lookup_tokens, int) or not 0 <= lookup_tokens <= 64:
        raise ValueError(f"lookup_tokens must be an integer in [0, 64] (0: no lookup rounds), got {lookup_tokens!r}")
    if lookup_tokens and prompt_lookup:
        raise ValueError("lookup_tokens (lookup proposals verified by the target) and prompt_lookup (lookup inside "
                         "the drafter's chain) are two uses of prompt lookup: pass one")
    if not prompt_lookup:
        return
    if not params.greedy:
        raise ValueError(
            f"prompt_lookup drafts the drafter's greedy chain, so it needs temperature 0 (got {params.temperature})"
        )
    trees = [str(arm) for arm in policy.arms if max(arm.branching, default=1) > 1]
    if trees:
        raise ValueError(
            f"prompt_lookup drafts chains only (every branching factor 1), but tree arm(s) {', '.join(trees)} branch; "
            "pass a chain such as tree='1,1,1,1,1'"
        )


def verify_tree(target_state: TargetState, verifier: Verifier, buf, params: SamplingParams, generator,
                mode: str, record_probs: bool) -> VerifyResult:
    """One target forward over the drafted tree, then the verifier's decision (a VerifyResult)."""
    logits, hidden = target_state.tree_forward(buf.tokens, buf.tree, want_hidden=verifier.needs_hidden)
    return verifier.verify(
        VerifyInput(
            tree=buf.tree,
            tokens=buf.tokens,
            target_logits=logits,
            draft_probs=buf.probs if record_probs else None,
            hidden=hidden,
            lm_head=target_state.model.get_output_embeddings() if verifier.needs_hidden else None,
            sampling=params,
            generator=generator,
            draft_mode=mode,
        )
    )


def round_tokens(buf, result: VerifyResult) -> list[int]:
    """The round's proposed tokens (accepted path + next token) in one device -> host copy: the whole tree's tokens
    (a few dozen) come over at once, so no index tensor has to go the other way first."""
    tokens = buf.tokens.tolist()
    return [tokens[node] for node in result.path] + [int(result.next_token)]  # next_token: an int (VerifyResult)


def truncate(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut a round's tokens at the first EOS (kept) or at the remaining budget; returns (tokens, finished)."""
    for i, tok in enumerate(tokens[:budget]):
        if tok in eos:
            return tokens[: i + 1], True
    kept = tokens[:budget]
    return kept, len(kept) >= budget


def make_policy(tree) -> UCBBandit:
    """'bandit' -> a fresh UCBBandit over the default arms; a UCBBandit passes through; anything else is one shape."""
    if isinstance(tree, UCBBandit):
        return tree
    if isinstance(tree, str) and tree.strip().lower() == "bandit":
        return UCBBandit()
    if isinstance(tree, (TreeConfig, str, tuple, list)):
        return FixedPolicy(TreeConfig.parse(tree))
    raise TypeError(f"tree must be a TreeConfig, a spec like '3,2,2,1,1', 'none', 'bandit' or a UCBBandit; "
                    f"got {type(tree).__name__}")


def check_prompt(
    target: torch.nn.Module, input_ids, max_new_tokens: int, tree_depth: int = 0, tree_nodes: int = 0
) -> torch.Tensor:
    """Validate the prompt (batch 1, non-empty, in-vocabulary, within the position and sliding-window limits)
    -> (1, L) on the target device. A tree reaches `tree_depth` positions and `tree_nodes` cache slots past the end."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    ids = torch.as_tensor(input_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (1, L), got {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise ValueError(f"only batch size 1 is supported, got a batch of {ids.shape[0]} prompts")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token")
    vocab = target_vocab_size(target)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
    limit = max_positions(target)
    if limit is not None:
        if ids.shape[1] > limit:
            raise ValueError(f"the prompt has {ids.shape[1]} tokens, beyond the target's {limit} max positions")
        if ids.shape[1] + max_new_tokens + tree_depth > limit:
            raise ValueError(
                f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree depth ({tree_depth}) "
                f"exceeds the target's {limit} max positions"
            )
    window = window_capacity(target)
    if window is not None and tree_nodes and ids.shape[1] + max_new_tokens + tree_nodes > window:
        raise ValueError(
            f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree nodes ({tree_nodes}) exceeds "
            f"the {window} tokens {type(target).__name__}'s sliding-window cache holds exactly"
        )
    return ids.to(device=next(target.parameters()).device, dtype=torch.long)


def check_vocab(target: torch.nn.Module, drafter, tokenizer=None) -> int:
    """Refuse a drafter/target vocabulary mismatch; returns how many distinct tokens the drafter can propose.

    Different logit widths are accepted only when a tokenizer shows both cover its real vocabulary (checkpoints
    pad their embeddings to multiples of 8/128); the drafter then only proposes ids below the narrower width.
    With a draft vocabulary (`drafter.draft_ids`) the drafter must read every token the target may commit (the
    target's vocabulary, or the tokenizer's) and propose only distinct ids of the target's vocabulary.
    Padding ids the target may still sample past the drafter's embedding are clamped by TreeDrafter.
    """
    if drafter.draft_ids is not None:
        return check_draft_vocab(target, drafter, tokenizer)
    target_vocab, draft_vocab = target_vocab_size(target), int(drafter.vocab_size)
    if tokenizer is not None:
        real = len(tokenizer)
        if min(target_vocab, draft_vocab) < real:
            raise ValueError(
                f"vocabulary mismatch: tokenizer has {real} tokens but the target covers {target_vocab} "
                f"and the drafter {draft_vocab}"
            )
    elif draft_vocab != target_vocab:
        raise ValueError(
            f"vocabulary mismatch: drafter has {draft_vocab} tokens, target {type(target).__name__} has "
            f"{target_vocab}; pass the tokenizer if both only pad the same real vocabulary"
        )
    return min(target_vocab, draft_vocab)


def check_draft_vocab(target: torch.nn.Module, drafter, tokenizer=None) -> int:
    """check_vocab for a drafter with a draft vocabulary; returns its size."""
    target_vocab, reads, ids = target_vocab_size(target), int(drafter.input_vocab_size), drafter.draft_ids
    needed, owner = (len(tokenizer), "the tokenizer") if tokenizer is not None \
        else (target_vocab, f"target {type(target).__name__}")
    if target_vocab < needed:
        raise ValueError(f"vocabulary mismatch: tokenizer has {needed} tokens but the target covers {target_vocab}")
    if reads < needed:
        raise ValueError(
            f"vocabulary mismatch: the drafter reads {reads} token ids but {owner} has {needed}; a drafter with a "
            "draft vocabulary must still read every token the target can commit"
        )
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"draft vocabulary must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= target_vocab:
        raise ValueError(
            f"draft vocabulary ids must lie in the target's vocabulary [0, {target_vocab}), got [{low}, {high}]"
        )
    if torch.unique(ids).numel() != ids.numel():  # a repeated id would get only one column's share of q
        raise ValueError("draft vocabulary ids must be distinct")
    return ids.numel()


def eos_set(target: torch.nn.Module, eos_token_id) -> set[int]:
    if eos_token_id is None:
        config = getattr(target, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}
