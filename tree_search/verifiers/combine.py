"""The any-of combinator: `get_verifier("a+b", **params)` builds `AnyOf("a+b", **params)`, which accepts a path
node if any of the lossy rules a, b accepts it; this is the one place that splits such a name."""
from __future__ import annotations

import torch

from tree_search.verifiers.base import (
    Verifier, VerifyInput, VerifyResult, register_verifier, route_params, verifier_class,
)
from tree_search.verifiers.lossy import LossyVerifier, accept_longest, build_paths


@register_verifier
class AnyOf(Verifier):
    """Accept a path node if any of several lossy verifiers accepts it (e.g. AutoJudge + DropMatch). verifiers:
    names or LossyVerifier instances (or one 'a+b' string); parameters are routed as `route_params` says."""

    name = "anyof"
    lossless = False
    draft_mode = "topk"

    def __init__(self, verifiers: list[str | Verifier] | str, **params) -> None:
        if isinstance(verifiers, str):
            verifiers = [part.strip() for part in verifiers.split("+")]
        verifiers = list(verifiers)
        if len(verifiers) < 2:
            raise ValueError(f"anyof needs at least two verifiers, got {verifiers!r}")
        classes = [verifier_class(v) if isinstance(v, str) else type(v) for v in verifiers]
        for v, cls in zip(verifiers, classes):  # checked before any constructor runs (autojudge reads a file)
            if not issubclass(cls, LossyVerifier):
                raise ValueError(f"anyof combines lossy rule verifiers (dropmatch, fly, topk, autojudge), got {v!r}; "
                                 "a lossless verifier adds nothing to an any-of combination")
        names = [cls.name for cls in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"anyof got the same verifier twice: {names}")
        routed = iter(route_params([cls for v, cls in zip(verifiers, classes) if isinstance(v, str)], params))
        self.verifiers = [cls(**next(routed)) if isinstance(v, str) else v for v, cls in zip(verifiers, classes)]
        self.name = "+".join(names)
        self.needs_hidden = any(v.needs_hidden for v in self.verifiers)
        self.needs_draft_probs = any(v.needs_draft_probs for v in self.verifiers)

    def verify(self, inp: VerifyInput) -> VerifyResult:
        # each rule's mask separately, so acceptances are counted per rule
        paths = build_paths(inp)
        return accept_longest(paths, {v.name: v.lossy_mask(inp, paths) & paths.valid for v in self.verifiers})

    def check_target(self, target: torch.nn.Module) -> None:
        for v in self.verifiers:
            v.check_target(target)
