"""GPT-Neo's local attention layers hide keys by their slot in a forward (modeling_gpt_neo: a fixed band of
window_size slots), not by position, so a tree's siblings (one depth, several slots) and a batch's holes lose keys
once a forward spans more than the window. Within it local attention equals global attention and tree verification
is exact; a generation (one prompt is a batch of one) or a batch that could pass it is refused, the window named,
before any model runs. One row's plain decoding through the cache is HF's own local attention, exact past the
window."""
import pytest
import torch
import transformers

from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.facts import UnsupportedTargetError, local_window, static_cache_refusal, window_capacity
from mamba_draft.tree import Tree
from tests.helpers.tree_models import hf_greedy, random_drafter
from tree_search.generate import generate, generate_autoregressive

VOCAB = 8  # small, so a random drafter's siblings are often accepted (and a wrong sibling's logits show)
WINDOW_ERROR = r"the 8-token local attention window \(window_size\) of GPTNeoForCausalLM"


def tiny_gpt_neo(window: int = 8, seed: int = 3, layers=("global", "local")):
    """A random 2-layer GPT-Neo (one global, one local layer), perturbed so attention matters."""
    torch.manual_seed(seed)
    config = transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=len(layers), num_heads=4, attention_types=[[list(layers), 1]],
        window_size=window, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = transformers.GPTNeoForCausalLM(config)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def neo():
    return tiny_gpt_neo()


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("neo_drafter"), vocab=VOCAB)


def count_forwards(model):
    """A list that gets one entry per forward of `model`, and the hook's handle (remove it when done)."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


def plain_logits(model, sequence) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


def test_the_local_window_is_the_capacity(neo):
    assert local_window(neo) == 8 and window_capacity(neo) == 8
    everywhere_global = tiny_gpt_neo(layers=("global", "global"))
    assert local_window(everywhere_global) is None and window_capacity(everywhere_global) is None


@pytest.mark.parametrize("static", [False, True])
def test_a_tree_forward_is_exact_up_to_the_window_and_not_one_slot_past_it(neo, static):
    """Root + 4 siblings after `cached` tokens: the last sibling sits 3 slots past its depth, so the band reaches
    one of its keys as soon as the forward spans 9 slots (a static cache: as soon as it has 9 slots at all)."""
    tree = Tree((-1, 0, 0, 0, 0))
    for cached, exact in ((3, True), (4, False)):
        torch.manual_seed(cached)
        sequence = torch.randint(0, VOCAB, (cached + len(tree),)).tolist()
        if static:
            if not exact:  # refused: a 9-slot static cache is wrong even for a forward of 8 tokens
                with pytest.raises(UnsupportedTargetError, match=r"^GPTNeoForCausalLM's local attention layers see "
                                                                 r"only the last 8 slots .*9 slots.*static=False$"):
                    TargetCache(neo, static=True, max_len=cached + len(tree))
                continue
            state = TargetCache(neo, static=True, max_len=cached + len(tree))
        else:
            state = TargetCache(neo)
        state.prefill(torch.tensor([sequence[:cached]]))
        logits, _ = state.tree_forward(torch.tensor([sequence[cached:]]), tree)
        errors = [float((logits[0, node] - plain_logits(neo, sequence[: cached + 1] + [sequence[cached + i]
                                                                                    for i in tree.path_to(node)])
                         ).abs().max()) for node in range(len(tree))]  # path_to: the node's path below the root
        if exact:
            assert max(errors) < 1e-5, errors
        else:  # what the refusals below protect against
            assert max(errors[:4]) < 1e-5 and errors[4] > 1e-2, errors
    assert static_cache_refusal(neo, 8) is None


@pytest.mark.parametrize("window, prompt_len, tree, new", [
    (8, 1, "3", 4), (8, 2, "2,1", 2), (8, 1, "1,1", 5),  # prompt + new + tree nodes == the window
    (16, 3, "4", 9), (16, 2, "3,2", 5), (16, 1, "2,2", 9),
])
def test_greedy_tree_generation_within_the_window_equals_the_targets_generate(drafter, window, prompt_len, tree, new):
    target = tiny_gpt_neo(window)
    for seed in range(3):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        ours = generate(target, drafter, prompt, max_new_tokens=new, tree=tree, lookup_tokens=0).tokens
        reference = hf_greedy(target, prompt, new)
        assert torch.equal(ours, reference), (seed, ours, reference)


def test_generation_past_the_window_is_refused_before_any_forward(neo, drafter):
    """This prompt and tree gave token 5 where the target's own generate gives 3 (new token 5) before the refusal."""
    prompt = torch.tensor([[5, 3, 4]])
    forwards, hook = count_forwards(neo)
    with pytest.raises(ValueError, match=r"^the padded prompts \(3\) \+ max_new_tokens \(12\) \+ tree nodes \(4\) "
                                         r"exceed " + WINDOW_ERROR + r", whose local layers hide keys by their slot"):
        generate(neo, drafter, prompt, max_new_tokens=12, tree="4")
    with pytest.raises(ValueError, match=r"\+ tree nodes \(4\) exceed " + WINDOW_ERROR):
        generate(neo, drafter, prompt, max_new_tokens=2, tree="4", lookup_tokens=0)  # one token past the window
    # plain decoding is refused past the window too: generation checks one prompt as a batch of one (the padded
    # width + max_new_tokens + tree nodes, 0 here, within every window the target has)
    with pytest.raises(ValueError, match=r"^the padded prompts \(3\) \+ max_new_tokens \(12\) \+ tree nodes \(0\) "
                                         r"exceed " + WINDOW_ERROR):
        generate_autoregressive(neo, prompt, max_new_tokens=12)
    hook.remove()
    assert not forwards
    assert torch.equal(generate_autoregressive(neo, prompt, max_new_tokens=5).tokens, hf_greedy(neo, prompt, 5))


