"""Held-out agreement of a drafter with its target: teacher-forced top-1 agreement and expected accepted length.

For every scored token i of a held-out sequence x (an assistant token of a chat; every token of a text), the
target's greedy choice g_i = argmax p(. | x_<i) and the drafter's d_i = argmax q(. | x_<i) (its logit column mapped
to a target id through `draft_ids`) are compared, both teacher-forced on the true prefix:

    agreement = mean_i [d_i == g_i]
    tau_gamma = mean_i (1 + run_i),   run_i = how many of the tokens i, i+1, ..., i+gamma-1 agree before the first
                                      disagreement, unscored token or end of the sequence

tau_gamma is the tokens a greedy chain of gamma drafts started before token i yields per target forward (accepted
drafts plus the target's bonus token). It is exact where the held-out text follows the target's greedy path
(x_i == g_i along the run); elsewhere it is the usual teacher-forced estimate. `greedy_path` is the fraction of
scored tokens with x_i == g_i (1.0: tau is exact).
"""
from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from mamba_draft import MambaDrafter, load_drafter
from mamba_draft.targets import load_causal_lm, load_tokenizer
from training import data as data_lib
from training.config import DataConfig, TrainConfig
from training.engine_data import engine_dirs, load_engine
from training.model import frozen_target
from training.ngram import NGramTable
from training.regenerate import target_tokenizer
from training.target_features import fed_features

Row = tuple[list[int], list[bool]]  # token ids, and which tokens are scored
ENGINE_EVAL_LEN = 2048  # held-out make-data replies are scored up to this many tokens (prompt included)
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, attention_mask) -> (B, L, V) logits


@dataclass(frozen=True)
class Agreement:
    """Counts over scored tokens; `a + b` pools batches or ranks."""
    gammas: tuple[int, ...]
    positions: int = 0               # scored tokens
    matches: int = 0                 # ... where the drafter's choice is the target's
    greedy_path: int = 0             # ... where the held-out token is the target's choice
    accepted: tuple[int, ...] = ()   # per gamma: sum over scored tokens of (1 + run)

    def __post_init__(self):
        if not self.accepted:
            object.__setattr__(self, "accepted", (0,) * len(self.gammas))

    def __add__(self, other: "Agreement") -> "Agreement":
        if self.gammas != other.gammas:
            raise ValueError(f"cannot pool agreement over gammas {self.gammas} and {other.gammas}")
        return Agreement.from_counts(self.gammas, [a + b for a, b in zip(self.counts(), other.counts())])

    def as_dict(self, prefix: str = "") -> dict:
        """{agreement, tau1, tau3, ..., greedy_path, positions}, keys prefixed (e.g. 'heldout_')."""
        rate = lambda count: count / self.positions if self.positions else math.nan  # per scored token
        return {f"{prefix}agreement": rate(self.matches),
                **{f"{prefix}tau{g}": rate(a) for g, a in zip(self.gammas, self.accepted)},
                f"{prefix}greedy_path": rate(self.greedy_path), f"{prefix}positions": self.positions}

    def counts(self) -> list[int]:
        return [self.positions, self.matches, self.greedy_path, *self.accepted]

    @classmethod
    def from_counts(cls, gammas: tuple[int, ...], counts: Sequence[int]) -> "Agreement":
        return cls(gammas, *map(int, counts[:3]), tuple(map(int, counts[3:])))


def check_gammas(gammas: Sequence[int]) -> tuple[int, ...]:
    gammas = tuple(gammas)
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas) \
            or len(set(gammas)) != len(gammas):
        raise ValueError(f"gammas must be distinct integers >= 1, got {list(gammas)}")
    return gammas


