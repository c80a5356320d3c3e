"""Transformer drafters (any HF causal LM behind the drafter interface) in the same tree engine as Mamba drafters:
the KV state's rows equal the model's own forward, greedy output is the target's own at batch 1 and in batches,
lossy verifiers and the bandit run, commands load either kind (lossless sampling with either kind:
tests/test_batch_generate.py's first-two-token law)."""
import copy

import pytest
import torch

from mamba_draft import load_drafter
from mamba_draft import transformer as transformer_module
from mamba_draft.drafter import Drafter, DraftState
from mamba_draft.transformer import TransformerDrafter
from tests.helpers.drafters import lean_drafter
from tests.helpers.tree_models import aligned_drafter, hf_greedy, random_drafter, tiny_llama, tiny_neox
from tree_search import UCBBandit
from tree_search.plan import check_drafter_room
from tree_search.generate import generate

VOCAB = 64
NEW = 30


def one_layer_copy(target) -> TransformerDrafter:
    """A Transformer drafter that mostly agrees with `target`: its first layer, its embedding and head."""
    model = copy.deepcopy(target)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return TransformerDrafter(model)


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_rows_equal_the_models_own_forward(kind, monkeypatch):
    """Rows of different lengths prefill, step and fork independently; the cache grows past its first capacity."""
    monkeypatch.setattr(transformer_module, "INITIAL_SLOTS", 8)
    model = (tiny_llama if kind == "llama" else tiny_neox)(vocab=VOCAB)
    if kind == "neox":
        model.config._attn_implementation = "eager"  # the additive-mask path
    drafter = TransformerDrafter(model)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    assert torch.allclose(drafter(ids), ref, atol=1e-5)
    state = drafter.allocate_state(6)
    first, _ = drafter.prefill(ids[:1, :5], state.rows(0, 1))
    second, _ = drafter.prefill(ids[1:, :11], state.rows(1, 2))
    assert torch.allclose(first[0], ref[0, 4], atol=1e-5) and torch.allclose(second[0], ref[1, 10], atol=1e-5)
    stepped = drafter.step(torch.stack([ids[0, 5], ids[1, 11]]), state.rows(0, 2))
    assert torch.allclose(stepped, torch.stack([ref[0, 5], ref[1, 11]]), atol=1e-5)
    state.gather_(3, torch.tensor([1, 0]))  # fork (rows swapped), then extend the copies past 8 slots
    block = drafter.extend(torch.stack([ids[1, 12:20], ids[0, 6:14]]), state.rows(3, 5))
    assert torch.allclose(block[0], ref[1, 12:20], atol=1e-5) and torch.allclose(block[1], ref[0, 6:14], atol=1e-5)
    assert state.lengths.tolist() == [6, 12, 0, 20, 14, 0]
    assert state.store.capacity >= 20
    # the originals were not touched by their copies' steps
    again = drafter.step(torch.stack([ids[0, 6], ids[1, 12]]), state.rows(0, 2))
    assert torch.allclose(again, torch.stack([ref[0, 6], ref[1, 12]]), atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=VOCAB)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 1, 10, 3)]
    refs = [hf_greedy(target, torch.tensor([p]), NEW) for p in prompts]
    return target, one_layer_copy(target), prompts, refs


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1", "bandit"])
def test_greedy_is_the_targets_own_at_batch_one_and_in_batches(pair, tree):
    target, drafter, prompts, refs = pair
    for prompt, ref in zip(prompts, refs):
        result = generate(target, drafter, torch.tensor([prompt]), max_new_tokens=NEW, tree=tree)
        assert torch.equal(result.tokens, ref)
    batch = generate(target, drafter, prompts, max_new_tokens=NEW, tree=tree)
    for row, ref in zip(batch.rows, refs):
        assert torch.equal(row.tokens, ref)


def test_the_target_as_its_own_drafter_accepts_every_token(pair):
    """A drafter equal to the target is always right: every round commits the whole chain plus the bonus, which
    holds only if every fork, step and resync keeps each row's cache exactly its committed sequence."""
    target, _, prompts, refs = pair
    drafter = TransformerDrafter(copy.deepcopy(target))
    result = generate(target, drafter, torch.tensor([prompts[2]]), max_new_tokens=NEW, tree="1,1,1,1")
    assert torch.equal(result.tokens, refs[2])
    assert result.stats.accepted_lengths[:-1] == [5] * (len(result.stats.accepted_lengths) - 1)
    batch = generate(target, drafter, prompts, max_new_tokens=NEW, tree="2,2,1")
    for row, ref in zip(batch.rows, refs):
        assert torch.equal(row.tokens, ref) and row.stats.accepted_lengths[:-1] == [4] * (row.stats.rounds - 1)


