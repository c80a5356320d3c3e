"""mamba_draft: drafters with an explicit, forkable state: Mamba-1/Mamba-2 (recurrent) and any HF causal LM (KV)."""
from .blas import prefer_fast_mkl_paths

prefer_fast_mkl_paths()  # before any matrix multiply: MKL reads its dispatch setting once

from .checkpoint import convert, load_checkpoint, save_checkpoint
from .config import MambaConfig
from .drafter import Drafter, DraftState, load_drafter
from .kernels import kernels_available
from .model import MambaDrafter
from .state import DrafterState

__all__ = ["Drafter", "DraftState", "MambaDrafter", "TransformerDrafter", "DrafterState", "load_drafter", "MambaConfig",
           "convert", "load_checkpoint", "save_checkpoint", "kernels_available"]


def __getattr__(name: str):
    if name == "TransformerDrafter":  # imports transformers: only when asked for
        from .transformer import TransformerDrafter

        return TransformerDrafter
    raise AttributeError(f"module 'mamba_draft' has no attribute {name!r}")
