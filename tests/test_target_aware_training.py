"""A drafter that reads the target (model.target_hidden_size): simulated draft windows, the features training feeds
it, per-depth acceptance, and a tiny run from make-data --hidden to a drafter loaded for inference."""
from __future__ import annotations

import json
import math

import pytest
import torch

from mamba_draft import MambaConfig, MambaDrafter
from tests.helpers.training_fixtures import REPO
from tests.test_engine_training import engine_dir  # noqa: F401  (the module-scoped make-data --hidden fixture)
from training.agreement import DepthAcceptance, chain_roots, depth_acceptance, draft_ranks, tree_tau
from training.config import load_config
from training.data import IGNORE_INDEX
from training.engine_data import EngineExample
from training.target_features import fed_features, known_rows, window_generator, window_mask


# ------------------------------------------------------------------------------------------- draft windows

def reference_windows(reply: torch.Tensor, k: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """window_mask's definition, one root at a time, on the same draws."""
    opens = torch.rand(reply.shape, generator=generator) < rate
    length = torch.randint(1, k, reply.shape, generator=generator)
    covered = torch.zeros_like(reply)
    for b, r in zip(*torch.nonzero(opens & reply, as_tuple=True)):
        for j in range(1, int(length[b, r]) + 1):
            if r + j >= reply.shape[1] or not reply[b, r + j]:
                break
            covered[b, r + j] = True
    return covered


def test_windows_follow_their_definition_and_rate_and_never_reach_prompt_rows():
    torch.manual_seed(0)
    reply = torch.ones(3, 4000, dtype=torch.bool)
    reply[:, :50] = False                # a prompt
    reply[1, 2000:2100] = False          # the next packed reply's prompt
    reply[2, ::7] = False                # scattered: windows stop at the first row that is not a reply row
    for k, rate in [(5, 0.15), (2, 0.5), (3, 1.0)]:
        mask = window_mask(reply, k, rate, window_generator(0, 0, 7, 1))
        torch.testing.assert_close(mask, reference_windows(reply, k, rate, window_generator(0, 0, 7, 1)))
        assert not (mask & ~reply).any()  # prompt rows keep their meaning: always the stand-in, never "windowed"
    # no boundaries: a row is outside every window with probability prod_j (1 - rate * P(length >= j))
    free = torch.ones(8, 20000, dtype=torch.bool)
    mask = window_mask(free, 5, 0.15, window_generator(3, 0, 1, 0))
    expected = 1 - math.prod(1 - 0.15 * (5 - j) / 4 for j in range(1, 5))
    assert abs(mask.float().mean().item() - expected) < 0.01, (mask.float().mean(), expected)
    # windows are 1..K-1 long: runs of covered rows at a low rate (windows rarely touch) are 1..4, each about as often
    mask = window_mask(free, 5, 0.02, window_generator(3, 0, 2, 0))[0].tolist()
    runs, run = [], 0
    for covered in mask + [False]:
        if covered:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    counts = [runs.count(n) for n in range(1, 5)]
    assert min(counts) > 0.6 * max(counts) and sum(counts) > 0.9 * len(runs), (counts, len(runs))
    assert not mask[0]  # row 0 has no root before it


def test_windows_are_a_function_of_the_step_and_off_when_asked():
    reply = torch.ones(2, 300, dtype=torch.bool)
    a = window_mask(reply, 5, 0.15, window_generator(0, 0, 10, 0))
    assert torch.equal(a, window_mask(reply, 5, 0.15, window_generator(0, 0, 10, 0)))  # a resumed step: the same
    for other in [(1, 0, 10, 0), (0, 1, 10, 0), (0, 0, 11, 0), (0, 0, 10, 1)]:  # seed, rank, step, micro-batch
        assert not torch.equal(a, window_mask(reply, 5, 0.15, window_generator(*other)))
    assert not window_mask(reply, 0, 0.15, window_generator(0, 0, 1, 0)).any()
    assert not window_mask(reply, 5, 0.0, window_generator(0, 0, 1, 0)).any()
    with pytest.raises(ValueError, match="0 \\(off\\) or >= 2"):
        window_mask(reply, 1, 0.15, window_generator(0, 0, 1, 0))
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        window_mask(reply, 5, 1.5, window_generator(0, 0, 1, 0))


def test_known_rows_are_reply_rows_outside_windows_and_the_stand_in_gets_their_gradient():
    from training.model import TrainableDrafter
    import transformers

    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, 8]])
    windows = torch.tensor([[False, False, False, True, True, False]])
    assert known_rows(labels, windows).tolist() == [[False, False, True, False, False, True]]
    assert known_rows(labels).tolist() == [[False, False, True, True, True, True]]

    config = transformers.Mamba2Config(vocab_size=16, hidden_size=16, num_hidden_layers=1, state_size=4, expand=2,
                                       head_dim=8, num_heads=4, n_groups=1, target_hidden_size=8)
    model = TrainableDrafter(config)
    assert model.reads_target and model.hf_config.target_hidden_size == 8
    hidden = torch.randn(1, 6, 8)
    fed = fed_features(hidden, known_rows(labels, windows), model.backbone.stand_in)
    assert torch.equal(fed[0, [2, 5]], hidden[0, [2, 5]])
    assert (fed[0, [0, 1, 3, 4]] == model.backbone.stand_in).all()
    out = model(input_ids=torch.tensor([[1, 2, 5, 6, 7, 8]]), features=hidden, known=known_rows(labels, windows))
    out.logits.float().pow(2).mean().backward()
    assert model.backbone.stand_in.grad is not None and model.backbone.stand_in.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="pass features too"):
        model(input_ids=torch.tensor([[1, 2]]), known=torch.ones(1, 2, dtype=torch.bool))