def test_both_kinds_run_the_same_rounds(pair, tmp_path):
    """An aligned drafter of either kind accepts more than one token per round on the same target."""
    target, _, prompts, _ = pair
    shrunk = copy.deepcopy(target)
    mamba = aligned_drafter(tmp_path, shrunk)  # shrinks `shrunk`'s mixing layers in place, aligned to it
    ref = hf_greedy(shrunk, torch.tensor([prompts[0]]), NEW)
    for drafter in (one_layer_copy(shrunk), mamba):
        result = generate(shrunk, drafter, torch.tensor([prompts[0]]), max_new_tokens=NEW, tree="2,1")
        assert torch.equal(result.tokens, ref) and result.stats.mean_accepted > 1.2


def test_lossy_verifiers_and_the_bandit_take_a_transformer_drafter(pair):
    target, drafter, prompts, refs = pair
    bandit = UCBBandit(arms=("none", "1,1", "3,2,1"), lambda_ucb=2.0)
    result = generate(target, drafter, torch.tensor([prompts[0]]), max_new_tokens=NEW, tree=bandit)
    assert torch.equal(result.tokens, refs[0]) and all(arm["pulls"] for arm in result.stats.arms.values())
    lossy = generate(target, drafter, torch.tensor([prompts[0]]), max_new_tokens=NEW, tree="3,2,1",
                     verifier="topk", verifier_params={"k": 3})
    assert not lossy.stats.lossless and lossy.stats.new_tokens == NEW


def test_memory_check_counts_a_transformer_drafters_context(pair):
    _, drafter, _, _ = pair
    assert drafter.row_bytes(2048) == 2048 * drafter.row_bytes(1) > 0
    with pytest.raises(ValueError, match="drafter state rows"):
        check_drafter_room(drafter, batch=64, tree_rows=64, out_vocab=VOCAB, context=10**9)


def test_load_drafter_picks_the_kind_from_the_checkpoint(pair, tmp_path):
    target, _, prompts, refs = pair
    llama_dir, mamba_dir = tmp_path / "llama", tmp_path / "mamba"
    target.save_pretrained(llama_dir)
    aligned_drafter(mamba_dir, copy.deepcopy(target))
    loaded = load_drafter(llama_dir)
    assert isinstance(loaded, TransformerDrafter)
    assert type(load_drafter(mamba_dir)).__name__ == "MambaDrafter"
    result = generate(target, loaded, torch.tensor([prompts[1]]), max_new_tokens=NEW, tree="2,1")
    assert torch.equal(result.tokens, refs[1])


def test_load_drafter_takes_the_target(tmp_path):
    """target=: the embedding a lean drafter needs, and the default device and dtype (explicit dtype still wins)."""
    target = tiny_llama(vocab=VOCAB)
    weight = target.get_input_embeddings().weight
    lean = lean_drafter(tmp_path / "lean", target)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    drafter = load_drafter(lean, target=target)
    assert (drafter.device, drafter.dtype) == (weight.device, torch.float32)
    assert torch.equal(drafter(ids), load_drafter(lean, embedding=weight)(ids))
    half = copy.deepcopy(target).to(torch.bfloat16)
    drafter = load_drafter(lean, target=half)
    assert drafter.dtype == torch.bfloat16 and drafter.allocate_state(1).ssm.dtype == torch.float32
    assert load_drafter(lean, target=half, dtype=torch.float32).dtype == torch.float32
    target.save_pretrained(tmp_path / "llama")
    assert load_drafter(tmp_path / "llama", target=half).dtype == torch.bfloat16  # a Transformer drafter too
    with pytest.raises(ValueError, match="target= or embedding=, not both"):
        load_drafter(lean, target=target, embedding=weight)


DRAFTER_MEMBERS = ("capturable", "backend", "state_dtype", "draft_ids", "vocab_size", "input_vocab_size", "device",
                   "dtype", "reads_target", "allocate_state", "row_bytes", "prefill", "extend", "step", "forward")
STATE_MEMBERS = ("max_batch", "device", "nbytes", "rows", "gather_", "reset_")


def stub(members: tuple[str, ...], missing: str | None = None) -> object:
    """An object with every one of `members` but `missing` (each a method: enough for a runtime protocol check)."""
    return type("Stub", (), {name: lambda self, *args: None for name in members if name != missing})()


def test_both_kinds_and_their_states_implement_the_protocols(pair, tmp_path):
    _, transformer_drafter, _, _ = pair
    for drafter in (random_drafter(tmp_path, vocab=VOCAB), transformer_drafter):
        state = drafter.allocate_state(2)
        assert isinstance(drafter, Drafter) and not isinstance(drafter, DraftState)
        assert isinstance(state, DraftState) and isinstance(state.rows(0, 1), DraftState)
    assert isinstance(stub(DRAFTER_MEMBERS), Drafter) and isinstance(stub(STATE_MEMBERS), DraftState)
    for name in DRAFTER_MEMBERS:
        assert not isinstance(stub(DRAFTER_MEMBERS, missing=name), Drafter), name
    for name in STATE_MEMBERS:
        assert not isinstance(stub(STATE_MEMBERS, missing=name), DraftState), name


