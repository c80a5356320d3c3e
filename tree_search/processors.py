"""The logits processors a call applies before choosing a token: the ones transformers builds from a model's
generation config (repetition penalty, no-repeat n-grams, bad words, suppressed tokens, minimum lengths, sequence
bias) and the OpenAI API's frequency / presence penalties and logit bias.

Each depends on the sequence a position continues, so verification applies them to every tree node with that
node's own sequence: the row's prompt, its committed tokens and the node's path in the tree. The target's
distribution at a node is then the one `target.generate` computes after that very sequence, so greedy verification
and rejection sampling stay lossless. A row's sequence never holds another row's pads: a batch row is processed as
its prompt alone would be. Built once per call; `None` where nothing is set (the hot path pays nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shaping:
    """What a call's processors do, in transformers' names (plus the OpenAI penalties); the defaults do nothing."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    min_length: int = 0  # prompt + new tokens before an EOS may come
    min_new_tokens: int = 0
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    frequency_penalty: float = 0.0  # OpenAI's: minus penalty x count of the token among the new tokens
    presence_penalty: float = 0.0  # OpenAI's: minus penalty if the token is among the new tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: added to the token's logit

    def __post_init__(self) -> None:
        checks = {"repetition_penalty": self.repetition_penalty > 0, "no_repeat_ngram_size": self.no_repeat_ngram_size >= 0,
                  "min_length": self.min_length >= 0, "min_new_tokens": self.min_new_tokens >= 0,
                  "frequency_penalty": -2 <= self.frequency_penalty <= 2,
                  "presence_penalty": -2 <= self.presence_penalty <= 2}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)!r}")

    @property
    def active(self) -> bool:
        return self != Shaping()


# generation_config fields `Shaping` takes (their transformers' types converted)
CONFIG_FIELDS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                 "begin_suppress_tokens", "min_length", "min_new_tokens", "sequence_bias")


def shaping_of(config, **overrides) -> Shaping:
    """The shaping of a call: the target's generation_config (None fields: off), then the call's own settings
    (None: the config's)."""
    values = {name: getattr(config, name) for name in CONFIG_FIELDS if getattr(config, name, None) is not None}
    values.update({name: value for name, value in overrides.items() if value is not None})
    return Shaping(**{name: _frozen(name, value) for name, value in values.items()})


def _frozen(name: str, value):
    """A setting as `Shaping` holds it: token lists as tuples, a bias dict as (key, bias) pairs."""
    if name == "bad_words_ids":
        return tuple(tuple(int(t) for t in words) for words in value)
    if name in ("suppress_tokens", "begin_suppress_tokens"):
        return tuple(int(t) for t in value)
    if name == "sequence_bias":  # transformers: [[ids, bias], ...] (a dict of tuples before 4.38)
        pairs = value.items() if isinstance(value, dict) else value
        return tuple((tuple(int(t) for t in ids), float(bias)) for ids, bias in pairs)
    if name == "logit_bias":  # OpenAI: {"token id": bias}
        pairs = value.items() if isinstance(value, dict) else value
        return tuple((int(token), float(bias)) for token, bias in pairs)
    return value


