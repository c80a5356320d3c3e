"""`mamba-draft eval`: multiple-choice acc / acc_norm and perplexity, checked against hand-computable models."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from mamba_draft.commands.cli import main as cli
from tests.helpers.training_fixtures import FIXTURES, make_tokenizer
from training.config import ModelConfig
from training.evaluate import TASKS, continuation_logprobs, evaluate, load_task, parse_tasks
from training.model import load_tokenizer, model_config


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))


def save_model(tokenizer, out, zero: bool):
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="mamba1", hidden_size=32, num_hidden_layers=2, state_size=8), tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if zero:  # every logit 0: each token has probability exactly 1/vocab
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, cfg.vocab_size


def n_continuation_tokens(tokenizer, context: str, choice: str) -> int:
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return len(tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]) - len(ctx)


# Worked by hand from the fixture tokenizer's counts (tokens / characters per choice, same for every item):
# hellaswag endings: tokens [12, 6, 27, 25], chars [18, 7, 41, 34]: acc -> ending 1 (fewest tokens), acc_norm ->
#   ending 2 (1.52 chars/token); golds 0,1,2,3,0 -> acc 1/5, acc_norm 1/5 (different items).
# arc_easy: tokens [4, 14, 3, 14], chars [6, 29, 5, 24]: acc -> C, acc_norm -> B; keys A,B,C,D,A -> 1/5, 1/5.
# piqa: tokens [8, 28], chars [10, 40]: acc -> sol1, acc_norm -> sol2 (1.43 > 1.25); labels 0,1,0,1,0 -> 3/5, 2/5.
HAND_COMPUTED = {"hellaswag": (1 / 5, 1 / 5), "arc_easy": (1 / 5, 1 / 5), "piqa": (3 / 5, 2 / 5)}


@pytest.mark.parametrize("task", ["hellaswag", "arc_easy", "piqa"])
def test_uniform_model_accuracy_matches_hand_computation(tokenizer, tmp_path, task):
    """Under a uniform model, log p(choice) = -n_tokens * log V: acc picks the fewest tokens, acc_norm the most
    characters per token; the expected accuracy follows from the 5 fixture items by counting."""
    model_dir, vocab = save_model(tokenizer, tmp_path / "zero", zero=True)
    path = FIXTURES / f"{task}.jsonl"
    items = load_task(task, str(path), None)
    assert len(items) == 5
    acc = acc_norm = 0
    for item in items:
        scores = [-n_continuation_tokens(tokenizer, item.context, c) * math.log(vocab) for c in item.choices]
        normed = [s / len(c) for s, c in zip(scores, item.choices)]
        acc += scores.index(max(scores)) == item.gold
        acc_norm += normed.index(max(normed)) == item.gold
    results = evaluate(model_dir, f"{task}:{path}")
    assert results[task] == {"acc": acc / 5, "acc_norm": acc_norm / 5, "n": 5}
    assert (acc / 5, acc_norm / 5) == HAND_COMPUTED[task]


def test_uniform_model_perplexity_is_vocab_size(tokenizer, tmp_path):
    model_dir, vocab = save_model(tokenizer, tmp_path / "zero", zero=True)
    result = evaluate(model_dir, f"perplexity:{FIXTURES / 'heldout.jsonl'}", max_len=16)["perplexity:heldout.jsonl"]
    texts = [json.loads(line)["text"] for line in (FIXTURES / "heldout.jsonl").read_text().splitlines()]
    assert result["tokens"] == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert result["perplexity"] == pytest.approx(vocab, rel=1e-5)


def test_loglikelihood_matches_a_direct_forward(tokenizer, tmp_path):
    model_dir, _ = save_model(tokenizer, tmp_path / "random", zero=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    context, choices = "Question: Who reads?\nAnswer:", [" the cat", " a small robot with great care"]
    got = continuation_logprobs(model, tokenizer, context, choices)
    for choice, score in zip(choices, got):
        ids = tokenizer(context + choice, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0], -1)
        expected = sum(logp[t - 1, ids[0, t]].item() for t in range(n_ctx, ids.size(1)))
        assert score == pytest.approx(expected, abs=1e-4)


def test_cli_eval_writes_json(tokenizer, tmp_path, capsys):
    model_dir, vocab = save_model(tokenizer, tmp_path / "zero", zero=True)
    out = tmp_path / "results.json"
    spec = f"arc_easy:{FIXTURES / 'arc_easy.jsonl'},perplexity:{FIXTURES / 'heldout.jsonl'}"
    assert cli(["eval", str(model_dir), "--tasks", spec, "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"arc_easy", "perplexity:heldout.jsonl"} and results["arc_easy"]["n"] == 5
    assert results["perplexity:heldout.jsonl"]["perplexity"] == pytest.approx(vocab, rel=1e-5)


def test_eval_bad_input(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown task 'winogrande'"):
        parse_tasks("hellaswag,winogrande")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_tasks(f"piqa:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(ValueError, match="perplexity:FILE"):
        parse_tasks("perplexity")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"piqa: .* lacks column\(s\) \['goal', 'sol1', 'sol2', 'label'\]"):
        load_task("piqa", str(wrong), None)
    assert set(TASKS) == {"hellaswag", "arc_easy", "piqa"}


def test_cli_eval_bad_input_is_one_line(tokenizer, tmp_path):
    model_dir, _ = save_model(tokenizer, tmp_path / "zero", zero=True)
    with pytest.raises(SystemExit, match="^mamba-draft eval: error: unknown task 'winogrande'"):
        cli(["eval", str(model_dir), "--tasks", "winogrande"])
    with pytest.raises(SystemExit, match="^mamba-draft eval: error: model directory .* does not exist"):
        cli(["eval", str(tmp_path / "missing"), "--tasks", f"perplexity:{FIXTURES / 'heldout.jsonl'}"])
    with pytest.raises(SystemExit, match="^mamba-draft eval: error: --agreement FILE and --target TARGET go together"):
        cli(["eval", str(model_dir), "--target", str(model_dir)])


def test_cli_eval_tasks_and_agreement_in_one_run(tokenizer, tmp_path):
    """--tasks and --agreement together: both result sets; a model agrees with itself everywhere."""
    model_dir, vocab = save_model(tokenizer, tmp_path / "random", zero=False)
    out = tmp_path / "results.json"
    assert cli(["eval", str(model_dir), "--tasks", f"perplexity:{FIXTURES / 'heldout.jsonl'}", "--target",
                str(model_dir), "--agreement", str(FIXTURES / "messages.jsonl"), "--gammas", "2",
                "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"perplexity:heldout.jsonl", "agreement:messages.jsonl"}
    agreement = results["agreement:messages.jsonl"]
    assert agreement["agreement"] == 1.0 and set(agreement) == {"agreement", "tau2", "greedy_path", "positions",
                                                                 "sequences", "skipped"}
