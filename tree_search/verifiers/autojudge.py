"""AutoJudge verifier: accept a mismatching draft token when the trained head says P(important) < threshold, reading
the target's final hidden state at the mismatching node (`autojudge.classifier`). Threshold 0 ≡ greedy."""
from __future__ import annotations

import os

import torch

from tree_search.autojudge.classifier import JudgeHead
from tree_search.verifiers.base import VerifyInput, register_verifier
from tree_search.verifiers.lossy import LossyVerifier, Paths


@register_verifier
class AutoJudgeVerifier(LossyVerifier):
    """judge: path to a head from `mamba-draft autojudge train` (or a JudgeHead); threshold in [0, 1].

    Without a threshold the head's own suggestion is used (recall >= 90% of important tokens on its held-out split).
    """

    name = "autojudge"
    needs_hidden = True

    def __init__(self, judge: str | os.PathLike | JudgeHead | None = None, threshold: float | None = None) -> None:
        if judge is None:
            raise ValueError("autojudge needs judge=<path to a trained AutoJudge head (.safetensors)>")
        head = judge if isinstance(judge, JudgeHead) else JudgeHead.load(judge)
        if threshold is None:
            threshold = head.info.get("threshold")
            if threshold is None:
                raise ValueError("autojudge: the judge file suggests no threshold; pass threshold=<value in [0, 1]>")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"autojudge: threshold must be in [0, 1], got {threshold!r}")
        self.head, self.threshold = head, float(threshold)

    def check_target(self, target: torch.nn.Module) -> None:
        hidden_size = getattr(target.config, "hidden_size", None)
        if hidden_size is not None and hidden_size != self.head.hidden_size:
            raise ValueError(f"AutoJudge head was trained on hidden size {self.head.hidden_size}, but "
                             f"{type(target).__name__} has hidden size {hidden_size}: the judge file belongs to "
                             "another target model")

    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        """The path nodes whose token the judge deems unimportant (P(important) < threshold)."""
        if inp.hidden is None:
            raise ValueError("autojudge needs the target's final hidden states (VerifyInput.hidden)")
        if self.head.mean.device != inp.hidden.device:
            self.head = self.head.to(inp.hidden.device)
        return paths.on_paths(self.head.prob_important(inp.hidden) < self.threshold)
