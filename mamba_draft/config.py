"""Drafter configuration and its mapping to the Hugging Face and mamba_ssm checkpoint formats."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


DRAFTED_FEATURES = ("stand_in", "own")
# transformers MambaConfig / Mamba2Config key -> MambaConfig field, in config.json's order
HF_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "state_size": "d_state",
             "num_hidden_layers": "n_layer", "layer_norm_epsilon": "norm_eps", "expand": "expand",
             "conv_kernel": "d_conv", "use_bias": "bias", "use_conv_bias": "conv_bias",
             "residual_in_fp32": "residual_in_fp32", "tie_word_embeddings": "tie_embeddings",
             "time_step_rank": "dt_rank"}
HF_MAMBA2_FIELDS = {"head_dim": "headdim", "n_groups": "ngroups", "chunk_size": "chunk_size"}
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers")
# mamba_ssm's ssm_cfg keys that are MambaConfig fields of the same name
SSM_FIELDS = ("d_state", "d_conv", "expand", "bias", "conv_bias")
SSM_MAMBA2_FIELDS = ("headdim", "ngroups", "chunk_size")


@dataclass
class MambaConfig:
    """Shape of a Mamba-1 or Mamba-2 language model: `vocab_size` embedding rows (possibly padded), of which
    `real_vocab_size` are the tokenizer's vocabulary (the width of the logits)."""

    arch: str  # "mamba1" | "mamba2"
    d_model: int
    n_layer: int
    vocab_size: int
    real_vocab_size: int | None = None
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str | None = None  # Mamba-1 only; None or "auto" (the checkpoints' word) -> ceil(d_model / 16)
    headdim: int = 64  # Mamba-2 only
    ngroups: int = 1  # Mamba-2 only
    chunk_size: int = 256  # Mamba-2 only (kept for round trips; the torch path does not chunk)
    dt_limit: tuple[float, float] = (0.0, math.inf)  # Mamba-2 only
    bias: bool = False
    conv_bias: bool = True
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    pad_vocab_size_multiple: int = 1
    # > 0: a drafter that reads the target (its final hidden state, this wide, fused with each token's embedding);
    # 0: an external drafter (token ids only)
    target_hidden_size: int = 0
    # what a drafter that reads the target is fed beside a drafted token (no target state exists for it yet):
    # "stand_in", a learned vector; "own", its own final-norm state at the parent (EAGLE; trained toward the target's)
    drafted_features: str = "stand_in"
    extra: dict = field(default_factory=dict)  # HF config fields we do not interpret (eos ids, ...)

    def __post_init__(self) -> None:
        if self.arch not in ("mamba1", "mamba2"):
            raise ValueError(f"unknown Mamba architecture {self.arch!r}; expected 'mamba1' or 'mamba2'")
        self.dt_rank = math.ceil(self.d_model / 16) if self.dt_rank in (None, "auto") else int(self.dt_rank)
        if self.real_vocab_size is None:
            self.real_vocab_size = self.vocab_size
        if self.real_vocab_size > self.vocab_size:
            raise ValueError(f"real_vocab_size {self.real_vocab_size} exceeds the embedding rows vocab_size "
                             f"{self.vocab_size}")
        self.dt_limit = tuple(float(v) for v in self.dt_limit)
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.target_hidden_size < 0:
            raise ValueError(f"target_hidden_size must be >= 0 (0: an external drafter), got {self.target_hidden_size}")
        if self.drafted_features not in DRAFTED_FEATURES:
            raise ValueError(f"drafted_features must be one of {DRAFTED_FEATURES}, got {self.drafted_features!r}")
        if self.drafted_features != "stand_in" and not self.target_hidden_size:
            raise ValueError("drafted_features 'own' is for a drafter that reads the target (target_hidden_size > 0)")
        if self.arch == "mamba2" and self.d_inner % self.headdim:
            raise ValueError(f"d_inner {self.d_inner} (expand*d_model) is not a multiple of headdim {self.headdim}")
        if self.arch == "mamba2" and self.nheads % self.ngroups:
            raise ValueError(f"nheads {self.nheads} is not a multiple of ngroups {self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels that go through the causal convolution (x for Mamba-1; x, B, C for Mamba-2)."""
        return self.d_inner if self.arch == "mamba1" else self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        return (self.d_inner, self.d_state) if self.arch == "mamba1" else (self.nheads, self.headdim, self.d_state)

    def to_hf_dict(self) -> dict:
        if self.arch == "mamba1":
            hf = dict(model_type="mamba", architectures=["MambaForCausalLM"])
        else:
            hf = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], num_heads=self.nheads,
                      **{key: getattr(self, name) for key, name in HF_MAMBA2_FIELDS.items()},
                      time_step_limit=list(self.dt_limit))
        hf.update({key: getattr(self, name) for key, name in HF_FIELDS.items()})
        # Kept so a padded checkpoint can still tell its tokenizer's size (transformers ignores these keys).
        hf.update(real_vocab_size=self.real_vocab_size, pad_vocab_size_multiple=self.pad_vocab_size_multiple)
        if self.target_hidden_size:  # what plain transformers cannot run: it ignores the key and the fusion weights
            hf["target_hidden_size"] = self.target_hidden_size
        if self.drafted_features != "stand_in":
            hf["drafted_features"] = self.drafted_features
        return {**self.extra, **hf}

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "MambaConfig":
        model_type = hf.get("model_type")
        if model_type not in ("mamba", "mamba2"):
            raise ValueError(f"config.json describes model_type={model_type!r} (architectures="
                             f"{hf.get('architectures')}); a Mamba drafter needs 'mamba' (MambaForCausalLM) or "
                             "'mamba2' (Mamba2ForCausalLM)")
        hf, mamba1 = dict(hf), model_type == "mamba"
        fields = {**HF_FIELDS, **({} if mamba1 else HF_MAMBA2_FIELDS),
                  **{name: name for name in ("real_vocab_size", "pad_vocab_size_multiple", "target_hidden_size",
                                             "drafted_features")}}
        # an absent key takes the field's default (a required one raises KeyError naming the key)
        kwargs = {name: hf.pop(key) for key, name in fields.items() if key in hf or key in HF_REQUIRED}
        kwargs.setdefault("d_state", 16 if mamba1 else 128)
        kwargs.setdefault("tie_embeddings", mamba1)
        kwargs["arch"] = "mamba1" if mamba1 else "mamba2"
        if not mamba1:
            # transformers 5 writes inf as {"__float__": "Infinity"} in config.json
            kwargs["dt_limit"] = tuple(float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)
                                       for v in hf.pop("time_step_limit", (0.0, math.inf)))
            num_heads = hf.pop("num_heads", None)
            expected = kwargs.get("expand", 2) * kwargs["d_model"] // kwargs.get("headdim", 64)
            if num_heads is not None and num_heads != expected:
                raise ValueError(f"num_heads {num_heads} != expand*hidden_size/head_dim = {expected}")
        for derived in ("intermediate_size", "model_type"):
            hf.pop(derived, None)
        return cls(**kwargs, extra=hf)

    def to_mamba_ssm_dict(self) -> dict:
        if self.target_hidden_size:
            raise ValueError("a drafter that reads the target has no mamba_ssm format (mamba_ssm has no input "
                             "fusion); save it in HF format")
        shared = {name: getattr(self, name) for name in SSM_FIELDS}
        if self.arch == "mamba1":
            ssm_cfg = dict(layer="Mamba1", dt_rank=self.dt_rank, **shared)
        else:
            ssm_cfg = dict(layer="Mamba2", **{name: getattr(self, name) for name in SSM_MAMBA2_FIELDS}, rmsnorm=True,
                           norm_before_gate=False, **shared)
            if self.dt_limit != (0.0, math.inf):
                ssm_cfg["dt_limit"] = list(self.dt_limit)
        return dict(d_model=self.d_model, d_intermediate=0, n_layer=self.n_layer, vocab_size=self.real_vocab_size,
                    ssm_cfg=ssm_cfg, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                    residual_in_fp32=self.residual_in_fp32, fused_add_norm=True,
                    pad_vocab_size_multiple=self.pad_vocab_size_multiple, tie_embeddings=self.tie_embeddings)

    @classmethod
    def from_mamba_ssm_dict(cls, cfg: dict) -> "MambaConfig":
        if cfg.get("attn_layer_idx"):
            raise ValueError("hybrid mamba_ssm checkpoints (attn_layer_idx) are not supported as drafters")
        if cfg.get("d_intermediate", 0):
            raise ValueError("mamba_ssm checkpoints with an MLP (d_intermediate > 0) are not supported as drafters")
        if not cfg.get("rms_norm", True):
            raise ValueError("mamba_ssm checkpoints with LayerNorm (rms_norm=false) are not supported as drafters")
        ssm_cfg = dict(cfg.get("ssm_cfg") or {})
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer not in ("Mamba1", "Mamba2"):
            raise ValueError(f"unknown mamba_ssm layer type {layer!r}; expected 'Mamba1' or 'Mamba2'")
        if layer == "Mamba2" and ssm_cfg.get("norm_before_gate", False):
            raise ValueError("Mamba-2 checkpoints with norm_before_gate=True are not supported")
        mamba1 = layer == "Mamba1"
        own_fields = ("dt_rank",) if mamba1 else SSM_MAMBA2_FIELDS
        kwargs = {name: ssm_cfg[name] for name in SSM_FIELDS + own_fields if name in ssm_cfg}
        kwargs.update({name: cfg[name] for name in ("residual_in_fp32", "tie_embeddings") if name in cfg})
        kwargs.setdefault("d_state", 16 if mamba1 else 128)
        if not mamba1:
            kwargs["dt_limit"] = tuple(ssm_cfg.get("dt_limit", (0.0, math.inf)))
        multiple = int(cfg.get("pad_vocab_size_multiple", 8))
        real_vocab = int(cfg["vocab_size"])
        return cls(arch="mamba1" if mamba1 else "mamba2", d_model=cfg["d_model"], n_layer=cfg["n_layer"],
                   vocab_size=real_vocab + (-real_vocab) % multiple, real_vocab_size=real_vocab,
                   pad_vocab_size_multiple=multiple, **kwargs)
