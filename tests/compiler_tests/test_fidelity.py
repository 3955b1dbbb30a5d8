from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from compiler import choose_metric, compare, fidelity, fingerprint
from compiler.fidelity import drop_floor, judgments, sqnr_db_of


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


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


@pytest.mark.parametrize("metric", ["top1", "cosine", "sqnr"])
def test_a_dataclass_output_is_compared_by_its_tensors(metric: str) -> None:
    """torch's pytree keeps a plain dataclass whole: before, no tensor was found on either
    side and every output, however wrong, scored 1.0."""
    torch.manual_seed(0)
    ref = Output(torch.randn(8, 10), torch.randn(8, 32))
    wrong = Output(-ref.logits, torch.randn(8, 32))
    assert choose_metric(ref) == "top1"
    assert fidelity(metric, [ref], [ref]) == pytest.approx(1.0)
    assert fidelity(metric, [ref], [wrong]) < 0.2
    assert compare(ref, wrong)["cosine"] < 0.2


def test_outputs_of_another_structure_score_zero() -> None:
    ref = (torch.ones(4, 10), torch.ones(4, 3))
    assert fidelity("cosine", [ref], [ref[:1]]) == 0.0  # a tensor missing
    assert fidelity("cosine", [ref], [(torch.ones(4, 10), torch.ones(4, 4))]) == 0.0  # a shape
    assert fidelity("sqnr", [ref], [(torch.ones(4, 10), torch.ones(4, 3, dtype=torch.long))]) == 0.0


def test_integer_outputs_count_by_exact_agreement() -> None:
    ids = torch.arange(8)
    assert fidelity("sqnr", [ids], [ids.clone()]) == 1.0
    assert fidelity("sqnr", [ids], [torch.where(ids < 2, -1, ids)]) == pytest.approx(0.75)
    # beside logits: the lower of the two judges
    ref = {"logits": torch.eye(4), "pred": torch.arange(4)}
    out = {"logits": torch.eye(4), "pred": torch.zeros(4, dtype=torch.long)}
    assert fidelity("top1", [ref], [out]) == 0.25


def test_an_output_without_tensors_cannot_be_judged() -> None:
    with pytest.raises(ValueError, match="no tensor"):
        fidelity("sqnr", [{"label": "cat"}], [{"label": "dog"}])


def test_fingerprint_follows_weights_not_identity() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 4)
    b = torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.weight[0, 0] += 1e-3
    assert fingerprint(a) != fingerprint(b)


def test_top1_judgments_are_the_rows_compared() -> None:
    batch1 = [torch.randn(1, 10) for _ in range(8)]
    batch4 = [torch.randn(4, 10) for _ in range(3)]
    assert judgments("top1", batch1) == 8
    assert judgments("top1", batch4) == 12
    assert judgments("top1", [{"logits": torch.randn(2, 5, 10)}]) == 10  # rows of a sequence
    assert judgments("cosine", batch1) == 0 and judgments("sqnr", batch4) == 0


def test_a_top1_drop_floor_is_the_least_likely_rate_of_changed_rows() -> None:
    # one row of 8 changed: as likely from a true drop of 0.0064 (1 - 0.95 ** (1 / 8))
    one = drop_floor("top1", 1 / 8, 8)
    assert one == pytest.approx(1 - 0.95 ** (1 / 8), rel=1e-6)
    assert one < 0.01 < drop_floor("top1", 2 / 8, 8) < 2 / 8
    # more rows, the same share: a tighter floor, closer to the share measured
    assert drop_floor("top1", 1 / 8, 8) < drop_floor("top1", 8 / 64, 64) < 1 / 8
    assert drop_floor("top1", 0.0, 8) == 0.0
    assert drop_floor("top1", 1.0, 8) == pytest.approx(0.05 ** (1 / 8), rel=1e-6)
    # continuous metrics, and counts not known, keep the drop measured
    assert drop_floor("cosine", 0.125, 8) == 0.125
    assert drop_floor("top1", 0.125, 0) == 0.125
