"""Static verify path (TargetCache(static=True)): a preallocated KV cache written at fixed slots and compacted in
place, one fixed input shape per (rows, tree size). Greedy output through it equals the target's own `generate`, for
one prompt and a batch; its logits, hidden states and committed slots equal the dynamic cache's (and re-encoding)
after every commit, across tree sizes, ragged per-row paths, dropped rows and re-prefills; capacity and models it
cannot serve are refused in one line before any forward; `for_call` keeps one on the model while it fits; torch.compile
of its forward gives the same tokens."""
import importlib
import time

import pytest
import torch

from mamba_draft.targets.cache import TargetCache, use_static
from mamba_draft.targets.facts import UnsupportedTargetError, static_cache_refusal
from mamba_draft.tree import Tree, TreeConfig
from tests.helpers.tree_models import aligned_drafter, encoded_cache, hf_greedy, prompts, tiny_causal_lm
from tests.test_batch_target import left_pad
from tree_search.bandit import DEFAULT_ARMS
from tree_search.generate import generate, generate_autoregressive

KINDS = ["llama", "neox", "qwen2", "mistral"]
CLOSE = dict(atol=1e-5, rtol=1e-4)
cache_module = importlib.import_module("mamba_draft.targets.cache")


def target(kind: str, attn: str = "sdpa"):
    model = tiny_causal_lm(kind, sliding_window=256) if kind == "mistral" else tiny_causal_lm(kind)
    model.set_attn_implementation(attn)
    return model


def static_targets(monkeypatch, max_len: int, forward=None) -> list[TargetCache]:
    """Make generate build static target caches (it asks `TargetCache.for_call`, which is dynamic on a CPU); returns
    them. The max_len generate asks for must fit the one given here."""
    built = []

    def for_call(cls, model, max_len: int, graphs: bool = True, kept=None, **_):
        assert max_len <= room, (max_len, room)
        state = cls(model, static=True, max_len=room)
        if forward is not None:
            state.forward = forward
        built.append(state)
        return state

    room = max_len
    monkeypatch.setattr(TargetCache, "for_call", classmethod(for_call))
    return built


# ------------------------------------------------------------------------------------------ through generate


@pytest.mark.parametrize("kind, attn", [(k, "sdpa") for k in KINDS] + [("llama", "eager"), ("neox", "eager")])
def test_greedy_generate_through_the_static_cache_equals_the_targets_own(tmp_path, monkeypatch, kind, attn):
    model = target(kind, attn)
    drafter = aligned_drafter(tmp_path, model)
    built = static_targets(monkeypatch, max_len=12 + 30 + max(a.num_nodes for a in DEFAULT_ARMS) + 1)
    cases = prompts(64, 3, seed=5)
    references = [hf_greedy(model, prompt, 30) for prompt in cases]
    for prompt, reference in zip(cases, references):
        for tree in ("3,2,1", "bandit"):  # one shape; several sizes (and "none": static decode) in one cache
            assert torch.equal(generate(model, drafter, prompt, max_new_tokens=30, tree=tree).tokens, reference)
        assert torch.equal(generate_autoregressive(model, prompt, max_new_tokens=30).tokens, reference)
    # a left-padded batch: ragged paths per row in the static storage, rows dropped as they reach an EOS
    eos = int(references[0][0, cases[0].shape[1] + 9])
    batch = [p[0].tolist() for p in cases]
    expected = [hf_greedy(model, p, 30, eos_token_id=eos)[0, p.shape[1]:].tolist() for p in cases]
    assert len({len(e) for e in expected}) > 1  # rows end in different rounds
    runs = {"speculative": lambda: generate(model, drafter, batch, max_new_tokens=30, tree="3,2,1", eos_token_id=eos),
            "plain": lambda: generate_autoregressive(model, batch, max_new_tokens=30, eos_token_id=eos)}
    for name, run in runs.items():
        assert run().new_tokens == expected, name
        assert built[-1].batch_size < 3, name  # finished rows left the static cache (drop_rows)
    assert len(built) == 3 * 3 + 2 and all(state.static for state in built)


# ------------------------------------------------------------------------------------------ one prompt


