"""Shared fixtures for the training tests: a tiny locally-trained tokenizer, fixture data, tiny configs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "training"
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def fixture_texts() -> list[str]:
    texts = [json.loads(line)["text"] for line in (FIXTURES / "fineweb_edu.jsonl").read_text().splitlines()]
    for conv in json.loads((FIXTURES / "sharegpt.json").read_text()):
        texts += [t.get("value") or "" for t in conv["conversations"]]
    return texts


def make_tokenizer(out_dir: Path, vocab_size: int = 300) -> Path:
    """Byte-level BPE trained on the fixture text, saved with PreTrainedTokenizerFast.save_pretrained."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(fixture_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return out_dir


def train_env(extra: dict | None = None) -> dict:
    """Environment for training subprocesses: CPU accelerator, repo importable, no hub access."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def deepspeed_cmd(nproc: int, config: Path, overrides: list[str], resume: bool = False) -> list[str]:
    """A real `deepspeed` launcher command on this machine's CPU (local launch, no pdsh)."""
    launcher = Path(sys.executable).with_name("deepspeed")
    return [str(launcher), "--num_nodes", "1", "--num_gpus", str(nproc), "--master_port", str(free_port()),
            "--module", "training.train", "--config", str(config), *overrides, *(["--resume"] if resume else [])]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def tiny_chat_target(out_dir: Path, chat_template: str | None = None):
    """A tiny random Llama (weights perturbed so replies depend on the prompt) with the fixture tokenizer (and a
    chat template, if given), saved to `out_dir` -> (tokenizer, model)."""
    import torch
    import transformers

    from training.config import ModelConfig
    from training.model import load_tokenizer, model_config

    make_tokenizer(out_dir)
    tokenizer = load_tokenizer(str(out_dir))
    if chat_template:
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(out_dir)
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="llama", hidden_size=32, num_hidden_layers=1, num_heads=2,
                                   tie_word_embeddings=False), tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return tokenizer, model.eval()
