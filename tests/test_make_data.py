"""`mamba-draft make-data`: Magpie prompts filtered and counted, user prompt files, greedy + sampled replies that
training reads, append-only shards that survive SIGKILL (at most the batch in flight is lost)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

from mamba_draft.commands import cli
from mamba_draft.heldout import is_heldout, read_spec_bench
from tests.helpers.training_fixtures import CHATML, REPO, tiny_chat_target, train_env
from training import make_data as md
from training.config import DataConfig
from training.data import load_records, prepare_sft
from training.regenerate import TopKSampler

ODD_QUESTION = next(r for r in read_spec_bench() if is_heldout(r) and r["category"] == "writing")["turns"][0]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama with a ChatML-style template (replies depend on the prompt)."""
    out = tmp_path_factory.mktemp("target")
    tokenizer, _ = tiny_chat_target(out, CHATML)
    return out, tokenizer


def args_for(target, out, *extra) -> object:
    return cli.build_parser("make-data").parse_args(["--target", str(target), "--out", str(out), *map(str, extra)])


def scripted_magpie(samples: list[str | None]):
    """A Generate that writes `samples` as Magpie prompts (None: a sample cut before its end-of-turn) and answers
    replies with real greedy/sampled tokens of the model."""
    queue = list(samples)

    def generate(model, tokenizer, prompts, *, max_new_tokens, temperature, top_p, eos_token_ids):
        if top_p == md.MAGPIE_TOP_P:  # a Magpie batch: every row is the template prefix
            rows = []
            for _ in prompts:
                text = queue.pop(0)
                ids = tokenizer("x " * (max_new_tokens + 1), add_special_tokens=False)["input_ids"] if text is None \
                    else tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_ids[0]]
                rows.append(ids)
            return rows
        return md.hf_sample(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, eos_token_ids=eos_token_ids)
    return generate


def test_request_filter():
    assert md.request_verdict("How do I sort a list in Python?") == ""
    assert md.request_verdict("Write a haiku about rain.") == ""
    assert md.request_verdict("I need help planning a trip to Rome.") == ""
    assert md.request_verdict("The weather was nice yesterday.") == "not_a_request"
    assert md.request_verdict("Hi there") == "too_short"
    assert md.request_verdict("I'm SmolLM, a helpful assistant. How can I help?") == "assistant_voice"
    assert md.request_verdict("You are a helpful assistant. I'll send you a text, what is it?") == "assistant_voice"
    assert md.request_verdict("I'm a new AI assistant, how can I help you today?") == "assistant_voice"
    assert md.request_verdict("I'm a student. How do I cite a book in APA style?") == ""


