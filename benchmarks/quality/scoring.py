"""LoCoMo's answer scoring: normalised token F1 (partial F1 over comma-separated parts for multi-hop), exact match,
the adversarial category scored by abstention, retrieval recall of the evidence turns, and bootstrap intervals
over questions (a mean, and a ratio of two configurations' means on the same questions)."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

ABSTAIN = ("not mentioned", "no information", "not available", "don't know", "do not know", "unknown")


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD/LoCoMo normalisation)."""
    text = str(text).lower().replace(",", " ")
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if not pred or not ref or same == 0:
        return float(pred == ref)
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def score(prediction: str, gold: str, category: int) -> float:
    """The F1 LoCoMo reports for one answer of a category."""
    if category == 5:  # adversarial: the right answer is to say it was not mentioned
        return float(any(phrase in prediction.lower() for phrase in ABSTAIN))
    if category == 3:  # open-domain answers keep their first alternative
        gold = gold.split(";")[0]
    if category == 1:  # multi-hop: each gold part matched by its best predicted part, averaged
        parts = [p for p in (s.strip() for s in str(gold).split(",")) if p]
        guesses = [g for g in (s.strip() for s in prediction.split(",")) if g] or [prediction]
        return sum(max(token_f1(g, part) for g in guesses) for part in parts) / len(parts) if parts else 0.0
    return token_f1(prediction, gold)


def recall(retrieved_evidence: Iterable[Iterable[str]], gold_evidence: Iterable[str]) -> float:
    """Share of the question's evidence turns backed by at least one retrieved fact (1.0 if it needs none)."""
    gold = set(gold_evidence)
    if not gold:
        return 1.0
    covered = set().union(*(set(e) for e in retrieved_evidence))
    return len(gold & covered) / len(gold)


def mean_interval(
    values: Sequence[float], rounds: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean, resampling the questions."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values")
    picks = np.random.default_rng(seed).integers(0, data.size, (rounds, data.size))
    means = data[picks].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], rounds: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(numerator) / mean(denominator), the two scored on the same questions
    (index i of both is one question): the questions are resampled together, so their shared difficulty cancels."""
    top, bottom = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if top.shape != bottom.shape or top.size == 0:
        raise ValueError(f"paired scores needed, got {top.size} and {bottom.size}")
    picks = np.random.default_rng(seed).integers(0, top.size, (rounds, top.size))
    sums = bottom[picks].sum(axis=1)
    ratios = np.where(sums > 0, top[picks].sum(axis=1) / np.where(sums > 0, sums, 1), np.nan)
    tail = (1 - level) / 2
    return float(np.nanquantile(ratios, tail)), float(np.nanquantile(ratios, 1 - tail))
