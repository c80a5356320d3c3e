"""Every low-precision target is exact however it was loaded: tiny bf16 targets of each supported architecture, built
with transformers' own classes (sdpa, `.to(torch.bfloat16)`), prepared (`exact.prepare_target`: row blocks and row
attention) and passed to `generate` as a user would, decode speculatively token for token as plainly; the engine
never changes a model itself: an unprepared one is used as it is where the compiled step computes it, else refused
in one line, as is a model whose attention cannot be swapped."""
from __future__ import annotations

import pytest
import torch
import transformers

from mamba_draft.targets.exact import is_prepared, prepare_target
from mamba_draft.targets.facts import UnsupportedTargetError
from tests.helpers.hand_attention import HandConfig, HandForCausalLM
from tests.helpers.tree_models import random_drafter
from tree_search.generate import generate, generate_autoregressive

VOCAB = 64
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
GPT = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512)
HEAD_DIM_8 = {**DECODER, "head_dim": 8}
EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
ARCHITECTURES = {  # name: (config class, model class, config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", DECODER),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**DECODER, **EXPERTS}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", HEAD_DIM_8),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**HEAD_DIM_8, "num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", HEAD_DIM_8),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", HEAD_DIM_8),  # softcapped scores
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", HEAD_DIM_8),
    "phi": ("PhiConfig", "PhiForCausalLM", DECODER),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", DECODER),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", DECODER),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DECODER),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", DECODER),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {k: v for k, v in DECODER.items() if k != "num_key_value_heads"}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**GPT, "rotary_dim": 4}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"vocab_size": VOCAB, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
                                            "num_attention_heads": 4, "word_embed_proj_dim": 32,
                                            "max_position_embeddings": 512}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", DECODER),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", DECODER),
    "cohere": ("CohereConfig", "CohereForCausalLM", DECODER),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", DECODER),
    "glm": ("GlmConfig", "GlmForCausalLM", DECODER),
    "helium": ("HeliumConfig", "HeliumForCausalLM", HEAD_DIM_8),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", DECODER),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", DECODER),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**HEAD_DIM_8, **EXPERTS}),  # attention sinks
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", DECODER),
}


def built_by_transformers(config_class: str, model_class: str, config: dict) -> torch.nn.Module:
    """A random bf16 model as transformers builds it (its default attention), weights perturbed for peaked logits."""
    torch.manual_seed(0)
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config, **ids))
    for name in ids:
        setattr(model.generation_config, name, None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval().to(torch.bfloat16)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"), vocab=VOCAB, hidden=32, layers=1)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_bf16_target_passed_in_decodes_speculatively_as_plainly(name, drafter, monkeypatch, tmp_path):
    monkeypatch.setenv("MAMBA_DRAFT_CACHE", str(tmp_path))
    target = prepare_target(built_by_transformers(*ARCHITECTURES[name]))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (1, 9), generator=g)
        plain = generate_autoregressive(target, ids, max_new_tokens=20, temperature=0).new_tokens[0].tolist()
        for tree in ("1,1,1,1,1", "3,2,2,1,1", "4", "bandit"):
            spec = generate(target, drafter, ids, max_new_tokens=20, temperature=0, tree=tree).new_tokens[0].tolist()
            assert spec == plain, tree
    assert target.config._attn_implementation == "row_stable"


def test_an_unprepared_bf16_target_is_used_as_it_is_or_refused(drafter):
    """A Llama the compiled step computes decodes exactly without preparation and is left as it was; a model
    transformers' forward would verify is refused until prepared, untouched."""
    llama = built_by_transformers(*ARCHITECTURES["llama"])
    ids = torch.tensor([[5, 9, 17, 3, 22, 41, 8, 1, 2]])
    plain = generate_autoregressive(llama, ids, max_new_tokens=20, temperature=0).new_tokens[0].tolist()
    assert generate(llama, drafter, ids, max_new_tokens=20, temperature=0, tree="3,2,2,1,1").new_tokens[0].tolist() \
        == plain
    assert not is_prepared(llama) and llama.config._attn_implementation == "sdpa"
    gpt2 = built_by_transformers(*ARCHITECTURES["gpt2"])
    with pytest.raises(UnsupportedTargetError, match="^this bf16/fp16 GPT2LMHeadModel on a CPU is not prepared") as err:
        generate(gpt2, drafter, ids, max_new_tokens=4, temperature=0)
    assert "\n" not in str(err.value) and gpt2.config._attn_implementation == "sdpa" and not is_prepared(gpt2)


@pytest.mark.parametrize("claims_swappable", [False, True], ids=["as-transformers-guesses", "claimed-swappable"])
def test_a_bf16_target_whose_attention_cannot_be_swapped_is_refused_in_one_line(claims_swappable, drafter,
                                                                                  monkeypatch):
    """A model with hand-written attention (tests/helpers/hand_attention.py) is refused whether transformers' source
    heuristic sees it (today) or a release claims it can set its attention: the swap is checked by a forward."""
    target = HandForCausalLM(HandConfig(vocab_size=VOCAB)).eval().to(torch.bfloat16)
    before = target.config._attn_implementation
    if claims_swappable:
        monkeypatch.setattr(HandForCausalLM, "_can_set_attn_implementation", classmethod(lambda cls: True))
    with pytest.raises(UnsupportedTargetError, match="not prepared for exact decoding: call .*prepare_target") as err:
        generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=4, temperature=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot be made exact; run it in float32") as err:
        prepare_target(target)
    assert "\n" not in str(err.value)
    assert prepare_target(target.float()) is target and not is_prepared(target)  # fp32 takes no construction
    assert target.config._attn_implementation == before  # the refused model is left as it was
