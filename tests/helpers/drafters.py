"""Tiny random Mamba drafters built with transformers and saved in HF format (no network)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_hf_mamba(arch: str = "mamba1", vocab_size: int = 96, seed: int = 0, **overrides):
    """A random `MambaForCausalLM` / `Mamba2ForCausalLM` with a few layers, in eval mode."""
    torch.manual_seed(seed)
    if arch == "mamba1":
        cfg = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                   conv_kernel=4)
        cfg.update(overrides)
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg))
    elif arch == "mamba2":
        cfg = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                   conv_kernel=4, num_heads=8, head_dim=8, n_groups=2, chunk_size=16)
        cfg.update(overrides)
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**cfg))
    else:
        raise ValueError(arch)
    # Random-init dt/A are tiny; perturb every parameter so the state actually matters over many steps.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_tiny_hf_mamba(directory: Path, arch: str = "mamba1", **kwargs) -> Path:
    tiny_hf_mamba(arch, **kwargs).save_pretrained(directory)
    return Path(directory)


def lean_drafter(directory: Path, target, seed: int = 0) -> Path:
    """A tied Mamba-1 drafter on `target`'s input embedding, saved without it: `target_embedding.json` names a target
    that does not exist, so it loads only with the embedding handed over (`embedding=` or `target=`)."""
    from mamba_draft import MambaConfig, MambaDrafter
    from mamba_draft.checkpoint import save_checkpoint

    weight = target.get_input_embeddings().weight
    hf = tiny_hf_mamba("mamba1", vocab_size=weight.shape[0], seed=seed, hidden_size=weight.shape[1],
                       tie_word_embeddings=True)
    drafter = MambaDrafter.from_state_dict(MambaConfig.from_hf_dict(hf.config.to_dict()), hf.state_dict())
    with torch.no_grad():
        drafter.backbone.embeddings.weight.copy_(weight)
    return save_checkpoint(drafter.config, drafter.checkpoint_tensors(), directory,
                           embedding_from=str(Path(directory) / "no-such-target"))
