"""A drafter that reads the target (`MambaConfig.target_hidden_size`): its model (fusion of each token's embedding with
the target's final hidden state before it, a learned stand-in where the target has not run), its checkpoint, and
the engine handing it the verification forward's states: lossless at every batch size, sampling and verifier, and
fed exactly the target's states for every committed token."""
from __future__ import annotations

import pytest
import torch

from mamba_draft import MambaConfig, MambaDrafter, load_drafter
from tests.helpers.tree_models import hf_greedy, prompts, tiny_llama
from tree_search import generate
from tree_search.tree_drafter import TreeDrafter

VOCAB, HIDDEN = 64, 32


def target_aware(target, seed: int = 1) -> MambaDrafter:
    """A random Mamba-2 drafter reading `target`'s states, on the target's embedding and head (so it agrees
    sometimes), with a non-zero stand-in."""
    torch.manual_seed(seed)
    config = MambaConfig(arch="mamba2", d_model=HIDDEN, n_layer=2, vocab_size=VOCAB, d_state=8, headdim=16,
                         tie_embeddings=False, target_hidden_size=target.config.hidden_size)
    drafter = MambaDrafter(config, backend="torch")
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(0.1 * torch.randn_like(p))
        drafter.backbone.embeddings.weight.copy_(target.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
        drafter.backbone.feature_norm.weight.fill_(1.0)
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=VOCAB, hidden=HIDDEN)
    return target, target_aware(target)


def test_the_fusion_reads_features_and_the_stand_in_fills_the_gaps(pair, tmp_path):
    _, drafter = pair
    ids, features = torch.randint(0, VOCAB, (2, 6)), torch.randn(2, 6, HIDDEN)
    logits, _ = drafter.train_forward(ids, features)
    state = drafter.allocate_state(2)
    drafter.extend(ids[:, :3], state, features=features[:, :3])
    stepped = [drafter.step(ids[:, t], state, features[:, t]) for t in range(3, 6)]
    torch.testing.assert_close(stepped[-1], logits[:, -1], atol=1e-5, rtol=1e-4)
    stand_in = drafter.backbone.stand_in.expand(2, 6, -1)
    torch.testing.assert_close(drafter.train_forward(ids)[0], drafter.train_forward(ids, stand_in)[0])
    assert not torch.allclose(drafter.train_forward(ids)[0], logits)  # the features matter
    # ... by direction: a target state 15x its embedding's scale does not swamp the token (`feature_norm`)
    torch.testing.assert_close(drafter.train_forward(ids, 15 * features)[0], logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="features must have shape"):
        drafter.train_forward(ids, features[:, :, :5])
    drafter.save_pretrained(tmp_path / "d")
    again = load_drafter(tmp_path / "d")
    assert again.reads_target and again.config.target_hidden_size == HIDDEN
    torch.testing.assert_close(again.train_forward(ids, features)[0], logits)
    with pytest.raises(ValueError, match="no mamba_ssm format"):
        drafter.save_pretrained(tmp_path / "s", format="mamba_ssm")


@pytest.mark.parametrize("tree", ["2,1", "3,2,1", "bandit-time:none/1,1/2,1"])
def test_greedy_output_is_the_targets_at_every_batch_size(pair, tree):
    target, drafter = pair
    batch = prompts(VOCAB, 4, seed=5, min_len=2, max_len=9)
    references = [hf_greedy(target, p, 24) for p in batch]
    for prompt, reference in zip(batch, references):
        result = generate(target, drafter, prompt, max_new_tokens=24, tree=tree, lookup_tokens=0)
        assert torch.equal(result.tokens, reference)
    together = generate(target, drafter, [p[0].tolist() for p in batch], max_new_tokens=24, tree=tree)
    assert all(torch.equal(row.tokens, ref) for row, ref in zip(together.rows, references))
    assert together.stats.mean_accepted > 1.0


