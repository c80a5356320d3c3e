"""The AutoJudge head: standardised target hidden state -> logistic P(important), stored as safetensors (no pickle).
Its feature (the paper's "DT" setup) is the target's final hidden state at the draft token: `VerifyInput.hidden` of
the mismatching node, so the judge needs nothing beyond the target's own tree forward."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from mamba_draft.io import save_safetensors

FORMAT = "mamba-draft-autojudge-v1"
FEATURE = "target final hidden state at the draft-token position (DT)"
TENSORS = ("mean", "scale", "weight", "bias")


@dataclass
class JudgeHead:
    """P(important | h) = sigmoid(w · (h - mean) / scale + b)."""

    mean: torch.Tensor  # (H,)
    scale: torch.Tensor  # (H,)
    weight: torch.Tensor  # (H,)
    bias: torch.Tensor  # (1,)
    info: dict = field(default_factory=dict)  # training record: C, val ROC-AUC, suggested thresholds, ...

    def __post_init__(self) -> None:
        shapes = {t.shape for t in (self.mean, self.scale, self.weight)}
        if len(shapes) != 1 or self.mean.dim() != 1 or self.bias.numel() != 1:
            raise ValueError(f"JudgeHead needs mean/scale/weight of one shape (H,) and a scalar bias, got "
                             f"{self.mean.shape}, {self.scale.shape}, {self.weight.shape}, {self.bias.shape}")

    @property
    def hidden_size(self) -> int:
        return self.mean.numel()

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> JudgeHead:
        return replace(self, **{name: getattr(self, name).to(device=device, dtype=dtype) for name in TENSORS})

    def prob_important(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) target hidden states -> (...,) P(important)."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"AutoJudge head was trained on hidden size {self.hidden_size}, but the target's hidden "
                             f"states have size {hidden.shape[-1]}: the judge file belongs to another target model")
        standardised = (hidden.to(self.mean.dtype) - self.mean) / self.scale
        return torch.sigmoid(standardised @ self.weight + self.bias)

    def save(self, path: str | os.PathLike) -> None:
        """Write safetensors atomically; training details go to the metadata as JSON."""
        tensors = {name: getattr(self, name).detach().float().cpu().contiguous() for name in TENSORS}
        save_safetensors(path, tensors, {"format": FORMAT, "feature": FEATURE, "info": json.dumps(self.info)})

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> JudgeHead:
        """Read a head written by `save` (or `mamba-draft autojudge train`); clear errors for wrong files."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"AutoJudge judge file {str(path)!r} does not exist (train one with `mamba-draft autojudge train`)")
        try:
            tensors = load_file(str(path), device=str(device))
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
        except (SafetensorError, ValueError, OSError) as err:
            raise ValueError(f"{str(path)!r} is not a readable safetensors AutoJudge file: {err}") from err
        missing = set(TENSORS) - set(tensors)
        if metadata.get("format") != FORMAT or missing:
            raise ValueError(f"{str(path)!r} is not an AutoJudge head ({FORMAT}); missing tensors {sorted(missing)}")
        return cls(*(tensors[name] for name in TENSORS), json.loads(metadata["info"]))
