"""The `llama-cpp` bench method: llama.cpp (through llama-cpp-python) decoding the very GGUF file the target was read
from, on the same prompt ids (our tokenizer and chat template), token budget, sampling and threads, prefill
included. What a CPU user picks without us; its outputs come from another implementation, so the bench reports
their agreement with `ar`, not equality.

    pip install 'mamba-draft[llama-cpp]'   # builds llama.cpp from source where no wheel fits (about 4 min, 2 cores);
                                           # on Intel AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"
"""
from __future__ import annotations

import importlib.util
import time

import torch

INSTALL = ("pip install 'mamba-draft[llama-cpp]' (llama-cpp-python; on Intel AMX CPUs with "
           "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON\")")
MISSING = ("llama.cpp is not in the tables: llama-cpp-python is not installed here; `LLAMA_CPP=1 bash "
           f"scripts/setup.sh` adds it (or {INSTALL})")
CONTEXT = 4096  # llama.cpp's context: the longest prompt plus the token budget must fit


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def load(target: str, logits_all: bool = False):
    """A llama_cpp.Llama over `target`'s GGUF file (the shipped SmolLM2's when `target` is "smollm2"), on torch's
    threads, quiet (`logits_all`: keeping every position's logits); a one-line error where `target` is no GGUF.
    Callers check `available()` first."""
    from mamba_draft.targets import resolve_gguf

    gguf = resolve_gguf(target)
    if gguf is None:
        raise ValueError(f"the llama-cpp method runs a .gguf target; --target {target} is not one")
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    return Llama(model_path=str(gguf[0] / gguf[1]), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False)


def run(llm, ids: torch.Tensor, max_new_tokens: int, sampling: dict, eos: list[int], seed: int) -> tuple[list, dict]:
    """One prompt (1, L) through llama.cpp from an empty cache (no prefix kept from an earlier call): its new tokens
    up to and including an EOS, and the bench's record. Greedy at temperature 0; otherwise llama.cpp's sampler with
    the same temperature, top-k (0: off) and top-p and none of its own extra filters (min-p, repeat penalty)."""
    options = dict(temp=sampling["temperature"] or 0.0, top_k=sampling.get("top_k") or 0,
                   top_p=sampling.get("top_p") or 1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True)
    start = time.perf_counter()
    llm.reset()  # the whole prompt is prefilled, as every other method prefills it
    llm.set_seed(seed)
    tokens = []
    for token in llm.generate(ids[0].tolist(), **options):
        tokens.append(int(token))
        if token in eos or len(tokens) >= max_new_tokens:
            break
    return tokens, {"new_tokens": len(tokens), "wall_time": time.perf_counter() - start, "rounds": len(tokens),
                    "accepted": len(tokens), "target_forwards": len(tokens)}