def test_own_rows_read_the_drafters_state_at_the_row_before_from_a_first_pass(monkeypatch):
    """drafted_features 'own' (EAGLE): window rows read the drafter's final-norm state at the row before, from a
    pass without gradients on the same features (window rows on the stand-in); everything else as with the
    stand-in, and the gradient flows through the second pass only."""
    from training.model import TrainableDrafter
    from training.target_features import own_features
    import transformers

    hidden, features = torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    own = torch.tensor([[False, True, True, False]])
    fed = own_features(features, own, hidden)
    assert torch.equal(fed[0, 1], hidden[0, 0]) and torch.equal(fed[0, 2], hidden[0, 1])
    assert torch.equal(fed[0, [0, 3]], features[0, [0, 3]])
    with pytest.raises(ValueError, match="row 0"):
        own_features(features, torch.tensor([[True, False, False, False]]), hidden)

    config = transformers.Mamba2Config(vocab_size=16, hidden_size=8, num_hidden_layers=1, state_size=4, expand=2,
                                       head_dim=8, num_heads=2, n_groups=1, target_hidden_size=8)
    model = TrainableDrafter(config)
    with torch.no_grad():
        model.backbone.fuse.weight.normal_(0, 0.5)  # the state half is zero at init: make the states matter
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, 8]])
    windows = torch.tensor([[False, False, False, True, True, False]])
    ids, states = torch.tensor([[1, 2, 5, 6, 7, 8]]), torch.randn(1, 6, 8)
    calls = []
    forward = TrainableDrafter.train_forward
    monkeypatch.setattr(TrainableDrafter, "train_forward", lambda self, i, f=None: calls.append(
        (f.detach().clone(), torch.is_grad_enabled())) or forward(self, i, f))
    out = model(input_ids=ids, features=states, known=known_rows(labels, windows), own=windows)
    (first, first_grad), (second, second_grad) = calls
    assert not first_grad and second_grad
    assert torch.equal(first, fed_features(states, known_rows(labels, windows), model.backbone.stand_in))
    with torch.no_grad():
        first_hidden = forward(model, ids, first)[1]
    torch.testing.assert_close(second[0, [3, 4]], first_hidden[0, [2, 3]])
    assert torch.equal(second[~windows], first[~windows])
    out.logits.float().pow(2).mean().backward()
    assert model.backbone.fuse.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------- acceptance per depth

