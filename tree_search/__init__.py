"""Tree-structured speculative decoding with a Mamba drafter: topology, drafting, verification, bandit, generate."""
from tree_search.bandit import FixedPolicy, UCBBandit, tree_reward
from tree_search.sampling import SamplingParams
from tree_search.tree import Tree, TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, available_verifiers, get_verifier, register_verifier

__all__ = [
    "FixedPolicy",
    "SamplingParams",
    "Tree",
    "TreeConfig",
    "UCBBandit",
    "Verifier",
    "VerifyInput",
    "VerifyResult",
    "available_verifiers",
    "get_verifier",
    "register_verifier",
    "tree_reward",
]
