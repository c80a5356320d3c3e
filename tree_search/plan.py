"""A generate call resolved once into a `Plan` (`plan_call`: sampling, verifier, lookup rounds, every option checked
without a model), then checked against the models once (`check_models`: limits, vocabularies, drafter room, tree
support). The engine, the CLI and the bench's regenerate command call the same two, before any model runs."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from mamba_draft.checkpoint import check_draft_ids
from mamba_draft.targets.facts import local_window, max_positions, target_vocab_size, window_capacity
from mamba_draft.targets.tree_mask import check_tree_support
from tree_search.bandit import UCBBandit
from tree_search.policy import TreePolicy, is_auto
from tree_search.sampling import SamplingParams
from tree_search.verifiers import Verifier, get_verifier

LOOKUP_TOKENS = 8  # the default prompt-lookup proposal length (`default_lookup_tokens`)


@dataclass(frozen=True)
class Plan:
    """What a call runs with, resolved from its options."""

    sampling: SamplingParams
    verifier: Verifier | None  # None: plain decoding (no drafter)
    lookup_tokens: int = 0  # prompt-lookup rounds of up to this many tokens (0: none)
    depth: int = 0  # the deepest proposal a round verifies (`check_models` sizes these two)
    nodes: int = 0  # the most tokens a round proposes
    fits: tuple[int, ...] | None = None  # the policy's arms this call's target cache holds (None: all; `fit_arms`)
    keyed: bool = False  # seeded lossless sampling: draws by (seed, position) (`sampling.keyed_choice`)

    @property
    def widest(self) -> int:
        """The most tokens one row's forward verifies: its widest proposal and the root."""
        return self.nodes + 1

    @property
    def records_probs(self) -> bool:
        """Whether drafts record their distributions q: when the verifier samples by rejection (keyed draws read
        no q), or when it reads them."""
        return self.verifier is not None and (
            (not self.sampling.greedy and not self.keyed) or self.verifier.needs_draft_probs)

    @property
    def draft_mode(self) -> str:
        """How drafted children are chosen: "sample" (draws without replacement from q) or "topk" (greedy, and keyed
        draws: the target's token is likeliest among the drafter's best)."""
        sampled = (self.verifier is not None and self.verifier.draft_mode == "sample" and not self.sampling.greedy
                   and not self.keyed)
        return "sample" if sampled else "topk"


def plan_call(policy: TreePolicy | None, sampling: SamplingParams, *, verifier: str | Verifier | None = None,
              verifier_params: dict | None = None, prompt_lookup: bool = False, lookup_tokens: int | None = None,
              device: str | torch.device = "cpu", batched: bool = False, streamer: bool = False) -> Plan:
    """Resolve and check a call's options without a model. policy None: plain decoding; lookup_tokens None:
    `default_lookup_tokens`."""
    if policy is None:
        if batched and streamer:
            raise ValueError("a batch of prompts takes no streamer; pass one prompt to stream")
        return Plan(sampling, None)
    verifier = get_verifier(verifier or ("greedy" if sampling.greedy else "sampling"), **(verifier_params or {}))
    lookup = default_lookup_tokens(policy, device, batched, prompt_lookup) if lookup_tokens is None else lookup_tokens
    if batched and (streamer or prompt_lookup or lookup):
        raise ValueError("a batch of prompts takes no streamer, prompt_lookup or lookup_tokens; pass one prompt for "
                         "those")
    check_options(verifier, policy, sampling, prompt_lookup, lookup)
    return Plan(sampling, verifier, lookup)


def check_models(plan: Plan, target: torch.nn.Module, drafter, tokenizer, policy: TreePolicy | None,
                 ids: torch.Tensor, lengths: list[int], max_new_tokens: int, tree_mask_ok: set | None = None) -> Plan:
    """Check a planned call against its models and prompts (`ids` (B, L) left-padded, `lengths` per row) -> the plan
    fitted to what the target's cache holds for this call (`fit_arms`). tree_mask_ok: the tree-mask probe verdicts
    the caller keeps (`check_tree_support`)."""
    check_limits(target, ids, max_new_tokens)
    exceeds = lambda depth, nodes: exceeded(target, ids, lengths, max_new_tokens, depth, nodes)  # noqa: E731
    if policy is not None:
        plan = fit_arms(plan, policy, exceeds)
    elif (why := exceeds(0, 0)) is not None:
        raise ValueError(why)
    if drafter is not None:
        check_drafter_room(drafter, len(lengths), plan.nodes + 1, target_vocab_size(target),
                           max(lengths) + max_new_tokens + plan.depth)
        check_drafter(target, drafter, tokenizer, plan.verifier, policy, tree_mask_ok)
    return plan