def test_magpie_prompts_are_filtered_counted_and_answered(target, tmp_path):
    path, tokenizer = target
    samples = ["How do I sort a list in Python?", "how do  I sort a list in python?",  # a duplicate
               "The weather was nice yesterday.", None,  # not a request; cut before its end-of-turn
               f"Please help: {' '.join(ODD_QUESTION.split()[:10])}?",  # quotes a held-out question
               "Write a short story about a robot learning to paint."]
    user_file = tmp_path / "mine.jsonl"
    user_file.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Explain recursion with an example."}, {"prompt": ODD_QUESTION},  # the second is held out
        {"question_id": 2, "category": "writing", "turns": ["Explain recursion with an example."]}]))  # duplicate
    out = tmp_path / "data"
    args = args_for(path, out, "--magpie", 6, "--batch-size", 3, "--prompts", user_file, "--temperatures", "0,0.7",
                    "--max-new-tokens", 12, "--dtype", "float32")
    manifest = md.make_data(args, generate=scripted_magpie(samples), progress=False)

    prompts = md.read_shard(out / "prompts.jsonl")
    assert [p["prompt"] for p in prompts] == ["Explain recursion with an example.", "How do I sort a list in Python?",
                                              "Write a short story about a robot learning to paint."]
    assert manifest["magpie"] == {"samples": 6, "kept": 2, "dropped": {
        "duplicate": 1, "not_a_request": 1, "cut": 1, "heldout_overlap": 1}}
    assert manifest["prompts"]["dropped_from_files"] == {"heldout_question": 1, "duplicate": 1}
    for t in ("0", "0.7"):
        rows = md.read_shard(out / f"replies-T{t}.jsonl")
        assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in prompts)
        assert manifest["replies"][t]["replies"] == 3
        assert manifest["replies"][t]["tokens"] == sum(len(r["reply_ids"]) for r in rows) > 0
    greedy = {r["id"]: r for r in md.read_shard(out / "replies-T0.jsonl")}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]["prompt"]}], tokenize=False,
                                        add_generation_prompt=True)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path)
    x = torch.tensor([tokenizer(ids, add_special_tokens=False)["input_ids"]])
    ref = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[0, x.size(1):].tolist()
    eos = md.eos_token_ids(tokenizer, ref_model)
    reply, cut = md.cut_at_eos(ref, eos, 12)
    record = greedy[prompts[0]["id"]]
    assert record["reply_ids"] == reply  # greedy = the target's own

    # the cached top-K is the target's distribution at every reply position (and the end-of-turn one)
    ids, logp = md.read_topk(out, 0.0, record)
    assert ids.shape == logp.shape == (len(reply) + (not cut), md.TOPK)
    assert ids[:, 0].tolist() == reply + ([] if cut else [ref[len(reply)]])  # greedy: the top-1 is the token
    full = torch.cat([x[0], torch.tensor(ref[:ids.size(0) - 1], dtype=torch.long)])
    with torch.no_grad():
        want = torch.log_softmax(ref_model(full[None]).logits[0, x.size(1) - 1:].float(), -1)
    torch.testing.assert_close(logp, want.gather(-1, ids), atol=2e-3, rtol=1e-3)  # float16 storage
    for r in md.read_shard(out / "replies-T0.7.jsonl"):  # sampled replies: their temperature-1 distribution
        ids, logp = md.read_topk(out, 0.7, r)
        assert ids.size(0) == len(r["reply_ids"]) + (not r["truncated"])
        assert (logp[:, :-1] >= logp[:, 1:]).all() and (logp <= 0).all()

    # the replies are SFT / distillation data as training reads it
    records = load_records(DataConfig(path=str(out / "replies-*.jsonl")))
    kept, skipped = prepare_sft(records, tokenizer, 512)
    assert len(kept) + sum(skipped.values()) == 6 and len(kept) >= 1

    # a larger --magpie extends the finished run; nothing already answered is generated again
    again = md.make_data(args_for(path, out, "--magpie", 9, "--batch-size", 3, "--prompts", user_file,
                                  "--temperatures", "0,0.7", "--max-new-tokens", 12, "--dtype", "float32"),
                         generate=scripted_magpie(["What is a prime number?", "Hello", "Why is the sky blue?"]),
                         progress=False)
    assert again["magpie"]["samples"] == 9 and again["prompts"]["total"] == 5
    assert again["replies"]["0"]["replies"] == 5
    rows = md.read_shard(out / "replies-T0.jsonl")
    assert len({r["id"] for r in rows}) == len(rows) == 5


def test_steered_magpie_tasks_add_kinds_of_request_and_pasted_texts(target, tmp_path, monkeypatch):
    """--magpie-tasks: each batch sampled after its task's system turn; a document task's text is cut back to a full
    sentence and followed by its request; the source can be added to a directory made without it."""
    path, tokenizer = target
    monkeypatch.setattr(md, "TASKS", (md.Task("math", "Users ask math word problems."),
                                      md.Task("doc", "Write a news article.", 200, "Summarize the text above.",
                                              document=True)))
    story = " ".join(["The river rose after the storm, and the town moved its market uphill."] * 4)
    samples = {"Users ask math word problems.": ["How many apples are left if Tom eats 3 of 10?", "Hello"],
               "Write a news article.": [story + " Then the mayor said", "Too short. Really."]}
    seen_systems = []

    def generate(model, tokenizer, prompts, *, max_new_tokens, temperature, top_p, eos_token_ids):
        if top_p != md.MAGPIE_TOP_P:
            return md.hf_sample(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, eos_token_ids=eos_token_ids)
        header = tokenizer.decode(prompts[0])
        system = next((k for k in samples if k in header), None)
        seen_systems.append(system)
        if system is None:  # a plain Magpie batch
            return [tokenizer("What is a prime number?", add_special_tokens=False)["input_ids"] + [eos_token_ids[0]]]
        rows = []
        for text in samples[system]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(ids + [eos_token_ids[0]] if len(ids) < max_new_tokens else ids)  # the story hits the cap
        return rows

    out = tmp_path / "data"
    common = ["--batch-size", 2, "--temperatures", "0", "--max-new-tokens", 6, "--dtype", "float32"]
    md.make_data(args_for(path, out, "--magpie", 1, *common), generate=generate, progress=False)
    manifest = md.make_data(args_for(path, out, "--magpie", 1, "--magpie-tasks", 4, *common), generate=generate,
                            progress=False)
    assert seen_systems == [None, "Users ask math word problems.", "Write a news article."]
    prompts = {p["id"]: p for p in md.read_shard(out / "prompts.jsonl")}
    assert prompts["task:0:0"] | {"prompt": ""} == {"id": "task:0:0", "source": "magpie_task", "prompt": "",
                                                    "batch": 0, "task": "math"}
    document = prompts["task:1:0"]["prompt"]
    assert document.endswith("moved its market uphill.\n\nSummarize the text above.")  # cut after "uphill."
    assert "the mayor said" not in document
    assert set(prompts) == {"magpie:0:0", "task:0:0", "task:1:0"}
    assert manifest["magpie_tasks"] == {"samples": 4, "kept": 2, "dropped": {"too_short": 2},
                                        "by_task": {"math": 1, "doc": 1}}
    assert manifest["replies"]["0"]["replies"] == 3  # steered prompts are answered like any other
    records = md.read_shard(out / "replies-T0.jsonl")
    reply = next(r for r in records if r["id"] == "task:1:0")
    assert reply["conversations"][0]["value"] == document  # answered under the default template, no steering turn
    monkeypatch.setattr(md, "TASKS", md.TASKS[:1])  # another task list: the directory refuses to mix them
    with pytest.raises(ValueError, match="magpie_tasks differ"):
        md.make_data(args_for(path, out, "--magpie-tasks", 6, *common), generate=generate, progress=False)


