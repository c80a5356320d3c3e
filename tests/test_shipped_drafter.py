"""The drafters shipped for the shipped target (`--drafter smollm2`, the default, and every other shipped name):
trained parameters only, in bf16 and small, loaded with the target's own embedding (checked by hash), lossless with
it, and actually trained."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mamba_draft import MambaDrafter
from mamba_draft.checkpoint import (EMBEDDING, SHIPPED_DRAFTER, SHIPPED_DRAFTER_NAMES, TARGET_EMBEDDING,
                                   embedding_digest, resolve_directory)
from mamba_draft.heldout import is_heldout, read_spec_bench
from mamba_draft.targets import SHIPPED_TARGET, load_causal_lm, load_tokenizer
from tree_search.generate import SpeculativeDecoder
from tree_search.prompts import encode_prompt


@pytest.fixture(scope="module")
def target():
    return load_causal_lm(SHIPPED_TARGET)  # fp32: the reference is its own greedy decoding


@pytest.fixture(scope="module", params=SHIPPED_DRAFTER_NAMES)
def pair(request, target):
    drafter = MambaDrafter.from_pretrained(request.param, embedding=target.get_input_embeddings().weight)
    return target, drafter, load_tokenizer(SHIPPED_TARGET), resolve_directory(request.param)


@pytest.mark.parametrize("name", SHIPPED_DRAFTER_NAMES)
def test_ships_trained_parameters_only_in_bf16_with_a_model_card(name):
    shipped = resolve_directory(name)
    files = {p.name: p.stat().st_size for p in shipped.iterdir()}
    assert set(files) == {"config.json", "model.safetensors", "draft_vocab.safetensors", TARGET_EMBEDDING, "README.md"}
    assert all(size <= 16 * 2**20 for size in files.values())
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        assert EMBEDDING not in f.keys() and "lm_head.weight" not in f.keys()
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    card = (shipped / "README.md").read_text()
    for needed in (f"--drafter {name}", "mamba-draft make-data", "mamba-draft train", "--lean-from-target", "held-out",
                   "mamba-draft demo"):
        assert needed in card, needed


def test_loads_with_the_shipped_targets_embedding(pair):
    target, drafter, _, shipped = pair
    spec = json.loads((shipped / TARGET_EMBEDDING).read_text())
    assert spec["sha256_bf16"] == embedding_digest(target.get_input_embeddings().weight)
    assert drafter.config.arch == "mamba2" and drafter.draft_ids is not None
    assert torch.equal(drafter.backbone.embeddings.weight.to(torch.bfloat16),
                       target.get_input_embeddings().weight.to(torch.bfloat16))


def test_greedy_with_the_shipped_drafter_is_the_targets_own_and_drafts_are_accepted(pair):
    """Even-id (training-side) questions: identical output; a trained drafter gets well past one token a round."""
    target, drafter, tokenizer, _ = pair
    questions = [r for r in read_spec_bench() if not is_heldout(r)][::60][:3]
    taus, plain_decoder, decoder = [], SpeculativeDecoder(target), SpeculativeDecoder(target, drafter, tree="1,1,1")
    for record in questions:
        ids = torch.tensor([encode_prompt(tokenizer, record["turns"][0])])
        plain = plain_decoder.generate(ids, max_new_tokens=24, temperature=0)
        result = decoder.generate(ids, max_new_tokens=24, temperature=0)
        assert torch.equal(result.tokens, plain.tokens), record["question_id"]
        taus.append(result.stats.mean_accepted)
    assert sum(taus) / len(taus) > 1.3, taus  # an untrained drafter of this vocabulary: ~1.0


def test_the_default_reads_the_target_and_the_external_one_token_ids_only(target):
    hidden = target.config.hidden_size
    default = MambaDrafter.from_pretrained(SHIPPED_DRAFTER, embedding=target.get_input_embeddings().weight)
    external = MambaDrafter.from_pretrained("smollm2-external", embedding=target.get_input_embeddings().weight)
    assert default.reads_target and default.config.target_hidden_size == hidden
    assert not external.reads_target
