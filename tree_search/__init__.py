"""Tree-structured speculative decoding with a Mamba drafter: topology, drafting, verification, bandit, generate."""
from tree_search.bandit import DEFAULT_ARMS, FixedPolicy, UCBBandit, time_reward, tree_reward
from tree_search.calls import BatchGenerateResult, GenerateResult, GenerateStats
from tree_search.generate import generate, generate_autoregressive, generate_autoregressive_batch, generate_batch
from tree_search.sampling import SamplingParams
from tree_search.target import UnsupportedTargetError
from tree_search.tree import Tree, TreeConfig
from tree_search.verifiers import Verifier, VerifyInput, VerifyResult, available_verifiers, get_verifier, register_verifier

__all__ = [
    "BatchGenerateResult",
    "DEFAULT_ARMS",
    "FixedPolicy",
    "GenerateResult",
    "GenerateStats",
    "SamplingParams",
    "Tree",
    "TreeConfig",
    "UCBBandit",
    "UnsupportedTargetError",
    "Verifier",
    "VerifyInput",
    "VerifyResult",
    "available_verifiers",
    "generate",
    "generate_autoregressive",
    "generate_autoregressive_batch",
    "generate_batch",
    "get_verifier",
    "register_verifier",
    "time_reward",
    "tree_reward",
]
