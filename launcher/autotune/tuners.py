"""Which candidate to try next, and when to stop: gridsearch, random, model_based.

A tuner sees the candidates not tried yet and the scores of those tried (higher is
better; a failed trial scores None) and proposes the next one. Random and model_based
are seeded, so a tuning run is reproducible. model_based fits a least-squares linear
model of the score on (stage, log2 micro-batch, accumulation, offloads, activation
checkpointing, log2 tp degree) to the trials
that ran and proposes the untried candidate it predicts best; it explores at random until
two trials have succeeded. Early stopping ends the run after `patience` trials in a row
that did not improve the best score.
"""
from __future__ import annotations

import math
import random
from typing import Dict, List, Optional, Sequence

from dslaunch.launcher.autotune.space import Candidate

SEED = 0


class Tuner:
    def __init__(self, seed: int = SEED):
        self.rng = random.Random(seed)

    def propose(self, untried: Sequence[Candidate], scores: Dict[Candidate, Optional[float]]) -> Candidate:
        raise NotImplementedError


class GridSearch(Tuner):
    def propose(self, untried, scores):
        return untried[0]


class RandomSearch(Tuner):
    def propose(self, untried, scores):
        return untried[self.rng.randrange(len(untried))]


def features(c: Candidate) -> List[float]:
    return [1.0, float(c.stage), math.log2(c.micro_batch), math.log2(c.grad_accum), float(c.offload_optimizer),
            float(c.offload_param), float(bool(c.activation_checkpointing)), math.log2(c.tp)]


def least_squares(xs: List[List[float]], ys: List[float], ridge: float = 1e-3) -> List[float]:
    """Weights w minimising |Xw - y|^2 + ridge |w|^2 (normal equations, Gaussian elimination)."""
    k = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) + (ridge if i == j else 0.0) for j in range(k)] for i in range(k)]
    b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if abs(a[col][col]) < 1e-12:  # a feature constant at 0 over the trials: its weight stays 0
            continue
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            a[r] = [v - f * w for v, w in zip(a[r], a[col])]
            b[r] -= f * b[col]
    w = [0.0] * k
    for r in reversed(range(k)):
        if abs(a[r][r]) >= 1e-12:
            w[r] = (b[r] - sum(a[r][c] * w[c] for c in range(r + 1, k))) / a[r][r]
    return w


class ModelBased(Tuner):
    def propose(self, untried, scores):
        ran = [(c, s) for c, s in scores.items() if s is not None]
        if len(ran) < 2:
            return untried[self.rng.randrange(len(untried))]
        w = least_squares([features(c) for c, _ in ran], [s for _, s in ran])
        return max(untried, key=lambda c: (sum(a * b for a, b in zip(w, features(c))), c.micro_batch))


TUNERS = {"gridsearch": GridSearch, "random": RandomSearch, "model_based": ModelBased}


class EarlyStopping:
    """Stop after `patience` trials in a row without a better score."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best: Optional[float] = None
        self.since_best = 0

    def observe(self, score: Optional[float]) -> bool:
        """Record one trial's score; True when tuning should stop."""
        if score is not None and (self.best is None or score > self.best):
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1
        return self.since_best >= self.patience
