"""Suite-wide settings: tiny models are pure per-op overhead, and on a busy 2-core machine a second intra-op
thread mostly spin-waits (measured up to 25x slower), so every test runs single-threaded."""
import importlib
import math
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(1)
# In-process `mamba_draft.commands.cli.main([...])` calls re-raise a command's exception (as with --debug), so tests can
# assert on its type; tests/test_cli_errors.py unsets it to check the one-line form users see.
os.environ.setdefault("MAMBA_DRAFT_DEBUG", "1")


def pytest_configure(config):
    """Dense copies of GGUF targets (mamba_draft.targets.dense_copy) go to a directory of this run, not the user's
    cache: the first test that loads the shipped target writes it, the rest (subprocesses too) read it."""
    if "MAMBA_DRAFT_CACHE" not in os.environ:
        os.environ["MAMBA_DRAFT_CACHE"] = config._mamba_draft_cache = tempfile.mkdtemp(prefix="mamba-draft-cache-")


def pytest_collection_modifyitems(config, items):
    """Files marked `heavy` first (stable otherwise): with two workers (pyproject addopts) a long file handed out
    last would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_unconfigure(config):
    if getattr(config, "_mamba_draft_cache", None):
        shutil.rmtree(config._mamba_draft_cache, ignore_errors=True)


@pytest.fixture
def flat_verify_costs(monkeypatch):
    """`auto`'s measured verify costs pinned flat, as a tiny target's forwards are on an idle machine: a loaded one
    may time them steep, and then the plan rightly runs no lookup round (what tests of the defaults assert)."""
    from tree_search.arms import VerifyCosts

    monkeypatch.setattr(importlib.import_module("tree_search.generate"), "measure_verify_costs",
                        lambda forward, widest: VerifyCosts({1: 1e-3, widest: 1.1e-3}, math.inf))
