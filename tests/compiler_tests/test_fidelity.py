from __future__ import annotations

import math

import pytest
import torch

from compiler import choose_metric, compare, fidelity, fingerprint
from compiler.fidelity import sqnr_db_of


def test_cosine_of_identical_and_opposite_embeddings() -> None:
    a = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    assert fidelity("cosine", [a], [a]) == pytest.approx(1.0)
    assert fidelity("cosine", [a], [-a]) == pytest.approx(-1.0)


def test_top1_agreement_counts_rows() -> None:
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    out = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert fidelity("top1", [ref], [out]) == pytest.approx(0.75)


def test_sqnr_fidelity_is_one_minus_noise_to_signal() -> None:
    ref = torch.ones(100)
    out = ref + 0.1  # noise power 0.01, signal power 1 -> SQNR 20 dB
    value = fidelity("sqnr", [ref], [out])
    assert value == pytest.approx(0.99, abs=1e-6)
    assert sqnr_db_of(value) == pytest.approx(20.0, abs=1e-3)


def test_non_finite_outputs_score_zero() -> None:
    ref = torch.ones(3, 4)
    out = torch.full((3, 4), float("nan"))
    assert fidelity("cosine", [ref], [out]) == 0.0
    assert fidelity("sqnr", [ref], [out]) == 0.0


def test_choose_metric_from_outputs() -> None:
    emb = torch.nn.functional.normalize(torch.randn(2, 384), dim=-1)
    assert choose_metric(emb) == "cosine"
    assert choose_metric(torch.randn(2, 10)) == "top1"
    assert choose_metric(torch.randn(2, 7, 64)) == "cosine"
    assert choose_metric(torch.randn(2, 1)) == "sqnr"
    assert choose_metric({"logits": torch.randn(3, 5)}) == "top1"


def test_compare_reports_every_measure() -> None:
    ref = torch.randn(4, 10)
    out = ref + 0.01 * torch.randn(4, 10)
    c = compare(ref, out)
    assert set(c) == {"max_abs", "rms", "cosine", "sqnr_db", "top1"}
    assert c["cosine"] > 0.99 and c["sqnr_db"] > 20 and c["max_abs"] < 0.1
    assert math.isinf(compare(ref, ref)["sqnr_db"])


def test_unknown_metric_and_mismatched_lengths_are_errors() -> None:
    with pytest.raises(ValueError):
        fidelity("l2", [torch.ones(1)], [torch.ones(1)])
    with pytest.raises(ValueError):
        fidelity("cosine", [torch.ones(1)], [])


def test_fingerprint_follows_weights_not_identity() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 4)
    b = torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.weight[0, 0] += 1e-3
    assert fingerprint(a) != fingerprint(b)
