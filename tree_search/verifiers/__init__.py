"""Pluggable tree verifiers: contract and registry (`base`), built-ins, lossy rules (`lossy`), `a+b` (`combine`)."""
from tree_search.verifiers.base import (
    Verifier, VerifyInput, VerifyResult, available_verifiers, get_verifier, register_verifier, verifier_class,
)
from tree_search.verifiers.greedy import GreedyVerifier
from tree_search.verifiers.sampling import SamplingVerifier

# imported for their @register_verifier: every built-in name resolves once this package is imported
from tree_search.verifiers import autojudge, combine, dropmatch, fly, topk  # noqa: F401

__all__ = [
    "Verifier", "VerifyInput", "VerifyResult", "available_verifiers", "get_verifier", "register_verifier",
    "verifier_class", "GreedyVerifier", "SamplingVerifier",
]