def fit_arms(plan: Plan, policy: TreePolicy, exceeds) -> Plan:
    """The plan narrowed to the policy's arms (and prompt-lookup rounds) the target's cache holds for this call:
    `exceeds(depth, nodes)` says why a round of that depth and size does not fit, or None. A bandit (`UCBBandit`)
    pulls only the arms that fit (`Plan.fits`, None: all); a call is refused, in one line, only where no arm fits
    (or, for another policy, where one does not)."""
    fits = tuple(k for k, arm in enumerate(policy.arms) if exceeds(arm.depth, arm.num_nodes) is None)
    if not fits or (len(fits) < len(policy.arms) and not isinstance(policy, UCBBandit)):
        widest = max(policy.arms, key=lambda arm: arm.num_nodes)
        raise ValueError(exceeds(widest.depth, widest.num_nodes))
    lookup = max((k for k in range(plan.lookup_tokens + 1) if exceeds(k, k) is None), default=0)
    arms = [policy.arms[k] for k in fits]
    return replace(plan, lookup_tokens=lookup, depth=max(lookup, *(a.depth for a in arms)),
                   nodes=max(lookup, *(a.num_nodes for a in arms)),
                   fits=None if len(fits) == len(policy.arms) else fits)


def check_drafter(target: torch.nn.Module, drafter, tokenizer, verifier: Verifier, policy: TreePolicy,
                  tree_mask_ok: set | None = None) -> None:
    """Refuse a drafter / tree / verifier the target cannot be decoded with (vocabularies, tree width, attention).
    tree_mask_ok: the tree-mask probe verdicts the caller keeps (`check_tree_support`)."""
    width = getattr(getattr(drafter, "config", None), "target_hidden_size", 0)
    if drafter.reads_target and width != target.config.hidden_size:
        raise ValueError(f"the drafter reads a target's hidden state of width {width}, but "
                         f"{type(target).__name__} has hidden_size {target.config.hidden_size}: it was trained for "
                         "another target")
    vocab = check_vocab(target, drafter, tokenizer)
    widest = max((n for a in policy.arms for n in a.branching), default=0)  # "none" has no level
    if widest > vocab:
        raise ValueError(f"a tree level asks for {widest} distinct children but the vocabulary has {vocab} tokens")
    verifier.check_target(target)
    check_tree_support(target, tree_mask_ok)


def check_options(verifier: Verifier, policy: TreePolicy, params: SamplingParams, prompt_lookup: bool,
                  lookup_tokens: int = 0) -> None:
    """Refuse verifier / tree / sampling / prompt-lookup combinations that cannot work (no model needed)."""
    if verifier.greedy_only and not params.greedy:
        raise ValueError(f"verifier {verifier.name!r} is for temperature 0; "
                         f"use verifier='sampling' for temperature {params.temperature}")
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
        raise ValueError(f"prompt_lookup drafts the drafter's greedy chain, so it needs temperature 0 "
                         f"(got {params.temperature})")
    trees = [str(arm) for arm in policy.arms if max(arm.branching, default=1) > 1]
    if trees:
        raise ValueError(f"prompt_lookup drafts chains only (every branching factor 1), but tree arm(s) "
                         f"{', '.join(trees)} branch; pass a chain such as tree='1,1,1,1,1'")


def default_lookup_tokens(tree, device: str | torch.device, batch: bool, prompt_lookup: bool) -> int:
    """`lookup_tokens=None`: with tree `auto` (the spec or its policy), prompt-lookup rounds of up to
    `LOOKUP_TOKENS` for one prompt on a CPU; none for a batch, with `prompt_lookup`, on other devices or for another
    tree policy."""
    cpu = torch.device(device).type == "cpu"
    return LOOKUP_TOKENS if is_auto(tree) and cpu and not batch and not prompt_lookup else 0