def greedy_reply(prompt: list[int], reply: list[int], width: int = 0, seed: int = 0) -> EngineExample:
    """An EngineExample of a greedy reply: the cached top-1 of every reply row is its token."""
    ids = torch.tensor(prompt + reply)
    labels = torch.tensor([IGNORE_INDEX] * len(prompt) + reply)
    soft_ids = torch.zeros(ids.numel(), 20, dtype=torch.int32)
    soft_ids[len(prompt):, 0] = torch.tensor(reply, dtype=torch.int32)
    hidden = None
    if width:
        hidden = torch.zeros(ids.numel(), width, dtype=torch.bfloat16)
        hidden[len(prompt):] = torch.randn(len(reply), width, generator=torch.Generator().manual_seed(seed))
    return EngineExample(ids, labels, soft_ids, torch.zeros(ids.numel(), 20, dtype=torch.float16), hidden)


def tiny_drafter(vocab: int, width: int = 0, seed: int = 0) -> MambaDrafter:
    torch.manual_seed(seed)
    config = MambaConfig(arch="mamba2", d_model=16, n_layer=1, vocab_size=vocab, d_state=4, expand=2, headdim=8,
                         tie_embeddings=False, target_hidden_size=width)
    drafter = MambaDrafter(config, backend="torch")
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.5)
    return drafter.eval()


def successor_drafter(vocab: int, width: int = 0) -> MambaDrafter:
    """A drafter whose prediction is the successor (id + 1 mod vocab) of the token it read: its mixer adds nothing,
    the embedding is one-hot, the head scores id j by the one-hot of j - 1, the fusion ignores the target state."""
    drafter = tiny_drafter(vocab, width)
    with torch.no_grad():
        for layer in drafter.backbone.layers:
            layer.mixer.out_proj.weight.zero_()
        eye = torch.eye(vocab, 16)
        drafter.backbone.embeddings.weight.copy_(eye)
        drafter.lm_head.weight.copy_(eye.roll(1, dims=0))
        drafter.backbone.norm_f.weight.fill_(1.0)
        if width:
            drafter.backbone.fuse.weight.copy_(torch.cat([torch.eye(16), torch.zeros(16, width)], dim=1))
    return drafter


@pytest.mark.parametrize("width", [0, 8])
def test_a_drafter_predicting_the_datas_next_token_is_accepted_at_every_depth(width):
    vocab = 12
    examples = [greedy_reply([3, 4, 5], [(s + i) % vocab for i in range(40)], width, seed=s) for s in range(4)]
    stats = depth_acceptance(successor_drafter(vocab, width), examples, roots_per_reply=10)
    assert stats.roots == 40 and stats.rates == [1.0] * 5 and stats.tau == 6.0
    assert stats.as_dict("heldout_") == {"heldout_depth1": 1.0, "heldout_depth2": 1.0, "heldout_depth3": 1.0,
                                         "heldout_depth4": 1.0, "heldout_depth5": 1.0, "heldout_chain_tau": 6.0,
                                         "heldout_depth_roots": 40}
    # a draft vocabulary without the ids 5..7: the chains through them stop there
    drafter = successor_drafter(vocab, width)
    drafter.set_draft_vocab(torch.tensor([i for i in range(vocab) if i not in (5, 6, 7)]))
    assert depth_acceptance(drafter, examples, roots_per_reply=40).rates[4] < 0.5