def test_bad_input_is_one_line_and_writes_nothing(target, tmp_path, capsys, monkeypatch):
    path, _ = target
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    for extra, message in ((["--temperatures", "0,x"], "--temperatures must be comma-separated numbers"),
                           (["--magpie", "0"], "nothing to answer"),
                           (["--prompts", str(tmp_path / "none.jsonl")], "prompt file not found"),
                           (["--batch-size", "0"], "--batch-size must be >= 1")):
        assert cli.main(["make-data", "--target", str(path), "--out", str(tmp_path / "o"), *extra]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mamba-draft make-data: error: ") and message in err, err
    assert cli.main(["make-data", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"),
                     "--magpie", "4"]) == 1
    assert not (tmp_path / "o").exists()


def test_resume_refuses_other_settings(target, tmp_path):
    path, _ = target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Explain recursion."}) + "\n")
    md.make_data(args_for(path, tmp_path / "d", "--prompts", prompts, "--max-new-tokens", 4), progress=False)
    with pytest.raises(ValueError, match="other settings \\(max_new_tokens differ\\)"):
        md.make_data(args_for(path, tmp_path / "d", "--prompts", prompts, "--max-new-tokens", 8), progress=False)


def test_torn_tail_is_cut_and_other_damage_refused(tmp_path):
    shard = tmp_path / "s.jsonl"
    md.append_shard(shard, [{"id": "a"}, {"id": "b"}])
    with open(shard, "ab") as f:
        f.write(b'{"id": "c", "conv')  # a kill in the middle of a write
    assert md.read_shard(shard) == [{"id": "a"}, {"id": "b"}]
    assert shard.read_bytes().endswith(b'"b"}\n')
    shard.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="s.jsonl:2: not valid JSON"):
        md.read_shard(shard)


SLOW_RUN = """
import sys, time
from mamba_draft.commands import cli
from training import make_data as md
from training.config import DataConfig

def slow(*args, **kwargs):  # one batch takes >= 0.3 s, so the test can kill the run between and within batches
    time.sleep(0.3)
    return md.hf_sample(*args, **kwargs)

md.make_data(cli.build_parser("make-data").parse_args(sys.argv[1:]), generate=slow, progress=False)
"""


