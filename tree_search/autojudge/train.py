"""Train the AutoJudge head: standardised features -> logistic regression, C chosen by held-out ROC-AUC (scikit-learn)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from tree_search.autojudge.classifier import JudgeHead

DEFAULT_C_GRID = tuple(float(c) for c in np.logspace(-4, 2, 13))


@dataclass
class TrainConfig:
    val_fraction: float = 0.2
    seed: int = 0
    c_grid: tuple[float, ...] = DEFAULT_C_GRID
    recall: float = 0.9  # the suggested threshold keeps at least this share of held-out important tokens rejected
    max_iter: int = 2000

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not self.c_grid or any(c <= 0 for c in self.c_grid):
            raise ValueError(f"c_grid must be a non-empty list of positive regularisation values, got {self.c_grid}")
        if not 0.0 < self.recall <= 1.0:
            raise ValueError(f"recall must be in (0, 1], got {self.recall}")


def threshold_for_recall(probs: np.ndarray, labels: np.ndarray, recall: float) -> float:
    """Largest threshold t such that P(important) >= t still flags `recall` of the important examples (a mismatch
    is accepted when P(important) < t)."""
    important = np.sort(probs[labels == 1])
    keep = int(np.ceil(recall * len(important)))  # flag the `keep` most confident important examples
    return float(important[len(important) - keep])


def train_judge(features: torch.Tensor, labels: torch.Tensor, cfg: TrainConfig = TrainConfig()) -> JudgeHead:
    """Fit scaler + logistic regression on a stratified split, pick C by validation ROC-AUC, return the head."""
    x = features.float().numpy()
    y = labels.long().numpy()
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(f"features must be (N, H) with one label each, got {tuple(features.shape)} and {tuple(labels.shape)}")
    counts = np.bincount(y, minlength=2)
    if len(counts) > 2 or counts.min() < 2:
        raise ValueError(f"need at least 2 important and 2 unimportant mismatches (labels 0/1) to train and validate, "
                         f"got {counts[1] if len(counts) > 1 else 0} important and {counts[0]} unimportant; "
                         "mine more prompts")
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=cfg.val_fraction, stratify=y,
                                                      random_state=cfg.seed)
    if len(np.unique(y_val)) < 2 or len(np.unique(y_train)) < 2:
        raise ValueError("the train/validation split lost a class; mine more prompts or change --val-fraction")
    scaler = StandardScaler().fit(x_train)
    train_std, val_std = scaler.transform(x_train), scaler.transform(x_val)
    models = [(c, LogisticRegression(C=c, max_iter=cfg.max_iter).fit(train_std, y_train)) for c in cfg.c_grid]
    fits = [(roc_auc_score(y_val, m.predict_proba(val_std)[:, 1]), c, m) for c, m in models]
    auc, c, model = max(fits, key=lambda fit: fit[0])  # the first of equal AUCs
    val_probs = model.predict_proba(val_std)[:, 1]
    thresholds = {f"recall_{r:g}": threshold_for_recall(val_probs, y_val, r) for r in sorted({0.9, 0.95, 0.99, cfg.recall})}
    info = {"C": c, "val_roc_auc": float(auc), "threshold": thresholds[f"recall_{cfg.recall:g}"],
            "thresholds": thresholds, "n_train": int(len(y_train)), "n_val": int(len(y_val)),
            "n_important": int(counts[1]), "n_unimportant": int(counts[0])}
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)  # constant features: StandardScaler also uses 1
    as_tensor = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32).reshape(-1)  # noqa: E731
    return JudgeHead(as_tensor(scaler.mean_), as_tensor(scale), as_tensor(model.coef_[0]), as_tensor(model.intercept_), info)