def check_vocab(target: torch.nn.Module, drafter, tokenizer=None) -> int:
    """Refuse a drafter/target vocabulary mismatch -> how many distinct tokens the drafter can propose. Different
    logit widths pass only when a tokenizer shows both cover its real vocabulary (checkpoints pad their embeddings);
    the drafter then proposes ids below the narrower width. A drafter with a draft vocabulary (`drafter.draft_ids`)
    must read every token the target may commit and propose only distinct ids of the target's vocabulary."""
    target_vocab = target_vocab_size(target)
    if drafter.draft_ids is not None:
        reads = int(drafter.input_vocab_size)
        needed, owner = (len(tokenizer), "the tokenizer") if tokenizer is not None \
            else (target_vocab, f"target {type(target).__name__}")
        if target_vocab < needed:
            raise ValueError(f"vocabulary mismatch: tokenizer has {needed} tokens but the target covers {target_vocab}")
        if reads < needed:
            raise ValueError(f"vocabulary mismatch: the drafter reads {reads} token ids but {owner} has {needed}; a "
                             "drafter with a draft vocabulary must still read every token the target can commit")
        return check_draft_ids(drafter.draft_ids, target_vocab, vocab_name="the target's vocabulary ").numel()
    draft_vocab = int(drafter.vocab_size)
    if tokenizer is not None:
        real = len(tokenizer)
        if min(target_vocab, draft_vocab) < real:
            raise ValueError(f"vocabulary mismatch: tokenizer has {real} tokens but the target covers {target_vocab} "
                             f"and the drafter {draft_vocab}")
    elif draft_vocab != target_vocab:
        raise ValueError(f"vocabulary mismatch: drafter has {draft_vocab} tokens, target {type(target).__name__} has "
                         f"{target_vocab}; pass the tokenizer if both only pad the same real vocabulary")
    return min(target_vocab, draft_vocab)


def row_seeds(seed, rows: int) -> list[int] | None:
    """Each row's seed: seed + b for an integer, seed[b] for one per prompt; None: torch's global RNG."""
    if seed is None:
        return None
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed]
    if any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ValueError(f"seed must be an integer (row b uses seed + b), one per prompt, or None, got {seed!r}")
    if not isinstance(seed, (list, tuple)):
        return [seed + b for b in range(rows)]
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} seeds for {rows} prompts: give one per prompt")
    return seeds


def eos_set(target: torch.nn.Module, eos_token_id) -> set[int]:
    """The ids that end a row: `eos_token_id` (None: the target's generation_config's) as an int, a list, a tensor
    or a numpy integer or array, as transformers takes it; anything else refused in one line."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    return token_ids(eos_token_id, "eos_token_id")


def token_ids(value, name: str) -> set[int]:
    """A set of token ids from None, an int, a numpy integer, a tensor or array of any shape, or a list / tuple /
    set of those (`name` says which argument is refused)."""
    if value is None:
        return set()
    if isinstance(value, torch.Tensor):
        value = value.numpy(force=True)
    if isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got an array of {value.dtype}")
        return {int(v) for v in value.reshape(-1).tolist()}
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return {int(value)}
    if isinstance(value, (list, tuple, set)):
        return set().union(*(token_ids(v, name) for v in value))
    raise ValueError(f"{name} must be a token id (int), a list of them, a tensor or a numpy integer, got {value!r}")


def is_batch(input_ids, attention_mask) -> bool:
    """A list of prompts, (B > 1, L) ids, or any ids with an attention mask (left-padded batches)."""
    if attention_mask is not None:
        return True
    if isinstance(input_ids, (list, tuple)):
        return bool(input_ids) and not isinstance(input_ids[0], int)
    return isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1


def batch_prompts(prompts, attention_mask) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One prompt ((L,) / (1, L) ids or a list of ints), a list of prompts (left-padded here) or left-padded ids
    (B, L) + attention_mask -> (ids (B, L), mask (B, L), lengths), checked before any model runs."""
    if isinstance(prompts, torch.Tensor) or (isinstance(prompts, (list, tuple)) and prompts
                                             and isinstance(prompts[0], int)):
        ids = torch.as_tensor(prompts)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (L,), (1, L) or left-padded (B, L), got {tuple(ids.shape)}")
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty: input_ids needs at least one token")
        lengths = check_batch_prompts(ids, attention_mask)  # shapes, 0/1, left padding, no empty prompt
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        return ids.long(), mask.to(device=ids.device, dtype=torch.long), lengths
    if attention_mask is not None:
        raise ValueError("attention_mask goes with left-padded (B, L) input_ids; a list of prompts is padded here")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists or a left-padded (B, L) tensor")
    rows = []
    for b, prompt in enumerate(prompts):
        row = torch.as_tensor(prompt)
        if row.dim() == 2 and row.shape[0] == 1:  # a (1, L) prompt, as one prompt is given
            row = row[0]
        if row.numel() == 0:  # first: torch reads [] as float
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        if row.dim() != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
            raise ValueError(f"prompt {b} must be a list or 1-D tensor of integer token ids, got "
                             f"{row.dtype} {tuple(row.shape)}")
        rows.append(row.long().cpu())
    ids = pad_sequence(rows, batch_first=True, padding_side="left")  # pad id 0: masked out, but the target embeds it
    mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True, padding_side="left")
    return ids, mask, [row.numel() for row in rows]


