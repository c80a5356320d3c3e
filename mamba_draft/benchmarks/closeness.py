"""How close a target's numerics are to its fp32 model: top-1 agreement, teacher-forced, on held-out replies.

The fp32 model (transformers' forward) answers held-out questions greedily; every numerics then reads the same
prompt and reply, and at each reply position its next-token argmax is compared with the fp32 model's: the model in
bf16 (transformers), our fp32 and integer-product steps (`TargetCache`, a reply verified as one chain: the bits of
decoding it token by token) and llama.cpp on the GGUF file itself (where llama-cpp-python is installed).
"""
from __future__ import annotations

import torch

from mamba_draft.benchmarks import llama_cpp
from mamba_draft.tree import Tree


@torch.no_grad()
def fp32_replies(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The fp32 model's own greedy replies (our plain decoding with its float products), `tokens` each."""
    from tree_search.generate import generate_autoregressive

    return [generate_autoregressive(model, torch.tensor([p]), max_new_tokens=tokens, temperature=0,
                                    eos_token_id=[]).new_tokens[0].tolist() for p in prompts]


@torch.no_grad()
def plain_argmax(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """transformers' forward over prompt + reply: the argmax predicting each reply token."""
    ids = torch.tensor([prompt + reply[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1:].float().argmax(-1)


@torch.no_grad()
def step_argmax(model, prompt: list[int], reply: list[int], integer_products: bool) -> torch.Tensor:
    """Our target step: the prompt prefilled, the reply verified as one chain."""
    from mamba_draft.targets.cache import TargetCache

    cache = TargetCache(model, static=True, max_len=len(prompt) + len(reply) + 2, integer_products=integer_products)
    cache.prefill(torch.tensor([prompt[:-1]]))
    logits, _ = cache.tree_forward(torch.tensor([prompt[-1:] + reply[:-1]]), Tree(tuple(range(-1, len(reply) - 1))))
    return logits[0].float().argmax(-1)


def llama_argmax(llm, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """llama.cpp (`logits_all`) over prompt + reply."""
    llm.reset()
    llm.eval(prompt + reply[:-1])
    return torch.from_numpy(llm.scores[len(prompt) - 1: len(prompt) + len(reply) - 1].copy()).argmax(-1)


def agreement(target: str, prompts: list[list[int]], tokens: int, fp32_model, bf16_model,
              integer_products: bool) -> dict[str, float]:
    """Top-1 agreement with the fp32 model of each numerics this machine runs, over `prompts`' fp32 replies
    (`integer_products`: the target holds a GGUF's codes, so that path runs too)."""
    from mamba_draft.targets import resolve_gguf

    replies = fp32_replies(fp32_model, prompts, tokens)
    reference = [plain_argmax(fp32_model, p, r) for p, r in zip(prompts, replies)]
    paths = {"bf16 (transformers)": lambda p, r: plain_argmax(bf16_model, p, r),
             "fp32, our step": lambda p, r: step_argmax(fp32_model, p, r, False)}
    if integer_products:
        paths["int8 products, our step"] = lambda p, r: step_argmax(fp32_model, p, r, True)
    if llama_cpp.available() and resolve_gguf(target) is not None:
        llm = llama_cpp.load(target, logits_all=True)
        paths["llama.cpp (the GGUF)"] = lambda p, r: llama_argmax(llm, p, r)
    result = {}
    for name, argmax in paths.items():
        same = sum(int((argmax(p, r) == ref).sum()) for p, r, ref in zip(prompts, replies, reference))
        result[name] = same / sum(len(r) for r in replies)
    return result
