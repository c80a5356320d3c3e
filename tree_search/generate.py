"""Speculative generation, one engine for any number of prompts (one prompt is a batch of one), and plain
autoregressive decoding on the same harness (the fair baseline).

Each round: **draft** one tree per row (`strategies`), or a prompt-lookup proposal -> **verify** every row in one
target forward (`target.TargetCache`), the verifier deciding each row -> **commit** each row's path -> **resync** the
drafter. A row leaves the batch at its own EOS / max_new_tokens. The policy picks one tree shape per round for the
whole batch; a `none` round is a plain decoding step that leaves the drafter alone (it catches up when it next drafts).

Per row the output is what that prompt gives alone: token-identical to the target's greedy decoding at temperature
0, and at temperature > 0 row b draws all its randomness from its own generator seeded `seed + b`. What the engine
reuses across calls lives on the models (`TargetFacts`, the drafter's `TreeDrafter`), not in this module.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mamba_draft.targets.cache import ROOT_ONLY, TargetCache
from mamba_draft.targets.facts import TargetFacts, max_positions, target_vocab_size
from tree_search.arms import VerifyCosts, measure_verify_costs, probe_forward
from tree_search.calls import (
    BatchGenerateResult, Call, GenerateResult, GenerateStats, batch_prompts, check_drafter, check_drafter_room,
    check_limits, check_options, default_lookup_tokens, eos_set, is_batch,
)
from tree_search.drafting import LOOKUP_ROWS, TreeDrafter
from tree_search.policy import is_auto, parse_policy
from tree_search.prompt_lookup import NgramLookup
from tree_search.recorder import DONE, DRAFT, RESYNC, VERIFIED, VERIFY
from tree_search.sampling import choose, resolve_sampling
from tree_search.strategies import LookupDrafting, TargetAwareDrafting, TreeDrafting
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, get_verifier
from tree_search.verifiers.greedy import greedy_walk

PLAIN = VerifyResult(path=[], next_token=0)  # what a plain decoding step counts as (no lossy accepts, no info)
PROBE_CONTEXT = 16  # prompt tokens the verify-cost probe runs after
PROBE_SLOTS = 48  # cache slots the probe's forwards leave (one each)


@dataclass
class CallOptions:
    """What may change from one generate call to the next (sampling None: the target's generation_config)."""

    max_new_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    eos_token_id: int | list[int] | None = None
    seed: int | None = None
    streamer: object = None
    attention_mask: torch.Tensor | None = None


class SpeculativeDecoder:
    """A target, a drafter (None: plain decoding) and the tree policy that picks each round's shape (`tree`: a
    policy spec, a TreeConfig / tuple, or a policy object). verifier None: "greedy" when a call's sampling is greedy,
    else "sampling". prompt_lookup: FLy's lookup inside the drafter's greedy chains. lookup_tokens K > 0:
    prompt-lookup rounds of <= K tokens (one prompt only); None: `calls.default_lookup_tokens`.
    """

    def __init__(self, target: torch.nn.Module, drafter=None, *, tree="auto", verifier: str | Verifier | None = None,
                 verifier_params: dict | None = None, tokenizer=None, prompt_lookup: bool = False,
                 lookup_tokens: int | None = None) -> None:
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.device = next(target.parameters()).device
        self.tree, self.prompt_lookup, self.lookup_tokens = tree, prompt_lookup, lookup_tokens
        # `auto` learns over the decoder's calls (acceptance, draft cost, which arms pay): the decoder is what a
        # stream of requests goes through
        self.policy = parse_policy(tree, persistent=is_auto(tree)) if drafter is not None else None
        self.verifier, self.verifier_params = verifier, verifier_params

    @torch.no_grad()
    def generate(self, input_ids, **options) -> GenerateResult | BatchGenerateResult:
        """input_ids: one prompt ((1, L) / (L,) ids -> GenerateResult) or a batch (a list of token lists, or
        left-padded (B, L) ids + attention_mask -> BatchGenerateResult). options: `CallOptions`. Every input is
        checked before any model runs."""
        call = self.prepare(input_ids, CallOptions(**options))
        return self.speculate(call) if self.drafter is not None else self.decode_plainly(call)

    def prepare(self, prompts, options: CallOptions) -> Call:
        """Validate a call's inputs before any model runs -> its Call."""
        seed = options.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer (row b uses seed + b) or None, got {seed!r}")
        m = options.max_new_tokens  # checked with the other limits (`check_limits`)
        batched = is_batch(prompts, options.attention_mask)
        params = resolve_sampling(self.target, options.temperature, options.top_p, options.top_k)
        verifier, lookup, arms = None, 0, ()
        if self.drafter is not None:
            verifier = get_verifier(self.verifier or ("greedy" if params.greedy else "sampling"),
                                    **(self.verifier_params or {}))
            lookup = self.lookup_tokens if self.lookup_tokens is not None else default_lookup_tokens(
                self.tree, self.device, batched, self.prompt_lookup)
            if batched and (options.streamer is not None or self.prompt_lookup or lookup):
                raise ValueError("a batch of prompts takes no streamer, prompt_lookup or lookup_tokens; pass one "
                                 "prompt for those")
            check_options(verifier, self.policy, params, self.prompt_lookup, lookup)
            arms = self.policy.arms
        elif batched and options.streamer is not None:
            raise ValueError("a batch of prompts takes no streamer; pass one prompt to stream")
        depth = max(lookup, *(a.depth for a in arms), 0)
        nodes = max(lookup, *(a.num_nodes for a in arms), 0)
        ids, mask, lengths = batch_prompts(prompts, options.attention_mask)
        check_limits(self.target, ids, lengths, m, tree_depth=depth, tree_nodes=nodes)
        if self.drafter is not None:
            check_drafter_room(self.drafter, len(lengths), nodes + 1, target_vocab_size(self.target),
                               max(lengths) + m + depth)
            check_drafter(self.target, self.drafter, self.tokenizer, verifier, self.policy)
        name, lossless = (verifier.name, verifier.lossless) if verifier is not None else ("autoregressive", True)
        stats = [GenerateStats(prompt_tokens=n, verifier=name, lossless=lossless, sampling=asdict(params))
                 for n in [sum(lengths), *lengths]]
        generators = None if seed is None else [torch.Generator(device=self.device).manual_seed(seed + b)
                                                for b in range(len(lengths))]
        return Call(ids.to(self.device), mask.to(self.device), lengths, batched, m, params,
                    eos_set(self.target, options.eos_token_id), stats[0], stats[1:], generators, options.streamer,
                    verifier, lookup)

    def start(self, call: Call, widest: int) -> TargetCache:
        """Start the clock and the stream; the target cache with every prompt but its last token prefilled (that
        token goes through the first round, as a plain decoding step feeds it: mamba_draft.targets.row_blocks)."""
        call.start()
        target = TargetCache.for_call(self.target, max_len=call.ids.shape[1] + call.max_new_tokens + widest)
        target.prefill(call.ids[:, :-1], call.mask[:, :-1])
        return target

    def speculate(self, call: Call) -> GenerateResult | BatchGenerateResult:
        """Rounds of draft -> verify -> commit -> resync for all rows until each has finished."""
        policy = self.policy
        widest = max(call.lookup_tokens, *(a.num_nodes for a in policy.arms)) + 1
        policy.start_call(call.batch, lambda tokens: self.verify_costs(call, tokens))
        target, rec = self.start(call, widest), call.recorder
        drafts = self.strategy(call, widest)
        lookup = NgramLookup(call.ids[0].tolist(), call.lookup_tokens) if call.lookup_tokens else None
        logits = None  # the drafter's logits after each root (None until its prefill; never, if only none runs)
        drafts_ever = any(arm.depth for arm in policy.arms)  # tree "none" alone never drafts: nothing to catch up on
        while True:
            rows = len(call.active)
            proposal = lookup.propose() if lookup is not None else None
            if proposal:  # as many as this machine's verify costs and the lookups' acceptance make worth it
                proposal = proposal[:policy.lookup_length(len(proposal))]
            arm = None if proposal else policy.select()  # a lookup round is no arm's: the policy learns from its own
            tree = None if proposal or not policy.arms[arm].depth else policy.arms[arm]
            if tree is not None and logits is None:  # once per call: not charged to this round's arm
                logits = drafts.prefill(call.ids[call.active], call.mask[call.active])
            rec.mark(DRAFT)
            if proposal:
                draft = drafts.proposal(proposal)
            elif tree is not None:
                logits = drafts.catch_up(logits)  # after rounds that left the drafter alone
                draft = drafts.draft(tree, logits, call.generators)
            rec.mark(VERIFY)
            if proposal or tree is not None:
                results, proposed, hidden = self.verify(target, draft, call, drafts)
                policy.observe(draft.tree, [r.path for r in results], lookup=bool(proposal))
            else:  # no speculation: one plain decoding step of every row (what any verifier picks on a root)
                scores, hidden = target.tree_forward(drafts.roots(rows)[:, None], ROOT_ONLY, drafts.reads_target)
                plain = choose(scores[:, 0], call.params, call.generators)
                results, proposed = [PLAIN] * rows, [[t] for t in plain.tolist()]  # the one host transfer
            rec.mark(VERIFIED)
            committed, finished = call.emit(proposed, results)
            if lookup is not None:
                lookup.extend(committed[0])
                call.stats.lookup_rounds += bool(proposal)
            if not all(finished):
                target.commit([r.path for r in results])
                # a drafter that reads the target reads each committed token with the target's state before it
                features = [hidden[b, [0, *r.path]] for b, r in enumerate(results)] if drafts.reads_target else None
                keep = call.drop_finished(target, finished)
                rec.mark(RESYNC)
                if tree is not None:
                    logits = drafts.resync(draft, results, proposed, features)
                elif drafts.reads_target:  # it reads them with their states when it next drafts (host lists: no sync)
                    drafts.skip(proposed, catch_up=drafts_ever, features=features)
                else:  # it reads these tokens when it next drafts
                    drafts.skip(torch.tensor(proposed, device=call.ids.device) if proposal else plain[:, None],
                                catch_up=drafts_ever)
                if keep is not None:
                    drafts.compact(keep)
                    logits = logits[keep] if logits is not None else None
                rec.mark(DONE)
            tokens_out = sum(map(len, proposed))
            if arm is not None:  # charged the whole round, commit and resync included
                policy.update(arm, tokens_out if policy.reward == "time" else tokens_out / rows,
                              *rec.round_times(finished=all(finished)))
            if all(finished):
                break
        return call.finish(target, drafter_calls=drafts.calls, drafter_calls_saved=drafts.calls_saved,
                           drafter_state_bytes=drafts.drafts.state.nbytes if logits is not None else 0,
                           arms=policy.summary())

    def verify_costs(self, call: Call, widest: int) -> VerifyCosts:
        """The target's verify costs on this device, dtype and thread count (`arms.measure_verify_costs`) up to
        `widest` tokens a forward (fewer where its positions end: the rest extrapolated), measured once per target
        (kept on its TargetFacts) after a few of the call's first prompt's tokens."""
        known = TargetFacts.of(self.target).verify_costs
        key = (str(self.device), next(self.target.parameters()).dtype, torch.get_num_threads())
        if key not in known or known[key].covers < widest:
            context = call.ids[0, -min(call.lengths[0], PROBE_CONTEXT):]
            room = max_positions(self.target) or call.ids.shape[1] + call.max_new_tokens + widest + 1
            probed = max(1, min(widest, room - PROBE_CONTEXT - PROBE_SLOTS))
            # on a CPU the static cache the call then reuses; eager on a GPU: no graphs for shapes the call never runs
            cache = TargetCache.for_call(self.target, max_len=max(call.ids.shape[1] + call.max_new_tokens,
                                                                  PROBE_CONTEXT + PROBE_SLOTS) + widest + 1,
                                         graphs=False)
            cache.prefill(context[None, :-1])
            costs = measure_verify_costs(probe_forward(cache, context[-1:]), probed)
            known[key] = VerifyCosts(costs.seconds, max(costs.covers, widest))
        return known[key]

    def strategy(self, call: Call, widest: int) -> TreeDrafting:
        """The call's drafting strategy on the drafter's reusable TreeDrafter (`TreeDrafter.of`), `widest` state rows
        per prompt; the roots are the prompts' last tokens (the drafter reads the prompts when it first drafts)."""
        params, verifier, drafter = call.params, call.verifier, self.drafter
        record_probs = not params.greedy or verifier.needs_draft_probs
        rows, out_vocab = call.batch * widest, target_vocab_size(self.target)
        if self.prompt_lookup:
            if drafter.reads_target:
                raise ValueError("prompt_lookup drafts chains on scratch rows without target states; a drafter that "
                                 "reads the target takes tree shapes (and lookup_tokens rounds) instead")
            drafts = LookupDrafting(TreeDrafter.of(drafter, max(rows, LOOKUP_ROWS), out_vocab), record_probs,
                                    capacity=call.ids.shape[1] + call.max_new_tokens)
        else:
            mode = "sample" if verifier.draft_mode == "sample" and not params.greedy else "topk"
            kind = TargetAwareDrafting if drafter.reads_target else TreeDrafting
            drafts = kind(TreeDrafter.of(drafter, rows, out_vocab), params, mode, record_probs)
        drafts.drafts.roots[: call.batch] = call.ids[:, -1]
        return drafts

    def verify(self, target: TargetCache, draft, call: Call, drafts):
        """One target forward over every row's tree (`drafts` drafted them), the verifier's decision per row ->
        (results, each row's proposed tokens: accepted path + next token, the final hidden states), with the round's
        one device -> host transfer (the trees' tokens come along: no index tensor has to go the other way first)."""
        verifier, params = call.verifier, call.params
        scores, hidden = target.tree_forward(draft.tokens, draft.tree, drafts.reads_target or verifier.needs_hidden)
        if verifier.walks_argmax(params):  # one batched argmax and one host copy instead of B verifier calls
            n = len(draft.tree)
            host = torch.cat([draft.tokens, scores.argmax(-1)], dim=1).tolist()
            tokens = [row[:n] for row in host]
            results = [greedy_walk(draft.tree, row[:n], row[n:]) for row in host]
        else:
            lm_head = self.target.get_output_embeddings() if verifier.needs_hidden else None
            results = [verifier.verify(VerifyInput(
                tree=draft.tree, tokens=draft.tokens[b], target_logits=scores[b],
                draft_probs=draft.probs[b] if drafts.record_probs else None,
                hidden=hidden[b] if hidden is not None else None, lm_head=lm_head, sampling=params,
                generator=call.generators[b] if call.generators else None, draft_mode=drafts.mode))
                for b in range(scores.shape[0])]
            tokens = draft.tokens.tolist()
        return results, [[row[node] for node in r.path] + [int(r.next_token)] for row, r in zip(tokens, results)], hidden

    def decode_plainly(self, call: Call) -> GenerateResult | BatchGenerateResult:
        """One target forward per token for all rows, on the same cache, sampling and stats code as `speculate`."""
        target, rec = self.start(call, 1), call.recorder
        logits = target.decode(call.ids[:, -1])
        while True:
            tokens = choose(logits, call.params, call.generators)
            proposed = [[t] for t in tokens.tolist()]  # the round's one device -> host transfer
            _, finished = call.emit(proposed, [PLAIN] * len(proposed))
            if all(finished):
                break
            keep = call.drop_finished(target, finished)
            if keep is not None:
                tokens = tokens[keep]
            rec.mark(VERIFY)
            logits = target.decode(tokens)
            rec.mark(VERIFIED)
            rec.decode_time()
        return call.finish(target)


@torch.no_grad()
def generate(target: torch.nn.Module, drafter, input_ids, *, tree="auto", verifier: str | Verifier | None = None,
             verifier_params: dict | None = None, tokenizer=None, prompt_lookup: bool = False,
             lookup_tokens: int | None = None, **options) -> GenerateResult | BatchGenerateResult:
    """Tree speculative decoding of one prompt or a batch: `SpeculativeDecoder.generate` of this pair for one call
    (options: `CallOptions`; sampling None: the target's generation_config, as `target.generate` does)."""
    if drafter is None:
        raise TypeError("generate needs a drafter; generate_autoregressive is the baseline without one")
    decoder = SpeculativeDecoder(target, drafter, tree=tree, verifier=verifier, verifier_params=verifier_params,
                                 tokenizer=tokenizer, prompt_lookup=prompt_lookup, lookup_tokens=lookup_tokens)
    return decoder.generate(input_ids, **options)


@torch.no_grad()
def generate_autoregressive(target: torch.nn.Module, input_ids, **options) -> GenerateResult | BatchGenerateResult:
    """The baseline: `generate` without a drafter, one target forward per token for all rows."""
    return SpeculativeDecoder(target).generate(input_ids, **options)
