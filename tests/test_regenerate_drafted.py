"""`mamba-draft regenerate --drafter`: the replies of `python -m training.regenerate`, produced by batched tree
speculative decoding (token-identical at temperature 0, reproducible when sampling), one-line errors on bad input."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import transformers

from mamba_draft.commands import cli
from tests.helpers.training_fixtures import FIXTURES, make_tokenizer
from tests.helpers.tree_models import aligned_drafter, random_drafter
from training import regenerate as plain
from training.config import ModelConfig
from training.model import load_tokenizer, model_config

SOURCE = str(FIXTURES / "sharegpt.json")  # multi-turn records of different lengths, and some invalid ones
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama target (the fixture tokenizer) and a Mamba drafter with its embeddings, final norm and head,
    which agrees with it often (tau about 1.3). A second EOS id, common in the greedy replies, ends some replies
    within MAX_NEW tokens while others are cut off. Returns (target dir, drafter dir)."""
    root = tmp_path_factory.mktemp("pair")
    target_dir = root / "target"
    tokenizer = load_tokenizer(str(make_tokenizer(target_dir)))
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="llama", hidden_size=32, num_hidden_layers=1, num_heads=2,
                                   tie_word_embeddings=False), tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    aligned_drafter(root / "drafter", model)  # shrinks the target's mixing layers in place
    drafter = transformers.MambaForCausalLM.from_pretrained(root / "drafter")
    with torch.no_grad():
        drafter.backbone.norm_f.weight.copy_(model.model.norm.weight)
    drafter.save_pretrained(root / "drafter")
    records = json.loads((FIXTURES / "sharegpt.json").read_text())
    prompts = dict.fromkeys(t["value"] for r in records if not r["id"].startswith("bad_")
                            for t in r["conversations"] if t["from"] == "human")
    model.generation_config.eos_token_id = None  # see every token
    heads = []
    for text in prompts:
        ids = torch.tensor([plain.prompt_ids(tokenizer, [{"role": "user", "content": text}])])
        heads.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                    do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist())
    first = {h[0] for h in heads}  # an EOS there would make an empty reply
    common = Counter(t for h in heads for t in set(h[1:]) if t not in first and t not in tokenizer.all_special_ids)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, common.most_common(1)[0][0]]
    model.save_pretrained(target_dir)
    return target_dir, root / "drafter"


def regenerate_cli(target_dir, output, *extra) -> int:
    return cli.main(["regenerate", "--target", str(target_dir), "--input", SOURCE, "--output", str(output),
                     "--max-new-tokens", str(MAX_NEW), "--batch-size", "3", *extra])


def drafted_line(out: str) -> dict:
    """`drafted: N new tokens in B batches, R rounds, tau T, X tok/s, drafter calls C` -> its numbers."""
    (line,) = [line for line in out.splitlines() if line.startswith("drafted: ")]
    words = line.replace(",", "").split()
    return {"new_tokens": int(words[1]), "batches": int(words[5]), "rounds": int(words[7]),
            "tau": float(words[10]), "drafter_calls": int(words[-1])}


