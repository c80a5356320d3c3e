"""Drafters train through mamba_draft's own scans: same loss and gradients as transformers' reference path, a draft
vocabulary that gathers head rows with gradients, target-embedding initialisation, and the frequency-ranked map."""
from __future__ import annotations

import pytest
import torch
import transformers

from training.config import ModelConfig
from training.model import TrainableDrafter, build_model, frequency_ranked_vocab


def hf_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "mamba1":
        return transformers.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                        use_bias=False, use_conv_bias=True)
    return transformers.Mamba2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=16, expand=2,
                                     head_dim=16, num_heads=4, n_groups=1, use_bias=False, use_conv_bias=True,
                                     chunk_size=16)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_loss_and_gradients_match_transformers_reference(arch):
    torch.manual_seed(0)
    config = hf_config(arch)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ours = TrainableDrafter(config)
    ours.load_hf_state_dict({k: v.clone() for k, v in reference.state_dict().items()})
    ours.train()
    ids = torch.randint(0, 96, (3, 40))  # longer than the Mamba-2 chunk: the scan crosses chunk boundaries
    losses = []
    for model in (reference, ours):
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss)
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    grads = dict(reference.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-3, msg=name)
        compared += 1
    assert compared >= 10


def test_draft_vocabulary_logits_are_the_gathered_head_rows_and_train_the_embedding():
    torch.manual_seed(0)
    ours = TrainableDrafter(hf_config("mamba1"))
    full = ours.train_forward(torch.randint(0, 96, (2, 9)))[0].detach()
    ids = torch.tensor([5, 17, 2, 90])
    ours.set_draft_vocab(ids)
    x = torch.randint(0, 96, (2, 9))
    ours.set_draft_vocab(None)
    expected = ours.train_forward(x)[0][..., ids]
    ours.set_draft_vocab(ids)
    logits = ours(input_ids=x).logits
    assert logits.shape == (2, 9, 4) and torch.allclose(logits, expected, atol=1e-6)
    logits.sum().backward()
    grad = ours.backbone.embeddings.weight.grad  # tied head: the drafted rows get a head gradient
    assert grad[ids].abs().sum() > 0 and full.shape[-1] == 96


def test_build_model_copies_and_freezes_the_target_embedding(tmp_path, monkeypatch):
    torch.manual_seed(1)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    target.save_pretrained(tmp_path / "target")

    class Tok:  # len() and special ids are all build_model needs
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

        def __len__(self):
            return 96

    cfg = ModelConfig(arch="mamba1", hidden_size=32, num_hidden_layers=1, state_size=8,
                      init_embeddings_from=str(tmp_path / "target"), freeze_embeddings=True, pad_vocab_multiple=8)
    model = build_model(cfg, Tok(), seed=0, draft_ids=torch.tensor([2, 3, 50]))
    assert torch.equal(model.backbone.embeddings.weight, target.get_input_embeddings().weight)
    assert not model.backbone.embeddings.weight.requires_grad
    assert model.vocab_size == 3 and model.input_vocab_size == 96
    with pytest.raises(ValueError, match="embedding width"):
        build_model(ModelConfig(arch="mamba1", hidden_size=16, num_hidden_layers=1,
                                init_embeddings_from=str(tmp_path / "target")), Tok(), seed=0)


def test_frequency_ranked_vocab_orders_by_count_keeps_eos_and_fills_unseen_ids_in_order():
    lists = [[7, 7, 7, 3, 3, 9, -100], [3, 7, 11]]
    assert frequency_ranked_vocab(lists, 3).tolist() == [7, 3, 9]  # counts 4, 3, then ties by id (9 < 11)
    assert frequency_ranked_vocab(lists, 3, always=(2,)).tolist() == [2, 7, 3]
    assert frequency_ranked_vocab(lists, 8, always=(2,), vocab=20).tolist() == [2, 7, 3, 9, 11, 0, 1, 4]
    assert frequency_ranked_vocab(lists, 8).tolist() == [7, 3, 9, 11]  # without a vocabulary: only seen ids
