"""AutoJudge mining (Algorithm 1) on a tiny synthetic task, classifier training, save/load, CLI."""
from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from mamba_draft.targets.cache import TargetCache
from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import tiny_llama
from tree_search.autojudge.answers import AnswerTask, get_task, gsm8k_answer
from tree_search.autojudge.classifier import JudgeHead
from tree_search.autojudge.mine import Mismatch, load_mined, mine, mine_prompt, save_prompt_record, target_greedy
from tree_search.autojudge.train import TrainConfig, threshold_for_recall, train_judge

VOCAB, MARKER = 64, 7  # MARKER: a token the target can never produce greedily (its head row is zeroed)
PROMPT = [5, 9, 12, 30]


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(vocab=VOCAB, head_scale=8.0, seed=3)
    with torch.no_grad():
        model.lm_head.weight[MARKER].zero_()  # logit 0 while some of 63 spread-out logits is positive
    return model


class PlantedDrafter(torch.nn.Module):
    """The target itself, except that at chosen response positions it insists on a chosen token."""

    def __init__(self, target, prompt_len: int, plants: dict[int, int]):
        super().__init__()
        self.target, self.prompt_len, self.plants = target, prompt_len, plants

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.target(input_ids=ids).logits.clone()
        for position, token in self.plants.items():
            row = self.prompt_len + position - 1  # logits at row predict response[position]
            if row < ids.shape[1]:
                logits[0, row, token] += 1e4
        return logits


def decode(ids):
    return " ".join(map(str, ids))


MARKER_TASK = AnswerTask(extract=lambda text: str(MARKER) in text.split(), equivalent=lambda a, b: a == b)


def test_mining_labels_planted_important_and_cosmetic_tokens(target):
    response = target_greedy(target, PROMPT, 12, None)
    assert MARKER not in response and len(response) == 12
    cosmetic = (response[2] + 1) % VOCAB if (response[2] + 1) % VOCAB != MARKER else (response[2] + 2) % VOCAB
    drafter = PlantedDrafter(target, len(PROMPT), {2: cosmetic, 6: MARKER})
    found, final = mine_prompt(target, drafter, PROMPT, MARKER_TASK, decode, max_new_tokens=12)
    assert [(m.position, m.draft_token, m.important) for m in found] == [(2, cosmetic, False), (6, MARKER, True)]
    assert found[0].target_token == response[2]
    # the cosmetic swap was kept and the target regenerated after it; the important one was rolled back
    regenerated = target_greedy(target, PROMPT + response[:2] + [cosmetic], 9, None)
    assert final == response[:2] + [cosmetic] + regenerated
    assert found[1].target_token == final[6] != MARKER


def test_mined_feature_is_the_tree_verifiers_hidden_state(target):
    """DT feature = the target's final hidden state at the draft token, as the tree forward reports it."""
    response = target_greedy(target, PROMPT, 8, None)
    drafter = PlantedDrafter(target, len(PROMPT), {5: MARKER})
    (mismatch,), _ = mine_prompt(target, drafter, PROMPT, MARKER_TASK, decode, max_new_tokens=8)
    state = TargetCache(target)
    context = PROMPT + response[:4]
    state.prefill(torch.tensor([context]))
    logits, hidden = state.tree_forward(torch.tensor([[response[4], MARKER]]), TreeConfig((1,)).build(),
                                        want_hidden=True)
    assert mismatch.feature.shape == (target.config.hidden_size,)
    assert torch.allclose(mismatch.feature, hidden[0, 1].float(), atol=1e-4)
    assert torch.allclose(target.lm_head(mismatch.feature), logits[0, 1].float(), atol=1e-4)  # what lm_head consumes


def test_mine_writes_one_file_per_prompt_and_resumes(target, tmp_path):
    prompts = [PROMPT, [1, 2, 3]]
    drafter = PlantedDrafter(target, len(PROMPT), {3: MARKER})  # one MARKER plant per prompt (row offset by prompt length)
    counts = mine(target, drafter, prompts, MARKER_TASK, decode, tmp_path, max_new_tokens=6, manifest={"task": "m"})
    assert counts["prompts"] == 2 and counts["skipped"] == 0
    first = tmp_path / "prompt_000000.safetensors"
    saved = load_file(str(first))
    assert saved["labels"].tolist() == [1] and saved["draft_tokens"].tolist() == [MARKER]
    assert saved["features"].shape == (1, target.config.hidden_size)
    (tmp_path / "prompt_000001.safetensors").unlink()
    again = mine(target, drafter, prompts, MARKER_TASK, decode, tmp_path, max_new_tokens=6, manifest={"task": "m"})
    assert again["prompts"] == 1 and again["skipped"] == 1
    with pytest.raises(ValueError, match="different settings"):
        mine(target, drafter, prompts, MARKER_TASK, decode, tmp_path, max_new_tokens=7, manifest={"task": "m"})
    features, labels = load_mined(tmp_path)
    assert features.shape[0] == labels.shape[0] == int(counts["important"] + counts["unimportant"])


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("so 3 + 4 = 7\n#### 1,234") == Fraction(1234)
    assert gsm8k_answer("The answer is $3.50.") == Fraction(7, 2)
    assert gsm8k_answer("first 5 then 12 apples") == Fraction(12)
    assert gsm8k_answer("no numbers here") is None
    task = get_task("gsm8k")
    assert task.equivalent(task.extract("answer: 3.5"), task.extract("#### 3.50"))
    assert not task.equivalent(task.extract("#### 4"), task.extract("#### 5"))
    assert get_task("exact").extract("  hi ") == "hi"
    with pytest.raises(ValueError, match="unknown AutoJudge task"):
        get_task("mmlu")


