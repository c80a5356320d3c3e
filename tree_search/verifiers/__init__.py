"""Pluggable tree verifiers: the contract (`base`), the registry and the lossless built-ins."""
from tree_search.verifiers.base import (
    Verifier,
    VerifyInput,
    VerifyResult,
    available_verifiers,
    get_verifier,
    register_verifier,
    verifier_class,
)
from tree_search.verifiers.greedy import GreedyVerifier
from tree_search.verifiers.sampling import SamplingVerifier

__all__ = [
    "Verifier",
    "VerifyInput",
    "VerifyResult",
    "available_verifiers",
    "get_verifier",
    "register_verifier",
    "verifier_class",
    "GreedyVerifier",
    "SamplingVerifier",
]