@pytest.mark.parametrize("tree", ["bandit", "3,2,1"])
def test_greedy_drafted_replies_equal_the_plain_ones(pair, tmp_path, capsys, monkeypatch, tree):
    target_dir, drafter_dir = pair
    assert plain.main(["--target", str(target_dir), "--input", SOURCE, "--output", str(tmp_path / "plain.json"),
                       "--max-new-tokens", str(MAX_NEW), "--batch-size", "3"]) == 0
    want = json.loads((tmp_path / "plain.json").read_text())
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert 0 < sum("truncated" in r for r in want) < len(want)  # some replies end at an EOS, others are cut off

    import tree_search

    batches, real = [], tree_search.SpeculativeDecoder.generate  # what DraftedGenerate calls, once per batch
    monkeypatch.setattr(tree_search.SpeculativeDecoder, "generate", lambda self, prompts, **kw:
                        batches.append((self.drafter, prompts, kw)) or real(self, prompts, **kw))
    assert regenerate_cli(target_dir, tmp_path / "drafted.json", "--drafter", str(drafter_dir), "--tree", tree) == 0
    assert json.loads((tmp_path / "drafted.json").read_text()) == want
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == summary  # the same summary line, after the drafted runs' one
    stats = drafted_line(out[-2])
    assert stats["batches"] == len(batches) > 1 and stats["drafter_calls"] > 0 and stats["tau"] > 1
    assert all(drafter is not None for drafter, _, _ in batches)
    assert any(len({len(p) for p in prompts}) > 1 for _, prompts, _ in batches)  # really left-padded batches
    assert all(len(prompts) <= 3 for _, prompts, _ in batches) and max(len(p) for _, p, _ in batches) == 3

    # without --drafter, `mamba-draft regenerate` is training.regenerate
    assert regenerate_cli(target_dir, tmp_path / "no_drafter.json") == 0
    assert json.loads((tmp_path / "no_drafter.json").read_text()) == want
    assert capsys.readouterr().out.strip().splitlines() == [summary]


def test_sampled_drafted_replies_are_reproducible(pair, tmp_path, capsys):
    target_dir, drafter_dir = pair
    read = lambda name: json.loads((tmp_path / name).read_text())
    runs = {"s0": ["--seed", "0"], "s0_again": ["--seed", "0"], "s1": ["--seed", "1"],
            "s0_batch1": ["--seed", "0", "--batch-size", "1"], "greedy": ["--temperature", "0"]}
    for name, extra in runs.items():
        assert regenerate_cli(target_dir, tmp_path / f"{name}.json", "--drafter", str(drafter_dir), "--tree", "2,1",
                              "--temperature", "1.0", *extra) == 0
        assert drafted_line(capsys.readouterr().out)["drafter_calls"] > 0
    assert read("s0.json") == read("s0_again.json") != read("s1.json")
    assert read("s0.json") != read("greedy.json")  # sampling, not greedy
    # reply n of the run draws from seed + n whatever the batch it falls in (a fixed tree: the same draws)
    assert read("s0_batch1.json") == read("s0.json")


def test_bad_drafter_or_tree_is_a_one_line_error_and_writes_nothing(pair, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)  # the one-line form users see (tests/conftest.py sets it)
    target_dir, drafter_dir = pair
    not_a_dir = tmp_path / "drafter.bin"
    not_a_dir.write_text("x")
    random_drafter(tmp_path / "small_vocab", vocab=200)
    capsys.readouterr()
    out = tmp_path / "out.json"
    before_any_model = [
        (["--drafter", str(tmp_path / "nowhere")], f"--drafter {tmp_path / 'nowhere'} does not exist"),
        (["--drafter", str(not_a_dir)], f"--drafter {not_a_dir} is not a directory"),
        (["--drafter", str(drafter_dir), "--tree", "3,,2"], "cannot parse tree spec '3,,2'"),
        (["--drafter", str(drafter_dir), "--tree", "bandit:1,1//2"], "tree spec '' is empty"),
        (["--drafter", str(drafter_dir), "--verifier", "greedy", "--temperature", "0.7"],
         "verifier 'greedy' is for temperature 0"),
        (["--tree", "3,2"], "--tree needs --drafter"),
    ]
    for extra, message in before_any_model:
        assert regenerate_cli(target_dir, out, *extra) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mamba-draft regenerate: error: "), err
        assert message in err, err
        assert not out.exists()
    # found once the target is loaded, before the first batch runs (the progress bar may have started)
    assert regenerate_cli(target_dir, out, "--drafter", str(tmp_path / "small_vocab")) == 1
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("error") == 1, err
    assert err.splitlines()[-1].startswith("mamba-draft regenerate: error: vocabulary mismatch: tokenizer has 300 "
                                           "tokens but the target covers 304 and the drafter 200"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter.bin", "small_vocab"]
