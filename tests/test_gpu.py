"""GPU checks, skipped without CUDA: run them all with `python -m pytest -q tests/test_gpu.py` on a CUDA machine.

- the kernel steps (mamba-ssm + causal-conv1d, and our fused Triton step; each skipped when not importable) against
  the torch step;
- CUDA-graph replay of tree drafting against eager drafting (mamba_draft/graphs.py), shared pool and output lifetime;
- graphs dropped and lossless output after the drafter's `.to(dtype)` / backend switch;
- the target's static verify path (mamba_draft/targets/cache.py, `TargetCache(static=True)`): captured graphs and
  torch.compile(mode="reduce-overhead") against the eager static path, for one prompt and a left-padded batch with
  ragged paths and dropped rows, and lossless generate through the graphs (the cache kept on the model);
- greedy generate at batch 1 and 8, fp32 and bf16, token-identical to the target's own greedy `generate`;
- no host sync inside captured drafting or a captured verify + commit;
- make-data's hook records top-K and hidden rows on CUDA as on CPU.

`scripts/gpu_check.sh` runs this file and the timings (`mamba_draft/benchmarks/gpu_timings.py`) on a GPU machine.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mamba_draft.benchmarks.gpu_timings import host_syncs
from mamba_draft.graphs import StepRunner
from mamba_draft.kernels import kernels_available
from mamba_draft.targets.cache import TargetCache
from mamba_draft.tree import Tree, TreeConfig
from tests.helpers.tree_models import aligned_drafter, hf_greedy, prompts, random_drafter, tiny_causal_lm, tiny_llama
from tests.test_graph_runner import GREEDY, VOCAB, tiny_drafter, walk
from tree_search.tree_drafter import TreeDrafter
from tree_search.generate import SpeculativeDecoder, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="mamba-ssm / causal-conv1d not importable")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")
BACKENDS = ["torch", pytest.param("kernels", marks=needs_kernels), pytest.param("fused", marks=needs_triton)]


def steps(drafter, tokens=(5, 9, 33, 2, 60, 11, 40, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill 3 tokens on 2 rows, then step the rest; all logits stacked, and the final SSM state."""
    state = drafter.allocate_state(2)
    prompt = torch.tensor([list(tokens[:3]), list(tokens[:3])[::-1]], device="cuda")
    out = [drafter.prefill(prompt, state=state)[0]]
    for t in tokens[3:]:
        out.append(drafter.step(torch.tensor([t, (t * 5) % VOCAB], device="cuda"), state))
    return torch.stack(out), state.ssm


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("arch, dt_limit", [("mamba1", None), ("mamba2", None), ("mamba2", (0.05, 0.2))])
def test_kernel_step_matches_torch_step(arch, dt_limit, backend):
    drafter = tiny_drafter(arch, dt_limit or (0.0, math.inf)).to("cuda")
    drafter.set_backend("torch")
    want_logits, want_state = steps(drafter)
    drafter.set_backend(backend)
    got_logits, got_state = steps(drafter)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_state, want_state, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replay_equals_eager_tree_drafting(tmp_path, backend):
    drafter = random_drafter(tmp_path, vocab=VOCAB).to("cuda")
    drafter.set_backend(backend)
    configs = [TreeConfig((3, 2, 1)), TreeConfig((3, 1, 1)), TreeConfig((1, 1, 1, 1))]
    eager = TreeDrafter(drafter, 16, VOCAB)
    eager.runner.use_graphs = False
    graphed = TreeDrafter(drafter, 16, VOCAB)
    assert graphed.runner.use_graphs  # on by default on CUDA
    want, got = walk(eager, configs), walk(graphed, configs)
    for a, b in zip(want, got):
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # one per (start, stop, fork), as tests/test_graph_runner.py counts them with fake graphs
    assert sorted(graphed.runner.graphs) == sorted({(1, 4, True), (4, 10, True), (4, 7, True), (1, 2, True),
                                                    (2, 3, True), (3, 4, True), (0, 1, True), (10, 11, True),
                                                    (7, 8, True)})
    assert graphed.runner.pool is not None


