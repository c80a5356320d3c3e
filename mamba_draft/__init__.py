"""mamba_draft: Mamba-1/Mamba-2 drafters with an explicit, forkable recurrent state."""
from .blas import prefer_fast_mkl_paths

prefer_fast_mkl_paths()  # before any matrix multiply: MKL reads its dispatch setting once

from .checkpoint import convert, load_checkpoint, save_checkpoint
from .config import MambaConfig
from .kernels import kernels_available
from .model import MambaDrafter
from .state import DrafterState

__all__ = ["MambaDrafter", "DrafterState", "MambaConfig", "convert", "load_checkpoint", "save_checkpoint",
           "kernels_available"]