def separable(n: int = 200, hidden: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < 0.4).long()
    features = torch.randn(n, hidden, generator=g) * 3 + 10
    features[:, 0] += 8.0 * labels  # one informative direction, with offsets and scales to standardise away
    return features, labels


def test_train_picks_c_by_auc_and_round_trips(tmp_path):
    features, labels = separable()
    head = train_judge(features, labels, TrainConfig(seed=1))
    assert head.info["val_roc_auc"] > 0.8 and head.info["C"] in TrainConfig().c_grid
    # the exported head reproduces scikit-learn's probabilities for the same C and split-free fit
    scaler = StandardScaler().fit(features.numpy())
    reference = LogisticRegression(C=head.info["C"], max_iter=2000).fit(scaler.transform(features.numpy()), labels.numpy())
    exported = JudgeHead(
        torch.tensor(scaler.mean_, dtype=torch.float32), torch.tensor(scaler.scale_, dtype=torch.float32),
        torch.tensor(reference.coef_[0], dtype=torch.float32), torch.tensor(reference.intercept_, dtype=torch.float32),
    )
    expected = reference.predict_proba(scaler.transform(features.numpy()))[:, 1]
    assert np.allclose(exported.prob_important(features).numpy(), expected, atol=1e-5)
    path = tmp_path / "judge.safetensors"
    head.save(path)
    loaded = JudgeHead.load(path)
    assert torch.equal(loaded.prob_important(features), head.prob_important(features))
    assert loaded.info == head.info and loaded.hidden_size == 6


def test_threshold_for_recall():
    probs = np.array([0.1, 0.2, 0.3, 0.4, 0.9, 0.05])
    labels = np.array([1, 1, 1, 1, 1, 0])
    t = threshold_for_recall(probs, labels, 0.8)
    assert t == 0.2 and (probs[labels == 1] >= t).mean() >= 0.8


def test_train_refuses_single_class():
    features, labels = separable()
    with pytest.raises(ValueError, match="at least 2 important and 2 unimportant"):
        train_judge(features, torch.zeros_like(labels))


def test_cli_mine_and_train(tmp_path, target):
    from mamba_draft.commands.cli import main
    from tests.helpers.training_fixtures import make_tokenizer
    from tests.helpers.tree_models import random_drafter

    tok_dir = make_tokenizer(tmp_path / "tok", vocab_size=VOCAB + 40)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    model = tiny_llama(vocab=vocab, head_scale=4.0)
    model.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(tmp_path / "target")
    random_drafter(tmp_path / "draft", vocab=vocab)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tom has {n} apples."}) for n in (3, 5)) + "\n")
    out = tmp_path / "mined"
    args = ["autojudge", "mine", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "draft"),
            "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6", "--no-chat-template"]
    assert main(args) == 0
    assert sorted(p.name for p in out.glob("prompt_*")) == ["prompt_000000.safetensors", "prompt_000001.safetensors"]
    assert json.loads((out / "manifest.json").read_text())["task"] == "gsm8k"
    with pytest.raises(ValueError, match="different settings"):  # resuming with other settings is refused
        main([*args[:-2], "8", "--no-chat-template"])
    with pytest.raises(ValueError, match="unknown AutoJudge task"):
        main([*args, "--task", "mmlu"])
    # train on a synthetic mined directory in the same format
    data = tmp_path / "synthetic"
    data.mkdir()
    features, labels = separable(hidden=model.config.hidden_size)
    for i in range(4):
        rows = range(i * 50, (i + 1) * 50)
        save_prompt_record(data / f"prompt_{i:06d}.safetensors",
                           [Mismatch(r, 0, 1, bool(labels[r]), features[r]) for r in rows], features.shape[1], {})
    judge = tmp_path / "judge.safetensors"
    assert main(["autojudge", "train", "--data", str(data), "--out", str(judge)]) == 0
    head = JudgeHead.load(judge)
    assert head.hidden_size == model.config.hidden_size and 0.0 < head.info["threshold"] < 1.0