def measure(tokens: torch.Tensor, scored: torch.Tensor, target_ids: torch.Tensor, draft_logits: torch.Tensor,
            draft_ids: torch.Tensor | None = None, gammas: Sequence[int] = (1, 3, 5)) -> Agreement:
    """Agreement counts of one batch. tokens (B, L) ids; scored (B, L) bool: which tokens count; target_ids (B, L):
    the target's argmax at each position (position t predicts token t+1); draft_logits (B, L, V): the drafter's
    logits on the same positions, column j scoring target id draft_ids[j] (id j without a map)."""
    if not (tokens.shape == scored.shape == target_ids.shape == draft_logits.shape[:2]) or tokens.dim() != 2:
        raise ValueError(f"shapes disagree: tokens {tuple(tokens.shape)}, scored {tuple(scored.shape)}, "
                         f"target_ids {tuple(target_ids.shape)}, draft_logits {tuple(draft_logits.shape)}")
    draft = draft_logits.argmax(-1).cpu()
    if draft_ids is not None:
        if draft_ids.dim() != 1 or draft_ids.numel() != draft_logits.size(-1):
            raise ValueError(f"draft_ids maps {tuple(draft_ids.shape)} columns but the drafter's logits have "
                             f"{draft_logits.size(-1)}")
        draft = draft_ids.cpu()[draft]
    return measure_ids(tokens, scored, target_ids, draft, gammas)


def measure_ids(tokens: torch.Tensor, scored: torch.Tensor, target_ids: torch.Tensor, draft: torch.Tensor,
                gammas: Sequence[int] = (1, 3, 5)) -> Agreement:
    """`measure` from the drafter's (or any predictor's) chosen ids (B, L) instead of its logits."""
    gammas = check_gammas(gammas)
    live = scored[:, 1:].cpu().bool()            # the prediction made at t scores token t+1
    guess = target_ids[:, :-1].cpu()
    agree = (draft[:, :-1].cpu() == guess) & live
    on_path = (tokens[:, 1:].cpu() == guess) & live
    accepted, alive, run = {}, torch.ones_like(agree), torch.zeros(agree.shape, dtype=torch.long)
    for k in range(max(gammas)):                  # alive[t]: the drafts for tokens t+1 .. t+1+k all agree
        alive = alive & torch.cat([agree[:, k:], agree.new_zeros(agree.size(0), min(k, agree.size(1)))], dim=1)
        run += alive
        if k + 1 in gammas:
            accepted[k + 1] = int((1 + run)[live].sum())
    return Agreement(gammas, int(live.sum()), int(agree.sum()), int(on_path.sum()), tuple(accepted[g] for g in gammas))


# ------------------------------------------------------------------------------------------ held-out data

def load_heldout(path: str, tokenizer, max_len: int, max_sequences: int | None = None) -> tuple[list[Row], Counter]:
    """The first `max_sequences` records of a local held-out file as (ids, scored) rows, and the skipped ones: chat
    records (as SFT reads them) score their assistant tokens; `text` records get an EOS in front (as pretraining
    packs them) and score every token. Both are truncated to `max_len` tokens."""
    if not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"held-out file {path} does not exist")
    records = data_lib.load_records(DataConfig(path=str(Path(path).expanduser())))
    if max_sequences:
        records = records.select(range(min(max_sequences, len(records))))
    columns = records.column_names
    if "conversations" in columns or "messages" in columns:
        examples, skipped = data_lib.prepare_sft(records, tokenizer, max_len, evaluation=True)
        rows = [(ids, [label != data_lib.IGNORE_INDEX for label in labels])
                for ids, labels in zip(examples["input_ids"], examples["labels"])]
    elif "text" in columns:
        skipped = Counter()
        encoded = tokenizer(list(records["text"]), add_special_tokens=False)["input_ids"]
        rows = [(ids, [False] + [True] * (len(ids) - 1))
                for ids in ([tokenizer.eos_token_id] + e[:max_len - 1] for e in encoded)]
    else:
        raise ValueError(f"{path}: held-out records need a 'conversations' or 'messages' column (chat) or a 'text' "
                         f"column; it has {columns}")
    if not any(any(s[1:]) for _, s in rows):
        raise ValueError(f"{path}: no scored tokens in the first {len(records)} records")
    return rows, skipped