@pytest.mark.parametrize("width", [0, 8])
def test_a_random_drafter_is_accepted_about_one_time_in_the_vocabulary(width):
    vocab = 8
    g = torch.Generator().manual_seed(1)
    examples = [greedy_reply([1, 2], torch.randint(0, vocab, (300,), generator=g).tolist(), width, seed=s)
                for s in range(12)]
    stats = depth_acceptance(tiny_drafter(vocab, width), examples, roots_per_reply=300)
    assert stats.roots == 12 * (300 - 5)
    assert abs(stats.rates[0] - 1 / vocab) < 0.03 and stats.rates[1] < 0.05, stats.rates


@pytest.mark.parametrize("drafted", ["stand_in", "own"])
def test_depth_acceptance_is_greedy_drafting_from_real_states_then_the_stand_in(drafted):
    """Against a brute-force reference: for every root, the whole prefix and the drafts so far in one train_forward,
    features the cached states on reply rows up to the root and the stand-in on the prompt; on the drafts the
    stand-in, or (drafted_features 'own') the drafter's own final-norm state at the row that drafted each."""
    vocab, width = 6, 16
    g = torch.Generator().manual_seed(2)
    drafter = tiny_drafter(vocab, width, seed=3)
    drafter.config.drafted_features = drafted
    with torch.no_grad():
        drafter.backbone.stand_in.normal_(0, 1.0)
    examples = [greedy_reply([1, 2, 3], torch.randint(0, vocab, (30,), generator=g).tolist(), width, seed=s)
                for s in range(3)]
    want = DepthAcceptance()
    for e in examples:
        reply = e.labels != IGNORE_INDEX
        accepted = [0] * 5
        roots = chain_roots(e, 5).tolist()
        assert roots == list(range(3, e.input_ids.numel() - 5))  # every reply row with 5 rows after it
        for root in roots:
            ids = e.input_ids[:root + 1].tolist()
            features = [e.hidden[t].float() if reply[t] else drafter.backbone.stand_in.detach()
                        for t in range(root + 1)]
            alive = True
            for d in range(1, 6):
                with torch.no_grad():
                    logits, state = drafter.train_forward(torch.tensor([ids]), torch.stack(features)[None])
                draft = int(logits[0, -1].argmax())
                alive = alive and draft == int(e.soft_ids[root + d, 0])
                accepted[d - 1] += alive
                ids.append(draft)
                features.append(state[0, -1] if drafted == "own" else drafter.backbone.stand_in.detach())
        want = want + DepthAcceptance(len(roots), tuple(accepted))
    got = depth_acceptance(drafter, examples, roots_per_reply=100)
    assert got == want and got.accepted[0] > 0, (got, want)


@pytest.mark.parametrize("draft_vocab", [None, [0, 1, 2, 3, 5]])
def test_tree_tau_walks_the_tree_greedy_verification_accepts(draft_vocab):
    """Against a brute-force walk: from each root, the node greedy verification has reached offers the drafter's top
    branching[d] tokens (of its draft vocabulary) given the committed prefix; the walk goes one level deeper while
    the target's token is among them. A chain of ones is the chain's τ."""
    vocab, width = 6, 16
    g = torch.Generator().manual_seed(4)
    drafter = tiny_drafter(vocab, width, seed=5)
    with torch.no_grad():
        drafter.backbone.stand_in.normal_(0, 1.0)
    if draft_vocab is not None:
        drafter.set_draft_vocab(torch.tensor(draft_vocab))
    examples = [greedy_reply([1, 2], torch.randint(0, vocab, (25,), generator=g).tolist(), width, seed=s)
                for s in range(3)]
    ranks = draft_ranks(drafter, examples, roots_per_reply=100)
    assert tree_tau(ranks, (1,) * 5) == pytest.approx(DepthAcceptance.from_ranks(ranks).tau)
    assert DepthAcceptance.from_ranks(ranks) == depth_acceptance(drafter, examples, roots_per_reply=100)
    ids_of = torch.tensor(draft_vocab) if draft_vocab is not None else torch.arange(vocab)
    for shape in [(2, 1), (3, 2, 2, 1, 1), (2, 2, 1), (6, 6)]:
        total, roots = 0.0, 0
        for e in examples:
            reply = e.labels != IGNORE_INDEX
            for root in chain_roots(e, 5).tolist():
                ids = e.input_ids[:root + 1].tolist()
                features = [e.hidden[t].float() if reply[t] else drafter.backbone.stand_in.detach()
                            for t in range(root + 1)]
                roots += 1
                for d, w in enumerate(shape, 1):
                    with torch.no_grad():
                        logits, _ = drafter.train_forward(torch.tensor([ids]), torch.stack(features)[None])
                    children = ids_of[logits[0, -1].topk(min(w, ids_of.numel())).indices].tolist()
                    token = int(e.soft_ids[root + d, 0])
                    if token not in children:
                        break
                    total += 1
                    ids.append(token)
                    features.append(drafter.backbone.stand_in.detach())
        assert tree_tau(ranks, shape) == pytest.approx(1 + total / roots), shape
    if draft_vocab is not None:  # the id outside the draft vocabulary is never among the children
        assert tree_tau(ranks, (6, 6)) < 3
    with pytest.raises(ValueError, match="depth 6"):
        tree_tau(ranks, (1,) * 6)


