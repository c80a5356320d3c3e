"""Held-out agreement / tau_gamma of a drafter with its target: hand-computed counts, the training hook (metrics,
plot, resume, ZeRO-3 on two ranks) and `mamba-draft eval --agreement`."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from mamba_draft import MambaDrafter
from mamba_draft.commands.cli import main as cli
from tests.helpers.training_fixtures import FIXTURES, REPO, deepspeed_cmd, make_tokenizer, read_metrics, train_env
from training.agreement import (Agreement, HeldoutEval, greedy_ids, hf_logits, load_heldout, measure, pad_batch,
                                plot_agreement, score)
from training.config import ModelConfig, load_config
from training.export import export
from training.model import load_tokenizer, model_config
from training.train import train

TINY = REPO / "configs" / "tiny"
CHAT = FIXTURES / "messages.jsonl"

# ------------------------------------------------------------------------------------ hand-computed fixture
# Position t predicts token t+1; a prediction counts when token t+1 is scored ("live").
#
#   row 0  tokens 5 1 2 3 0 1 2   scored . . x x x . x   live t = 1 2 3 5
#          target 9 2 3 1 7 2 0   drafter 2 2 3 1 7 2 3  agree at t = 1 2 3 (4: unscored) 5
#          greedy path (token t+1 == target t): t = 1 2 5 (t=3: token 0, target 1)
#          runs (gamma 1 / 2 / 5): t1 1/2/3 (t4 unscored stops it), t2 1/2/2, t3 1/1/1, t5 1/1/1 (sequence end)
#   row 1  tokens 4 1 1 2 3 P P   scored . x x x x . .   live t = 0 1 2 3
#          target 1 0 2 3 9 7 7   drafter 1 9 2 3 9 7 2  agree at t = 0 2 3 (4, 5: padding)
#          greedy path: t = 0 2 3
#          runs: t0 1/1/1, t1 0/0/0, t2 1/2/2, t3 1/1/1 (t4 unscored)
#
# positions 8, matches 7 -> agreement 7/8; greedy path 6/8
# sum(1 + run): gamma 1: (2+2+2+2) + (2+1+2+2) = 15; gamma 2: (3+3+2+2) + (2+1+3+2) = 18;
#               gamma 5: (4+3+2+2) + (2+1+3+2) = 19  ->  tau 15/8, 18/8, 19/8
TOKENS = torch.tensor([[5, 1, 2, 3, 0, 1, 2], [4, 1, 1, 2, 3, 0, 0]])
SCORED = torch.tensor([[0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
TARGET = torch.tensor([[9, 2, 3, 1, 7, 2, 0], [1, 0, 2, 3, 9, 7, 7]])
DRAFT = torch.tensor([[2, 2, 3, 1, 7, 2, 3], [1, 9, 2, 3, 9, 7, 2]])
DRAFT_IDS = torch.tensor([7, 2, 9, 3, 1])  # draft column j proposes target id DRAFT_IDS[j]
GAMMAS = (1, 2, 5)
EXPECTED = {"agreement": 7 / 8, "tau1": 15 / 8, "tau2": 18 / 8, "tau5": 19 / 8, "greedy_path": 6 / 8, "positions": 8}


def one_hot(ids: torch.Tensor, columns: list[int], width: int) -> torch.Tensor:
    """Logits peaked on the column that proposes each id."""
    col = torch.tensor([columns.index(i) for i in ids.flatten().tolist()]).view(ids.shape)
    return torch.nn.functional.one_hot(col, width).float() * 3 - 1


def test_hand_computed_with_draft_vocabulary():
    logits = one_hot(DRAFT, DRAFT_IDS.tolist(), len(DRAFT_IDS))
    stats = measure(TOKENS, SCORED, TARGET, logits, DRAFT_IDS, GAMMAS)
    assert stats.as_dict() == pytest.approx(EXPECTED)
    assert (stats.positions, stats.matches, stats.greedy_path, stats.accepted) == (8, 7, 6, (15, 18, 19))
    # the same drafter over the full vocabulary (no map) scores the same
    assert measure(TOKENS, SCORED, TARGET, one_hot(DRAFT, list(range(10)), 10), None, GAMMAS) == stats
    # read without its map, column j would propose id j: only row 0 t=2 and row 1 t=3 (column 3 is id 3) agree
    unmapped = measure(TOKENS, SCORED, TARGET, logits, None, GAMMAS)
    assert unmapped.matches == 2 and unmapped.accepted == (10, 10, 10)


def test_rows_pool_into_the_batch():
    logits = one_hot(DRAFT, DRAFT_IDS.tolist(), len(DRAFT_IDS))
    parts = [measure(TOKENS[i:i + 1], SCORED[i:i + 1], TARGET[i:i + 1], logits[i:i + 1], DRAFT_IDS, GAMMAS)
             for i in range(2)]
    assert parts[0].accepted == (8, 10, 11) and parts[1].accepted == (7, 8, 8)
    assert parts[0] + parts[1] == measure(TOKENS, SCORED, TARGET, logits, DRAFT_IDS, GAMMAS)
    assert Agreement.from_counts(GAMMAS, (parts[0] + parts[1]).counts()) == parts[0] + parts[1]


def reference(tokens, scored, target, draft, gammas) -> dict:
    """Straight loops over the definition."""
    pos = match = path = 0
    acc = dict.fromkeys(gammas, 0)
    rows, length = tokens.shape
    for b in range(rows):
        for t in range(length - 1):
            if not scored[b, t + 1]:
                continue
            pos += 1
            match += int(draft[b, t] == target[b, t])
            path += int(tokens[b, t + 1] == target[b, t])
            for g in gammas:
                s = t  # the chain drafts tokens s + 1 = t + 1, t + 2, ...
                while s - t < g and s < length - 1 and scored[b, s + 1] and draft[b, s] == target[b, s]:
                    s += 1
                acc[g] += 1 + (s - t)
    return {"agreement": match / pos, **{f"tau{g}": acc[g] / pos for g in gammas}, "greedy_path": path / pos,
            "positions": pos}


def test_matches_the_definition_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, length, vocab = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (2, 12), (2, 4)))
        tokens = torch.randint(0, vocab, (rows, length), generator=g)
        scored = torch.rand(rows, length, generator=g) < 0.7
        scored[0, -1] = True  # at least one scored token
        target = torch.randint(0, vocab, (rows, length), generator=g)
        logits = torch.randn(rows, length, vocab, generator=g)
        got = measure(tokens, scored, target, logits, None, (1, 2, 3, 7)).as_dict()
        assert got == pytest.approx(reference(tokens, scored, target, logits.argmax(-1), (1, 2, 3, 7)))


def test_bad_inputs():
    logits = one_hot(DRAFT, DRAFT_IDS.tolist(), len(DRAFT_IDS))
    with pytest.raises(ValueError, match="shapes disagree"):
        measure(TOKENS, SCORED[:, :-1], TARGET, logits, DRAFT_IDS)
    with pytest.raises(ValueError, match=r"draft_ids maps \(4,\) columns but the drafter's logits have 5"):
        measure(TOKENS, SCORED, TARGET, logits, DRAFT_IDS[:4])
    for gammas in [(), (0, 1), (2, 2), (1.5,)]:
        with pytest.raises(ValueError, match="gammas must be distinct integers >= 1"):
            measure(TOKENS, SCORED, TARGET, logits, DRAFT_IDS, gammas)
    with pytest.raises(ValueError, match="cannot pool"):
        Agreement((1,)) + Agreement((1, 2))


# ----------------------------------------------------------------------------------------- held-out data

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(str(tok_dir))


def test_load_heldout_chat_and_text(tokenizer, tmp_path):
    rows, skipped = load_heldout(str(CHAT), tokenizer, 64, max_sequences=3)
    assert len(rows) == 3 and not skipped and all(len(ids) == len(s) <= 64 for ids, s in rows)
    for ids, scored in rows:  # scored = the assistant replies, the first one right after '<|assistant|>\n'
        first = scored.index(True)
        assert tokenizer.decode(ids[:first]).endswith("<|assistant|>\n")
    texts = [json.loads(line)["text"] for line in (FIXTURES / "heldout.jsonl").read_text().splitlines()]
    rows, _ = load_heldout(str(FIXTURES / "heldout.jsonl"), tokenizer, 10_000)
    assert rows[0] == ([tokenizer.eos_token_id] + tokenizer(texts[0], add_special_tokens=False)["input_ids"],
                       [False] + [True] * (len(rows[0][0]) - 1))
    assert len(rows) == len(texts)
    with pytest.raises(FileNotFoundError, match="held-out file .* does not exist"):
        load_heldout(str(tmp_path / "missing.json"), tokenizer, 64)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"need a 'conversations' or 'messages' column .* it has \['question'\]"):
        load_heldout(str(wrong), tokenizer, 64)


def test_cached_target_ids_and_scoring_batches_agree_with_one_forward(tokenizer, tmp_path):
    """greedy_ids + score over uneven batches (and extra dummy batches) == measure on one padded batch."""
    model = save_mamba(tokenizer, tmp_path / "m", seed=0)
    rows, _ = load_heldout(str(CHAT), tokenizer, 48)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    cached = greedy_ids(hf_logits(hf), rows, 4, tokenizer.pad_token_id, vocab=300)
    assert [len(c) for c in cached] == [len(ids) for ids, _ in rows]
    other = transformers.AutoModelForCausalLM.from_pretrained(save_mamba(tokenizer, tmp_path / "d", seed=1)).eval()
    calls = []
    def drafter_fn(ids, attention):
        calls.append(ids.shape)
        return hf_logits(other)(ids, attention)
    got = score(drafter_fn, rows, cached, gammas=(1, 4), batch_size=4, pad_id=tokenizer.pad_token_id, vocab=300,
                batches=4)
    assert len(calls) == 4 and calls[-1] == (1, 1)  # 6 rows -> 2 batches, then 2 dummy forwards
    ids, attention, scored = pad_batch(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        target = hf(input_ids=ids, attention_mask=attention).logits[..., :300].argmax(-1)
        expected = measure(ids, scored, target, other(input_ids=ids, attention_mask=attention).logits[..., :300],
                           None, (1, 4))
    assert got == expected and 0 < got.matches < got.positions


# ---------------------------------------------------------------------------------------------- CLI

def save_mamba(tokenizer, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = model_config(ModelConfig(arch="mamba1", hidden_size=32, num_hidden_layers=2, state_size=8), tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # peaked, varied logits
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def all_agree_tau(rows, gamma: int) -> float:
    """tau when every draft agrees: a chain runs to gamma or to the end of its span of scored tokens."""
    total = count = 0
    for _, scored in rows:
        for i in range(1, len(scored)):
            if scored[i]:
                span = next((j for j in range(i, len(scored)) if not scored[j]), len(scored)) - i
                total, count = total + 1 + min(gamma, span), count + 1
    return total / count


def test_cli_drafter_equal_to_its_target_agrees_everywhere(tokenizer, tmp_path, capsys):
    target = save_mamba(tokenizer, tmp_path / "target", seed=0)  # an HF Mamba is also a causal LM target
    drafter = MambaDrafter.from_pretrained(str(target), backend="torch")
    drafter.set_draft_vocab(torch.randperm(300, generator=torch.Generator().manual_seed(0)))
    drafter.save_pretrained(tmp_path / "permuted")  # logit columns shuffled; draft_ids maps them back
    rows, _ = load_heldout(str(CHAT), tokenizer, 2048, max_sequences=4)
    for name in ("target", "permuted"):
        out = tmp_path / f"{name}.json"
        assert cli(["eval", str(tmp_path / name), "--target", str(target), "--agreement", str(CHAT),
                    "--gammas", "1,3,5", "--max-sequences", "4", "--batch-size", "3", "--output", str(out)]) == 0
        printed = json.loads(capsys.readouterr().out)
        result = printed["agreement:messages.jsonl"]
        assert printed == json.loads(out.read_text())
        assert result["agreement"] == 1.0 and result["sequences"] == 4 and result["skipped"] == 0
        assert result["positions"] == sum(sum(s[1:]) for _, s in rows)
        for g in (1, 3, 5):
            assert result[f"tau{g}"] == pytest.approx(all_agree_tau(rows, g))
        assert result["tau5"] > result["tau3"] > result["tau1"] == 2.0


def test_cli_takes_a_transformer_drafter_with_its_draft_vocabulary(tokenizer, target_dir, tmp_path, capsys):
    """`eval --agreement` on a Transformer drafter: the target itself, its logit columns permuted by a stored
    draft vocabulary, agrees everywhere."""
    from safetensors.torch import save_file

    drafter = tmp_path / "self"
    transformers.AutoModelForCausalLM.from_pretrained(target_dir).save_pretrained(drafter)
    save_file({"d2t": torch.randperm(300, generator=torch.Generator().manual_seed(1))},
              str(drafter / "draft_vocab.safetensors"))
    assert cli(["eval", str(drafter), "--target", str(target_dir), "--agreement", str(CHAT),
                "--max-sequences", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["agreement:messages.jsonl"]["agreement"] == 1.0


def test_cli_agreement_bad_input(tokenizer, tmp_path, capsys):
    target = save_mamba(tokenizer, tmp_path / "target", seed=0)
    base = ["eval", str(target), "--target", str(target), "--agreement"]
    cases = [(["eval", str(target), "--agreement", str(CHAT)], "--agreement FILE and --target TARGET go together"),
             ([*base, str(tmp_path / "none.json")], "held-out file .*none.json does not exist"),
             ([*base, str(CHAT), "--gammas", "1,x"], "--gammas expects comma-separated integers, got '1,x'"),
             ([*base, str(CHAT), "--gammas", "0"], r"gammas must be distinct integers >= 1, got \[0\]"),
             ([*base, str(CHAT), "--max-sequences", "0"], "--max-sequences must be >= 1")]
    for argv, match in cases:
        with pytest.raises(SystemExit, match="^mamba-draft eval: error: " + match):
            cli(argv)
    small = tmp_path / "small-tok"
    make_tokenizer(small, vocab_size=280)
    drafter = tmp_path / "small"
    small_tok = load_tokenizer(str(small))
    save_mamba(small_tok, drafter, seed=0)
    with pytest.raises(SystemExit, match="tokenizer has 300 tokens but the drafter reads only 280"):
        cli(["eval", str(drafter), "--target", str(target), "--agreement", str(CHAT)])


# ---------------------------------------------------------------------------------------- training hook

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama target sharing the tokenizer, which a barely trained drafter agrees with about half the time.

    At random init the residual stream is mostly the input embedding, so a model whose output head is its embedding
    (the tiny tied drafter) predicts the token it reads. This target's head is its embedding with the rows of ids
    2k and 2k+1 swapped for 2k < 150: it predicts the token it reads for ids >= 150 and its partner for the others.
    """
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="llama", hidden_size=32, num_hidden_layers=2, num_heads=2,
                                   tie_word_embeddings=False), tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        head = model.get_input_embeddings().weight.clone()
        head[:150] = head[torch.arange(150).view(-1, 2).flip(1).flatten()]
        model.lm_head.weight.copy_(head)
    out = tmp_path_factory.mktemp("target") / "target"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sft_config(tok_dir, target_dir, out, *extra):
    return load_config(TINY / "sft-cpu.yaml", [
        f"model.tokenizer={tok_dir}", f"output_dir={out}", f"data.path={FIXTURES / 'sharegpt.json'}",
        f"eval.data={CHAT}", f"eval.target={target_dir}", "eval.every=2", "eval.max_sequences=5",
        "eval.gammas=[1,3]", "checkpoint_every=2", *extra])


