"""`mamba-draft demo --quick` on the real pair: shipped SmolLM2 GGUF -> regenerated even-id data -> drafter and
assistant -> greedy and sampled tables on held-out odd-id Spec-Bench questions; then from cache."""
from __future__ import annotations

import json

import pytest
import torch

from mamba_draft.benchmarks import demo
from mamba_draft.benchmarks.real_pair import heldout_prompts, training_prompts
from mamba_draft.heldout import SPEC_BENCH, is_heldout, read_spec_bench
from mamba_draft.commands import cli
from mamba_draft.benchmarks import llama_cpp
from mamba_draft.devices import cpu_info

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)


def test_held_out_questions_never_reach_training_prompts():
    from mamba_draft.targets import SHIPPED_TARGET, load_tokenizer

    records = read_spec_bench(SPEC_BENCH)
    train = training_prompts(records, load_tokenizer(SHIPPED_TARGET), 10**6, None)
    assert train and not any(is_heldout(r) for r in train)
    assert {r["category"] for r in train} == {r["category"] for r in records}
    bench = heldout_prompts(records, 1)
    assert all(is_heldout(r) for r in bench)
    assert len(bench) == len({r["category"] for r in records}) == 13  # every category, one question each


@pytest.fixture(scope="module")
def quick_train(tmp_path_factory):
    cache = tmp_path_factory.mktemp("real-demo")
    assert cli.main(["demo", "--train", "--quick", "--cache-dir", str(cache)]) == 0
    (run_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    return cache, run_dir


def test_quick_rebuild_makes_data_trains_the_pair_and_benchmarks_it(quick_train):
    from transformers import AutoConfig

    from mamba_draft import MambaDrafter
    from training.make_data import read_shard

    _, run_dir = quick_train
    _, quick = demo.real_configs()
    assert AutoConfig.from_pretrained(run_dir / "assistant").model_type == "llama"
    drafter = MambaDrafter.from_pretrained(str(run_dir / "drafter"))
    assert drafter.config.arch == "mamba2"
    assert drafter.vocab_size == quick.draft_vocab_size  # a draft vocabulary, from the training data
    assert drafter.input_vocab_size == 49152
    from mamba_draft import load_drafter

    assistant = load_drafter(run_dir / "assistant")  # the same draft vocabulary, stored beside its full model
    assert type(assistant).__name__ == "TransformerDrafter" and torch.equal(assistant.draft_ids, drafter.draft_ids)
    prompts = read_shard(run_dir / "data" / "prompts.jsonl")
    questions = [p for p in prompts if p["source"] == "even_questions" and "history" not in p]
    assert {p["source"] for p in prompts} <= {"even_questions", "magpie", "magpie_task"}
    assert len(questions) == quick.train_prompts and all(int(p["id"].split(":")[1]) % 2 == 0 for p in questions)
    # a question's own second turn is asked after the target's reply to its first
    later = [p for p in prompts if "history" in p]
    assert {p["id"] for p in later} == {f"{q['id']}/2" for q in questions if q.get("next_turns")}
    for t in ("0", "0.7"):  # greedy and sampled replies, with the target's cached distributions
        assert len(read_shard(run_dir / "data" / f"replies-T{t}.jsonl")) == len(prompts)
    assert (run_dir / "drafter" / "agreement.png").read_bytes()[:4] == b"\x89PNG"

    result = json.loads((run_dir / "results" / "demo.json").read_text())
    for model in ("drafter", "assistant"):
        assert result["training"][model] and 0 <= result["training"][model][-1]["heldout_agreement"] <= 1
    assert result["dtype"] == "float32"  # as `generate` runs the GGUF target on a CPU (`targets.auto_dtype`)
    assert result["products"] == ("int8" if "avx2" in cpu_info("flags").split() else "float")  # --products auto
    specs = demo.real_methods(result["dtype"], assistant=True, full_sweep=False)
    assert "hf-assisted" in specs["greedy"]
    for table in ("greedy", "sampled"):
        methods = result[table]["batches"]["1"]["methods"]
        assert len(methods) == len(specs[table])
        assert len(result[table]["prompts"]) == quick.bench_prompts
        assert all(int(p["question_id"]) % 2 == 1 for p in result[table]["prompts"])
        # the reference is `ar`, our plain decoding on the same exact model; hf-* methods run transformers'
        # generate on a plain copy, which may round otherwise, and llama-cpp (where installed) another implementation
        # on the GGUF's own weights, so they are not held to it
        assert result[table]["reference"] == "ar"
        assert result[table]["baselines"] == ["ar", "hf-ar"] + ["llama-cpp"] * llama_cpp.available()
        assert result[table]["budget"] == result["budget"] and "summary" in result["budget"]
        for name, s in methods.items():
            assert all(v > 0 for v in s["tokens_per_s"]), (table, name)
            if table == "greedy" and s["lossless"] and not name.startswith("hf-") and s["kind"] != "llama-cpp":
                assert s["equality"]["all_repeats_identical"], (name, s["equality"])
    assert result["sampled"]["config"]["temperature"] == quick.temperature
    assert (run_dir / "results" / "demo_sampled_speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert result["sizing"]["ratio"] > 0


def test_real_demo_rerun_uses_the_cache(quick_train, monkeypatch, capsys):
    import training.make_data
    import training.train

    cache, _ = quick_train

    def never(*_, **__):
        raise AssertionError("cached data and models must not be rebuilt")

    monkeypatch.setattr(training.train, "train", never)
    monkeypatch.setattr(training.make_data, "make_data", never)
    assert cli.main(["demo", "--train", "--quick", "--cache-dir", str(cache)]) == 0
    assert "results cached" in capsys.readouterr().out
    # an installation without a shipped drafter: the default demo is the rebuild (here: its cached results)
    from mamba_draft import checkpoint

    monkeypatch.setattr(checkpoint, "SHIPPED_DRAFTERS", cache / "no-drafters-here")
    assert cli.main(["demo", "--quick", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "no drafter is shipped" in out and "results cached" in out


def test_real_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="Spec-Bench questions not found"):
        cli.main(["demo", "--quick", "--cache-dir", str(tmp_path / "c"), "--prompts", str(tmp_path / "none.jsonl")])
    with pytest.raises(ValueError, match="drop --drafter"):
        cli.main(["demo", "--train", "--drafter", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    with pytest.raises(FileNotFoundError, match="not a directory"):
        cli.main(["demo", "--drafter", str(tmp_path / "none"), "--cache-dir", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()


def test_per_category_defaults_to_two_and_to_one_with_train(tmp_path, monkeypatch):
    """--train benchmarks one held-out question per category unless told otherwise (the rebuild and its benchmark
    within 30 min on 2 cores); bad values and --toy are refused before anything is built."""
    seen = []
    monkeypatch.setattr(demo, "run_real_demo", lambda cfg, *a, **k: seen.append(cfg.per_category) or {})
    monkeypatch.setattr(demo, "print_real", lambda result: None)
    cache = ["--cache-dir", str(tmp_path / "c")]
    for args, expected in (([], 2), (["--train"], 1), (["--train", "--per-category", "3"], 3),
                           (["--per-category", "1"], 1)):
        assert cli.main(["demo", *args, *cache]) == 0
        assert seen[-1] == expected, args
    with pytest.raises(ValueError, match="--per-category must be >= 1"):
        cli.main(["demo", "--per-category", "0", *cache])
    with pytest.raises(ValueError, match="apply to the real pair"):
        cli.main(["demo", "--toy", "--per-category", "1", *cache])
    assert not (tmp_path / "c").exists()