def test_chain_roots_need_the_greedy_path_and_room_for_the_chain():
    e = greedy_reply([1, 2], [3, 4, 5, 6, 7, 8, 9])
    assert chain_roots(e, 5).tolist() == [2, 3]  # rows 2..8 are the reply; a root needs 5 reply rows after it
    e.soft_ids[5, 0] = 0  # row 5's token is not the target's greedy choice (a sampled reply): no chain through it
    assert chain_roots(e, 5).tolist() == []
    assert chain_roots(e, 2).tolist() == [2, 3, 5, 6]  # from root 4 a chain of 2 would draft after row 5's token


# ------------------------------------------------------------------------------------------ configuration

def tiny_overrides(out, target, tmp_path, *extra) -> list[str]:
    return [f"model.tokenizer={target}", f"output_dir={tmp_path / 'run'}", "data.kind=engine", f"data.path={out}",
            "data.seq_len=32", "deepspeed=configs/deepspeed/zero1.json", "model.arch=mamba2", "model.head_dim=16",
            *extra]


def test_bad_target_reading_configs_fail_in_one_line(engine_dir, tmp_path):
    from training.train import train

    out, target, _ = engine_dir
    tiny = REPO / "configs" / "tiny" / "distill-cpu.yaml"
    cases = [
        ([f"model.tokenizer={target}", f"output_dir={tmp_path / 'r'}", "model.target_hidden_size=32"],
         "needs data.kind: engine"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=48"),
         r"\(model.target_hidden_size\).*another width"),
        (tiny_overrides(out, target, tmp_path, "distill.draft_windows=5"), "needs model.target_hidden_size > 0"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "distill.draft_windows=1"),
         "0 \\(off\\) or K >= 2"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "distill.draft_windows=3",
                        "distill.window_rate=2"), "window_rate must lie in"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "model.arch=llama"), "Mamba drafter"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "model.hidden_size=16",
                        "distill.feature_weight=1"), "must equal model.target_hidden_size"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "model.hidden_size=32",
                        "model.drafted_features=own", "distill.draft_windows=3"), "distill.feature_weight > 0"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "model.drafted_features=eagle"),
         "must be one of"),
        (tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32", "eval.every=2",
                        f"eval.data={REPO / 'tests/fixtures/training/sharegpt.json'}", f"distill.target={target}"),
         "eval.data must be a make-data directory"),
    ]
    for overrides, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            train(load_config(tiny, overrides))
        assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_fresh_fusion_starts_as_the_external_drafter_with_states_at_the_embeddings_scale(engine_dir, tmp_path):
    """The identity on the token, zero on the state, and `feature_norm` at the embedding's RMS: the first forward is
    the external drafter's whatever the states, and the states' half of the fusion trains at the tokens' scale."""
    from training.model import build_model
    from training.regenerate import target_tokenizer

    out, target, _ = engine_dir
    tiny = REPO / "configs" / "tiny" / "distill-cpu.yaml"
    cfg = load_config(tiny, tiny_overrides(out, target, tmp_path, "model.target_hidden_size=32",
                                           f"model.init_embeddings_from={target}", "model.hidden_size=32"))
    model = build_model(cfg.model, target_tokenizer(str(target)), seed=0)
    embedding = model.get_input_embeddings().weight.detach()
    norm = model.backbone.feature_norm.weight.detach()
    torch.testing.assert_close(norm, torch.full_like(norm, float(embedding.pow(2).mean().sqrt())))
    ids = torch.randint(0, embedding.shape[0], (1, 8))
    torch.testing.assert_close(model.train_forward(ids, 20 * torch.randn(1, 8, 32))[0], model.train_forward(ids)[0])