@pytest.mark.parametrize("tree, lookup", [("2,1", 0), ("bandit-time:none/1,1/2,1", 0), ("1,1", 4)])
def test_each_committed_token_is_read_with_the_targets_state_before_it(pair, monkeypatch, tree, lookup):
    """Spy on every read: the features of a row's committed tokens (drafted, plain and prompt-lookup rounds alike)
    are the target's final hidden states at the positions before them, from a plain forward of the committed
    text."""
    target, drafter = pair
    prompt = prompts(VOCAB, 1, seed=9, min_len=4, max_len=4)[0]
    reads, read = [], TreeDrafter.read

    def spy(self, tokens, features):
        reads.append(([list(t) for t in tokens], [f.clone() for f in features]))
        return read(self, tokens, features)

    monkeypatch.setattr(TreeDrafter, "read", spy)
    result = generate(target, drafter, prompt, max_new_tokens=20, tree=tree, lookup_tokens=lookup)
    text = result.tokens
    with torch.no_grad():
        states = target.model(input_ids=text).last_hidden_state[0]
    position = prompt.shape[1]  # where the first committed token sits
    read_so_far = []
    for tokens, features in reads:
        (row_tokens,), (row_features,) = tokens, features
        start = position + len(read_so_far)
        assert row_tokens == text[0, start:start + len(row_tokens)].tolist()
        torch.testing.assert_close(row_features, states[start - 1:start - 1 + len(row_tokens)], atol=1e-4, rtol=1e-4)
        read_so_far += row_tokens
    assert len(reads) >= 3 and len(read_so_far) >= 3


def test_sampling_and_lossy_verifiers_run_and_a_batch_row_draws_as_alone(pair):
    target, drafter = pair
    batch = prompts(VOCAB, 3, seed=2, min_len=2, max_len=6)
    rows = [p[0].tolist() for p in batch]
    together = generate(target, drafter, rows, max_new_tokens=12, tree="2,1", temperature=0.9, top_k=8, seed=3)
    for b, prompt in enumerate(rows):
        alone = generate(target, drafter, [prompt], max_new_tokens=12, tree="2,1", temperature=0.9, top_k=8,
                         seed=3 + b)
        assert together.rows[b].tokens.tolist() == alone.rows[0].tokens.tolist()
    lossy = generate(target, drafter, batch[0], max_new_tokens=12, tree="3,2,1", verifier="topk")
    assert lossy.stats.new_tokens == 12 and not lossy.stats.lossless
    greedy = generate(target, drafter, batch[0], max_new_tokens=16, tree="none", lookup_tokens=4)
    assert torch.equal(greedy.tokens, hf_greedy(target, batch[0], 16))
    with pytest.raises(ValueError, match="reads the target takes tree shapes"):
        generate(target, drafter, batch[0], max_new_tokens=4, tree="1,1,1", prompt_lookup=True)
    wider = tiny_llama(vocab=VOCAB, hidden=48)
    with pytest.raises(ValueError, match="trained for another target"):
        generate(wider, drafter, batch[0], max_new_tokens=4, tree="2,1")


def test_a_drafter_reading_its_own_states_says_so_and_the_engine_refuses_it(pair, tmp_path):
    """drafted_features 'own' (EAGLE) is a property of the checkpoint: it survives a save and load, `step` and
    `extend` hand back the final-norm states it reads, an external drafter cannot have it, and tree drafting (which
    feeds drafted tokens the stand-in) refuses such a drafter rather than feed it what it was not trained on."""
    target, drafter = pair
    own = target_aware(target)
    own.config.drafted_features = "own"
    own.save_pretrained(tmp_path / "own")
    again = load_drafter(tmp_path / "own")
    assert again.config.drafted_features == "own" and load_drafter_config(tmp_path / "own") == "own"
    assert "drafted_features" not in (drafter.config.to_hf_dict())  # the stand-in: the default, not written
    ids = torch.randint(0, VOCAB, (2, 4))
    state = own.allocate_state(2)
    logits, hidden = own.extend(ids, state, last_only=True, with_hidden=True)
    assert hidden.shape == (2, HIDDEN) and torch.equal(logits, own._head(hidden))
    logits, hidden = own.step(ids[:, 0], state, hidden, with_hidden=True)
    assert hidden.shape == (2, HIDDEN) and torch.equal(logits, own._head(hidden))
    with pytest.raises(ValueError, match="tree drafting feeds them the stand-in"):
        TreeDrafter(again, 8, VOCAB)
    with pytest.raises(ValueError, match="for a drafter that reads the target"):
        MambaConfig(arch="mamba2", d_model=HIDDEN, n_layer=1, vocab_size=VOCAB, headdim=16, drafted_features="own")


def load_drafter_config(path) -> str:
    import json

    return json.loads((path / "config.json").read_text())["drafted_features"]
