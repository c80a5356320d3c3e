"""`mamba-draft bench` on tiny random models: valid JSON, markdown and PNGs; lossless methods match the target."""
from __future__ import annotations

import json

import pytest
import torch

from mamba_draft.benchmarks.bench import resolve_methods
from mamba_draft.benchmarks.methods import parse_method
from mamba_draft.benchmarks.corpus import train_tokenizer
from mamba_draft.commands import cli
from mamba_draft.devices import default_dtype

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\ndef main():\n    return os.getcwd()\n",
] * 20


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A random tiny Llama target, a random tiny Mamba drafter and a Llama assistant sharing a local tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

    root = tmp_path_factory.mktemp("pair")
    tokenizer = train_tokenizer(TEXT, vocab_size=120)
    vocab = len(tokenizer)
    special = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    for name, layers in (("target", 2), ("assistant", 1)):
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=2, max_position_embeddings=256, **special)
        LlamaForCausalLM(cfg).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, state_size=4,
                                 **special)).save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "category": c}) + "\n"
                               for t, c in [("def add(a,", "def"), ("class Point:", "class"), ("for i in", "def")]))
    return root, prompts


def test_bench_writes_json_markdown_and_png(tiny_pair, tmp_path):
    root, prompts = tiny_pair
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
                     "--assistant", str(root / "assistant"), "--prompts", str(prompts), "--repeats", "2",
                     "--max-new-tokens", "12", "--methods", "hf-ar", "hf-assisted", "chain:3", "2,2,1",
                     "cpu=bandit-time:1,1,1/2,1", "2,1@fly", "hf-lookup", "lk=bandit-time:1,1,1/2,1+lookup:4",
                     "none+lookup", "tf=assistant:2,1", "assistant:chain:2+lookup:4", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert list(result["batches"]) == ["1"]  # one prompt at a time: a batch of one
    methods = result["batches"]["1"]["methods"]
    # `ar` was added as the baseline of our harness; every speedup is against the faster of ar and hf-ar
    assert list(methods)[0] == "ar" and result["baselines"] == ["ar", "hf-ar"] and result["reference"] == "ar"
    for name in ("ar", "hf-ar", "hf-assisted", "chain:3", "2,2,1", "cpu", "hf-lookup", "lk", "none+lookup",
                 "tf", "assistant:chain:2+lookup:4"):
        s = methods[name]
        assert s["lossless"] and s["equality"]["all_repeats_identical"], (name, s["equality"])
        assert len(s["tokens_per_s"]) == 2 and all(v > 0 for v in s["tokens_per_s"])
        assert set(s["categories"]) == {"def", "class"}
    assert methods["ar"]["tau"] == [1.0, 1.0] and methods["hf-ar"]["tau"] == [1.0, 1.0]
    assert methods["2,2,1"]["tau"][0] >= 1.0
    assert methods["2,1@fly"]["lossless"] is False and "prefix_agreement" in methods["2,1@fly"]["equality"]
    assert methods["cpu"]["tree"] == "bandit-time:1,1,1/2,1"  # LABEL=METHOD; measured-time reward
    assert parse_method("lk=bandit-time:1,1,1/2,1+lookup:4").lookup == 4 and parse_method("none+lookup").lookup == 8
    # assistant: methods draft with the --assistant Llama in our engine (a TransformerDrafter), the rest with --drafter
    assert parse_method("tf=assistant:2,1").drafter == "assistant" and parse_method("2,1").drafter == "drafter"
    assert methods["tf"]["tau"][0] >= 1.0
    # the bandit starts afresh on each prompt; the report sums its pulls over the last repeat's three prompts
    last = result["batches"]["1"]["runs"]["cpu"][-1]["records"]
    assert sum(v["pulls"] for v in methods["cpu"]["arms"].values()) == sum(r["rounds"] for r in last)
    assert all(sum(r["arm_pulls"].values()) == r["rounds"] and len(r["arm_pulls"]) == 2 for r in last)
    md = (out / "bench.md").read_text()
    assert "| chain:3 |" in md and "identical" in md and "per category" in md
    assert "| speedup vs best of ar/hf-ar | vs ar | vs hf-ar |" in md
    for png in ("bench_tokens_per_s.png", "bench_tau.png", "bench_speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*tmp"))  # atomic writes leave no temporaries