def test_graph_outputs_survive_replays_of_other_rows(tmp_path):
    """All graphs share one pool; each copies its logits out to the runner's buffer, so another graph's replay
    cannot overwrite them."""
    drafter = random_drafter(tmp_path, vocab=VOCAB).to("cuda")
    state = drafter.allocate_state(12)
    drafter.prefill(torch.tensor([[5, 9, 2]], device="cuda"), state=state)
    reference = state.clone()
    runner = StepRunner(drafter, state)
    cuda = dict(device="cuda")
    level = runner.run(1, 4, torch.tensor([3, 4, 5], **cuda), torch.tensor([0, 0, 0], **cuda))
    kept = level.clone()
    for _ in range(2):  # capture, then replay
        runner.run(4, 8, torch.tensor([1, 2, 3, 4], **cuda), torch.tensor([1, 1, 2, 3], **cuda))
        runner.run(0, 1, torch.tensor([9], **cuda))
    assert torch.equal(level, kept)
    reference.gather_(1, torch.tensor([0, 0, 0], **cuda))
    torch.testing.assert_close(kept, drafter.step(torch.tensor([3, 4, 5], **cuda), reference.rows(1, 4)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_graphs_are_dropped_after_to_dtype_and_output_stays_lossless(tmp_path, dtype):
    target = tiny_llama(vocab=VOCAB, seed=4).to("cuda")
    drafter = aligned_drafter(tmp_path, target).to("cuda")  # aligned_drafter shrinks the target's layers first
    prompt = torch.tensor([[3, 14, 15, 9, 2]], device="cuda")
    reference = hf_greedy(target, prompt, 24)
    first, decoder = None, SpeculativeDecoder(target, drafter, tree="3,2,1", verifier="greedy")
    for step_dtype in (torch.float32, dtype):
        drafter.to(step_dtype)
        result = decoder.generate(prompt, max_new_tokens=24, temperature=0.0)
        assert torch.equal(result.tokens, reference)
        drafts = decoder.drafts
        assert drafts.runner.graphs and drafts.state.conv.dtype == step_dtype
        if first is None:
            first = drafts
    assert drafts is not first and first.runner.graphs == {} and first.runner.pool is None


@needs_kernels
def test_backend_switch_drops_the_graphs(tmp_path):
    drafter = random_drafter(tmp_path, vocab=VOCAB).to("cuda")
    drafter.set_backend("torch")
    first = TreeDrafter.reuse(None, drafter, 8, VOCAB)
    first.draft(TreeConfig((2, 2)), first.roots[:1], first.prefill(torch.tensor([[1, 2]], device="cuda")),
                GREEDY, "topk", False, None)
    assert first.runner.graphs
    drafter.set_backend("kernels")
    second = TreeDrafter.reuse(first, drafter, 8, VOCAB)
    assert second is not first and first.runner.graphs == {}


def _left_padded(lengths, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of these lengths, left-padded (pads hold token 7) -> ids, mask (B, L) on CUDA."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 7)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:], mask[b, width - n:] = torch.randint(0, VOCAB, (n,), generator=g), 1
    return ids.to("cuda"), mask.to("cuda")


def _static_rounds(state, ids: torch.Tensor, mask: torch.Tensor, rounds) -> list[torch.Tensor]:
    """Prefill, then rounds: (tokens, tree, paths) = tree forward (with hidden states every other one) + commit of
    each row's path, or ("drop", keep) = drop_rows. Returns every output (cloned: graph outputs are rewritten by the
    next replay) and each row's committed K slots."""
    outs = [state.prefill(ids, mask).clone()]
    forwards = 0
    for item in rounds:
        if item[0] == "drop":
            state.drop_rows(item[1])
            continue
        tokens, tree, paths = item
        logits, hidden = state.tree_forward(tokens[: state.batch_size], tree, want_hidden=bool(forwards % 2))
        outs += [logits.clone()] + ([hidden.clone()] if hidden is not None else [])
        state.commit(paths[: state.batch_size])
        forwards += 1
    slots = [row.nonzero().flatten() for row in state.valid]
    outs += [layer.keys[row][:, index].clone() for layer in state.cache.layers for row, index in enumerate(slots)]
    return outs


def _random_rounds(count: int, rows: int = 1, seed: int = 0, drop_at: int | None = None):
    """Trees of three sizes in turn (16, 7 and 1 nodes), each row accepting a path of its own length; ("drop",
    [0, rows - 1]) before round `drop_at`."""
    g = torch.Generator().manual_seed(seed)
    trees = [TreeConfig((3, 2, 1)).build(), TreeConfig((2, 2)).build(), Tree((-1,))]
    rounds = []
    for i in range(count):
        if i == drop_at:
            rounds.append(("drop", [0, rows - 1]))
        tree = trees[i % 3]
        leaves = tree.leaf_paths
        paths = [list(leaves[(i + b) % len(leaves)][: 1 + (i + b) % 2]) if len(tree) > 1 else [] for b in range(rows)]
        rounds.append((torch.randint(0, VOCAB, (rows, len(tree)), generator=g).to("cuda"), tree, paths))
    return rounds


@pytest.mark.parametrize("kind", ["llama", "neox", "qwen2"])
def test_static_verify_graphs_equal_eager_and_stay_lossless(tmp_path, kind):
    """TargetCache(static=True, graphs=True): one captured forward per (rows, tree size, want_hidden) and one commit
    per (rows, tree size), replayed with the same outputs and cache as the eager static path, for one prompt and for
    a left-padded batch of 3 with ragged paths and a row dropped; generate through it (the cache a decoder keeps)
    stays token-identical to the target's own greedy generate."""
    target = tiny_causal_lm(kind, vocab=VOCAB).to("cuda")
    drafter = aligned_drafter(tmp_path, target).to("cuda")
    prompt = torch.tensor([[3, 14, 15, 9, 2]], device="cuda")
    cases = [((prompt, torch.ones_like(prompt)), _random_rounds(9), {(1, 16), (1, 7), (1, 1)}),
             (_left_padded((5, 2, 7), seed=1), _random_rounds(9, rows=3, seed=2, drop_at=5),
              {(3, 16), (3, 7), (3, 1), (2, 16), (2, 7), (2, 1)})]
    for (ids, mask), rounds, shapes in cases:
        eager = _static_rounds(TargetCache(target, static=True, max_len=64), ids, mask, rounds)
        graphed_state = TargetCache(target, static=True, max_len=64, graphs=True)
        graphed = _static_rounds(graphed_state, ids, mask, rounds)
        for want, got in zip(eager, graphed, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert set(graphed_state._shapes) == shapes
        big = graphed_state._shapes[(ids.shape[0], 16)]
        assert big.graphs.keys() == {False, True, "commit"}
    reference = hf_greedy(target, prompt, 24)
    decoders = [SpeculativeDecoder(target, drafter, tree=tree) for tree in ("3,2,1", "2,2,1", "none")]
    for decoder in decoders:  # the decoder's own cache: static and captured on CUDA
        assert torch.equal(decoder.generate(prompt, max_new_tokens=24).tokens, reference)
    state = decoders[0].static_cache
    assert state.static and state.use_graphs
    assert (1, 16) in state._shapes and state._shapes[(1, 16)].graphs
    assert (1, 11) in decoders[1].static_cache._shapes and (1, 1) in decoders[2].static_cache._shapes
    assert torch.equal(decoders[0].generate(prompt, max_new_tokens=24).tokens, reference)
    assert decoders[0].static_cache is state  # reused while it has room
    assert TargetCache.for_call(target, state.max_len, kept=state) is state


def test_static_verify_compiled_with_reduce_overhead_equals_eager():
    """The static forward has one shape per (rows, tree size), so torch.compile(mode="reduce-overhead") captures it
    (CUDA graphs via cudagraph trees) and gives the eager static path's outputs. One graph per shape and per
    rows-in-use (an int the cache layers hold): more than dynamo's default 8 recompiles of one frame (H200,
    torch 2.11: "recompile limit exceeded"), so the limit is raised to what the shapes need."""
    target = tiny_causal_lm("llama", vocab=VOCAB).to("cuda")
    prompt = torch.tensor([[3, 14, 15, 9, 2]], device="cuda")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        for (ids, mask), rounds in (((prompt, torch.ones_like(prompt)), _random_rounds(9, seed=1)),
                                    (_left_padded((5, 2, 7), seed=3), _random_rounds(9, rows=3, seed=4))):
            eager = _static_rounds(TargetCache(target, static=True, max_len=64), ids, mask, rounds)
            compiled = TargetCache(target, static=True, max_len=64)
            compiled.forward = torch.compile(target, mode="reduce-overhead", fullgraph=True, dynamic=False)
            for want, got in zip(eager, _static_rounds(compiled, ids, mask, rounds), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_batch_1_and_8_equal_the_targets_generate(tmp_path, kind, dtype):
    target = tiny_causal_lm(kind, vocab=VOCAB)
    drafter = aligned_drafter(tmp_path, target)
    target, drafter = target.to("cuda", dtype), drafter.to("cuda", dtype)
    rows = [p.to("cuda") for p in prompts(VOCAB, 8, seed=3, min_len=3)]
    references = [hf_greedy(target, p, 24) for p in rows]
    one = generate(target, drafter, rows[0], max_new_tokens=24, tree="3,2,1", temperature=0.0)
    assert torch.equal(one.tokens, references[0])
    batch = generate(target, drafter, [p[0].tolist() for p in rows], max_new_tokens=24, tree="3,2,1",
                     temperature=0.0)
    for b, (row, reference) in enumerate(zip(batch.rows, references, strict=True)):
        assert torch.equal(row.tokens, reference), f"row {b} diverged"


def test_captured_drafting_and_verification_make_no_host_sync(tmp_path):
    """Once captured, drafting a tree (graph replays per level) and verifying + committing it (static cache,
    captured forward and commit) never wait for the device: the round's only sync is reading its verdict."""
    target = tiny_llama(vocab=VOCAB).to("cuda")
    drafter = aligned_drafter(tmp_path, target).to("cuda")
    config = TreeConfig((3, 2, 1))
    drafts = TreeDrafter(drafter, len(config.build()), VOCAB)
    prompt = torch.tensor([[3, 14, 15, 9, 2]], device="cuda")
    logits = drafts.prefill(prompt)
    draft = lambda: drafts.draft(config, drafts.roots[:1], logits, GREEDY, "topk", False, None)  # noqa: E731
    draft()  # captures
    assert host_syncs(draft) == []
    tree = config.build()
    for rows, paths in ((1, [[1, 4]]), (3, [[1, 4], [], [2]])):  # one prompt; ragged paths in a batch
        state = TargetCache(target, static=True, max_len=64, graphs=True)
        state.prefill(prompt.expand(rows, -1))
        tokens = torch.randint(0, VOCAB, (rows, len(tree)), device="cuda")

        def verify():
            state.tree_forward(tokens, tree)
            state.commit(paths)

        verify()  # captures
        assert host_syncs(verify) == [], rows


def test_make_data_records_rows_on_cuda_like_on_cpu(tmp_path):
    """make-data --hidden on CUDA: the generating forward's hook records every reply's top-K and hidden rows (the
    static-cache forward transformers would compile, and CUDA-graph, runs eager while it records), equal to the
    CPU run's up to float noise."""
    import json

    from mamba_draft.commands import cli
    from tests.helpers.training_fixtures import CHATML, tiny_chat_target
    from training import make_data as md

    target = tmp_path / "target"
    tiny_chat_target(target, CHATML)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about topic number {i}."}) for i in range(6)))
    outs = {}
    for device in ("cuda", "cpu"):
        outs[device] = tmp_path / device
        args = cli.build_parser("make-data").parse_args(
            ["--target", str(target), "--out", str(outs[device]), "--prompts", str(prompts), "--max-new-tokens", "12",
             "--dtype", "float32", "--device", device, "--temperatures", "0", "--hidden"])
        md.make_data(args, progress=False)
    gpu, cpu = (md.read_shard(md.reply_path(outs[d], 0.0)) for d in ("cuda", "cpu"))
    assert len(gpu) == 6 and all(r["topk"] is not None for r in gpu)  # recorded by the hook, not filled in after
    matched = 0
    for g, c in zip(sorted(gpu, key=lambda r: r["id"]), sorted(cpu, key=lambda r: r["id"]), strict=True):
        if g["reply_ids"] != c["reply_ids"]:  # a near-tie may flip a greedy token between devices
            continue
        matched += 1
        (ids, logp), (want_ids, want_logp) = md.read_topk(outs["cuda"], 0.0, g), md.read_topk(outs["cpu"], 0.0, c)
        assert torch.equal(ids[:, 0], want_ids[:, 0])
        torch.testing.assert_close(logp[:, 0], want_logp[:, 0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(md.read_hidden(outs["cuda"], 0.0, g, 32).float(),
                                   md.read_hidden(outs["cpu"], 0.0, c, 32).float(), atol=0.02, rtol=0.02)
    assert matched >= 4


def test_a_generate_round_waits_for_the_device_once(tmp_path):
    """Past the call's own checks and prefill, a round's only host sync is reading its verdict: a longer call adds
    at most one sync per extra round (the accepted rows go back to the device from pinned memory, non-blocking)."""
    target = tiny_llama(vocab=VOCAB).to("cuda")
    drafter = aligned_drafter(tmp_path, target).to("cuda")
    prompt = torch.tensor([[3, 14, 15, 9, 2]], device="cuda")

    def syncs_and_rounds(tokens: int) -> tuple[int, int]:
        rounds = []

        def call():
            rounds.append(generate(target, drafter, prompt, max_new_tokens=tokens, tree="3,2,1",
                                   temperature=0.0).stats.rounds)
        call()  # captures
        return len(host_syncs(call)), rounds[-1]

    (short_syncs, short_rounds), (long_syncs, long_rounds) = syncs_and_rounds(16), syncs_and_rounds(48)
    assert long_rounds > short_rounds
    assert long_syncs - short_syncs <= long_rounds - short_rounds, (short_syncs, short_rounds, long_syncs, long_rounds)
