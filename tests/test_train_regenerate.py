"""`python -m training.regenerate`: assistant turns replaced by the target's own greedy replies, ShareGPT out."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.helpers.training_fixtures import FIXTURES, make_tokenizer
from training.config import DataConfig, ModelConfig
from training.data import FALLBACK_CHAT_TEMPLATE, load_records, prepare_sft
from training.model import load_tokenizer, model_config
from training.regenerate import main


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    tokenizer = load_tokenizer(str(make_tokenizer(out)))
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="llama", hidden_size=32, num_hidden_layers=1, num_heads=2,
                                  tie_word_embeddings=False), tokenizer)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out, tokenizer


def test_regenerate_replaces_assistant_turns_with_target_greedy(target, tmp_path):
    model_dir, tokenizer = target
    out = tmp_path / "regen.json"
    assert main(["--model", str(model_dir), "--input", str(FIXTURES / "sharegpt.json"), "--output", str(out),
                 "--max-new-tokens", "6", "--limit", "4"]) == 0
    records = json.loads(out.read_text())
    source = json.loads((FIXTURES / "sharegpt.json").read_text())[:4]
    assert len(records) >= 2  # records whose reply came out empty are dropped (and counted)
    source = [s for s in source if s["id"] in {r["id"] for r in records}]
    assert [r["id"] for r in records] == [s["id"] for s in source]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for rec, src in zip(records, source):
        assert [t["from"] for t in rec["conversations"]] == [t["from"] for t in src["conversations"]]
        history = []
        for new, old in zip(rec["conversations"], src["conversations"]):
            role = {"human": "user", "gpt": "assistant", "system": "system"}[old["from"]]
            if role != "assistant":
                assert new["value"] == old["value"]  # user and system turns are kept verbatim
            else:  # the reply is the target's greedy continuation of the conversation so far
                prompt = tokenizer.apply_chat_template(history, chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False,
                                                       add_generation_prompt=True)
                ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
                greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                assert new["value"] == tokenizer.decode(greedy[0, ids.size(1):], skip_special_tokens=True).strip()
            history.append({"role": role, "content": new["value"]})
    assert all(t["value"] for r in records for t in r["conversations"])
    kept, skipped = prepare_sft(load_records(DataConfig(path=str(out))), tokenizer, 512)  # valid SFT input
    assert len(kept) == len(records) and not skipped


def test_regenerate_bad_input(target, tmp_path):
    model_dir, _ = target
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir), "--input", str(tmp_path / "missing.json"), "--output", str(tmp_path / "o.json")])
    assert not (tmp_path / "o.json").exists()