@pytest.mark.parametrize("kind", KINDS)
def test_static_slots_equal_reencoding_after_every_commit(kind):
    """One prompt (a batch of one): trees of three sizes in turn, root-only decodes, a re-prefill of a shorter
    prompt into the same cache: logits and hidden states equal the dynamic cache's, committed slots equal
    re-encoding."""
    model = target(kind)
    torch.manual_seed(0)
    trees = [TreeConfig((2, 2, 2)).build(), TreeConfig((3, 1)).build(), Tree((-1,))]
    state = TargetCache(model, static=True, max_len=64)
    for prompt_len in (9, 4):
        prompt = torch.randint(0, 64, (1, prompt_len))
        dynamic = TargetCache(model, static=False)
        for s in (state, dynamic):
            s.prefill(prompt[:, :-1])
        committed, root = prompt[:, :-1], prompt[0, -1]
        for round_ in range(7):
            tree = trees[round_ % 3]
            tokens = torch.cat([root.view(1), torch.randint(0, 64, (len(tree) - 1,))])[None]
            logits, hidden = state.tree_forward(tokens, tree, want_hidden=True)
            want_logits, want_hidden = dynamic.tree_forward(tokens, tree, want_hidden=True)
            torch.testing.assert_close(logits, want_logits, **CLOSE)
            torch.testing.assert_close(hidden, want_hidden, **CLOSE)
            leaves = tree.leaf_paths
            path = list(leaves[round_ % len(leaves)][: 1 + round_ % 3]) if len(tree) > 1 else []
            for s in (state, dynamic):
                s.commit([path])
            committed = torch.cat([committed, tokens[0, [0] + path].view(1, -1)], dim=1)
            assert state.slots == dynamic.slots == committed.shape[1]
            assert state.positions.tolist() == [committed.shape[1]] and bool(state.valid.all())
            for ours, ref in zip(state.cache.layers, encoded_cache(model, committed).layers, strict=True):
                assert ours.keys.shape[2] == 64  # preallocated, never grown
                torch.testing.assert_close(ours.keys[:, :, : state.slots], ref.keys, **CLOSE)
                torch.testing.assert_close(ours.values[:, :, : state.slots], ref.values, **CLOSE)
            root = torch.randint(0, 64, ())


# ------------------------------------------------------------------------------------------ a batch


