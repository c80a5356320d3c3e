"""Suite-wide settings: tiny models are pure per-op overhead, and on a busy 2-core machine a second intra-op
thread mostly spin-waits (measured up to 25x slower), so every test runs single-threaded."""
import torch

torch.set_num_threads(1)