def test_sigkill_loses_at_most_the_batch_in_flight(target, tmp_path):
    path, _ = target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Question number {i}: what is {i} plus {i}?"})
                                 for i in range(24)))
    out = tmp_path / "data"
    argv = ["--target", str(path), "--out", str(out), "--prompts", str(prompts), "--temperatures", "0,0.7",
            "--batch-size", "2", "--max-new-tokens", "8", "--dtype", "float32"]
    replies = out / "replies-T0.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RUN, *argv], env=train_env(), cwd=REPO)
    deadline = time.time() + 120
    while time.time() < deadline and (not replies.exists() or replies.read_text().count("\n") < 6):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = replies.read_bytes()
    done = before.count(b"\n")
    assert 6 <= done < 24, "the run must be killed part-way"
    with open(replies, "ab") as f:  # and as if the kill had hit a write
        f.write(b'{"id": "p:9", "source"')
    with open(out / "topk-T0.bin", "ab") as f:  # or had come between the top-K append and the reply lines
        f.write(b"\0" * md.topk_bytes() * 5)

    subprocess.run([sys.executable, "-c", SLOW_RUN, *argv], env=train_env(), cwd=REPO, check=True, timeout=300)
    after = replies.read_bytes()
    assert after.startswith(before)  # every reply written before the kill is kept as it was
    for t in ("0", "0.7"):
        rows = md.read_shard(out / f"replies-T{t}.jsonl")
        assert len(rows) == len({r["id"] for r in rows}) == 24
        assert (out / f"topk-T{t}.bin").stat().st_size == sum(r["topk"][1] for r in rows) * md.topk_bytes()
        spans = sorted(r["topk"] for r in rows)
        assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, nothing orphaned
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["replies"]["0"]["replies"] == manifest["replies"]["0.7"]["replies"] == 24
    assert manifest["prompts"]["total"] == 24


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_native_bf16(monkeypatch, tmp_path):
    from mamba_draft import devices

    for flags, native in (("fpu avx2 avx512f avx512_bf16", True), ("fpu avx2 amx_bf16 amx_tile", True),
                          ("fpu avx2 avx512f avx512_vnni", False)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        real_open = open
        monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo"
                                                                             else path, *a, **k))
        assert devices.native_bf16("cpu") is native
        assert devices.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
        monkeypatch.undo()
    assert devices.resolve_dtype("float32", "cpu") == torch.float32


def test_long_prompts_are_answered_in_smaller_batches():
    assert md.length_batches([1000, 600, 300, 300, 300, 300, 200], batch_size=4, row_tokens=500) == [
        (0, 2), (2, 6), (6, 7)]
    assert md.length_batches([5000, 10], batch_size=4, row_tokens=500) == [(0, 1), (1, 2)]  # a row alone may exceed
    assert md.length_batches([], batch_size=4) == []


def test_the_sampler_draws_from_transformers_top_k_top_p_distribution():
    """TopKSampler (the engine's fast draw) samples what transformers' temperature / top-k / top-p warpers keep, in
    the same proportions, and returns scores whose argmax is the drawn token."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    scores = torch.randn(1, 40) * 2
    warped = scores.clone()
    for warp in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.8)):
        warped = warp(None, warped)
    want = torch.softmax(warped, -1)[0]
    sampler = TopKSampler(0.7, 8, 0.8)
    n = 20000
    out = sampler(None, scores.expand(n, -1).clone())
    tokens = out.argmax(-1)
    assert torch.isinf(out).sum(-1).eq(39).all()  # one finite score per row: the drawn token
    freq = torch.bincount(tokens, minlength=40).float() / n
    assert set(tokens.tolist()) <= set(want.nonzero().flatten().tolist())  # nothing outside top-k / top-p
    assert (freq - want).abs().max() < 4 * (want * (1 - want) / n).sqrt().max() + 1e-3


def test_the_data_engine_runs_without_datasets():
    """A GPU machine's image may hold torch and transformers but not `datasets`: make-data never imports it."""
    code = "import sys, training.make_data; sys.exit('datasets' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, env=train_env()).returncode == 0


def test_rows_are_recorded_from_an_eager_forward(target):
    """While the hook records, transformers must not compile the static-cache forward (on CUDA it would CUDA-graph
    it: the hook would read overwritten buffers and recompile per batch); the model's own setting comes back."""
    path, tokenizer = target
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = []

    def generate(model, tokenizer, prompts, **kwargs):
        seen.append(model.generation_config.disable_compile)
        return md.hf_sample(model, tokenizer, prompts, **kwargs)

    own = model.generation_config.disable_compile
    engine = md.Engine(model, tokenizer, generate)
    prompt = md.prompt_ids(tokenizer, [{"role": "user", "content": "Name a colour."}])
    rows, topk, _ = engine.run([prompt], 4, 0.0, None, seed=0, record_topk=True)
    assert topk is not None and topk[0].shape[0] == len(rows[0][0]) + (not rows[0][1])
    engine.run([prompt], 4, 0.0, None, seed=0)
    assert seen == [True, own] and not own and model.generation_config.disable_compile == own