def assert_rows_hold_the_same_keys(static: TargetCache, dynamic: TargetCache) -> None:
    """Row by row, the static cache's valid slots hold the dynamic cache's valid slots (the dynamic one drops the
    columns no row uses when rows go, so the slots are compared through each row's validity)."""
    assert static.batch_size == dynamic.batch_size
    assert static.positions.tolist() == dynamic.positions.tolist()
    for row in range(static.batch_size):
        mine, theirs = static.valid[row].nonzero().flatten(), dynamic.valid[row].nonzero().flatten()
        assert mine.numel() == theirs.numel() == int(static.positions[row])
        for a, b in zip(static.cache.layers, dynamic.cache.layers, strict=True):
            torch.testing.assert_close(a.keys[row][:, mine], b.keys[row][:, theirs], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(a.values[row][:, mine], b.values[row][:, theirs], atol=1e-6, rtol=1e-5)


# Trees used in turn: branching trees (paths move down), a chain (paths from node 1 move nothing), a chain that
# forks at its last level (node 4: some rows move, others do not), root-only rounds (decodes).
BATCH_TREES = [TreeConfig((2, 2, 1)).build(), TreeConfig((1, 1, 1)).build(), Tree((-1, 0, 1, 2, 2)),
               TreeConfig((3, 1)).build(), Tree((-1,))]


def ragged_paths(tree: Tree, rows: int, round_: int) -> list[list[int]]:
    """A different accepted path per row: [] for one, a prefix of some leaf path of varying length for the others."""
    if len(tree) == 1:
        return [[] for _ in range(rows)]
    leaves = tree.leaf_paths
    paths = []
    for b in range(rows):
        pick = (round_ + 2 * b) % (len(leaves) + 1)
        paths.append([] if pick == len(leaves) else list(leaves[pick][: 1 + (round_ + b) % tree.depth]))
    return paths


@pytest.mark.parametrize("kind, attn", [(k, "sdpa") for k in KINDS] + [("llama", "eager"), ("neox", "eager")])
def test_static_batches_equal_the_dynamic_cache_through_ragged_rounds_and_dropped_rows(kind, attn):
    """Left-padded rows of different lengths, every round each row accepting its own path (of another length, or
    none, or a chain that moves nothing), rows dropped between rounds, then a re-prefill of a bigger batch (the
    static storage grows) and of a smaller one into the same cache: in fp32 the static cache's logits, hidden states,
    positions and per-row committed keys equal the dynamic cache's after every round."""
    model = target(kind, attn)
    g = torch.Generator().manual_seed(7)
    state = TargetCache(model, static=True, max_len=80)
    moved = set()
    for lengths, drops in (((6, 2, 9), [[0, 2], [1]]), ((3, 8, 1, 5), [[0, 1, 3]]), ((4, 7), [[1]])):
        rows = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
        ids, mask = left_pad(rows)
        dynamic = TargetCache(model)
        want = dynamic.prefill(ids[:, :-1], mask[:, :-1])
        got = state.prefill(ids[:, :-1], mask[:, :-1])
        assert (got is None) == (want is None) == (ids.shape[1] == 1)
        assert state.batch_size == len(lengths) and state.slots == dynamic.slots == ids.shape[1] - 1
        roots = ids[:, -1]
        for round_ in range(12):
            if round_ in (4, 8) and drops:  # between a commit and the next tree forward
                keep = drops.pop(0)
                for s in (state, dynamic):
                    s.drop_rows(keep)
                roots = roots[keep]
                assert_rows_hold_the_same_keys(state, dynamic)
            tree = BATCH_TREES[round_ % len(BATCH_TREES)]
            tokens = torch.randint(0, 64, (state.batch_size, len(tree)), generator=g)
            tokens[:, 0] = roots
            want_hidden = bool(round_ % 2)
            logits, hidden = state.tree_forward(tokens, tree, want_hidden=want_hidden)
            ref_logits, ref_hidden = dynamic.tree_forward(tokens, tree, want_hidden=want_hidden)
            assert logits.shape == (state.batch_size, len(tree), 64)
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
            if want_hidden:
                torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
            else:
                assert hidden is None and ref_hidden is None
            paths = ragged_paths(tree, state.batch_size, round_)
            moved |= {any(p != list(range(1, len(p) + 1)) for p in paths)}
            for s in (state, dynamic):
                s.commit(paths)
            assert_rows_hold_the_same_keys(state, dynamic)
            roots = logits.argmax(-1)[:, 0]
        assert not drops
    assert moved == {True, False}  # rounds that moved slots and rounds whose paths were all in place
    assert all(layer.keys.shape[:3] == (4, layer.keys.shape[1], 80) for layer in state.cache.layers)


@pytest.mark.parametrize("lengths", [(5,), (5, 1, 3)])
def test_static_decode_matches_the_dynamic_decode(lengths):
    model = target("llama")
    g = torch.Generator().manual_seed(2)
    ids, mask = left_pad([torch.randint(0, 64, (n,), generator=g) for n in lengths])
    states = [TargetCache(model, static=True, max_len=16), TargetCache(model)]
    outs = [[s.prefill(ids, mask)] for s in states]
    for token in (3, 40, 7):
        for s, out in zip(states, outs):
            out.append(s.decode(torch.full((len(lengths),), token)))
    torch.testing.assert_close(torch.stack(outs[0]), torch.stack(outs[1]), **CLOSE)
    assert states[0].slots == states[1].slots == ids.shape[1] + 3
    assert states[0].positions.tolist() == [n + 3 for n in lengths]


# ------------------------------------------------------------------------------------------ refusals


def test_capacity_is_refused_in_one_line_before_any_forward(monkeypatch):
    monkeypatch.setenv("MAMBA_DRAFT_CPU_STEP", "0")  # every forward is the model's own (counted); the step shares _reserve
    model = target("llama")
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    state = TargetCache(model, static=True, max_len=8)
    with pytest.raises(ValueError, match=r"^the static KV cache holds 8 tokens but this forward needs 9: .*max_len"):
        state.prefill(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"needs 9: "):  # the padded width counts, not the longest prompt
        state.prefill(torch.zeros(2, 9, dtype=torch.long), torch.tensor([[0] * 4 + [1] * 5] * 2))
    assert not calls
    state.prefill(torch.zeros(1, 5, dtype=torch.long))
    assert len(calls) == 1
    tree = TreeConfig((2, 2)).build()  # 7 tokens after 5 committed: 12 > 8
    with pytest.raises(ValueError, match=r"needs 12: pass max_len") as err:
        state.tree_forward(torch.zeros(1, len(tree), dtype=torch.long), tree)
    assert "\n" not in str(err.value) and len(calls) == 1 and state.forwards == 1 and state.slots == 5
    with pytest.raises(ValueError, match="commit needs a tree_forward first"):  # the refused forward is not pending
        state.commit([[1]])
    state.tree_forward(torch.zeros(1, 3, dtype=torch.long), Tree((-1, 0, 0)))  # 5 + 3 fits exactly
    assert len(calls) == 2


def test_bad_arguments_and_unservable_models_are_refused_in_one_line():
    llama = target("llama")
    with pytest.raises(ValueError, match="static=True needs max_len"):
        TargetCache(llama, static=True)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_len must be a positive int"):
            TargetCache(llama, static=True, max_len=bad)
    with pytest.raises(ValueError, match="graphs=True needs the static KV cache"):
        TargetCache(llama, static=True, max_len=16, graphs=True)  # CPU
    with pytest.raises(ValueError, match="graphs=True needs the static KV cache"):
        TargetCache(llama, graphs=True)  # dynamic
    windowed = tiny_causal_lm("mistral", sliding_window=32)  # its window keeps 31 tokens
    assert static_cache_refusal(windowed, 31) is None
    with pytest.raises(UnsupportedTargetError, match=r"^MistralForCausalLM's sliding-window layers keep only the "
                                                      r"last 31 tokens, fewer than the 40 slots.*static=False$"):
        TargetCache(windowed, static=True, max_len=40)
    # auto (static=None): static on CUDA where it can serve, and on a CPU for the compiled step; else dynamic
    cuda = torch.device("cuda")
    assert use_static(llama, cuda, None, 40) and use_static(windowed, cuda, None, 31)
    assert not use_static(windowed, cuda, None, 40) and not use_static(llama, cuda, None, None)
    assert not TargetCache(windowed, max_len=40).static and not TargetCache(tiny_causal_lm("neox"), max_len=40).static
    assert TargetCache(llama, max_len=40).step is not None  # CPU, Llama: static storage and the compiled step
    assert TargetCache(windowed, static=True, max_len=31).static


# ------------------------------------------------------------------------------------------ for_call


def test_for_call_reuses_a_kept_static_cache_while_it_fits_and_the_weights_stay(monkeypatch):
    """With the auto rule made to choose static storage here (as it does on CUDA), `for_call` reuses the cache the
    caller kept while it has room and the weights, attention, dtype and device are those it was built for."""
    real = cache_module.use_static
    monkeypatch.setenv("MAMBA_DRAFT_CPU_STEP", "0")  # transformers' forward, as on CUDA (mask conventions differ)
    monkeypatch.setattr(cache_module, "use_static", lambda model, device, static, max_len: real(
        model, torch.device("cuda") if static is None else device, static, max_len))
    model = target("qwen2")

    def reused(max_len, kept, graphs=False):
        return TargetCache.for_call(model, max_len, graphs=graphs, kept=kept)

    first = reused(32, None)
    assert first.static and first.max_len == 32
    assert reused(20, first) is first
    bigger = reused(48, first)
    assert bigger is not first and bigger.max_len == 48
    assert reused(32, bigger) is bigger and reused(32, bigger, graphs=True) is bigger  # graphs are CUDA's
    assert reused(32, None) is not bigger  # nothing kept: a new one
    model.set_attn_implementation("eager")  # another mask convention: a cache built for sdpa is not reused
    eager = reused(20, bigger)
    assert eager is not bigger and eager.style.dtype == torch.float32  # eager: the additive float mask
    assert reused(20, eager) is eager
    model.to(torch.float64)  # new weights: a cache built for the old ones is not reused
    wide = reused(20, eager)
    assert wide is not eager and reused(20, wide) is wide
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # one weight reallocated, same dtype and device
    assert reused(20, wide) is not wide
    assert TargetCache.for_call(target("qwen2"), 20, graphs=False, kept=wide) is not wide  # another model
    # a model the static storage cannot serve gets a fresh dynamic cache, as any model on a CPU does
    windowed = tiny_causal_lm("mistral", sliding_window=32)
    assert TargetCache.for_call(windowed, 31, graphs=False).static
    assert not TargetCache.for_call(windowed, 40, graphs=False).static
    monkeypatch.undo()
    plain = TargetCache.for_call(model, 20)
    assert not plain.static and TargetCache.for_call(model, 20, kept=plain) is not plain  # CPU, fp64: dynamic


def test_for_call_asks_graphs_only_of_static_caches():
    windowed = tiny_causal_lm("mistral", sliding_window=32)
    assert not TargetCache.for_call(windowed, 40, graphs=True).static  # auto: dynamic, graphs not requested
    llama = target("llama")
    state = TargetCache.for_call(llama, 40, graphs=True)  # CPU: static for the compiled step, no graphs
    assert state.static and state.step is not None and not state.use_graphs
    assert TargetCache.for_call(llama, 40, graphs=True, kept=state) is state


# ------------------------------------------------------------------------------------------ compile and graphs


def test_torch_compile_of_the_static_forward_gives_the_same_greedy_tokens(tmp_path, monkeypatch):
    """One fixed shape per tree size: dynamo traces the static forward in one graph (fullgraph), and the
    compiled verify (default mode, CPU) keeps greedy output identical. Skipped where compiling is too slow."""
    model = target("llama")
    drafter = aligned_drafter(tmp_path, model)
    prompt = prompts(64, 1, seed=8)[0]
    reference = hf_greedy(model, prompt, 20)
    # a cache of our own: inductor's on-disk cache is not keyed on ATEN_CPU_CAPABILITY, and a kernel compiled under
    # another setting (scripts/kernel_sweep.sh) segfaults when loaded
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    built = static_targets(monkeypatch, max_len=prompt.shape[1] + 20 + 5, forward=compiled)  # + tree "2,1" + 1
    start = time.perf_counter()
    try:
        tokens = generate(model, drafter, prompt, max_new_tokens=20, tree="2,1", lookup_tokens=0).tokens
    except Exception as err:  # no C++ toolchain for inductor, or similar: not what this test checks
        if "compile" in type(err).__name__.lower() or "Inductor" in str(err)[:200]:
            pytest.skip(f"torch.compile unavailable here: {str(err).splitlines()[0][:120]}")
        raise
    if time.perf_counter() - start > 60:
        pytest.skip("torch.compile took over 60 s on this machine")
    assert torch.equal(tokens, reference) and built[0].forward is compiled


class ReplayInPlace:
    """Stands in for a CUDA graph on CPU: replaying runs the captured body again."""

    def __init__(self, body) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def test_graph_bookkeeping_warmups_are_harmless_and_outputs_are_copied_out(monkeypatch):
    """The graph path's logic without a GPU: capture = two warm-up runs (as `_capture` does) + a replayable body.
    The warm-ups must not disturb the cache (the commit's run with identity moves), outputs come from per-shape
    buffers, and one graph is kept per (rows, size, want_hidden) and per (rows, size) commit: for one prompt, for
    a left-padded batch with ragged paths (growing the storage drops the graphs), and for the rows left after
    drop_rows."""
    def fake_capture(self, body):
        body()
        body()
        return ReplayInPlace(body)

    monkeypatch.setattr(TargetCache, "_capture", fake_capture)
    monkeypatch.setenv("MAMBA_DRAFT_CPU_STEP", "0")  # transformers' forward, which CUDA graphs capture
    model = target("llama")
    g = torch.Generator().manual_seed(3)
    eager, graphed = TargetCache(model, static=True, max_len=64), TargetCache(model, static=True, max_len=64)
    graphed.use_graphs = True  # refused on CPU by the constructor; the fake capture needs no device
    tree = TreeConfig((2, 2, 1)).build()
    for lengths in ((6,), (6, 2, 4)):
        ids, mask = left_pad([torch.randint(0, 64, (n,), generator=g) for n in lengths])
        for s in (eager, graphed):
            s.prefill(ids, mask)
        for i in range(6):
            if i == 3 and len(lengths) > 1:
                for s in (eager, graphed):
                    s.drop_rows([0, 2])
            rows = eager.batch_size
            tokens = torch.randint(0, 64, (rows, len(tree)), generator=g)
            want, want_hidden = eager.tree_forward(tokens, tree, want_hidden=bool(i % 2))
            got, got_hidden = graphed.tree_forward(tokens, tree, want_hidden=bool(i % 2))
            torch.testing.assert_close(got, want, **CLOSE)
            if i % 2:
                torch.testing.assert_close(got_hidden, want_hidden, **CLOSE)
            assert got.data_ptr() == graphed._shapes[(rows, len(tree))].outputs[bool(i % 2)][0].data_ptr()
            leaves = tree.leaf_paths
            paths = [list(leaves[(i + b) % len(leaves)][: 1 + (i + b) % 3]) for b in range(rows)]
            for s in (eager, graphed):
                s.commit(paths)
            assert graphed.positions.tolist() == eager.positions.tolist()
            assert torch.equal(graphed.valid, eager.valid)
            for a, b in zip(eager.cache.layers, graphed.cache.layers, strict=True):
                torch.testing.assert_close(b.keys[:rows, :, : eager.slots], a.keys[:rows, :, : eager.slots], **CLOSE)
                torch.testing.assert_close(b.values[:rows, :, : eager.slots], a.values[:rows, :, : eager.slots],
                                           **CLOSE)
        # one prompt: its shape's graphs; the batch of 3 outgrew the storage, so those went with it (they read the
        # old storage), and the rows left after drop_rows have their own
        assert set(graphed._shapes) == ({(1, len(tree))} if len(lengths) == 1 else {(3, len(tree)), (2, len(tree))})
        for shape in graphed._shapes.values():
            assert shape.graphs.keys() == {False, True, "commit"}
