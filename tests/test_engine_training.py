"""Distillation from the data engine's cached top-K: the loss is the forward KL it stands for, windows carry the
right distribution at every scored position, the iterator resumes exactly, and a drafter trains on it in-process."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.training_fixtures import CHATML, REPO, tiny_chat_target
from training import make_data as md
from training.config import load_config
from training.data import IGNORE_INDEX
from training.engine_data import PackedEngine, load_engine
from training.loss import cached_kl, feature_loss, forward_kl
from training.train import train


def test_cached_kl_is_forward_kl_when_the_cache_holds_the_whole_distribution():
    torch.manual_seed(0)
    B, L, V = 2, 7, 9
    logits, target = torch.randn(B, L, V), 3 * torch.randn(B, L, V)
    labels = torch.randint(0, V, (B, L))
    labels[:, :3] = IGNORE_INDEX
    logp, ids = torch.log_softmax(target, -1).sort(dim=-1, descending=True)
    # row t of the cache is the distribution token t was predicted from: the target's logits at t - 1
    soft_ids = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
    soft_logp = torch.cat([logp[:, :1], logp[:, :-1]], dim=1)
    torch.testing.assert_close(cached_kl(logits, soft_ids, soft_logp, labels), forward_kl(logits, target, labels, V))

    # a draft vocabulary: the cached distribution renormalised over the ids the drafter emits, as forward_kl on the
    # target's logits restricted to them (what distillation with a live target computes)
    draft_ids = torch.tensor([0, 2, 3, 7])
    to_draft = torch.full((V,), IGNORE_INDEX)
    to_draft[draft_ids] = torch.arange(4)
    small = logits[..., :4]
    want = forward_kl(small, target.index_select(-1, draft_ids), labels.clamp(max=3), 4)
    torch.testing.assert_close(cached_kl(small, soft_ids, soft_logp, labels.clamp(max=3), to_draft), want)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """A make-data directory from a tiny random chat target: 10 prompts, greedy and sampled replies."""
    root = tmp_path_factory.mktemp("engine")
    target = root / "target"
    tokenizer, _ = tiny_chat_target(target, CHATML)
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about topic number {i} and why it matters."})
                                 for i in range(10)))
    out = root / "data"
    from mamba_draft.commands import cli
    args = cli.build_parser("make-data").parse_args(["--target", str(target), "--out", str(out), "--prompts",
                                                     str(prompts), "--max-new-tokens", "16", "--dtype", "float32",
                                                     "--hidden"])
    md.make_data(args, progress=False)
    return out, target, tokenizer


def test_windows_carry_each_scored_tokens_distribution_and_resume_exactly(engine_dir):
    out, _, tokenizer = engine_dir
    greedy = load_engine(out, tokenizer, temperatures=[0.0])
    assert len(greedy) == 10 and len(load_engine(out, tokenizer)) == 20
    for e in greedy:  # greedy replies: the cached top-1 at every scored position is the token itself
        scored = e.labels != IGNORE_INDEX
        assert scored.any() and torch.equal(e.soft_ids[scored, 0].long(), e.labels[scored])
    data = PackedEngine(greedy, seq_len=24, seed=1, rank=0, world=1)
    total = sum(e.input_ids.numel() for e in greedy)
    batches = [data.next_batch(3) for _ in range(total // 72 + 2)]  # past an epoch boundary
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (3, 24) and b["soft_ids"].shape == (3, 24, md.TOPK)
        scored = b["labels"] != IGNORE_INDEX
        assert torch.equal(b["soft_ids"][scored][:, 0], b["labels"][scored])
    assert data.epoch >= 1
    state = data.state_dict()
    expected = data.next_batch(2)
    again = PackedEngine(greedy, seq_len=24, seed=1, rank=0, world=1)
    again.load_state_dict(state)
    assert all(torch.equal(expected[k], v) for k, v in again.next_batch(2).items())


def test_cached_hidden_states_are_the_targets_and_sit_beside_its_top_k(engine_dir):
    """make-data --hidden: row j of a reply is the target's final-norm state its top-K row j came from (the head on
    it gives the cached top-1), equal to a teacher-forced forward of the prompt and reply alone."""
    import transformers

    out, target, tokenizer = engine_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    width = model.config.hidden_size
    prompts = {p["id"]: p["prompt"] for p in md.read_shard(out / "prompts.jsonl")}
    for t in (0.0, 0.7):
        records = md.read_shard(md.reply_path(out, t))
        assert md.hidden_path(out, t).stat().st_size == sum(r["topk"][1] for r in records) * width * 2
        for record in records[:4]:
            hidden = md.read_hidden(out, t, record, width)
            ids, _ = md.read_topk(out, t, record)
            prompt = md.prompt_ids(tokenizer, [{"role": "user", "content": prompts[record["id"]]}])
            x = torch.tensor([prompt + record["reply_ids"]])
            with torch.no_grad():
                want = model.model(input_ids=x).last_hidden_state[0, len(prompt) - 1:][: hidden.shape[0]]
                head = model.lm_head(hidden.float())
            torch.testing.assert_close(hidden.float(), want, atol=0.02, rtol=0.02)  # bf16 storage
            assert (head.argmax(-1) == ids[:, 0]).float().mean() > 0.9  # bf16-rounded state: near-ties may flip


def test_hidden_states_resume_after_a_torn_write(engine_dir, tmp_path):
    import shutil

    out, target, tokenizer = engine_dir
    copy = tmp_path / "data"
    shutil.copytree(out, copy)
    path = md.hidden_path(copy, 0.0)
    whole = path.read_bytes()
    first = md.read_shard(md.reply_path(copy, 0.0))[0]["topk"][1] * 2 * 32  # a width-32 target: the first reply
    path.write_bytes(whole[: first + 100])  # killed mid-append: one reply and a torn piece of the next
    from training.regenerate import target_tokenizer
    from mamba_draft.targets import load_causal_lm

    engine = md.Engine(load_causal_lm(target, attn_implementation="grouped"), target_tokenizer(str(target)),
                       md.hf_sample)
    assert engine.model.config.hidden_size == 32
    prompts = {p["id"]: md.prompt_messages(p) for p in md.read_shard(copy / "prompts.jsonl")}
    md.teacher_forced(engine, copy, prompts, 0.0, True, progress=False, on_batch=lambda: None)
    resumed = path.read_bytes()
    assert len(resumed) == len(whole)
    torch.testing.assert_close(torch.frombuffer(bytearray(resumed), dtype=torch.bfloat16).float(),
                               torch.frombuffer(bytearray(whole), dtype=torch.bfloat16).float(), atol=0.02, rtol=0.02)


def test_a_directory_of_make_data_directories_is_their_union(engine_dir, tmp_path):
    import shutil

    from training.engine_data import check_hidden_width

    out, _, tokenizer = engine_dir
    for name in ("a", "b"):
        shutil.copytree(out, tmp_path / "all" / name)
    (tmp_path / "all" / "notes").mkdir()  # not a make-data directory: ignored
    for split in ("train", "heldout"):
        one = load_engine(out, tokenizer, split=split, hidden_size=32)
        both = load_engine(tmp_path / "all", tokenizer, split=split, hidden_size=32)
        assert len(both) == 2 * len(one) and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(both, one * 2))
    check_hidden_width(tmp_path / "all", 32, "width")
    with pytest.raises(ValueError, match="states 32 wide"):
        check_hidden_width(tmp_path / "all", 33, "width")
    with pytest.raises(FileNotFoundError, match="neither a make-data directory"):
        load_engine(tmp_path / "all" / "notes", tokenizer)


def test_replies_made_elsewhere_get_their_rows_from_one_teacher_forced_forward(engine_dir, tmp_path):
    """Replies copied in without their row files (made on a GPU machine), or recorded without spans (transformers'
    compiled decoding on CUDA hides the forward from the hook): a rerun of the same command writes the top-K and
    hidden rows the generating forward would have recorded, aligned with the records, and makes nothing new."""
    import shutil

    out, target, _ = engine_dir
    copy = tmp_path / "data"
    shutil.copytree(out, copy)
    for t in (0.0, 0.7):
        md.topk_path(copy, t).unlink()
        md.hidden_path(copy, t).unlink()
    unrecorded = [dict(r, topk=None) for r in md.read_shard(md.reply_path(copy, 0.7))]
    md.reply_path(copy, 0.7).write_text("".join(json.dumps(r) + "\n" for r in unrecorded))
    from mamba_draft.commands import cli
    prompts = copy.parent / "p.jsonl"
    prompts.write_text((out.parent / "p.jsonl").read_text())
    args = cli.build_parser("make-data").parse_args(["--target", str(target), "--out", str(copy), "--prompts",
                                                     str(prompts), "--max-new-tokens", "16", "--dtype", "float32",
                                                     "--hidden"])
    md.make_data(args, progress=False)
    for t in (0.0, 0.7):
        records = md.read_shard(md.reply_path(copy, t))
        assert records == md.read_shard(md.reply_path(out, t))  # nothing regenerated; the same spans assigned
        assert md.topk_path(copy, t).stat().st_size == md.topk_path(out, t).stat().st_size
        for r in records:
            ids, logp = md.read_topk(copy, t, r)
            want_ids, want_logp = md.read_topk(out, t, r)
            assert (ids[:, 0] == want_ids[:, 0]).float().mean() > 0.95  # a cached decode vs one forward: near-ties
            torch.testing.assert_close(logp[:, 0], want_logp[:, 0], atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(md.read_hidden(copy, t, r, 32).float(), md.read_hidden(out, t, r, 32).float(),
                                       atol=0.02, rtol=0.02)


def test_feature_loss_pairs_the_drafters_state_at_t_with_the_targets_row_t_plus_1():
    torch.manual_seed(0)
    target = torch.randn(2, 6, 8)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 4, 5, 6, 7]] * 2)
    drafter = torch.cat([target[:, 1:], torch.randn(2, 1, 8)], dim=1)  # state t = target row t + 1
    drafter[:, 0] = 100.0  # position 0 predicts an unlabelled token: never scored
    assert feature_loss(drafter, target, labels).item() == 0.0
    assert feature_loss(target, target, labels).item() > 0.1


def test_the_feature_loss_trains_the_drafters_state_toward_the_targets(engine_dir, tmp_path):
    """distill.feature_weight: KL + SmoothL1 to the cached hidden states; the state distance falls as it trains."""
    from mamba_draft import MambaDrafter
    from training.export import export

    out, target, tokenizer = engine_dir
    overrides = [f"model.tokenizer={target}", "data.kind=engine", f"data.path={out}", "data.seq_len=32",
                 "deepspeed=configs/deepspeed/zero1.json", "optim.lr=1e-2", "model.arch=mamba2", "model.head_dim=16",
                 f"model.init_embeddings_from={target}", "model.freeze_embeddings=true", "distill.feature_weight=1.0", "distill.kl_weight=0.0"]
    examples = load_engine(out, tokenizer, temperatures=[0.0], hidden_size=32)

    def distance(run) -> float:
        drafter = MambaDrafter.from_pretrained(str(export(run, tmp_path / f"x{run.name}")))
        total = 0.0
        for e in examples:
            with torch.no_grad():
                _, hidden = drafter.train_forward(e.input_ids[None])
            total += feature_loss(hidden, e.hidden[None].float(), e.labels[None]).item()
        return total / len(examples)

    kl_only = distance(train(load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", overrides + [
        f"output_dir={tmp_path / 'r0'}", "steps=60", "distill.feature_weight=0.0", "distill.kl_weight=1.0"])))
    features = distance(train(load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml",
                                          overrides + [f"output_dir={tmp_path / 'r1'}", "steps=60"])))
    assert features < 0.8 * kl_only, (kl_only, features)
    with pytest.raises(ValueError, match="data.kind: engine"):
        train(load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", [
            f"model.tokenizer={target}", f"output_dir={tmp_path / 'r2'}", "distill.feature_weight=1.0"]))
    with pytest.raises(ValueError, match="another width"):
        load_engine(out, tokenizer, hidden_size=16)


def test_a_drafter_distils_from_the_cache_in_process_and_ships_lean(engine_dir, tmp_path):
    """The shipped recipe's shape (configs/distill/smollm2-engine.yaml): Mamba-2, the target's embedding tied and
    frozen, a draft vocabulary; exported lean (trained parameters in bf16) it loads with the target's embedding."""
    from mamba_draft import MambaDrafter
    from mamba_draft.checkpoint import TARGET_EMBEDDING
    from training.export import export

    out, target, _ = engine_dir
    cfg = load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", [
        f"model.tokenizer={target}", f"output_dir={tmp_path / 'run'}", "data.kind=engine", f"data.path={out}",
        "data.seq_len=32", "steps=12", "deepspeed=configs/deepspeed/zero1.json", "optim.lr=1e-2",
        "model.arch=mamba2", "model.head_dim=16", f"model.init_embeddings_from={target}",
        "model.freeze_embeddings=true", "model.tie_word_embeddings=true", "model.draft_vocab_size=64"])
    run = train(cfg)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.2, losses

    whole = MambaDrafter.from_pretrained(str(export(run, tmp_path / "whole")))
    lean = export(run, tmp_path / "lean", lean_target=str(target))
    assert (lean / TARGET_EMBEDDING).is_file()
    shipped = MambaDrafter.from_pretrained(str(lean))  # the embedding comes from the target named in the digest file
    assert torch.equal(shipped.draft_ids, whole.draft_ids)
    ids = torch.tensor([[5, 9, 2, 7, 3, 3, 8]])
    torch.testing.assert_close(shipped(ids), whole(ids), rtol=0.05, atol=0.05)  # bf16-rounded mixers
    with pytest.raises(ValueError, match="embedding is not"):  # the embedding trained: nothing to share
        export(train(load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", [
            f"model.tokenizer={target}", f"output_dir={tmp_path / 'run2'}", "data.kind=engine", f"data.path={out}",
            "data.seq_len=32", "steps=1", "deepspeed=configs/deepspeed/zero1.json", "model.tie_word_embeddings=true",
            f"model.init_embeddings_from={target}"])), tmp_path / "lean2", lean_target=str(target))
    assert not (tmp_path / "lean2").exists()