def test_load_drafter_names_a_directory_it_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "nonsense"}')
    with pytest.raises(ValueError, match="neither a Mamba checkpoint nor a causal LM transformers can load"):
        load_drafter(tmp_path)


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_a_draft_vocabulary_scores_its_ids_as_the_model_does(kind):
    """Column j of every prefill / step / block is the full model's logit of draft id j (body, then the draft rows)."""
    model = (tiny_llama if kind == "llama" else tiny_neox)(vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    draft = torch.tensor([7, 0, 63, 12, 5, 30])
    drafter = TransformerDrafter(model, draft)
    assert drafter.vocab_size == 6 and drafter.input_vocab_size == VOCAB
    with torch.no_grad():
        ref = model(ids).logits[..., draft]
    assert torch.allclose(drafter(ids), ref, atol=1e-5)
    last, state = drafter.prefill(ids[:, :5])
    assert torch.allclose(last, ref[:, 4], atol=1e-5)
    assert torch.allclose(drafter.step(ids[:, 5], state), ref[:, 5], atol=1e-5)
    drafter.set_draft_vocab(None)
    assert drafter.vocab_size == VOCAB


def test_greedy_with_a_draft_vocabulary_is_the_targets_own(pair, tmp_path):
    """A Transformer drafter with a draft vocabulary (stored next to its weights, as training writes it) still
    gives the target's own greedy output; the target drafting for itself over every id it emits accepts every token."""
    from safetensors.torch import save_file

    target, drafter, prompts, refs = pair
    draft = torch.arange(0, VOCAB, 2)  # half the ids: proposals of the others never happen
    small = TransformerDrafter(drafter.model, draft)
    for prompt, ref in zip(prompts, refs):
        assert torch.equal(generate(target, small, torch.tensor([prompt]), max_new_tokens=NEW, tree="3,2,1").tokens, ref)
    batch = generate(target, small, prompts, max_new_tokens=NEW, tree="2,1")
    assert all(torch.equal(row.tokens, ref) for row, ref in zip(batch.rows, refs))
    directory = tmp_path / "self"
    target.save_pretrained(directory)
    emitted = torch.unique(torch.cat([torch.tensor(p) for p in prompts] + [r.flatten() for r in refs]))
    save_file({"d2t": emitted.flip(0).contiguous()}, str(directory / "draft_vocab.safetensors"))
    itself = load_drafter(directory)
    assert torch.equal(itself.draft_ids, emitted.flip(0))
    result = generate(target, itself, torch.tensor([prompts[2]]), max_new_tokens=NEW, tree="1,1,1,1")
    assert torch.equal(result.tokens, refs[2])
    assert result.stats.accepted_lengths[:-1] == [5] * (len(result.stats.accepted_lengths) - 1)


def test_a_draft_vocabulary_is_refused_where_logits_are_not_head_times_state(pair):
    target, _, _, _ = pair
    model = copy.deepcopy(target)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        TransformerDrafter(model, torch.arange(8))
    model = copy.deepcopy(target)
    forward = model.forward
    model.forward = lambda *args, **kwargs: type(out := forward(*args, **kwargs))(logits=2 * out.logits)
    with pytest.raises(ValueError, match="not its head applied"):
        TransformerDrafter(model, torch.arange(8))
    with pytest.raises(ValueError, match="distinct"):
        TransformerDrafter(copy.deepcopy(target), torch.tensor([1, 1]))


def test_load_drafter_names_a_bad_stored_draft_vocabulary(pair, tmp_path):
    from safetensors.torch import save_file

    target, _, _, _ = pair
    target.save_pretrained(tmp_path)
    save_file({"d2t": torch.tensor([1, 1, 2])}, str(tmp_path / "draft_vocab.safetensors"))
    with pytest.raises(ValueError, match=r"^\S*draft_vocab.safetensors: draft vocabulary ids must be distinct$"):
        load_drafter(tmp_path)


def test_runs_report_the_drafter_state_memory(pair, tmp_path, monkeypatch):
    """stats.drafter_state_bytes: a Transformer drafter's KV rows grow with the context, a Mamba drafter's state
    does not; a run that never drafts reports 0."""
    monkeypatch.setattr(transformer_module, "INITIAL_SLOTS", 8)
    target, _, prompts, _ = pair
    short, long = torch.tensor([prompts[1]]), torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    for drafter in (one_layer_copy(target), aligned_drafter(tmp_path, copy.deepcopy(target))):
        sizes = [generate(target, drafter, ids, max_new_tokens=8, tree="2,1").stats.drafter_state_bytes
                 for ids in (short, long)]
        assert sizes[0] > 0
        if isinstance(drafter, TransformerDrafter):  # 8 slots per row held the short call; the long one needs > 40
            assert sizes[1] > 5 * sizes[0]
        else:
            assert sizes[1] == sizes[0]
    assert generate(target, one_layer_copy(target), short, max_new_tokens=4, tree="none").stats.drafter_state_bytes == 0
