"""Speculative generation with a drafter (Mamba, or any HF causal LM: `mamba_draft.drafter`): draft -> verify ->
commit -> resync, plus the plain autoregressive loop on the same harness (for fair baselines). How a round is drafted
lives in `strategies` (the tree, or prompt-lookup chains), the stats bookkeeping and phase timing in `recorder`, what
every call shares (stats, result, checks) in `calls`; batches go to `batch_generate`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tree_search.batch_generate import generate_autoregressive_batch, generate_batch
from tree_search.calls import (
    GenerateResult, GenerateStats, check_drafter, check_options, eos_set, make_policy, truncate,
)
from tree_search.prompt_lookup import NgramLookup
from tree_search.recorder import DONE, DRAFT, RESYNC, VERIFIED, VERIFY, Recorder
from tree_search.sampling import SamplingParams, logits_to_probs, make_generator, resolve_sampling, sample
from tree_search.strategies import drafting_strategy
from tree_search.bandit import UCBBandit
from tree_search.target import TargetState, max_positions, target_vocab_size, window_capacity
from tree_search.tree import TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, get_verifier


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


