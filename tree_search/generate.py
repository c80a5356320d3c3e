"""Speculative generation, one engine for any number of prompts (one prompt is a batch of one), and plain
autoregressive decoding on the same harness (the fair baseline).

Each round: **select** a proposer (the policy's arm for the whole batch, or a prompt-lookup round) -> **propose**
one draft per row (`proposers`: a tree, a lookup chain, or the root alone for `none`) -> **verify** every row in one
target forward (`TargetCache`), the verifier deciding each row -> **commit** each row's path -> **accept**: every
proposer reads what was committed (the one that proposed resyncs, the others catch up when they next propose) ->
**update** the policy. A row leaves the batch at its own EOS / max_new_tokens.

Per row the output is what that prompt gives alone: token-identical to the target's greedy decoding at temperature
0, and at temperature > 0 row b draws all its randomness from its own generator seeded `seed + b`. What the engine
reuses across calls lives on the `SpeculativeDecoder`: keep one for a stream of calls.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

import torch

from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.facts import max_positions
from tree_search.arms import VerifyCosts, measure_verify_costs, probe_forward
from tree_search.calls import (
    DONE, DRAFT, RESYNC, VERIFIED, VERIFY, BatchGenerateResult, Call, GenerateResult, GenerateStats,
)
from tree_search.plan import batch_prompts, check_models, eos_set, is_batch, plan_call, row_seeds
from tree_search.policy import is_auto, parse_policy
from tree_search.processors import CallProcessors, shaping_of
from tree_search.proposers import Proposers, Round
from tree_search.sampling import logits_to_probs, resolve_sampling
from tree_search.tree_drafter import TreeDrafter
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult
from tree_search.verifiers.greedy import greedy_walk

PLAIN = VerifyResult(path=[], next_token=0)  # what a plain decoding step counts as (no lossy accepts, no info)
PROCESSOR_OPTIONS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "min_new_tokens",
                     "frequency_penalty", "presence_penalty", "logit_bias")  # CallOptions' logits settings
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
    seed: int | list[int] | None = None  # row b draws from seed + b, or from seed[b]
    streamer: object = None
    attention_mask: torch.Tensor | None = None
    # each round, per row: its committed tokens and their TokenLogprobs (None unless `logprobs`); False stops that
    # row there (a client gone, a stop string)
    on_tokens: Callable[[int, list[int], list | None], bool] | None = None
    # logits processors (None: the target's generation_config, as target.generate; `tree_search.processors`)
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: list[list[int]] | None = None
    suppress_tokens: list[int] | None = None
    min_new_tokens: int | None = None
    frequency_penalty: float | None = None  # OpenAI's penalties and bias, on the new tokens
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # report each new token's log-probability and this many top alternatives


@dataclass(frozen=True)
class EngineOptions:
    """What a decoder keeps for all its calls (`SpeculativeDecoder`'s keywords; `generate` takes these and
    `CallOptions`' fields together). tree: the policy that picks each round's shape (a policy spec, a TreeConfig /
    tuple, or a policy object). verifier None: "greedy" when a call's sampling is greedy, else "sampling".
    prompt_lookup: FLy's lookup inside the drafter's greedy chains. lookup_tokens K > 0: prompt-lookup rounds of <= K
    tokens (one prompt only); None: `plan.default_lookup_tokens`. integer_products: the target's GGUF-coded products
    as integers, llama.cpp's numerics (`TargetCache`); plain decoding with the same setting is what the output
    equals."""

    tree: object = "auto"
    verifier: str | Verifier | None = None
    verifier_params: dict | None = None
    prompt_lookup: bool = False
    lookup_tokens: int | None = None
    integer_products: bool = False


ENGINE_OPTIONS = tuple(f.name for f in fields(EngineOptions))


class SpeculativeDecoder:
    """A target, a drafter (None: plain decoding), its tokenizer (for stop strings and streaming) and the engine's
    options (`EngineOptions`' fields as keywords)."""

    def __init__(self, target: torch.nn.Module, drafter=None, *, tokenizer=None, **options) -> None:
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.options = options = EngineOptions(**options)
        self.device = next(target.parameters()).device
        # `auto` learns over the decoder's calls (acceptance, draft cost, which arms pay)
        self.policy = parse_policy(options.tree, persistent=is_auto(options.tree)) if drafter is not None else None
        # what lives across calls is kept here, nothing on the models passed in: the drafter's state rows and tree
        # buffers (CUDA: its graphs), the target's static KV cache (CPU: its compiled step; CUDA: its graphs), the
        # verify costs `auto` plans from, and the tree-mask probe's verdicts
        self.drafts: TreeDrafter | None = None
        self.static_cache: TargetCache | None = None
        self.costs: dict[tuple, VerifyCosts] = {}
        self.tree_mask_ok: set[tuple] = set()

    @torch.no_grad()
    def generate(self, input_ids, **options) -> GenerateResult | BatchGenerateResult:
        """input_ids: one prompt ((1, L) / (L,) ids -> GenerateResult) or a batch (a list of token lists, or
        left-padded (B, L) ids + attention_mask -> BatchGenerateResult). options: `CallOptions`. Every input is
        checked before any model runs."""
        call = self.prepare(input_ids, CallOptions(**options))
        return self.speculate(call) if self.drafter is not None else self.decode_plainly(call)

    def prepare(self, prompts, options: CallOptions) -> Call:
        """Validate a call's inputs before any model runs (`plan`) -> its Call."""
        params = resolve_sampling(self.target, options.temperature, options.top_p, options.top_k)
        batched = is_batch(prompts, options.attention_mask)
        plan = plan_call(self.policy, params, verifier=self.options.verifier,
                         verifier_params=self.options.verifier_params, prompt_lookup=self.options.prompt_lookup,
                         lookup_tokens=self.options.lookup_tokens, device=self.device, batched=batched,
                         streamer=options.streamer is not None)
        ids, mask, lengths = batch_prompts(prompts, options.attention_mask)
        seeds = row_seeds(options.seed, len(lengths))
        plan = check_models(plan, self.target, self.drafter, self.tokenizer, self.policy, ids, lengths,
                            options.max_new_tokens, self.tree_mask_ok)
        verifier = plan.verifier
        name, lossless = (verifier.name, verifier.lossless) if verifier is not None else ("autoregressive", True)
        stats = [GenerateStats(prompt_tokens=n, verifier=name, lossless=lossless, sampling=asdict(params))
                 for n in [sum(lengths), *lengths]]
        generators = None if seeds is None else [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        eos = eos_set(self.target, options.eos_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        shaping = shaping_of(getattr(self.target, "generation_config", None),
                             **{name: getattr(options, name) for name in PROCESSOR_OPTIONS})
        processors = (CallProcessors(shaping, [row[keep.bool()] for row, keep in zip(ids, mask)], eos)
                      if shaping.active else None)
        # seeded lossless sampling draws by (seed, position): the same tokens alone, in any batch, with speculation
        # on or off (`sampling.keyed_choice`); lossy verifiers keep their own draws from the row generators
        keyed = seeds is not None and not params.greedy and (verifier is None or getattr(verifier, "keyed", False))
        logprobs = options.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be a number of top alternatives >= 0, or None; got {logprobs!r}")
        return Call(plan=replace(plan, keyed=keyed), ids=ids, mask=mask, lengths=lengths, batched=batched,
                    max_new_tokens=options.max_new_tokens, eos=eos, stats=stats[0], row_stats=stats[1:],
                    generators=generators, streamer=options.streamer, on_tokens=options.on_tokens,
                    processors=processors, logprobs=logprobs, seeds=seeds if keyed else None)

    def start(self, call: Call, widest: int) -> TargetCache:
        """Start the clock and the stream; the target cache with every prompt but its last token prefilled (that
        token goes through the first round, as a plain decoding step feeds it: mamba_draft.targets.row_blocks)."""
        call.start()
        target = self.target_cache(call.ids.shape[1] + call.max_new_tokens + widest)
        target.prefill(call.ids[:, :-1], call.mask[:, :-1])
        return target

    def target_cache(self, max_len: int, graphs: bool = True) -> TargetCache:
        """A call's target cache: the kept static one while it serves (`TargetCache.for_call`), else a new one."""
        cache = TargetCache.for_call(self.target, max_len, graphs, kept=self.static_cache,
                                     integer_products=self.options.integer_products)
        if cache.static:
            self.static_cache = cache
        return cache

    def tree_drafter(self, rows: int, out_vocab: int) -> TreeDrafter:
        self.drafts = TreeDrafter.reuse(self.drafts, self.drafter, rows, out_vocab)
        return self.drafts

    def speculate(self, call: Call) -> GenerateResult | BatchGenerateResult:
        """Rounds of select -> propose -> verify -> commit -> accept -> update for all rows until each has finished."""
        policy, widest = self.policy, call.plan.widest
        costs = lambda tokens: self.verify_costs(call, tokens)  # noqa: E731
        if call.plan.fits is None:
            policy.start_call(call.batch, costs)
        else:  # arms the cache cannot hold this call are not pulled (`plan.fit_arms`: a bandit's)
            policy.start_call(call.batch, costs, call.plan.fits)
        target, rec = self.start(call, widest), call.recorder
        proposers, roots = Proposers(self, call, widest), call.ids[:, -1]
        while True:
            proposer, arm, shape = proposers.select(policy)
            proposer.prepare(call)  # once per call (the drafter's prefill): not charged to this round's arm
            rec.mark(DRAFT)
            draft = proposer.propose(shape, roots, call)
            rec.mark(VERIFY)
            results, proposed, roots, hidden = self.verify(target, draft, call, proposers.reads_target)
            policy.observe(arm, draft.tree, [r.path for r in results])
            rec.mark(VERIFIED)
            committed, finished = call.emit(proposed, results, len(draft.tree) - 1)
            if not all(finished):
                target.commit([r.path for r in results])
                keep = call.drop_finished(target, finished)
                rec.mark(RESYNC)
                proposers.accept(Round(draft, proposer, results, proposed, committed, roots, hidden, keep))
                roots = roots[keep] if keep is not None else roots
                rec.mark(DONE)
            times = rec.round_times(finished=all(finished))
            tokens_out = sum(map(len, proposed))  # the arm is charged the whole round, commit and resync included
            policy.update(arm, tokens_out if policy.reward == "time" else tokens_out / len(proposed), *times)
            if all(finished):
                return call.finish(target, arms=policy.summary(), **proposers.drafter_stats())

    def verify_costs(self, call: Call, widest: int) -> VerifyCosts:
        """The target's verify costs on this device, dtype and thread count (`arms.measure_verify_costs`) up to
        `widest` tokens a forward (fewer where its positions end: the rest extrapolated), measured once per target
        (kept by this decoder) after a few of the call's first prompt's tokens."""
        known = self.costs
        key = (str(self.device), next(self.target.parameters()).dtype, torch.get_num_threads(),
               self.options.integer_products)
        if key not in known or known[key].covers < widest:
            context = call.ids[0, -min(call.lengths[0], PROBE_CONTEXT):]
            room = max_positions(self.target) or call.ids.shape[1] + call.max_new_tokens + widest + 1
            probed = max(1, min(widest, room - PROBE_CONTEXT - PROBE_SLOTS))
            # on a CPU the static cache the call then reuses; eager on a GPU: no graphs for shapes the call never runs
            cache = self.target_cache(max(call.ids.shape[1] + call.max_new_tokens, PROBE_CONTEXT + PROBE_SLOTS)
                                      + widest + 1, graphs=False)
            cache.prefill(context[None, :-1])
            costs = measure_verify_costs(probe_forward(cache, context[-1:]), probed)
            known[key] = VerifyCosts(costs.seconds, max(costs.covers, widest))
        return known[key]

    def verify(self, target: TargetCache, draft, call: Call, need_hidden: bool):
        """One target forward over every row's draft, the verifier's decision per row -> (results, each row's proposed
        tokens: accepted path + next token, the next tokens on the device, the final hidden states), with the
        round's one device -> host transfer (the drafts' tokens come along: no index tensor has to go the other way
        first). A root-only draft is a plain decoding step, sampled as `decode_plainly` samples."""
        verifier, params = call.plan.verifier, call.plan.sampling
        scores, hidden = target.tree_forward(draft.tokens, draft.tree, need_hidden or verifier.needs_hidden)
        raw = scores  # the target's own distribution: what log-probabilities report
        if call.processors is not None:  # each node's scores after its own sequence, as target.generate's
            scores = call.processors.tree(scores, draft.tokens, draft.tree, call.active, call.out)
        if len(draft.tree) == 1:
            plain = call.choose_plain(scores[:, 0])
            proposed = [[t] for t in plain.tolist()]
            call.note_logprobs(raw, [[0]] * len(proposed), proposed)
            return [PLAIN] * len(plain), proposed, plain, hidden
        if call.seeds is not None or verifier.walks_argmax(params):  # one batched choice and one host copy
            # greedy: each node's argmax; seeded sampling: each node's keyed draw (`Call.keyed`), which makes the
            # greedy walk over them lossless
            n = len(draft.tree)
            picks = (call.keyed(draft.tree.levels, logits_to_probs(scores, params)) if call.seeds is not None
                     else scores.argmax(-1))
            host = torch.cat([draft.tokens, picks], dim=1).tolist()
            tokens = [row[:n] for row in host]
            results = [greedy_walk(draft.tree, row[:n], row[n:]) for row in host]
        else:
            lm_head = self.target.get_output_embeddings() if verifier.needs_hidden else None
            results = [verifier.verify(VerifyInput(
                tree=draft.tree, tokens=draft.tokens[b], target_logits=scores[b],
                draft_probs=draft.probs[b] if call.plan.records_probs else None,
                hidden=hidden[b] if hidden is not None else None, lm_head=lm_head, sampling=params,
                generator=call.generators[b] if call.generators else None, draft_mode=call.plan.draft_mode))
                for b in range(scores.shape[0])]
            tokens = draft.tokens.tolist()
        proposed = [[row[node] for node in r.path] + [int(r.next_token)] for row, r in zip(tokens, results)]
        call.note_logprobs(raw, [[0, *r.path] for r in results], proposed)  # each token after its parent node
        return results, proposed, torch.tensor([p[-1] for p in proposed], device=scores.device), hidden

    def decode_plainly(self, call: Call) -> GenerateResult | BatchGenerateResult:
        """One target forward per token for all rows, on the same cache, sampling and stats code as `speculate`."""
        target, rec = self.start(call, 1), call.recorder
        logits = target.decode(call.ids[:, -1])
        while True:
            raw = logits
            if call.processors is not None:
                logits = call.processors.plain(logits, call.active, call.out)
            tokens = call.choose_plain(logits)
            proposed = [[t] for t in tokens.tolist()]  # the round's one device -> host transfer
            call.note_logprobs(raw[:, None], [[0]] * len(proposed), proposed)
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
def generate(target: torch.nn.Module, drafter, input_ids, *, tokenizer=None,
             **options) -> GenerateResult | BatchGenerateResult:
    """Tree speculative decoding of one prompt or a batch: one call of a fresh `SpeculativeDecoder` of this pair.
    options: `EngineOptions`' fields and `CallOptions`' (sampling None: the target's generation_config, as
    `target.generate` does)."""
    if drafter is None:
        raise TypeError("generate needs a drafter; generate_autoregressive is the baseline without one")
    return SpeculativeDecoder(target, drafter, tokenizer=tokenizer, **engine_options(options)).generate(input_ids,
                                                                                                   **options)


@torch.no_grad()
def generate_autoregressive(target: torch.nn.Module, input_ids, *, tokenizer=None,
                            **options) -> GenerateResult | BatchGenerateResult:
    """The baseline: `generate` without a drafter, one target forward per token for all rows (of `EngineOptions`
    only integer_products applies)."""
    return SpeculativeDecoder(target, tokenizer=tokenizer, **engine_options(options)).generate(input_ids, **options)


def engine_options(options: dict) -> dict:
    """`EngineOptions`' fields taken out of one set of keywords (what is left: `CallOptions`')."""
    return {name: options.pop(name) for name in ENGINE_OPTIONS if name in options}