def check_batch_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Refuse what a batch prefill cannot take (no model needed): ids not (B, L), a mask of another shape, values
    other than 0/1, right padding, empty prompts. Returns each prompt's length (its tokens, pads excluded)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"batched input_ids must be a (B, L) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise ValueError("the batch is empty: input_ids has no rows")
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a (B, L) tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} "
                         f"but input_ids has shape {tuple(input_ids.shape)}")
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
    late = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero()  # a pad after a token: right (or inner) padding
    if late.numel():
        raise ValueError(f"prompt {int(late[0])} is not left-padded (a pad follows a token): pad prompts on the left")
    lengths = mask.sum(dim=1).tolist()
    if 0 in lengths:
        raise ValueError(f"prompt {lengths.index(0)} is empty (its attention_mask row is all zeros)")
    return lengths


def check_limits(target: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int) -> None:
    """A call's budget and token ids (pads too: the target embeds them)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = target_vocab_size(target)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"token ids (pads included) must lie in [0, {vocab}), got [{low}, {high}]")


def exceeded(target: torch.nn.Module, ids: torch.Tensor, lengths: list[int], max_new_tokens: int,
             tree_depth: int, tree_nodes: int) -> str | None:
    """Why rounds of `tree_depth` and `tree_nodes` do not fit this call's target cache (None: they do): positions
    per row, and the sliding window, which the batch cache's shared slots fill at least as fast as the longest
    row."""
    longest = max(lengths)
    limit = max_positions(target)
    if limit is not None and longest + max_new_tokens + tree_depth > limit:
        return (f"the longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) + tree depth ({tree_depth}) "
                f"exceeds the target's {limit} max positions")
    window = window_capacity(target)
    if window is not None and ids.shape[1] + max_new_tokens + tree_nodes > window:
        return (f"the padded prompts ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree nodes "
                f"({tree_nodes}) exceed {_window_limit(target, window)}")
    # A local window has no runtime guard, so bound the shared slots up front: a round adds 1 + its longest accepted
    # path (<= tree depth), and runs only while some row has < max_new_tokens.
    local = local_window(target)
    slots = ids.shape[1] + (max_new_tokens - 1) * (1 + tree_depth) + tree_nodes
    if local is not None and ids.shape[0] > 1 and tree_depth and slots > local:
        return (f"a batch of {ids.shape[0]} prompts may need {slots} slots (padded prompts {ids.shape[1]} + up to "
                f"{1 + tree_depth} per round for {max_new_tokens - 1} rounds + tree nodes {tree_nodes}: shorter "
                f"accepted paths leave holes) and exceed {_window_limit(target, local)}; pass fewer max_new_tokens, "
                "a shallower tree or one prompt")
    return None


def _window_limit(target: torch.nn.Module, window: int) -> str:
    """The window a generation must fit in, named for the error message."""
    name = type(target).__name__
    if local_window(target) == window:
        return (f"the {window}-token local attention window (window_size) of {name}, whose local layers hide keys "
                "by their slot in a forward, so a draft tree is verified exactly only within it")
    return f"the {window} tokens {name}'s sliding-window cache holds exactly"


def check_drafter_room(drafter, batch: int, tree_rows: int, out_vocab: int, context: int) -> None:
    """Refuse a batch whose drafter state rows (one per node of every row's largest tree, up to `context` tokens
    each for a Transformer drafter), step logits and recorded draft distributions would not fit in the drafter
    device's whole memory (a clear error instead of an OOM)."""
    per_node = drafter.row_bytes(context) + int(drafter.vocab_size) * drafter.dtype.itemsize + out_vocab * 4
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
