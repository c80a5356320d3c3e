"""What a generate call is while it runs: its stats and result (one prompt, or a batch) and the mutable `Call` both
loops share (its inputs as `plan` checked them, each row's committed tokens), and the `Recorder` that times a
round's phases: CUDA events on a GPU (`perf_counter` on CPU), read once per round with one wait, instead of a device
synchronize at every boundary."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from tree_search.sampling import choose, keyed_choice, logits_to_probs
from tree_search.verifiers import VerifyResult

if TYPE_CHECKING:
    from tree_search.plan import Plan


# A round's marks: drafting starts, verification starts, verification ends, drafter resync starts, round ends.
DRAFT, VERIFY, VERIFIED, RESYNC, DONE = range(5)


class Recorder:
    """Fills one call's GenerateStats with its draft / verify / total time."""

    def __init__(self, stats, device: torch.device) -> None:
        self.stats = stats
        self.device = device
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if device.type == "cuda" else None
        self.clock = [0.0] * 5
        self.started = time.perf_counter()

    def mark(self, slot: int) -> None:
        """Note the time once the device reaches this point (an event, so the host does not wait here)."""
        if self.events is None:
            self.clock[slot] = time.perf_counter()
        else:
            self.events[slot].record()

    def _wait(self, slot: int) -> None:
        if self.events is not None:
            self.events[slot].synchronize()

    def _seconds(self, start: int, stop: int) -> float:
        if self.events is None:
            return self.clock[stop] - self.clock[start]
        return self.events[start].elapsed_time(self.events[stop]) / 1000.0

    def round_times(self, finished: bool) -> tuple[float, float]:
        """Read the round's marks (one wait, on its last), add its draft and verify time to the stats -> the
        (draft, verify) seconds the policy is charged: the whole round, commit as verification, resync as drafting."""
        self._wait(VERIFIED if finished else DONE)
        draft, verify = self._seconds(DRAFT, VERIFY), self._seconds(VERIFY, VERIFIED)
        self.stats.verify_time += verify
        if not finished:
            draft += self._seconds(RESYNC, DONE)
            verify = self._seconds(VERIFY, RESYNC)
        self.stats.draft_time += draft
        return draft, verify

    def decode_time(self) -> None:
        """Autoregressive rounds: the decode between VERIFY and VERIFIED is verification time."""
        self._wait(VERIFIED)
        self.stats.verify_time += self._seconds(VERIFY, VERIFIED)

    def total_time(self) -> float:
        """Seconds since construction, once the device has finished everything queued (one sync per call)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.started


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
    drafted_tokens: int = 0  # tokens proposed to the target beyond each round's root (drafts and lookups)
    drafter_state_bytes: int = 0  # its state rows at the end (a Transformer's grow with the context; 0: never ran)
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

    def count(self, result: VerifyResult, committed: int, proposed: int, drafted: int = 0) -> None:
        """Count one round of this row: `committed` of its `proposed` tokens kept (fewer only in the last round), of
        `drafted` tokens verified beyond the root."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_lengths.append(committed)
        self.cut_tokens = proposed - committed
        self.lossy_accepts += result.lossy_accepts
        alone = {self.verifier: result.lossy_accepts} if result.lossy_accepts else {}  # a verifier of one rule
        for name, n in result.info.get("lossy_accepts_by", alone).items():
            self.lossy_accepts_by[name] = self.lossy_accepts_by.get(name, 0) + int(n)
        if result.info:
            self.round_info.append(result.info)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(mean_accepted=self.mean_accepted, tokens_per_s=self.tokens_per_s, other_time=self.other_time)
        return out