def test_ngram_table_backs_off_to_shorter_contexts():
    from training.ngram import NGramTable

    rows = [([1, 2, 3, 4], [False, True, True, True]), ([9, 2, 3, 5], [False, True, True, True]),
            ([7, 2, 3, 5], [False, False, True, True])]
    table = NGramTable(3).fit(rows)
    # after (2, 3): 4 once, 5 twice; after (1, 2): 3; unseen context (8,): backs off to the most frequent token
    assert table.predict([2, 3]).tolist()[-1] == 5
    assert table.predict([1, 2]).tolist()[-1] == 3
    assert table.predict([8]).tolist() == [3]  # 3 and 2 were scored 3 times each, 3 first
    assert NGramTable(1).fit(rows).predict([1, 2, 3]).tolist() == [3, 3, 3]


def test_engine_training_logs_agreement_against_the_cache_and_the_ngram_line(engine_dir, tmp_path, monkeypatch):
    from training import engine_data

    monkeypatch.setattr(engine_data, "HELDOUT", 3)  # 10 prompts: hold a few out
    out, target, tokenizer = engine_dir
    heldout = load_engine(out, tokenizer, split="heldout")
    train_ids = {e.input_ids[:8].tolist().__repr__() for e in load_engine(out, tokenizer, split="train")}
    assert heldout and len(heldout) + len(load_engine(out, tokenizer, split="train")) == 20
    cfg = load_config(REPO / "configs" / "tiny" / "distill-cpu.yaml", [
        f"model.tokenizer={target}", f"output_dir={tmp_path / 'run'}", "data.kind=engine", f"data.path={out}",
        "data.seq_len=32", "steps=4", "deepspeed=configs/deepspeed/zero1.json", f"eval.data={out}", "eval.every=2"])
    run = train(cfg)
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "heldout_agreement" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0 <= r["heldout_agreement"] <= 1 and 0 <= r["ngram3_agreement"] <= 1 and "ngram4_tau3" in r
        assert r["heldout_greedy_path"] < 1  # sampled replies are held out too: their tokens are not all greedy
    assert (run / "agreement.png").read_bytes()[:4] == b"\x89PNG"
    assert train_ids  # the split is by prompt: no held-out reply's prompt trains
