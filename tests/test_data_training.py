"""Unit tests of training.data: packing, rank sharding, resumable state, SFT rendering and masking."""
from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest

from tests.helpers.training_fixtures import FIXTURES, make_tokenizer
from training.config import DataConfig
from training.chat import FALLBACK_CHAT_TEMPLATE, normalize_conversation
from training.data import IGNORE_INDEX, PackedSequences, SFTExamples, load_records, prepare_sft, render_sft
from training.model import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))


def docs_dataset(texts):
    return datasets.Dataset.from_list([{"text": t} for t in texts])


def test_packing_places_eos_after_every_document_and_cuts_fixed_windows(tokenizer):
    texts = ["the cat reads", "a small robot builds the red bridge", "warm bread"]
    cfg = DataConfig(seq_len=5, seed=3)
    packed = PackedSequences(docs_dataset(texts), tokenizer, cfg, rank=0, world=1)
    windows = [next(packed) for _ in range(12)]
    assert all(w.shape == (5,) for w in windows)
    stream = [t for w in windows for t in w.tolist()]
    # the first epoch, in its seeded order, each document followed by EOS
    from training.data import rank_order
    order = rank_order(3, cfg.seed, 0, 0, 1)
    expected = []
    for i in order:
        expected += tokenizer(texts[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert stream[:len(expected)] == expected
    assert stream.count(tokenizer.eos_token_id) >= 3


def test_pretrain_sharding_covers_every_document_once_per_epoch(tokenizer):
    texts = [f"document number {i}" for i in range(11)]  # 11 docs over 3 ranks: uneven shards
    seen, orders = Counter(), []
    for rank in range(3):
        packed = PackedSequences(docs_dataset(texts), tokenizer, DataConfig(seed=5), rank=rank, world=3)
        docs = []
        while (doc := packed._next_doc()) and packed.epoch == 0:
            docs.append(doc)
        seen.update(docs)
        orders.append(docs)
    assert seen == Counter(texts)  # nothing dropped, nothing duplicated
    again = PackedSequences(docs_dataset(texts), tokenizer, DataConfig(seed=5), rank=0, world=3)
    assert [again._next_doc() for _ in orders[0]] == orders[0]  # deterministic from the seed
    assert [again._next_doc() for _ in orders[0]] != orders[0]  # next epoch reshuffled


def test_packed_state_dict_resumes_exactly(tokenizer):
    records = load_records(DataConfig(path=str(FIXTURES / "fineweb_edu.jsonl")))
    cfg = DataConfig(seq_len=16, seed=1)
    a = PackedSequences(records, tokenizer, cfg, rank=1, world=2)
    for _ in range(7):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # must survive serialisation
    rest = []
    while a.epoch == 0 or len(rest) < 5:  # cross an epoch boundary
        rest.append(next(a).tolist())
    b = PackedSequences(records, tokenizer, cfg, rank=1, world=2)
    b.load_state_dict(state)
    assert [next(b).tolist() for _ in rest] == rest


def test_streaming_parquet_source_packs_and_resumes(tokenizer, tmp_path):
    rows = [json.loads(line) for line in (FIXTURES / "fineweb_edu.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "part-0.parquet"))
    cfg = DataConfig(path=str(tmp_path / "*.parquet"), streaming=True, seq_len=16, shuffle_buffer=8)
    records = load_records(cfg)
    assert isinstance(records, datasets.IterableDataset)
    a = PackedSequences(records, tokenizer, cfg, rank=0, world=2)
    for _ in range(5):
        next(a)
    state = a.state_dict()
    rest = [next(a).tolist() for _ in range(40)]
    b = PackedSequences(records, tokenizer, cfg, rank=0, world=2)
    b.load_state_dict(state)
    assert [next(b).tolist() for _ in range(40)] == rest


def test_sft_labels_cover_assistant_replies_only(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who reads?"},
                {"role": "assistant", "content": "The cat reads."}, {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "It sleeps."}]
    ids, labels, reason = render_sft(messages, tokenizer, max_len=512)
    assert reason == "" and len(ids) == len(labels)
    labelled = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    assert labelled == "The cat reads.</s>It sleeps.</s>"
    unlabelled = tokenizer.decode([t for t, l in zip(ids, labels) if l == IGNORE_INDEX])
    assert "Who reads?" in unlabelled and "Be brief." in unlabelled and "<|assistant|>" in unlabelled
    assert all(l in (IGNORE_INDEX, t) for t, l in zip(ids, labels))
    assert tokenizer.chat_template is None  # the fallback (Zephyr) template was used
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, chat_template=FALLBACK_CHAT_TEMPLATE,
                                                                  tokenize=False)


def test_sft_truncation(tokenizer):
    messages = [{"role": "user", "content": "Who reads? " * 3}, {"role": "assistant", "content": "The cat reads. " * 20}]
    full, _, _ = render_sft(messages, tokenizer, max_len=10_000)
    ids, labels, reason = render_sft(messages, tokenizer, max_len=40)
    assert reason == "" and len(ids) == len(labels) == 40 and ids == full[:40]
    _, _, reason = render_sft(messages, tokenizer, max_len=5)  # the cut falls before the reply
    assert reason == "no_assistant_tokens_after_truncation"


@pytest.mark.parametrize("record,reason", [
    ({"id": "x"}, "missing_conversation"),
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}, "missing_field"),
    ({"conversations": [{"from": "narrator", "value": "a"}, {"from": "gpt", "value": "b"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": " "}]}, "empty_turn"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}, "non_alternating"),
    ({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "non_alternating"),
    ({"conversations": []}, "empty_conversation"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, ""),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "a"},
                        {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"}]}, ""),
])
def test_normalize_conversation(record, reason):
    messages, got = normalize_conversation(record)
    assert got == reason and (messages is None) == bool(reason)
    if messages:
        assert messages[-1]["role"] == "assistant"  # a trailing user turn is dropped


def test_prepare_sft_counts_malformed_records(tokenizer):
    records = load_records(DataConfig(path=str(FIXTURES / "sharegpt.json")))
    kept, skipped = prepare_sft(records, tokenizer, max_len=2048)
    assert len(kept) == 12
    assert skipped == Counter(missing_field=1, unknown_role=1, empty_turn=1, non_alternating=2, empty_conversation=1)


def test_prepare_sft_messages_layout(tokenizer):
    records = load_records(DataConfig(path=str(FIXTURES / "messages.jsonl")))
    kept, skipped = prepare_sft(records, tokenizer, max_len=2048)
    assert len(kept) == 6 and not skipped


def test_prepare_sft_fails_when_everything_is_skipped(tokenizer, tmp_path):
    bad = [{"id": "a", "conversations": [{"from": "narrator", "value": "x"}]},
           {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]}]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="all 2 SFT records were skipped.*unknown_role"):
        prepare_sft(load_records(DataConfig(path=str(tmp_path / "bad.json"))), tokenizer, 2048)


def test_sft_batches_are_right_padded_and_resumable(tokenizer):
    records = load_records(DataConfig(path=str(FIXTURES / "sharegpt.json")))
    kept, _ = prepare_sft(records, tokenizer, max_len=2048)
    a = SFTExamples(kept, tokenizer.pad_token_id, seed=0, rank=0, world=2)
    batch = a.next_batch(3)
    lengths = batch["attention_mask"].sum(1)
    for row, n in zip(range(3), lengths):
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all() and (batch["attention_mask"][row, :n] == 1).all()
    state = a.state_dict()
    rest = [a.next_batch(2)["input_ids"].tolist() for _ in range(5)]  # 6 examples per rank: wraps twice
    b = SFTExamples(kept, tokenizer.pad_token_id, seed=0, rank=0, world=2)
    b.load_state_dict(state)
    assert [b.next_batch(2)["input_ids"].tolist() for _ in range(5)] == rest and a.epoch == 2


def test_bad_data_inputs_fail_clearly(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        load_records(DataConfig(path=str(tmp_path / "missing.jsonl")))
    records = load_records(DataConfig(path=str(FIXTURES / "fineweb_edu.jsonl")))
    with pytest.raises(ValueError, match="column named 'content'.*columns"):
        PackedSequences(records, tokenizer, DataConfig(text_column="content"), 0, 1)
    with pytest.raises(ValueError, match="'conversations' or 'messages'"):
        prepare_sft(records, tokenizer, 2048)


def test_hub_dataset_id_goes_to_load_dataset_with_config_and_streaming(tokenizer, monkeypatch):
    """No network in tests: the hub call is intercepted, and fed local FineWeb-Edu-shaped rows."""
    calls = []
    local = datasets.load_dataset("json", data_files=str(FIXTURES / "fineweb_edu.jsonl"), split="train", streaming=True)

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return local

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(path="HuggingFaceFW/fineweb-edu", hub_config="sample-10BT", streaming=True, seq_len=8)
    records = load_records(cfg)
    assert calls == [("HuggingFaceFW/fineweb-edu", {"name": "sample-10BT", "split": "train", "streaming": True})]
    assert next(PackedSequences(records, tokenizer, cfg, rank=0, world=1)).shape == (8,)