class Processors:
    """One row's processors (transformers' own classes, in `generate`'s order, then the OpenAI ones): `__call__`
    processes the scores of sequences that all continue this row's prompt."""

    def __init__(self, shaping: Shaping, prompt_length: int, eos: set[int], device: torch.device) -> None:
        from transformers.generation import logits_process as lp

        eos_ids = sorted(eos)
        s, steps = shaping, []
        if s.sequence_bias:
            steps.append(lp.SequenceBiasLogitsProcessor([[list(ids), bias] for ids, bias in s.sequence_bias]))
        if s.repetition_penalty != 1.0:
            steps.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if s.no_repeat_ngram_size > 0:
            steps.append(lp.NoRepeatNGramLogitsProcessor(s.no_repeat_ngram_size))
        if s.bad_words_ids:
            steps.append(lp.NoBadWordsLogitsProcessor([list(w) for w in s.bad_words_ids], eos_ids or None))
        if eos_ids and s.min_length > 0:
            steps.append(lp.MinLengthLogitsProcessor(s.min_length, eos_ids, device=device))
        if eos_ids and s.min_new_tokens > 0:
            steps.append(lp.MinNewTokensLengthLogitsProcessor(prompt_length, s.min_new_tokens, eos_ids, device=device))
        if s.suppress_tokens:
            steps.append(lp.SuppressTokensLogitsProcessor(list(s.suppress_tokens), device=device))
        if s.begin_suppress_tokens:
            steps.append(lp.SuppressTokensAtBeginLogitsProcessor(list(s.begin_suppress_tokens), prompt_length,
                                                                 device=device))
        self.steps, self.shaping, self.prompt_length = steps, shaping, prompt_length
        if s.logit_bias:
            self.bias_ids = torch.tensor([t for t, _ in s.logit_bias], device=device)
            self.bias = torch.tensor([b for _, b in s.logit_bias], device=device)

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """sequences (n, L) token ids, scores (n, V) the logits after each -> the processed scores (float32)."""
        scores = scores.float()
        for step in self.steps:
            scores = step(sequences, scores)
        s = self.shaping
        if s.frequency_penalty or s.presence_penalty:
            new = sequences[:, self.prompt_length:]
            counts = torch.zeros_like(scores).scatter_add_(1, new, torch.ones_like(new, dtype=scores.dtype))
            scores = scores - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).to(scores.dtype)
        if s.logit_bias:
            scores = scores.index_add(1, self.bias_ids, self.bias.expand(scores.shape[0], -1))
        return scores


class CallProcessors:
    """A call's processors, one `Processors` per prompt: they process a round's tree scores node by node, each
    node after its own sequence, and a plain step's scores after each row's sequence."""

    def __init__(self, shaping: Shaping, prompts: list[torch.Tensor], eos: set[int]) -> None:
        self.prompts = prompts  # each prompt's tokens (no pads)
        self.rows = [Processors(shaping, len(p), eos, p.device) for p in prompts]

    def sequence(self, prompt: int, committed: list[int]) -> torch.Tensor:
        """The tokens a prompt's next position continues: the prompt and its committed new tokens."""
        p = self.prompts[prompt]
        return torch.cat([p, torch.tensor(committed, dtype=p.dtype, device=p.device)]) if committed else p

    def plain(self, scores: torch.Tensor, active: list[int], out: list[list[int]]) -> torch.Tensor:
        """scores (B, V) of a plain step, row i continuing prompt active[i] -> float32, as transformers processes
        them."""
        return torch.stack([self.rows[p](self.sequence(p, out[p])[None], scores[i:i + 1])[0]
                            for i, p in enumerate(active)])

    def tree(self, scores: torch.Tensor, tokens: torch.Tensor, tree, active: list[int],
             out: list[list[int]]) -> torch.Tensor:
        """scores (B, N, V) of a `Tree` (node 0 the root, the row's last committed token), its tokens (B, N):
        every node's scores processed after the row's sequence and the node's path below the root, the nodes of one
        depth together -> float32."""
        # per depth: its node range and each node's path below the root
        levels = [(start, stop, torch.tensor([tree.path_to(node) for node in range(start, stop)], dtype=torch.long,
                                             device=tokens.device)) for start, stop in tree.levels]
        processed = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        for i, p in enumerate(active):
            base = self.sequence(p, out[p])
            for start, stop, paths in levels:
                rows = base.expand(stop - start, -1)
                sequences = torch.cat([rows, tokens[i, paths].to(base.dtype)], dim=1) if paths.shape[1] else rows
                processed[i, start:stop] = self.rows[p](sequences, scores[i, start:stop])
        return processed
