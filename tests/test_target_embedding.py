"""Drafters stored without their embedding (the target's, tied and frozen): saved as trained parameters plus a digest,
loaded with the target's embedding (passed in or loaded by name), refused with another target's, converted whole."""
import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from mamba_draft import MambaDrafter, convert
from mamba_draft.checkpoint import (EMBEDDING, SHIPPED_DRAFTER, TARGET_EMBEDDING, embedding_digest,
                                    resolve_directory, save_checkpoint)
from tests.helpers.training_fixtures import tiny_chat_target

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, target, drafter sharing its embedding with a draft vocabulary, that drafter saved lean)."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer, target = tiny_chat_target(root / "target")
    config = transformers.MambaConfig(vocab_size=target.config.vocab_size, hidden_size=target.config.hidden_size,
                                      num_hidden_layers=2, state_size=8, expand=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    drafter = MambaDrafter.from_state_dict(
        *_config_and_tensors(transformers.MambaForCausalLM(config)), dtype=torch.float32)
    with torch.no_grad():
        drafter.backbone.embeddings.weight.copy_(target.get_input_embeddings().weight)
    drafter.set_draft_vocab(torch.arange(0, 40, 2))
    save_checkpoint(drafter.config, drafter.checkpoint_tensors(), root / "lean", dtype=torch.bfloat16,
                    embedding_from=str(root / "target"))
    return root / "target", target, drafter, root / "lean"


def _config_and_tensors(hf_model):
    from mamba_draft import MambaConfig

    return MambaConfig.from_hf_dict(hf_model.config.to_dict()), hf_model.state_dict()


def test_lean_directory_holds_trained_parameters_only_in_bf16(pair):
    target_dir, target, _, lean = pair
    with safe_open(str(lean / "model.safetensors"), "pt") as f:
        assert EMBEDDING not in f.keys() and "lm_head.weight" not in f.keys()
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    spec = json.loads((lean / TARGET_EMBEDDING).read_text())
    assert spec == {"target": str(target_dir), "shape": list(target.get_input_embeddings().weight.shape),
                    "sha256_bf16": embedding_digest(target.get_input_embeddings().weight)}


def test_loads_with_the_targets_embedding_given_or_by_name(pair):
    _, target, drafter, lean = pair
    given = MambaDrafter.from_pretrained(str(lean), embedding=target.get_input_embeddings().weight)
    by_name = MambaDrafter.from_pretrained(str(lean))
    reference = drafter.to(torch.bfloat16).float()  # what was shipped: every trained parameter rounded to bf16
    with torch.no_grad():
        reference.backbone.embeddings.weight.copy_(target.get_input_embeddings().weight)
        reference.set_draft_vocab(drafter.draft_ids)
    expected = reference(IDS)
    assert torch.equal(given(IDS), expected) and torch.equal(by_name(IDS), expected)
    assert torch.equal(given.draft_ids, drafter.draft_ids)
    # the digest is of the bf16-rounded embedding: a bf16 copy of the same target is accepted
    MambaDrafter.from_pretrained(str(lean), embedding=target.get_input_embeddings().weight.to(torch.bfloat16))


def test_another_targets_embedding_is_refused(pair):
    _, target, _, lean = pair
    other = target.get_input_embeddings().weight.clone()
    other[7, 3] += 1.0
    with pytest.raises(ValueError, match="was trained on the embedding of"):
        MambaDrafter.from_pretrained(str(lean), embedding=other)
    with pytest.raises(ValueError, match="was trained on the embedding of"):
        MambaDrafter.from_pretrained(str(lean), embedding=other[:-1])


def test_convert_writes_a_whole_directory_plain_transformers_loads(pair, tmp_path):
    _, target, _, lean = pair
    out = convert(str(lean), tmp_path / "whole", to="hf")
    assert not (out / TARGET_EMBEDDING).exists() and (out / "tokenizer_config.json").is_file()
    hf = transformers.MambaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(hf.get_input_embeddings().weight, target.get_input_embeddings().weight.detach())
    ours = MambaDrafter.from_pretrained(str(lean))
    ours.set_draft_vocab(None)
    torch.testing.assert_close(hf(IDS).logits, ours(IDS), rtol=1e-4, atol=1e-4)


def test_embedding_from_needs_a_tied_hf_checkpoint(pair, tmp_path):
    _, _, drafter, _ = pair
    with pytest.raises(ValueError, match="embedding_from"):
        save_checkpoint(drafter.config, drafter.checkpoint_tensors(), tmp_path / "x", format="mamba_ssm",
                        embedding_from="t")
    assert not (tmp_path / "x").exists()


def test_shipped_drafter_names_resolve_into_the_package(pair, tmp_path, monkeypatch):
    from mamba_draft import checkpoint

    monkeypatch.setattr(checkpoint, "SHIPPED_DRAFTERS", tmp_path / "drafters")
    _, target, drafter, lean = pair
    for name in checkpoint.SHIPPED_DRAFTER_NAMES:
        with pytest.raises(FileNotFoundError, match=f"shipped drafter {name} is missing"):
            MambaDrafter.from_pretrained(name)
        shutil.copytree(lean, tmp_path / "drafters" / name)
        assert resolve_directory(name) == tmp_path / "drafters" / name
        loaded = MambaDrafter.from_pretrained(name, embedding=target.get_input_embeddings().weight)
        assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    assert SHIPPED_DRAFTER in checkpoint.SHIPPED_DRAFTER_NAMES
