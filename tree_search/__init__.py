"""Tree-structured speculative decoding with a Mamba drafter: topology, drafting, verification, bandit, generate."""
from mamba_draft.targets.facts import UnsupportedTargetError
from mamba_draft.tree import Tree, TreeConfig
from tree_search.bandit import DEFAULT_ARMS, UCBBandit, time_reward, tree_reward
from tree_search.calls import BatchGenerateResult, GenerateResult, GenerateStats
from tree_search.generate import CallOptions, EngineOptions, SpeculativeDecoder, generate, generate_autoregressive
from tree_search.generator import RunDefaults, SpeculativeGenerator, TextResult, run_defaults
from tree_search.policy import FixedShape, TreePolicy, parse_policy
from tree_search.sampling import SamplingParams
from tree_search.verifiers import (
    Verifier, VerifyInput, VerifyResult, available_verifiers, get_verifier, register_verifier,
)

__all__ = [
    "BatchGenerateResult", "CallOptions", "DEFAULT_ARMS", "EngineOptions", "FixedShape", "GenerateResult", "GenerateStats", "SamplingParams",
    "RunDefaults", "SpeculativeDecoder", "SpeculativeGenerator", "TextResult", "Tree", "TreeConfig", "TreePolicy",
    "UCBBandit", "UnsupportedTargetError", "Verifier", "VerifyInput", "VerifyResult", "available_verifiers",
    "generate", "generate_autoregressive", "get_verifier", "parse_policy", "register_verifier", "run_defaults",
    "time_reward", "tree_reward",
]
