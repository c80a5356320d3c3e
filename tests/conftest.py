"""Suite-wide settings: tiny models are pure per-op overhead, and on a busy 2-core machine a second intra-op
thread mostly spin-waits (measured up to 25x slower), so every test runs single-threaded."""
import os

import torch

torch.set_num_threads(1)
# In-process `mamba_draft.cli.main([...])` calls re-raise a command's exception (as with --debug), so tests can
# assert on its type; tests/test_cli_errors.py unsets it to check the one-line form users see.
os.environ.setdefault("MAMBA_DRAFT_DEBUG", "1")
