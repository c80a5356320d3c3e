"""mamba_draft: drafters with an explicit, forkable state: Mamba-1/Mamba-2 (recurrent) and any HF causal LM (KV)."""
import os

# Before any matrix multiply (MKL reads it at its first call), unless the user chose a setting: on AMD CPUs MKL's
# default dispatch runs skinny GEMMs (2-16 rows: a tree verification, a few drafter rows) on a slow generic path, and
# with conditional numerical reproducibility AUTO its much faster AVX2 path; 1-row and large GEMMs stay within noise.
os.environ.setdefault("MKL_CBWR", "AUTO")

from .checkpoint import load_checkpoint, save_checkpoint
from .convert import convert
from .config import MambaConfig
from .drafter import Drafter, DraftState, load_drafter
from .kernels import kernels_available
from .model import DrafterState, MambaDrafter

__all__ = ["Drafter", "DraftState", "MambaDrafter", "TransformerDrafter", "DrafterState", "load_drafter", "MambaConfig",
           "convert", "load_checkpoint", "save_checkpoint", "kernels_available"]


def __getattr__(name: str):
    if name == "TransformerDrafter":  # imports transformers: only when asked for
        from .transformer import TransformerDrafter

        return TransformerDrafter
    raise AttributeError(f"module 'mamba_draft' has no attribute {name!r}")