def engine_rows(examples: Sequence) -> tuple[list[Row], list[torch.Tensor]]:
    """`measure`'s rows and target ids from make-data replies (`engine_data.EngineExample`s) cut to ENGINE_EVAL_LEN:
    position t's choice is the cached top-1 of row t+1 (-1 where nothing is cached)."""
    rows, target_ids = [], []
    for e in examples:
        n = min(ENGINE_EVAL_LEN, e.input_ids.numel())
        scored = (e.labels[:n] != data_lib.IGNORE_INDEX).tolist()
        choice = torch.cat([e.soft_ids[1:n, 0].long(), torch.tensor([-1])])
        choice[~torch.tensor(scored[1:] + [False])] = -1
        rows.append((e.input_ids[:n].tolist(), scored))
        target_ids.append(choice)
    return rows, target_ids


def pad_batch(rows: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention_mask, scored): causal models never see the padding of a row's own positions."""
    ids = pad_sequence([torch.tensor(row, dtype=torch.long) for row, _ in rows], batch_first=True, padding_value=pad_id)
    attention = pad_sequence([torch.ones(len(row), dtype=torch.long) for row, _ in rows], batch_first=True)
    return ids, attention, pad_sequence([torch.tensor(marks, dtype=torch.bool) for _, marks in rows], batch_first=True)


def hf_logits(model) -> LogitsFn:
    """Logits of a Hugging Face causal LM (or anything called like one, e.g. a DeepSpeed engine); keywords (a
    drafter that reads the target: features, known) go to its forward."""
    return lambda ids, attention, **kw: model(input_ids=ids, attention_mask=attention, **kw).logits


@torch.no_grad()
def greedy_ids(logits_fn: LogitsFn, rows: Sequence[Row], batch_size: int, pad_id: int,
               device: str | torch.device = "cpu", vocab: int | None = None) -> list[torch.Tensor]:
    """The model's argmax at every position of every row (over its first `vocab` columns if given), computed in
    batches without gradients, as CPU tensors to cache: the target's side of `measure`."""
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, attention, _ = pad_batch(chunk, pad_id)
        logits = logits_fn(ids.to(device), attention.to(device))
        best = (logits[..., :vocab] if vocab else logits).argmax(-1).cpu()
        out += [best[i, :len(row)] for i, (row, _) in enumerate(chunk)]
    return out


@torch.no_grad()
def score(logits_fn: LogitsFn, rows: Sequence[Row], target_ids: Sequence[torch.Tensor], *, gammas: Sequence[int],
          batch_size: int, pad_id: int, device: str | torch.device = "cpu", draft_ids: torch.Tensor | None = None,
          vocab: int | None = None, batches: int | None = None,
          features: Sequence[torch.Tensor] | None = None) -> Agreement:
    """The drafter's agreement over `rows` against the cached target argmax ids. `vocab` slices the drafter's
    logits to the real vocabulary when it has no draft map. `batches` > the batches the rows need runs 1-token
    dummy forwards after them: under ZeRO-3 every rank must call forward equally often. `features` (a drafter
    that reads the target): per row, the target's state before each token (L, H), read on its scored rows."""
    total = Agreement(check_gammas(gammas))
    for b in range(max(math.ceil(len(rows) / batch_size), batches or 0)):
        part = slice(b * batch_size, (b + 1) * batch_size)
        dummy = not rows[part]  # past the rows: a 1-token forward, its logits unused
        ids, attention, scored = pad_batch([([pad_id], [False])] if dummy else rows[part], pad_id)
        extra = {} if features is None else {"features": pad_sequence(
            [torch.zeros(1, features[0].shape[-1])] if dummy else [f.float() for f in features[part]],
            batch_first=True).to(device), "known": scored.to(device)}
        logits = logits_fn(ids.to(device), attention.to(device), **extra)
        if dummy:
            continue
        if draft_ids is None and vocab:
            logits = logits[..., :vocab]
        target = pad_sequence(list(target_ids[part]), batch_first=True, padding_value=-1)
        total = total + measure(ids, scored, target, logits, draft_ids, gammas)
    return total


# ---------------------------------------------------------------------------------------- training hook