def test_one_rows_plain_decoding_past_the_window_is_hfs_own_local_attention(neo):
    """No tree, no sibling, no hole: one row's slots are its positions, so the band hides exactly what HF's own
    local attention hides, past the window too (the cache itself refuses nothing here)."""
    prompt = torch.tensor([[5, 3, 4]])
    reference = hf_greedy(neo, prompt, 12)[0, 3:].tolist()
    state = TargetCache(neo)
    logits = state.prefill(prompt)
    out = []
    for _ in range(12):
        out.append(int(logits[0].argmax()))
        logits = state.decode(torch.tensor(out[-1:]))
    assert out == reference and state.slots == 3 + 12 > 8


def test_batch_holes_use_window_slots(neo):
    """Row 0 accepts whole chains, row 1 nothing: row 1's own sequence stays within the window, but the holes its
    shorter paths leave push the shared slots past it, and the band then hides keys row 1 still sees."""
    chain = Tree((-1, 0, 1))
    torch.manual_seed(0)
    state = TargetCache(neo)
    committed = [[1], [2]]
    state.prefill(torch.tensor(committed))
    errors = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, len(chain)))
        logits, _ = state.tree_forward(tokens, chain)
        errors.append(max(float((logits[1, node] - plain_logits(neo, committed[1] + tokens[1, : node + 1].tolist())
                                 ).abs().max()) for node in range(len(chain))))
        state.commit([[1, 2], []])
        committed = [committed[0] + tokens[0].tolist(), committed[1] + tokens[1, :1].tolist()]
    assert len(committed[1]) == 4  # row 1's third forward: 3 committed + a 3-token chain, within the window
    assert errors[0] < 1e-5 and errors[1] < 1e-5 and errors[2] > 1e-2, errors  # slots 7 + 3 > 8 in the third round


def test_batches_past_the_window_are_refused_before_any_forward(neo, drafter):
    forwards, hook = count_forwards(neo)
    # within the simple bound (2 + 3 + 2 <= 8), but rounds may add 3 slots each (the holes above): 2 + 2 * 3 + 2
    with pytest.raises(ValueError, match=r"^a batch of 2 prompts may need 10 slots .* exceed " + WINDOW_ERROR):
        generate(neo, drafter, [[1, 2], [3, 4]], max_new_tokens=3, tree="1,1")
    with pytest.raises(ValueError, match=r"padded prompts \(2\) \+ max_new_tokens \(7\) \+ tree nodes \(0\) exceed "
                                         + WINDOW_ERROR):
        generate_autoregressive(neo, [[1, 2], [3]], max_new_tokens=7)
    hook.remove()
    assert not forwards


def test_batches_within_the_window_equal_the_targets_generate(drafter):
    neo16 = tiny_gpt_neo(16)
    prompts = [[5, 3], [4]]
    result = generate(neo16, drafter, prompts, max_new_tokens=7, tree="2")  # 2 + 6 * 2 + 2 = 16 slots
    for row, prompt in zip(result.rows, prompts):
        assert torch.equal(row.tokens, hf_greedy(neo16, torch.tensor([prompt]), 7))
    neo8 = tiny_gpt_neo(8)
    # one row leaves no holes: its slots are its sequence (2 + 4 + 2 <= 8)
    result = generate(neo8, drafter, [[5, 3]], max_new_tokens=4, tree="1,1")
    assert torch.equal(result.rows[0].tokens, hf_greedy(neo8, torch.tensor([[5, 3]]), 4))