class TokenLogprob(NamedTuple):
    """A committed token, its log-probability under the target and the top alternatives [(token, logprob)]."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # (1, prompt + new) committed sequence
    stats: GenerateStats
    # per new token, where asked (`logprobs=`): its log-probability under the target's own distribution and the
    # top alternatives [(token, log-probability), ...], as plain decoding's forward gives them
    logprobs: list[TokenLogprob] | None = None

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.stats.prompt_tokens :]


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


@dataclass
class Call:
    """One generate call: its validated inputs, options, per-row committed tokens and stats (what both loops share)."""

    plan: Plan  # sampling, verifier, lookup rounds, the arms that fit, keyed draws (`tree_search.plan`)
    ids: torch.Tensor  # (B, L) left-padded prompts on the target's device
    mask: torch.Tensor  # (B, L) 1 on prompt tokens, 0 on the padding
    lengths: list[int]
    batched: bool  # the caller passed a batch (-> BatchGenerateResult), even of one
    max_new_tokens: int
    eos: set[int]
    stats: GenerateStats
    row_stats: list[GenerateStats]
    generators: list[torch.Generator] | None  # active rows' generators (None: torch's global RNG)
    streamer: object = None
    on_tokens: object = None  # (prompt, committed tokens, their logprobs) -> False stops the row (`CallOptions`)
    processors: object = None  # `processors.CallProcessors` (None: no logits processors this call)
    # per prompt, the seed of its draws keyed by position (`sampling.keyed_choice`): where sampling is lossless
    # and seeded, a row samples the tokens its seed gives at each position, alone, in any batch, under any tree
    seeds: list[int] | None = None
    logprobs: int | None = None  # top alternatives reported per token (None: no log-probabilities)
    token_logprobs: list[list] = field(default_factory=list)  # per prompt, per committed token: a TokenLogprob
    pending: list[list] | None = None  # per active row, this round's TokenLogprobs (`note_logprobs`)
    out: list[list[int]] = field(default_factory=list)  # committed new tokens per prompt
    active: list[int] = field(default_factory=list)  # batch row i holds prompt active[i]
    recorder: Recorder | None = None

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def lookup_tokens(self) -> int:
        return self.plan.lookup_tokens

    def keyed(self, levels, probs: torch.Tensor) -> torch.Tensor:
        """Each active row's sampled token at every node (probs (B, N, V), the target's processed distribution;
        `levels`: each depth's (start, stop) node range): level d draws the row's keyed noise at position
        len(committed) + d."""
        chosen = torch.empty(probs.shape[:2], dtype=torch.long, device=probs.device)
        for b, prompt in enumerate(self.active):
            for depth, (start, stop) in enumerate(levels):
                chosen[b, start:stop] = keyed_choice(probs[b, start:stop], self.seeds[prompt],
                                                     len(self.out[prompt]) + depth)
        return chosen

    def choose_plain(self, logits: torch.Tensor) -> torch.Tensor:
        """Each active row's next token from its processed logits (B, V), as plain decoding samples it: a seeded
        call's keyed draw, else `sampling.choose` (argmax when greedy, the row generators' draw otherwise)."""
        if self.seeds is not None:
            return self.keyed(((0, 1),), logits_to_probs(logits[:, None], self.plan.sampling))[:, 0]
        return choose(logits, self.plan.sampling, self.generators)

    def start(self) -> None:
        """Start the clock (the batch's recorder: phase times, rounds), stream the prompt."""
        self.out = [[] for _ in self.lengths]
        self.token_logprobs = [[] for _ in self.lengths]
        self.active = list(range(self.batch))
        self.recorder = Recorder(self.stats, self.ids.device)
        if self.streamer is not None:
            self.streamer.put(self.ids[0].cpu())

    def emit(self, proposed: list[list[int]], results: list[VerifyResult], drafted: int = 0
             ) -> tuple[list[list[int]], list[bool]]:
        """Commit each active row's round (of `drafted` tokens a row beyond the root) up to its first EOS (kept) or
        its budget -> (committed, which finished)."""
        committed, finished = [], []
        for row, (prompt, tokens, result) in enumerate(zip(self.active, proposed, results)):
            out = self.out[prompt]
            kept, done = truncate(tokens, self.max_new_tokens - len(out), self.eos)
            logprobs = None if self.pending is None else self.pending[row][:len(kept)]
            if logprobs is not None:
                self.token_logprobs[prompt].extend(logprobs)
            if self.on_tokens is not None and kept and self.on_tokens(prompt, kept, logprobs) is False:
                done = True
            out.extend(kept)
            self.row_stats[prompt].count(result, len(kept), len(tokens), drafted)
            committed.append(kept)
            finished.append(done)
        self.stats.rounds += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor(committed[0]))
        return committed, finished

    def note_logprobs(self, scores: torch.Tensor, nodes: list[list[int]], tokens: list[list[int]]) -> None:
        """This round's log-probabilities, when the call reports them: scores (B, N, V) the target's own logits, and
        per active row the nodes whose scores predict its proposed tokens (the root, then each accepted node)."""
        if self.logprobs is None:
            self.pending = None
            return
        self.pending = []
        for b, (row_nodes, row_tokens) in enumerate(zip(nodes, tokens)):
            logp = torch.log_softmax(scores[b, row_nodes].float(), dim=-1)
            chosen = logp.gather(1, torch.tensor(row_tokens, device=logp.device)[:, None])[:, 0].tolist()
            top = logp.topk(self.logprobs, dim=-1) if self.logprobs else None
            alternatives = ([list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
                            if top is not None else [[] for _ in row_tokens])
            self.pending.append([TokenLogprob(t, c, a) for t, c, a in zip(row_tokens, chosen, alternatives)])

    def drop_finished(self, target_state, finished: list[bool]) -> list[int] | None:
        """Finished rows leave the batch (this call's rows and the target cache's) -> the rows kept (None: all)."""
        keep = [b for b, done in enumerate(finished) if not done]
        if len(keep) == len(finished):
            return None
        target_state.drop_rows(keep)
        self.active = [self.active[b] for b in keep]
        if self.generators is not None:
            self.generators = [self.generators[b] for b in keep]
        return keep

    def finish(self, target_state, **stats) -> GenerateResult | BatchGenerateResult:
        """Fill the batch's and the rows' stats, end the stream -> one GenerateResult for one prompt, else a
        BatchGenerateResult."""
        total = self.stats
        stats.update(total_time=self.recorder.total_time(), target_forwards=target_state.forwards)
        for name, value in stats.items():
            setattr(total, name, value)
        rows = []
        width = self.ids.shape[1]
        for b, (length, out, row) in enumerate(zip(self.lengths, self.out, self.row_stats)):
            row.new_tokens = len(out)
            for name in ("new_tokens", "accepted_lengths", "cut_tokens", "lossy_accepts", "round_info",
                         "drafted_tokens"):
                setattr(total, name, getattr(total, name) + getattr(row, name))
            for rule, n in row.lossy_accepts_by.items():
                total.lossy_accepts_by[rule] = total.lossy_accepts_by.get(rule, 0) + n
            tokens = torch.cat([self.ids[b, width - length:], torch.tensor(out, dtype=torch.long,
                                                                           device=self.ids.device)])
            rows.append(GenerateResult(tokens[None], row,
                                       self.token_logprobs[b] if self.logprobs is not None else None))
        if self.streamer is not None:
            self.streamer.end()
        if self.batched:
            return BatchGenerateResult(rows, total)
        return GenerateResult(rows[0].tokens, total, rows[0].logprobs)


def truncate(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut a round's tokens at the first EOS (kept) or at the remaining budget; returns (tokens, finished)."""
    for i, tok in enumerate(tokens[:budget]):
        if tok in eos:
            return tokens[: i + 1], True
    kept = tokens[:budget]
    return kept, len(kept) >= budget