def check_eval_config(cfg: TrainConfig) -> None:
    """Cheap checks of the `eval.*` fields, before any process group or model work."""
    e = cfg.eval
    if e.every < 0:
        raise ValueError(f"eval.every must be >= 0 (0: off), got {e.every}")
    if e.every and not e.data:
        raise ValueError("eval.every is set but eval.data is empty: name a held-out file")
    if e.data and not e.every:
        raise ValueError("eval.data is set but eval.every is 0: set eval.every to the steps between evaluations")
    if not e.every:
        return
    engine = Path(e.data).expanduser().is_dir()
    if not (engine or Path(e.data).expanduser().is_file()):
        raise FileNotFoundError(f"eval.data {e.data!r} does not exist")
    if e.max_sequences < 1:
        raise ValueError(f"eval.max_sequences must be >= 1, got {e.max_sequences}")
    check_gammas(e.gammas)
    if not (engine or e.target or cfg.distill.target):
        raise ValueError("held-out agreement needs a target: set eval.target (or distill.target)")
    if cfg.model.target_hidden_size and not engine:
        raise ValueError("model.target_hidden_size: eval.data must be a make-data directory with cached hidden "
                         "states (the drafter reads the target's), not a file")


class HeldoutEval:
    """Held-out agreement during training, run by every rank on its share (record i % world) of the first
    `eval.max_sequences` records and summed; the target's argmax ids are computed once here and cached.

    With a make-data directory as `eval.data`, the rows are its held-out replies, the target's choices its cached
    top-1, and 3- and 4-gram tables fitted on its training replies are logged beside the drafter (`ngram3_*`, ...);
    a drafter that reads the target is fed the target's states on reply rows, and its per-depth acceptance
    (`depth_acceptance`) is logged too (heldout_depth1 .., heldout_chain_tau, heldout_depth_roots)."""

    def __init__(self, cfg: TrainConfig, tokenizer, rank: int, world: int, device, dtype: torch.dtype, target=None):
        e = cfg.eval
        self.gammas, self.batch_size, self.device, self.seed = tuple(e.gammas), cfg.micro_batch_size, device, cfg.seed
        self.pad_id, self.vocab = tokenizer.pad_token_id, len(tokenizer)
        self.baselines: dict = {}
        self.features = self.examples = None  # a drafter that reads the target: states per row, replies to draft
        if Path(e.data).expanduser().is_dir():
            width = cfg.model.target_hidden_size or None
            # whole replies (packed training windows may be short; a reply's prompt alone can fill one)
            held = load_engine(e.data, tokenizer, split="heldout", hidden_size=width)[:e.max_sequences]
            rows, target_ids = engine_rows(held)
            train_rows, _ = engine_rows(load_engine(e.data, tokenizer, split="train"))
            self.baselines = ngram_baselines(train_rows, rows, target_ids, self.gammas)
            self.rows, self.target_ids = rows[rank::world], target_ids[rank::world]
            if width:
                self.features = [x.hidden[:len(ids)] for x, (ids, _) in zip(held, rows)][rank::world]
                self.examples = held[rank::world]
        else:
            rows, _ = load_heldout(e.data, tokenizer, cfg.data.seq_len, e.max_sequences)
            self.rows = rows[rank::world]
            name = e.target or cfg.distill.target
            if target is None or name != cfg.distill.target:
                target = frozen_target(name, "eval.target", tokenizer, device, dtype, attn_implementation=None)
            self.target_ids = greedy_ids(hf_logits(target), self.rows, self.batch_size, self.pad_id, device, self.vocab)
        self.batches = math.ceil(math.ceil(len(rows) / world) / self.batch_size)  # the same on every rank

    @torch.no_grad()
    def __call__(self, engine) -> dict:
        """{'heldout_agreement', 'heldout_tau<g>', ...} of the model being trained (a collective: every rank)."""
        was_training = engine.module.training
        engine.eval()
        depth = None
        try:
            stats = score(hf_logits(engine), self.rows, self.target_ids, gammas=self.gammas,
                          batch_size=self.batch_size, pad_id=self.pad_id, device=self.device,
                          draft_ids=getattr(engine.module, "draft_ids", None), vocab=self.vocab,
                          batches=self.batches, features=self.features)
            if self.examples is not None:
                depth = depth_acceptance(inference_copy(engine.module), self.examples, seed=self.seed)
        finally:
            engine.train(was_training)
        counts = torch.tensor(stats.counts() + (depth.counts() if depth is not None else []), dtype=torch.long,
                              device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        counts = counts.tolist()
        out = Agreement.from_counts(self.gammas, counts[:len(stats.counts())]).as_dict("heldout_")
        if depth is not None:
            out |= DepthAcceptance.from_counts(counts[len(stats.counts()):]).as_dict("heldout_")
        return out | self.baselines


# ---------------------------------------------------------------------------------- acceptance per depth

DEPTHS = 5          # chain of 5 drafts
ROOTS_PER_REPLY = 16
OUTSIDE = torch.iinfo(torch.long).max  # the rank of a token the drafter cannot propose
TREE_SHAPES = ("1,1", "1,1,1", "2,1", "2,2,1", "3,2,2,1,1")  # the CPU policy's arms and the paper's tree


@dataclass(frozen=True)
class DepthAcceptance:
    """Free-running greedy chains from sampled roots: `accepted[d-1]` roots whose first d drafts all equal the
    target's greedy tokens; `a + b` pools replies or ranks."""
    roots: int = 0
    accepted: tuple[int, ...] = (0,) * DEPTHS

    def __add__(self, other: "DepthAcceptance") -> "DepthAcceptance":
        if len(self.accepted) != len(other.accepted):
            raise ValueError(f"cannot pool acceptance to depth {len(self.accepted)} and {len(other.accepted)}")
        return DepthAcceptance.from_counts([a + b for a, b in zip(self.counts(), other.counts())])

    @property
    def rates(self) -> list[float]:
        """P(the first d drafts all match), d = 1 .. depth."""
        return [a / self.roots if self.roots else math.nan for a in self.accepted]

    @property
    def tau(self) -> float:
        """Tokens per target forward of a chain as deep: its accepted drafts plus the target's own token."""
        return 1 + sum(self.rates)

    def as_dict(self, prefix: str = "") -> dict:
        """{depth1, ..., depth5, chain_tau, depth_roots}, keys prefixed (e.g. 'heldout_')."""
        out = {f"{prefix}depth{d}": p for d, p in enumerate(self.rates, 1)}
        return out | {f"{prefix}chain_tau": self.tau, f"{prefix}depth_roots": self.roots}

    def counts(self) -> list[int]:
        return [self.roots, *self.accepted]

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> "DepthAcceptance":
        return cls(int(counts[0]), tuple(map(int, counts[1:])))

    @classmethod
    def from_ranks(cls, ranks: torch.Tensor) -> "DepthAcceptance":
        """From `draft_ranks`: a chain's first d drafts all match where the target's token ranks first at each."""
        hits = (ranks == 0).long().cumprod(dim=1)
        return cls(ranks.shape[0], tuple(int(n) for n in hits.sum(0)))


def tree_tau(ranks: torch.Tensor, branching: Sequence[int]) -> float:
    """τ of a static tree (`mamba_draft.tree.TreeConfig`: every node at depth d has branching[d] children, the
    drafter's top ones) under greedy verification, from `draft_ranks`: the accepted path goes one level deeper
    while the target's token is among the children the drafter gave the node it reached."""
    if not 1 <= len(branching) <= ranks.shape[1]:
        raise ValueError(f"a tree of depth {len(branching)} needs ranks to that depth, have {ranks.shape[1]}")
    hits = (ranks[:, :len(branching)] < torch.tensor(list(branching))).long().cumprod(dim=1)
    return 1 + float(hits.float().mean(0).sum()) if ranks.shape[0] else math.nan


def inference_copy(module):
    """A plain `MambaDrafter` holding the trained drafter's weights as they are now (a collective under ZeRO-3,
    which gathers them: its hooks would release parameters that `step` reads outside their modules' forwards)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return MambaDrafter.from_state_dict(module.config, module.checkpoint_tensors(), device=module.device,
                                            dtype=module.dtype, backend="torch", state_dtype=torch.float32)


def chain_roots(example, depths: int) -> torch.Tensor:
    """The rows of a make-data reply a chain of `depths` drafts can start after (its roots: the last committed
    token), where the target's greedy continuation is known: the next `depths` rows are reply rows (their cached
    top-1 is the target's greedy choice) and the reply follows that choice for the first depths-1 of them."""
    n = min(ENGINE_EVAL_LEN, example.input_ids.numel())
    reply = example.labels[:n] != data_lib.IGNORE_INDEX
    greedy = reply & (example.input_ids[:n] == example.soft_ids[:n, 0].long())
    ok = reply[:n - depths].clone() if n > depths else torch.zeros(0, dtype=torch.bool)
    for j in range(1, depths + 1):
        ok &= reply[j:n - depths + j] & (greedy[j:n - depths + j] if j < depths else True)
    return torch.nonzero(ok).flatten()


def depth_acceptance(drafter, examples: Sequence, **options) -> DepthAcceptance:
    """Per-depth acceptance of greedy chains on make-data replies: `draft_ranks` (`options` are its keywords)."""
    return DepthAcceptance.from_ranks(draft_ranks(drafter, examples, **options))


@torch.no_grad()
def draft_ranks(drafter, examples: Sequence, *, depths: int = DEPTHS, roots_per_reply: int = ROOTS_PER_REPLY,
                seed: int = 0) -> torch.Tensor:
    """(roots, depths) long: where the target's greedy token ranks among the drafter's proposals at each depth
    after a root, on make-data replies (`engine_data.EngineExample`s), as the engine drafts: for up to
    `roots_per_reply` roots per reply (`chain_roots`, drawn with `seed`), read the committed prefix, then step
    `depths` times, each time on the target's token. 0: the drafter's first choice; outside its draft vocabulary:
    `OUTSIDE`. A chain's acceptance (`DepthAcceptance.from_ranks`) and any tree's (`tree_tau`) follow.

    A drafter that reads the target (the examples need `hidden`) reads the prompt with its stand-in, the committed
    reply with the target's cached states, and the tokens after the root with the stand-in or, with
    drafted_features 'own', its own final-norm state. Any `mamba_draft.drafter.Drafter` works."""
    if depths < 1 or roots_per_reply < 1:
        raise ValueError(f"depths and roots_per_reply must be >= 1, got {depths} and {roots_per_reply}")
    reads = getattr(drafter, "reads_target", False)
    ranks = [torch.zeros(0, depths, dtype=torch.long)]
    for index, example in enumerate(examples):
        roots = chain_roots(example, depths)
        if reads and example.hidden is None:
            raise ValueError("this drafter reads the target: load the replies with their hidden states "
                             "(load_engine(..., hidden_size=...))")
        if not roots.numel():
            continue
        pick = torch.randperm(roots.numel(), generator=torch.Generator().manual_seed(seed * 1_000_003 + index))
        roots = roots[pick[:roots_per_reply]].sort().values.tolist()
        ranks.append(chains(drafter, example, roots, depths, reads))
    return torch.cat(ranks)


def chains(drafter, example, roots: list[int], depths: int, reads: bool) -> torch.Tensor:
    """`draft_ranks` after each of `roots` (ascending) of one reply: the committed prefix runs once in row 0 of the
    state, forked into row 1 + i at root i; the chains then step together on the target's tokens."""
    device = drafter.device
    own = reads and drafter.config.drafted_features == "own"  # drafted tokens read the drafter's own state (EAGLE)
    ids = example.input_ids.to(device)
    top1 = example.soft_ids[:, 0].long().to(device)
    start = int(torch.nonzero(example.labels != data_lib.IGNORE_INDEX)[0])  # the prompt: rows [0, start)
    state = drafter.allocate_state(1 + len(roots))
    head = state.rows(0, 1)
    drafter.prefill(ids[None, :start], head)  # prompt tokens: no target state (the stand-in)
    first, pos = [], start
    for i, root in enumerate(roots):
        extra = {"features": example.hidden[None, pos:root + 1].to(device)} if reads else {}
        first.append(drafter.extend(ids[None, pos:root + 1], head, last_only=True, with_hidden=own, **extra))
        state.gather_(1 + i, torch.tensor([0], device=device))
        pos = root + 1
    rows = state.rows(1, 1 + len(roots))
    logits, hidden = (torch.cat(x) for x in zip(*first)) if own else (torch.cat(first), None)
    at = torch.tensor(roots, device=device)
    columns = torch.arange(logits.shape[-1], device=device) if drafter.draft_ids is None \
        else data_lib.draft_label_map(drafter.draft_ids, int(top1.max()) + 1, device)  # target id -> logit column
    ranks = []
    for d in range(1, depths + 1):
        token = top1[at + d]  # the target's greedy token after the root's first d - 1
        column = columns[token]
        score = logits.gather(-1, column.clamp(min=0)[:, None])
        ranks.append(torch.where(column >= 0, (logits > score).sum(-1), OUTSIDE))
        if d < depths:  # a drafted token: no target state yet (the stand-in, or the drafter's own)
            if own:
                logits, hidden = drafter.step(token, rows, hidden, with_hidden=True)
            else:
                logits = drafter.step(token, rows)
    return torch.stack(ranks, dim=1).cpu()


def engine_depth_acceptance(drafter_path: str, data_dir: str, *, max_replies: int | None = None,
                            device: str = "cpu") -> dict:
    """`draft_ranks` of a saved drafter on the held-out replies of a make-data directory (or a directory of them),
    rendered with the tokenizer of the target that made them (its manifest).
    {depth1 .. depth5, chain_tau, depth_roots, replies, tree_tau: {shape: τ} for `TREE_SHAPES`}."""
    manifest = engine_dirs(data_dir)[0] / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{data_dir} has no manifest.json (not a make-data directory?)")
    tokenizer = target_tokenizer(json.loads(manifest.read_text())["settings"]["target"])
    drafter = load_drafter(drafter_path, device=device)
    width = drafter.config.target_hidden_size if getattr(drafter, "reads_target", False) else None
    examples = load_engine(data_dir, tokenizer, split="heldout", hidden_size=width)[:max_replies]
    ranks = draft_ranks(drafter, examples)
    trees = {shape: tree_tau(ranks, [int(w) for w in shape.split(",")]) for shape in TREE_SHAPES}
    return DepthAcceptance.from_ranks(ranks).as_dict() | {"replies": len(examples), "tree_tau": trees}


def ngram_baselines(train_rows: Sequence[Row], rows: Sequence[Row], target_ids: Sequence[torch.Tensor],
                    gammas: Sequence[int], orders: Sequence[int] = (3, 4)) -> dict:
    """{'ngram3_agreement': a, 'ngram3_tau3': t, ...}: n-gram tables fitted on `train_rows`, scored like a drafter."""
    out = {}
    for n in orders:
        table = NGramTable(n).fit(train_rows)
        total = Agreement(tuple(gammas))
        for (ids, scored), target in zip(rows, target_ids):
            total = total + measure_ids(torch.tensor([ids]), torch.tensor([scored]), target[None],
                                        table.predict(ids)[None], gammas)
        out.update({f"ngram{n}_{k}": v for k, v in total.as_dict().items() if k != "positions"})
    return out


def plot_agreement(metrics: Path | dict[str, Path], out: Path) -> bool:
    """Held-out agreement vs training tokens as a PNG: one metrics.jsonl, or {recipe label: metrics.jsonl} (the
    n-gram lines are the first run's). False (nothing written) without records."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    runs = {"drafter": metrics} if isinstance(metrics, (str, Path)) else dict(metrics)
    curves = {label: [r for r in map(json.loads, Path(path).read_text().splitlines()) if "heldout_agreement" in r]
              for label, path in runs.items()}
    curves = {label: records for label, records in curves.items() if records}
    if not curves:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, records in curves.items():
        ax.plot([r["train_tokens"] for r in records], [r["heldout_agreement"] for r in records], marker="o",
                markersize=3, label=label)
    first = next(iter(curves.values()))[-1]
    for key in sorted(k for k in first if k.startswith("ngram") and k.endswith("_agreement")):
        ax.axhline(first[key], linestyle="--", color="gray" if "3" in key else "black",
                   label=f"{key.split('_')[0]} table, same data")
    if len(ax.get_lines()) > 1:
        ax.legend(loc="upper left", fontsize=8)
    last = max(curves.items(), key=lambda item: item[1][-1]["heldout_agreement"])
    ax.set(xlabel="training tokens", ylabel="held-out top-1 agreement", ylim=(0, 1),
           title=f"agreement with the target: best {last[1][-1]['heldout_agreement']:.3f} ({last[0]})"
           if len(curves) > 1 else
           f"agreement with the target: {last[1][-1]['heldout_agreement']:.3f} at step {last[1][-1]['step']}")
    ax.grid(alpha=0.3)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return True


# ------------------------------------------------------------------------------------------------- CLI

def drafter_agreement(drafter_path: str, target_path: str, heldout_path: str, *, gammas: Sequence[int] = (1, 3, 5),
                      max_sequences: int | None = None, max_len: int = 2048, batch_size: int = 4,
                      device: str = "cpu") -> dict:
    """Agreement and tau of a saved drafter (`mamba_draft.load_drafter`) with a target, on a held-out file rendered
    with the target's tokenizer. A drafter that reads the target is given the target's final hidden state before
    each scored token, and its stand-in before the others."""
    gammas = check_gammas(gammas)
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    tokenizer = load_tokenizer(target_path)
    rows, skipped = load_heldout(heldout_path, tokenizer, max_len, max_sequences)
    target = load_causal_lm(target_path, device=device, attn_implementation=None)
    drafter = load_drafter(drafter_path, device=device, embedding=target.get_input_embeddings().weight)
    if len(tokenizer) > drafter.input_vocab_size:
        raise ValueError(f"the target's tokenizer has {len(tokenizer)} tokens but the drafter reads only "
                         f"{drafter.input_vocab_size}: drafter and target must share a tokenizer")
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    vocab = len(tokenizer)  # as training scores them: ids past the tokenizer are padding rows, never real tokens
    states: list[torch.Tensor] = []  # the head's input per batch (B, L, H): a drafter that reads the target's
    if drafter.reads_target:  # no need to remove the hook: the target is dropped right after
        target.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: states.append(inputs[0].detach().float().cpu()))
    target_ids = greedy_ids(hf_logits(target), rows, batch_size, pad_id, device, vocab)
    del target
    # row t's feature: the state at t - 1 (what token t's distribution came from); row 0 has none
    per_row = zip((h for batch in states for h in batch), rows)  # the batches' rows, in order
    features = [torch.cat([torch.zeros_like(h[:1]), h[:len(ids) - 1]]) for h, (ids, _) in per_row] or None

    def drafter_logits(ids, _, features=None, known=None):
        if features is None:
            return drafter(ids)
        return drafter.train_forward(ids, fed_features(features.to(drafter.dtype), known, drafter.backbone.stand_in))[0]

    stats = score(drafter_logits, rows, target_ids, gammas=gammas, batch_size=batch_size, pad_id=pad_id,
                  device=device, draft_ids=drafter.draft_ids, vocab=vocab, features=features)
    return {**stats.as_dict(), "sequences": len(rows), "skipped": sum(skipped.values())}


def main(argv: list[str] | None = None) -> int:
    """python -m training.agreement --plot OUT.png LABEL=RUN_DIR ...: the recipes' curves on one plot."""
    parser = argparse.ArgumentParser(prog="python -m training.agreement", description=main.__doc__)
    parser.add_argument("--plot", type=Path, required=True, help="PNG to write")
    parser.add_argument("runs", nargs="+", help="LABEL=DIR: a training output_dir (or export) holding metrics.jsonl")
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        metrics = Path(path) / "metrics.jsonl"
        if not sep or not metrics.is_file():
            parser.error(f"{item!r}: expected LABEL=DIR with DIR/metrics.jsonl")
        runs[label] = metrics
    if not plot_agreement(runs, args.plot):
        parser.error("no held-out agreement records in these runs")
    print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