def test_training_hook_logs_agreement_plots_and_resumes(tok_dir, target_dir, tmp_path):
    """In-process world of one: steps 1-2, resume to 5; evaluations at 2, 4 and the last step."""
    out = tmp_path / "run"
    train(sft_config(tok_dir, target_dir, out, "steps=2"))
    train(sft_config(tok_dir, target_dir, out, "steps=5"), resume_run=True)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    evaluated = [m for m in metrics if "heldout_agreement" in m]
    assert [m["step"] for m in evaluated] == [2, 4, 5]
    for m in evaluated:  # train_tokens: cumulative over the resume
        assert m["train_tokens"] == sum(r["tokens"] for r in metrics if r["step"] <= m["step"])
        assert 0.2 < m["heldout_agreement"] < 0.8 and m["heldout_tau1"] == pytest.approx(1 + m["heldout_agreement"])
        assert m["heldout_tau1"] <= m["heldout_tau3"] and m["heldout_positions"] > 0
        assert set(m) >= {"loss", "heldout_tau3", "heldout_greedy_path"} and "heldout_tau5" not in m
    assert (out / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_hook_with_a_draft_vocabulary_matches_the_cli_on_the_export(tok_dir, target_dir, tmp_path):
    """The trained drafter proposes only its 64 most frequent ids: the hook maps its columns through draft_ids, and
    `mamba-draft eval --agreement` on the export (which keeps the map) reports the same numbers."""
    out = tmp_path / "run"
    train(sft_config(tok_dir, target_dir, out, "steps=2", "model.draft_vocab_size=64"))
    final = read_metrics(out)[-1]
    hf_dir = export(out, tmp_path / "export")
    assert MambaDrafter.from_pretrained(str(hf_dir)).vocab_size == 64
    assert cli(["eval", str(hf_dir), "--target", str(target_dir), "--agreement", str(CHAT), "--max-sequences", "5",
                "--max-len", "128", "--gammas", "1,3", "--output", str(tmp_path / "cli.json")]) == 0
    result = json.loads((tmp_path / "cli.json").read_text())["agreement:messages.jsonl"]
    assert 0.1 < final["heldout_agreement"] < 0.9 and result["positions"] == final["heldout_positions"]
    for key in ("agreement", "tau1", "tau3", "greedy_path"):
        assert result[key] == pytest.approx(final[f"heldout_{key}"]), key


def test_training_hook_config_errors(tok_dir, target_dir, tmp_path):
    cases = [(["eval.every=0"], "eval.data is set but eval.every is 0"),
             (["eval.data=''", "eval.every=2"], "eval.every is set but eval.data is empty"),
             (["eval.every=-1"], r"eval.every must be >= 0"),
             ([f"eval.data={tmp_path / 'none.json'}"], "eval.data .*none.json' does not exist"),
             (["eval.max_sequences=0"], "eval.max_sequences must be >= 1"),
             (["eval.gammas=[]"], "gammas must be distinct integers >= 1"),
             (["eval.target=null"], "held-out agreement needs a target: set eval.target")]
    for extra, match in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            train(sft_config(tok_dir, target_dir, tmp_path / "bad", *extra))
    assert not (tmp_path / "bad").exists()
    assert plot_agreement(FIXTURES / "heldout.jsonl", tmp_path / "none.png") is False  # no heldout records


class CountingEngine(torch.nn.Module):
    """Stands in for the DeepSpeed engine: `.module`, called with input_ids / attention_mask."""
    def __init__(self, model):
        super().__init__()
        self.module, self.calls = model, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def test_heldout_eval_shards_rows_and_calls_forward_equally_often_on_every_rank(tok_dir, target_dir, tokenizer,
                                                                                 tmp_path):
    """5 sequences over 2 ranks, 2 per forward: rank 0 scores 3 (2 forwards), rank 1 scores 2 (1 forward + 1 dummy,
    as ZeRO-3 needs every rank to gather parameters together); the shards add up to the whole set."""
    cfg = load_config(TINY / "distill-cpu.yaml", [f"model.tokenizer={tok_dir}", f"output_dir={tmp_path}",
                                                  f"distill.target={target_dir}", f"eval.data={CHAT}", "eval.every=2",
                                                  "eval.max_sequences=5"])
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = transformers.AutoModelForCausalLM.from_pretrained(save_mamba(tokenizer, tmp_path / "d", seed=1)).eval()
    results = []
    for rank, world in [(0, 2), (1, 2), (0, 1)]:
        heldout = HeldoutEval(cfg, tokenizer, rank, world, "cpu", torch.float32, target)
        engine = CountingEngine(drafter)
        results.append(heldout(engine))
        assert engine.calls == (3 if world == 1 else 2)
        assert len(heldout.rows) == {(0, 2): 3, (1, 2): 2, (0, 1): 5}[rank, world]
    assert results[0]["heldout_positions"] + results[1]["heldout_positions"] == results[2]["heldout_positions"]


def test_two_rank_zero3_distill_hook_matches_the_cli_on_the_export(tok_dir, target_dir, tmp_path):
    """Two ranks under ZeRO-3 (even tiny parameters partitioned) share 5 held-out sequences (3 + 2, so rank 1 adds a
    dummy forward); the summed numbers equal `mamba-draft eval --agreement` on the exported drafter."""
    zero3 = json.loads((REPO / "configs/deepspeed/zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny parameters
    (tmp_path / "zero3.json").write_text(json.dumps(zero3))
    out = tmp_path / "distill"
    cmd = deepspeed_cmd(2, TINY / "distill-cpu.yaml", [
        f"model.tokenizer={tok_dir}", f"output_dir={out}", f"data.path={FIXTURES / 'sharegpt.json'}",
        f"distill.target={target_dir}", f"eval.data={CHAT}", "eval.every=2", "eval.max_sequences=5", "steps=4",
        f"deepspeed={tmp_path / 'zero3.json'}"])
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evaluated = [m for m in read_metrics(out) if "heldout_agreement" in m]
    assert [m["step"] for m in evaluated] == [2, 4]
    assert (out / "agreement.png").is_file()
    hf_dir = export(out, tmp_path / "export")
    assert cli(["eval", str(hf_dir), "--target", str(target_dir), "--agreement", str(CHAT), "--max-sequences", "5",
                "--max-len", "128", "--output", str(tmp_path / "cli.json")]) == 0
    result = json.loads((tmp_path / "cli.json").read_text())["agreement:messages.jsonl"]
    final = evaluated[-1]
    assert 0.2 < final["heldout_agreement"] < 0.8
    assert result["positions"] == final["heldout_positions"]
    for key in ("agreement", "tau1", "tau3", "tau5", "greedy_path"):
        assert result[key] == pytest.approx(final[f"heldout_{key}"]), key


def test_recipe_curves_share_one_plot(tmp_path, capsys):
    from training.agreement import main as agreement_main

    for name, values in (("kl", (0.2, 0.3)), ("ce", (0.1, 0.2))):
        run = tmp_path / name
        run.mkdir()
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"step": i + 1, "train_tokens": 100 * (i + 1), "heldout_agreement": v, "ngram4_agreement": 0.25}) + "\n"
            for i, v in enumerate(values)))
    out = tmp_path / "recipes.png"
    assert agreement_main(["--plot", str(out), f"KL={tmp_path / 'kl'}", f"CE={tmp_path / 'ce'}"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        agreement_main(["--plot", str(tmp_path / "x.png"), f"none={tmp_path}"])
    assert not (tmp_path / "x.png").exists()