def test_bench_rejects_bad_arguments_before_loading(tiny_pair, tmp_path):
    root, prompts = tiny_pair
    base = ["bench", "--target", str(root / "target"), "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="need --drafter"):
        cli.main(base + ["--methods", "chain:5"])
    with pytest.raises(ValueError, match="needs --assistant"):
        cli.main(base + ["--methods", "hf-assisted"])
    with pytest.raises(ValueError, match="assistant: methods draft with --assistant"):
        cli.main(base + ["--methods", "assistant:chain:5"])
    with pytest.raises(ValueError, match="crashes with recurrent-state assistants"):
        cli.main(base + ["--methods", "hf-assisted", "--assistant", str(root / "drafter")])
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        cli.main(base + ["--drafter", str(root / "drafter"), "--methods", "chain:5@nope"])
    with pytest.raises(ValueError, match="unknown method"):
        resolve_methods(["beam"])
    for bad in ("chain:5+lookup:0", "chain:5+lookup8", "chain:5+lookup:x"):
        with pytest.raises(ValueError, match=r"\+lookup takes a proposal length"):
            resolve_methods([bad])
    with pytest.raises(ValueError, match="prompt lookup decodes one prompt at a time"):
        cli.main(base + ["--drafter", str(root / "drafter"), "--methods", "chain:5+lookup", "--batch-size", "2"])
    with pytest.raises(ValueError, match="duplicate methods"):
        resolve_methods(["chain:5", "chain:5"])
    assert not (tmp_path / "o").exists()


CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_bench_resolves_sampling_once_for_every_method(tiny_pair, tmp_path, monkeypatch):
    """A target that samples by default: hf-* and our methods all get the generation_config's values, explicitly,
    and the result records them; --system-prompt goes through the chat template; --threads reaches the run."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mamba_draft.benchmarks import bench

    root, prompts = tiny_pair
    target = LlamaForCausalLM.from_pretrained(root / "target")
    target.generation_config.do_sample, target.generation_config.temperature = True, 0.8  # top_k/top_p left unset
    target.save_pretrained(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    seen = []
    for name in ("run_hf", "run_ours"):
        real = getattr(bench, name)
        monkeypatch.setattr(bench, name, lambda *a, real=real: seen.append(a[4]) or real(*a))
    out = tmp_path / "out"
    argv = ["bench", "--target", str(tmp_path / "target"), "--drafter", str(root / "drafter"), "--tokenizer",
            str(tmp_path / "tokenizer"), "--prompts", str(prompts), "--repeats", "1", "--warmup", "0",
            "--max-new-tokens", "4", "--system-prompt", "be brief", "--threads", "2", "--out", str(out)]
    before = torch.get_num_threads()
    try:
        assert cli.main(argv + ["--methods", "hf-ar", "ar", "chain:2@sampling"]) == 0
    finally:
        torch.set_num_threads(before)
    result = json.loads((out / "bench.json").read_text())
    resolved = {"temperature": 0.8, "top_p": 1.0, "top_k": 50}
    assert {k: result["config"][k] for k in resolved} == resolved and result["config"]["system_prompt"] == "be brief"
    assert len(seen) == 3 * 3 and all(s == resolved for s in seen)  # 3 methods x 3 prompts, one sampling for all
    assert result["device"] == "CPU (2 threads)" and result["references"] is None
    first = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "def add(a,"}], add_generation_prompt=True)
    assert result["prompt_tokens"][0] == len(first["input_ids"] if hasattr(first, "keys") else first)
    assert "top-k 50" in (out / "bench.md").read_text()
    # the default greedy verifier cannot verify the sampled target: refused once the target says it samples
    with pytest.raises(ValueError, match="verifier 'greedy' is greedy-only; use chain:2@sampling"):
        cli.main(argv + ["--methods", "chain:2"])


def test_bench_loads_targets_through_mamba_draft_targets(tiny_pair, tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mamba_draft import targets

    root, prompts = tiny_pair
    calls = []
    monkeypatch.setattr(targets, "load_tokenizer",
                        lambda path: calls.append(str(path)) or AutoTokenizer.from_pretrained(root / "target"))
    monkeypatch.setattr(targets, "load_causal_lm", lambda path, **kw: calls.append((str(path), kw))
                        or LlamaForCausalLM.from_pretrained(root / "target").eval())
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")  # only its name is checked: the loader is replaced
    assert cli.main(["bench", "--target", str(gguf), "--prompts", str(prompts), "--methods", "ar", "--repeats", "1",
                     "--max-new-tokens", "3", "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    # --dtype auto, as every command: bf16 where native; attention, packing, row blocks: load_causal_lm's defaults
    kw = {"dtype": default_dtype("cpu"), "device": "cpu"}
    assert calls == [(str(gguf), kw), str(gguf)]  # no hf-* method: no plain copy
    calls.clear()
    assert cli.main(["bench", "--target", str(gguf), "--prompts", str(prompts), "--methods", "hf-ar", "--repeats", "1",
                     "--max-new-tokens", "3", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "o")]) == 0
    plain = {"dtype": torch.float32, "device": "cpu", "attn_implementation": None, "pack": False, "row_blocks": False}
    assert calls == [(str(gguf), kw | {"dtype": torch.float32}), str(gguf), (str(gguf), plain)]


def test_bench_rejects_bad_target_and_sampling_arguments_before_loading(tiny_pair, tmp_path):
    root, prompts = tiny_pair
    base = ["bench", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--methods", "ar"]
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match="^mamba-draft bench: error: --target .*weights.bin is a file but not a .gguf"):
        cli.main(base + ["--target", str(tmp_path / "weights.bin")])
    with pytest.raises(SystemExit, match="^mamba-draft bench: error: --target .*nowhere does not exist: give"):
        cli.main(base + ["--target", str(tmp_path / "nowhere")])
    target = ["--target", str(root / "target")]
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        cli.main(base + target + ["--temperature", "-1"])
    with pytest.raises(ValueError, match="top_p must be in"):
        cli.main(base + target + ["--top-p", "0"])
    with pytest.raises(ValueError, match="--system-prompt needs the chat template"):
        cli.main(base + target + ["--system-prompt", "hi", "--no-chat-template"])
    with pytest.raises(ValueError, match="greedy-only"):
        cli.main(base + target + ["--drafter", str(root / "drafter"), "--methods", "chain:5", "--temperature", "0.5"])
    assert not (tmp_path / "o").exists()


def test_lossless_reference_is_our_plain_decoding_whenever_it_ran():
    """Lossless outputs are checked against `ar` on the same exact model; hf-* methods alone against `hf-ar`."""
    from mamba_draft.benchmarks import bench

    assert bench.reference_method(["ar", "hf-ar", "chain:5"]) == "ar"
    assert bench.reference_text({"reference": "ar"}) == "plain decoding (ar)"
    assert bench.reference_method(["hf-ar", "hf-lookup"]) == "hf-ar"
    assert bench.reference_text({"reference": "hf-ar"}) == "transformers' greedy (hf-ar)"


def test_methods_take_turns_prompt_by_prompt_each_keeping_its_policy_over_the_pass(monkeypatch):
    """Within a repeat every method runs prompt 0, then every method prompt 1, ... (a drifting machine times all
    methods on a prompt within seconds); a pass-memory bandit stays one object over its pass, fresh per repeat."""
    from mamba_draft.benchmarks import bench
    from mamba_draft.benchmarks.methods import Models

    calls = []

    def fake_ours(method, models, ids, max_new_tokens, sampling, eos, policy, seed, mask=None, decoders=None):
        calls.append((method.name, int(ids[0, 0]), id(policy) if policy is not None else None, seed))
        return [1], {"new_tokens": 1, "wall_time": 1.0, "rounds": 1, "accepted": 1, "arm_pulls": {}}

    def fake_hf(method, models, ids, max_new_tokens, sampling, eos, pad, mask=None):
        calls.append((method.name, int(ids[0, 0]), None, None))
        return [1], {"new_tokens": 1, "wall_time": 1.0, "rounds": 1, "accepted": 1}

    monkeypatch.setattr(bench, "run_ours", fake_ours)
    monkeypatch.setattr(bench, "run_hf", fake_hf)
    methods = [parse_method(m) for m in ("ar", "hf-ar", "cpu=bandit-time:1,1/2,1")]
    cfg = bench.BenchConfig(methods=tuple(m.name for m in methods), repeats=2, warmup=1, bandit_memory="pass",
                            temperature=0.0)
    batches = bench.make_batches([torch.tensor([[10 + i, 1]]) for i in range(3)], 1)

    class Bar:
        updates = 0

        def set_postfix_str(self, _):
            pass

        def update(self, n):
            Bar.updates += n

    runs = bench.measure(methods, Models(target=torch.nn.Linear(1, 1)), batches, cfg, [], Bar(), cfg)
    warm, timed = calls[:3], calls[3:]
    assert [(name, prompt) for name, prompt, _, _ in warm] == [("ar", 10), ("hf-ar", 10), ("cpu", 10)]
    order = [(name, prompt) for name, prompt, _, _ in timed]
    assert order == [(m.name, 10 + i) for _ in range(2) for i in range(3) for m in methods]
    bandits = [[policy for name, _, policy, _ in timed[r * 9:(r + 1) * 9] if name == "cpu"] for r in range(2)]
    assert all(len(set(b)) == 1 for b in bandits) and bandits[0][0] != bandits[1][0]
    assert [seed for name, _, _, seed in timed if name == "ar"] == [0, 1, 2, 1000, 1001, 1002]
    assert Bar.updates == 18 and all(len(runs[m.name]) == 2 and len(runs[m.name][0]["records"]) == 3
                                     for m in methods)


def fake_runs(rates: dict[str, list[float]], categories=("a", "b")) -> dict:
    """{method: per repeat, one record per category decoding `rate` tokens in one second}."""
    return {name: [{"records": [{"new_tokens": r, "wall_time": 1.0, "rounds": r, "accepted": r}
                                for _ in categories], "arms": {}} for r in per_repeat]
            for name, per_repeat in rates.items()}


def test_speedups_are_against_the_fastest_baseline_repeat_by_repeat():
    """hf-ar is faster in repeat 0, ar in repeat 1: the headline speedup divides by the faster one each time (against
    ar alone it would read 3.0x in repeat 0); per-prompt and batch summaries, per category too."""
    from mamba_draft.benchmarks import bench
    from tree_search.prompts import Prompt

    runs = fake_runs({"ar": [10, 20], "hf-ar": [20, 10], "chain:5": [30, 30]})
    prompts = [Prompt("x", "a"), Prompt("y", "b")]
    single = bench.summarize(parse_method("chain:5"), runs, prompts, None, by_prompt=True)
    batch = bench.summarize(parse_method("chain:5"), runs, prompts, None, by_prompt=False)
    assert "categories" in single and "categories" not in batch  # a batch's records are not one prompt's
    for s in (single, batch, single["categories"]["a"]):
        assert s["speedup"] == [pytest.approx(1.5), pytest.approx(1.5)]
        assert s["speedup_vs_ar"] == [pytest.approx(3.0), pytest.approx(1.5)]
        assert s["speedup_vs_hf-ar"] == [pytest.approx(1.5), pytest.approx(3.0)]
    assert bench.summarize(parse_method("ar"), runs, prompts, None, by_prompt=True)["speedup"] == [0.5, 1.0]

    def result(runs, shares=None):
        cfg = {"max_new_tokens": 4, "temperature": 0.0, "repeats": 2, "bandit_memory": "call", "batch_sizes": [1],
               "shares": shares}
        methods = {n: bench.summarize(parse_method(n), runs, prompts, None, by_prompt=True) for n in runs}
        return {"config": cfg, "prompts": prompts, "device": "CPU", "reference": "ar",
                "baselines": bench.baselines_of(runs), "batches": {"1": {"methods": methods, "runs": runs}}}

    md = bench.markdown_report(result(runs))
    assert "| speedup vs best of ar/hf-ar | vs ar | vs hf-ar |" in md and "| 1.50 ± 0.00× | 2.25 ± 1.06× |" in md
    assert "fastest of `ar`, `hf-ar` (our plain decoding" in md and "Speedup vs best of ar/hf-ar (τ)" in md
    # llama.cpp is a baseline too; a slow baseline cut to the first prompt (a share) rates over that prompt alone
    runs = fake_runs({"ar": [10, 10], "hf-ar": [5, 5], "llama-cpp": [15, 15], "chain:5": [30, 30]})
    runs["hf-ar"] = [{"records": run["records"][:1], "arms": {}} for run in runs["hf-ar"]]
    single = bench.summarize(parse_method("chain:5"), runs, prompts, None, by_prompt=True)
    assert single["speedup"] == [pytest.approx(2.0)] * 2 and single["speedup_vs_hf-ar"] == [pytest.approx(6.0)] * 2
    assert "speedup_vs_hf-ar" in single["categories"]["a"] and "speedup_vs_hf-ar" not in single["categories"]["b"]
    md = bench.markdown_report(result(runs, shares={"hf-ar": 1}))
    assert "| speedup vs best of ar/hf-ar/llama-cpp | vs ar | vs hf-ar | vs llama-cpp |" in md
    assert "`hf-ar` decoded the first 1 of the 2 prompts" in md
    assert "| hf-ar | 0.33× (τ 1.00) | – |" in md  # hf-ar has no rate in category b
    alone = bench.markdown_report(result(fake_runs({"ar": [10, 20], "chain:5": [30, 30]})))
    assert "| speedup vs ar (hf-ar, llama-cpp not run) | drafter state |" in alone and "| 2.25 ± 1.06× | – |" in alone


def test_hf_methods_run_transformers_generate_on_a_plain_copy(tiny_pair, tmp_path, monkeypatch):
    """hf-* methods run on a separate copy of the target (and assistant) loaded the plain way: same dtype,
    transformers' default attention, no prepacked or row-block layers; ours on the target as generate loads it."""
    from transformers import AutoModelForCausalLM

    from mamba_draft.benchmarks import bench
    from mamba_draft.packed_linear import PackedLinear

    root, prompts = tiny_pair
    given = []
    real = bench.run_hf
    monkeypatch.setattr(bench, "run_hf", lambda method, models, *a: given.append((method.name, models))
                        or real(method, models, *a))
    assert cli.main(["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--assistant",
                     str(root / "assistant"), "--prompts", str(prompts), "--methods", "hf-ar", "hf-assisted", "chain:2",
                     "--repeats", "1", "--warmup", "0", "--max-new-tokens", "3", "--dtype", "float32",
                     "--out", str(tmp_path / "o")]) == 0
    assert {name for name, _ in given} == {"hf-ar", "hf-assisted"}
    models = given[0][1]
    for copy, path in zip(models.for_hf(), ("target", "assistant")):
        assert copy is not models.target and copy is not models.assistant
        assert not any(isinstance(m, PackedLinear) for m in copy.modules())  # row-block layers are PackedLinears
        assert all(type(m).__module__.startswith(("transformers.", "torch.")) for m in copy.modules())
        default = AutoModelForCausalLM.from_pretrained(root / path, dtype=torch.float32)
        assert copy.config._attn_implementation == default.config._attn_implementation
        assert next(copy.parameters()).dtype == torch.float32 and not copy.training


def test_default_method_is_what_generate_runs_by_default(tiny_pair, tmp_path, monkeypatch):
    """`--methods default` hands the engine the policy, lookup rounds and verifier `mamba-draft generate` resolves
    for tree "auto" (tree_search.cli: policy.parse_policy / plan.default_lookup_tokens), on a CPU and on a GPU: one
    SpeculativeDecoder for the pass."""
    import importlib

    from mamba_draft.benchmarks.bench import DEFAULT_METHODS
    from mamba_draft.benchmarks.methods import lookup_of
    from tree_search.plan import default_lookup_tokens
    from tree_search.arms import PlannedBandit
    from tree_search.policy import parse_policy

    engine = importlib.import_module("tree_search.generate")  # the module (the package exports its function)
    root, prompts = tiny_pair
    seen = []
    real = engine.SpeculativeDecoder
    monkeypatch.setattr(engine, "SpeculativeDecoder", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    assert cli.main(["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
                     str(prompts), "--methods", "default", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "3",
                     "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    seen = [kw for kw in seen if kw["tree"] is not None]  # `ar`, which bench adds to any of ours, has no policy
    assert len(seen) == 1 and all(kw["verifier"] is None for kw in seen)  # generate picks greedy / sampling
    for kw in seen:  # --bandit-memory call: the policy restarts at every call
        assert isinstance(kw["tree"], PlannedBandit) and not kw["tree"].persistent
        assert kw["lookup_tokens"] == default_lookup_tokens("auto", "cpu", False, False) > 0
    method = parse_method("default")
    assert method.lossless and "default" in DEFAULT_METHODS and method.tree == "auto"  # measured by default
    # --bandit-memory pass: `default` learns over the pass as a SpeculativeDecoder learns over its calls
    assert parse_policy(method.tree, persistent=True).persistent
    for device in ("cpu", "cuda"):  # resolving a policy needs no GPU
        for batch in (False, True):
            assert lookup_of(method, device, batch) == default_lookup_tokens("auto", device, batch, False)
    assert parse_method("default@fly").verifier == "fly" and parse_method("default+lookup:4").lookup == 4


def test_bench_dtype_defaults_to_auto():
    assert cli.build_parser("bench").parse_args(["--target", "t", "--out", "o"]).dtype == "auto"


def test_methods_draft_in_generates_tree_grammar():
    """A method's drafting part is `generate --tree`'s grammar (tree_search.policy), parsed by `parse_policy` alone;
    `default` is a method (policy auto with generate's lookup rounds and verifier), `auto` the bare policy; a policy's
    spec is what the result records."""
    from tree_search.bandit import DEFAULT_ARMS
    from tree_search.policy import parse_policy, spec_of

    default, auto = parse_method("default"), parse_method("auto")
    assert default.tree == auto.tree == "auto" and (default.lookup, default.verifier) == (None, None)
    assert (auto.lookup, auto.verifier) == (0, "greedy") and parse_method("auto+lookup:4@fly").lookup == 4
    assert parse_method("chain:3").tree == "1,1,1" and parse_method("none").tree == "none"
    assert parse_method("3,2,2,1,1").tree == "3,2,2,1,1" and parse_method("assistant:2,1").drafter == "assistant"
    assert parse_method("bandit").tree == spec_of(parse_policy("bandit")) == "bandit:" + "/".join(
        arm.spec for arm in DEFAULT_ARMS)
    assert parse_method("bandit-time:none/2,1@fly").tree == "bandit-time:none/2,1"
    for bad, message in (("chain:0", "chain:N takes a positive length"), ("bandit:2,1//1", "tree spec '' is empty"),
                         ("3,,2", "cannot parse tree spec"), ("beam", "unknown method 'beam'"),
                         ("tree:2,1", "unknown method"), ("chain", "unknown method"),
                         ("assistant:ar", "unknown method")):
        with pytest.raises(ValueError, match=message) as err:
            parse_method(bad)
        assert "\n" not in str(err.value) and "a method is hf-ar, " in str(err.value)
        assert "expected auto, none, a shape like 3,2,2,1,1, chain:N" in str(err.value)


class StandInLlama:
    """llama_cpp.Llama's surface the llama-cpp method uses (reset, set_seed, a generate token stream), continuing
    each prompt with the tiny target's own greedy tokens; it records what it was asked."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.reset_before, self.yielded = model, [], [], []

    def reset(self) -> None:
        self.reset_before.append(len(self.calls))

    def set_seed(self, seed: int) -> None:
        self.calls.append(("seed", seed))

    def generate(self, tokens, **options):
        self.calls.append(("generate", list(tokens), options))
        with torch.no_grad():
            out = self.model.generate(torch.tensor([tokens]), max_new_tokens=40, do_sample=False, pad_token_id=0)
        self.yielded.append(0)
        for token in out[0, len(tokens):].tolist():
            self.yielded[-1] += 1
            yield token


def test_the_llama_cpp_method_runs_the_gguf_beside_ours(tiny_pair, tmp_path, monkeypatch):
    """Wired without building llama.cpp: each prompt whole from an empty cache (reset first), greedy with none of
    llama.cpp's own filters, stopped at the token budget, reported as another implementation's agreement."""
    from transformers import LlamaForCausalLM

    from mamba_draft.benchmarks import llama_cpp

    root, prompts = tiny_pair
    stand_in = StandInLlama(LlamaForCausalLM.from_pretrained(root / "target").eval())
    monkeypatch.setattr(llama_cpp, "available", lambda: True)
    monkeypatch.setattr(llama_cpp, "load", lambda target, threads=None: stand_in)
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(root / "target"), "--prompts", str(prompts), "--methods", "llama-cpp",
                     "--repeats", "1", "--max-new-tokens", "6", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    methods = result["batches"]["1"]["methods"]
    assert list(methods) == ["ar", "llama-cpp"]  # our plain decoding runs beside it, as its baseline
    assert methods["llama-cpp"]["tokens_per_s"][0] > 0 and methods["llama-cpp"]["kind"] == "llama-cpp"
    generates = [c for c in stand_in.calls if c[0] == "generate"]
    assert len(generates) >= 3 and all(stand_in.calls[i][0] == "seed" for i in stand_in.reset_before)  # (+ warm-up)
    assert all(c[2]["temp"] == 0.0 and c[2]["min_p"] == 0.0 and c[2]["repeat_penalty"] == 1.0 for c in generates)
    assert stand_in.yielded[-3:] == [6, 6, 6]  # the budget stops the stream (the stand-in's has 40 tokens)
    assert methods["llama-cpp"]["equality"]["n_prompts"] == 3  # its agreement with ar, reported


def test_the_llama_cpp_method_says_how_to_install_it_and_what_it_needs(tiny_pair, tmp_path, monkeypatch):
    from mamba_draft.benchmarks import llama_cpp

    root, prompts = tiny_pair
    base = ["bench", "--target", str(root / "target"), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
            "--methods", "llama-cpp"]
    monkeypatch.setattr(llama_cpp, "available", lambda: False)
    with pytest.raises(ImportError, match=r"needs llama-cpp-python: pip install 'mamba-draft\[llama-cpp\]'") as err:
        cli.main(base)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(llama_cpp, "available", lambda: True)
    with pytest.raises(ValueError, match="llama-cpp decodes one prompt at a time"):
        cli.main(base + ["--batch-size", "2"])
    with pytest.raises(ValueError, match="runs a .gguf target"):
        llama_cpp.load(str(root / "target"))
    assert not (tmp_path / "o").exists()
