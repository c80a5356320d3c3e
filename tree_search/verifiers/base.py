"""The verifier contract (see docs/architecture.md) and the by-name registry."""
from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from mamba_draft.tree import Tree
from tree_search.sampling import SamplingParams

DRAFT_MODES = ("topk", "sample")


@dataclass
class VerifyInput:
    """One drafted tree and everything the target said about it."""

    tree: Tree  # topology: node 0 = root (last committed token), parents in level order
    tokens: torch.Tensor  # (T+1,) token at each node; tokens[0] = root token
    target_logits: torch.Tensor  # (T+1, V) raw target logits at each node (they predict that node's children)
    draft_probs: torch.Tensor | None  # (T+1, V) processed draft distribution each node's children came from
    hidden: torch.Tensor | None  # (T+1, H) target final hidden states (what lm_head consumes), if needs_hidden
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None  # target output head, hidden -> logits
    sampling: SamplingParams  # temperature, top_k, top_p (applied identically to target and draft)
    generator: torch.Generator | None
    draft_mode: str = "topk"  # how the children were chosen ("topk" or "sample")


@dataclass
class VerifyResult:
    """Which root-to-node path the target accepts and the token that follows it."""

    path: list[int]  # accepted node indices in depth order, root excluded
    next_token: int  # bonus / correction token after the path
    lossy_accepts: int = 0  # path nodes accepted although they differ from the target's own choice
    info: dict = field(default_factory=dict)


class Verifier(abc.ABC):
    """Base class: subclasses set the class variables and implement `verify`."""

    name: ClassVar[str]
    lossless: ClassVar[bool]
    draft_mode: ClassVar[str]  # "topk" (top-N distinct draft tokens) | "sample" (N draws without replacement, q recorded)
    needs_hidden: ClassVar[bool] = False
    needs_draft_probs: ClassVar[bool] = False  # record q even at temperature 0 (always recorded when T > 0)
    greedy_only: ClassVar[bool] = False  # refuses temperature > 0 (checked by generate before any work)

    @abc.abstractmethod
    def verify(self, inp: VerifyInput) -> VerifyResult:
        """Accepted path and next token for one drafted tree."""

    def check_target(self, target: torch.nn.Module) -> None:
        """Refuse a target this verifier cannot judge; `generate` calls it before any model runs (default: any)."""

    def walks_argmax(self, sampling: SamplingParams) -> bool:
        """Whether, at these sampling settings, `verify` is the greedy walk over each node's target argmax
        (`greedy.greedy_walk`): then the engine decides every row with one batched argmax and one host copy."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, lossless={self.lossless}, draft_mode={self.draft_mode!r})"


_REGISTRY: dict[str, type[Verifier]] = {}


def register_verifier(cls: type[Verifier]) -> type[Verifier]:
    """Class decorator: make `cls` available to `get_verifier(cls.name)`."""
    for attr in ("name", "lossless", "draft_mode"):
        if not hasattr(cls, attr):
            raise TypeError(f"verifier {cls.__name__} must define the class variable {attr!r}")
    if cls.draft_mode not in DRAFT_MODES:
        raise ValueError(f"verifier {cls.__name__} has draft_mode {cls.draft_mode!r}; expected one of {DRAFT_MODES}")
    if "+" in cls.name:
        raise ValueError(f"verifier name {cls.name!r} must not contain '+' (reserved for combinations)")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"verifier name {cls.name!r} is already registered by {existing.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_verifiers() -> list[str]:
    """Names accepted by `get_verifier` (plus any 'a+b' combination of them)."""
    return sorted(_REGISTRY)


def verifier_class(name: str) -> type[Verifier]:
    """The class registered under `name`, without constructing it (constructors may need parameters)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown verifier {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_verifier(name: str | Verifier, **params) -> Verifier:
    """Build a verifier by registered name (`"a+b"`: the any-of combinator `combine.AnyOf`), parameters routed by
    `route_params`; a Verifier instance is passed through. Unknown names and parameters raise ValueError."""
    if isinstance(name, Verifier):
        if params:
            raise ValueError("parameters cannot be applied to an already built verifier instance")
        return name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"verifier name must be a non-empty string, got {name!r}")
    if "+" in name:  # found through the registry, so this module never imports combine
        name, params = "anyof", {**params, "verifiers": name}
    cls = verifier_class(name)
    (routed,) = route_params([cls], params)
    return cls(**routed)


def route_params(classes: list[type[Verifier]], params: dict) -> list[dict]:
    """Each class's constructor arguments out of `params`: `key` goes to every class whose constructor takes it,
    `<name>.key` only to the class registered as `name`, a class taking **kwargs gets them all; a parameter no class
    takes raises ValueError listing what the verifiers do take."""
    routed: list[dict] = [{} for _ in classes]
    used = set()
    for cls, own in zip(classes, routed):
        takes = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in takes.values())
        for key, value in params.items():
            local = key.removeprefix(f"{cls.name}.")
            if takes_any or local in takes:
                own[local] = value
                used.add(key)
    unused = sorted(set(params) - used)
    if unused and len(classes) == 1:
        accepted = list(inspect.signature(classes[0]).parameters)
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no parameters"
        raise ValueError(f"verifier {classes[0].name!r} does not take {', '.join(map(repr, unused))}; {takes}")
    if unused:
        raise ValueError(f"parameters {unused} are not accepted by any of {[cls.name for cls in classes]}")
    return routed