# --------------------------------------------------------------------------------------------- end to end

def test_a_target_aware_drafter_trains_on_the_engines_pattern_and_loads_for_inference(engine_dir, tmp_path,
                                                                                     monkeypatch, capsys):
    """make-data --hidden -> training with draft windows (features spied) -> lean export -> load_drafter."""
    import transformers

    from mamba_draft.commands.cli import main as cli
    from mamba_draft import load_drafter
    from training import train as train_mod
    from training.agreement import engine_depth_acceptance
    from training.export import export
    from training.model import TrainableDrafter

    out, target, _ = engine_dir
    seen, fed = [], []
    compute_loss, train_forward = train_mod.compute_loss, TrainableDrafter.train_forward

    def spy_loss(engine, target_model, batch, *args, **kwargs):
        seen.append({k: v.detach().clone() for k, v in batch.items()}
                    | {"stand_in": engine.module.backbone.stand_in.detach().clone()})
        return compute_loss(engine, target_model, batch, *args, **kwargs)

    def spy_forward(self, input_ids, features=None):
        if self.training:
            fed.append(features.detach().clone())
        return train_forward(self, input_ids, features)

    monkeypatch.setattr(train_mod, "compute_loss", spy_loss)
    monkeypatch.setattr(TrainableDrafter, "train_forward", spy_forward)
    steps = 30
    cfg = load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", tiny_overrides(
        out, target, tmp_path, f"steps={steps}", "optim.lr=1e-2", "model.target_hidden_size=32",
        f"model.init_embeddings_from={target}", "model.freeze_embeddings=true", "model.tie_word_embeddings=true",
        "model.draft_vocab_size=64", "distill.draft_windows=4", "distill.window_rate=0.3",
        f"eval.data={out}", f"eval.every={steps}"))
    run = train_mod.train(cfg)

    assert len(seen) == len(fed) == steps * 2  # two micro-batches a step
    windowed = 0
    for batch, features in zip(seen, fed):
        reply = batch["labels"] != IGNORE_INDEX
        windows = batch["windows"]
        assert not (windows & ~reply).any()
        known = reply & ~windows
        assert torch.equal(features[known], batch["hidden"][known])  # the cached target states
        assert (features[~known] == batch["stand_in"]).all()  # prompt rows and windows: the stand-in
        windowed += int(windows.sum())
    assert windowed > 0.1 * sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in seen)
    assert not torch.equal(seen[0]["stand_in"], seen[-1]["stand_in"])  # the stand-in trains

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.2, losses
    final = records[-1]
    assert {f"heldout_depth{d}" for d in range(1, 6)} <= set(final) and final["heldout_depth_roots"] > 0
    assert final["heldout_depth1"] >= final["heldout_depth5"] and final["heldout_chain_tau"] >= 1
    assert json.loads((run / "model" / "config.json").read_text())["target_hidden_size"] == 32

    embedding = transformers.AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight
    lean = export(run, tmp_path / "lean", lean_target=str(target))
    drafter = load_drafter(lean, embedding=embedding)
    assert drafter.reads_target and drafter.config.target_hidden_size == 32 and drafter.draft_ids.numel() == 64
    whole = export(run, tmp_path / "whole")
    # the script's acceptance of the export is the training's last held-out evaluation (same replies, same roots)
    again = engine_depth_acceptance(str(whole), str(out))
    assert all(again[f"depth{d}"] == pytest.approx(final[f"heldout_depth{d}"]) for d in range(1, 6))
    import shutil  # a directory of make-data directories: the union of theirs
    for name in ("a", "b"):
        shutil.copytree(out, tmp_path / "both" / name)
    twice = engine_depth_acceptance(str(whole), str(tmp_path / "both"))
    assert twice["replies"] == 2 * again["replies"] and twice["depth_roots"] == 2 * again["depth_roots"]
    capsys.readouterr()
    assert cli(["eval", str(whole), "--depths", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == {f"depths:{out.name}": again}
    with pytest.raises(ValueError, match="no mamba_ssm form"):
        export(run, tmp_path / "ssm", format="mamba_ssm")

    # `mamba-draft eval --agreement` on a chat file: the target's head input from its own forward before each scored
    # token (the replies file is ShareGPT-shaped), the stand-in before the others
    from training.agreement import drafter_agreement

    calls = []
    monkeypatch.setattr(MambaDrafter, "train_forward",
                        lambda self, ids, features=None: calls.append((ids, features, self.backbone.stand_in.clone()))
                        or train_forward(self, ids, features))
    result = drafter_agreement(str(whole), str(target), str(out / "replies-T0.jsonl"), max_sequences=3)
    assert result["sequences"] == 3 and 0 <= result["agreement"] <= 1 and len(calls) == 1
    ids, features, stand_in = calls[0]
    with torch.no_grad():
        states = transformers.AutoModelForCausalLM.from_pretrained(target).model(input_ids=ids).last_hidden_state
    real = ~(features == stand_in).all(-1)
    assert real.sum() > 20 and not real[:, 0].any()
    torch.testing.assert_close(features[:, 1:][real[:, 1:]], states[:, :-1][real[:, 1:]])


def test_a_drafter_reading_its_own_states_trains_with_them_in_its_windows(engine_dir, tmp_path, monkeypatch):
    """model.drafted_features own: each micro-batch runs a first pass without gradients, then the trained pass whose
    window rows read the first pass's states at the rows before; the run's config says which kind it is."""
    from training import train as train_mod
    from training.model import TrainableDrafter

    out, target, _ = engine_dir
    passes = []
    train_forward = TrainableDrafter.train_forward

    def spy_forward(self, input_ids, features=None):
        result = train_forward(self, input_ids, features)
        if self.training:
            passes.append((features.detach().clone(), result[1].detach().clone(), torch.is_grad_enabled()))
        return result

    monkeypatch.setattr(TrainableDrafter, "train_forward", spy_forward)
    steps = 3
    cfg = load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", tiny_overrides(
        out, target, tmp_path, f"steps={steps}", "model.target_hidden_size=32", "model.hidden_size=32",
        "model.drafted_features=own", "distill.feature_weight=1", "distill.draft_windows=4",
        "distill.window_rate=0.3"))
    run = train_mod.train(cfg)
    assert len(passes) == steps * 2 * 2  # two micro-batches a step, two passes each
    own_rows = 0
    for (first, states, first_grad), (second, _, second_grad) in zip(passes[::2], passes[1::2]):
        assert not first_grad and second_grad
        changed = (second != first).any(-1)  # the window rows: the first pass's state at the row before
        before = torch.cat([states[:, :1], states[:, :-1]], dim=1)
        torch.testing.assert_close(second[changed], before[changed].to(second.dtype))
        own_rows += int(changed.sum())
    assert own_rows > 0
    assert json.loads((run / "model" / "config.json").read_text())["drafted_features"] == "own"