def test_style_tasks_quote_even_questions_of_one_category_per_batch():
    """--magpie-styles: batch b quotes even-id questions of the b-th category (in turn, all 13 of Spec-Bench), cut
    to STYLE_WORDS words; categories of pasted documents sample longer; odd ids are refused."""
    records = read_spec_bench()
    evens = [r for r in records if not is_heldout(r)]
    tasks = md.style_tasks(evens, 26, seed=7)
    categories = sorted({r["category"] for r in records})
    assert [t.name for t in tasks] == [f"style:{c}" for c in categories] * 2
    texts = {" ".join(r["turns"][0].split()[:md.STYLE_WORDS]) for r in evens}
    for task in tasks:
        quoted = [part.split(": ", 1)[1].removesuffix(" ...") for part in task.system.split("\n\n")[1:-1]]
        assert len(quoted) == md.STYLE_EXEMPLARS and all(q in texts for q in quoted)
    documents = {t.name for t in tasks if t.document}
    assert {"style:summarization", "style:rag"} <= documents and "style:qa" not in documents
    assert all(t.tokens == (md.STYLE_DOCUMENT_TOKENS if t.document else md.MAGPIE_TOKENS) for t in tasks)
    assert md.style_tasks(evens, 26, seed=7) == tasks  # a resumed run steers its batches the same way
    with pytest.raises(ValueError, match="held-out"):
        md.style_tasks(evens + [next(r for r in records if is_heldout(r))], 1, seed=0)


def test_styles_and_follow_ups_make_multi_turn_chats_training_reads(target, tmp_path):
    """--magpie-styles and --follow-ups: style-steered first turns, a follow-up the target writes after its own
    greedy reply, and a Spec-Bench question's own second turn; every later turn is answered after the whole chat,
    its record holds the chat, and the training loader reads it with the same prompt ids."""
    from training.engine_data import load_engine

    path, tokenizer = target
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 2, "category": "writing",
                                     "turns": ["Write a poem about tea.", "Now make it rhyme."]}) + "\n")
    magpie_rows = []

    def generate(model, tokenizer, prompts, *, max_new_tokens, temperature, top_p, eos_token_ids):
        if top_p != md.MAGPIE_TOP_P:  # the model's own greedy tokens, ended after three (a finished reply)
            rows = md.hf_sample(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, eos_token_ids=eos_token_ids)
            return [row[:3] + [eos_token_ids[0]] for row in rows]
        magpie_rows.append([tokenizer.decode(p) for p in prompts])
        first = "What is the capital of Peru?"
        text = "Can you explain that more simply?" if first in magpie_rows[-1][0] else first  # after it: a follow-up
        return [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_ids[0]] for _ in prompts]

    out = tmp_path / "data"
    manifest = md.make_data(args_for(path, out, "--magpie-styles", 1, "--follow-ups", 4, "--prompts", questions,
                                     "--batch-size", 2, "--temperatures", "0", "--max-new-tokens", 6, "--dtype",
                                     "float32", "--hidden"), generate=generate, progress=False)
    prompts = {p["id"]: p for p in md.read_shard(out / "prompts.jsonl")}
    style = prompts["style:0:0"]
    assert style["source"] == "magpie_style" and style["task"].startswith("style:")
    assert "Users send requests like these" in magpie_rows[0][0]
    replies = {r["id"]: r for r in md.read_shard(out / "replies-T0.jsonl")}
    second = prompts["questions:2/2"]  # the question's own second turn, after the target's greedy reply
    assert second["prompt"] == "Now make it rhyme." and second["source"] == "questions"
    assert second["history"] == [{"role": "user", "content": "Write a poem about tea."},
                                 {"role": "assistant", "content": replies["questions:2"]["conversations"][1]["value"]}]
    follow = prompts["style:0:0/2"]
    assert follow["source"] == "follow_up" and follow["prompt"] == "Can you explain that more simply?"
    assert follow["history"][0]["content"] == "What is the capital of Peru?"
    assert "questions:2" not in {p for line in md.read_shard(out / "follow-ups.jsonl") for p in line["parents"]}
    assert manifest["follow_ups"]["kept"] == 1 and manifest["follow_ups"]["later_turns"] == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    examples = {tuple(e.input_ids.tolist()): e for e in load_engine(out, tokenizer, hidden_size=model.config.hidden_size)}
    assert len(examples) == len(replies) == 4
    for pid in ("questions:2/2", "style:0:0/2"):  # answered after the whole chat: greedy given all of it
        chat = [m["value"] for m in replies[pid]["conversations"]]
        assert len(chat) == 4 and chat[2] == prompts[pid]["prompt"]
        ids, reply = md.prompt_ids(tokenizer, md.prompt_messages(prompts[pid])), replies[pid]["reply_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + reply])).logits[0, len(ids) - 1:]
        assert logits[:len(reply)].argmax(-1).tolist() == reply
        example = examples[tuple(ids + reply + ([] if replies[pid]["truncated"] else [tokenizer.eos_token_id]))]
        assert int((example.labels == -100).sum()) == len(ids)  # the training loader's prompt: the same chat
