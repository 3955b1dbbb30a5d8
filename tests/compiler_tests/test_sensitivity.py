"""Per-layer sensitivity: the numbers, their JSON, and their rows in the store."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from compiler import (
    LayerQuant,
    Quantization,
    Recipe,
    SensitivityReport,
    build,
    fidelity,
    fingerprint,
    sensitivity,
)
from tests.compiler_tests.conftest import examples, outputs

LAYERS = [
    "encoder.encoder.layer.0.intermediate.dense",
    "encoder.encoder.layer.0.output.dense",
    "encoder.encoder.layer.1.attention.self.query",
]


@pytest.fixture(scope="module")
def report(tiny_bert: dict[str, Any]) -> SensitivityReport:
    return sensitivity(
        tiny_bert["model"], tiny_bert["inputs"], ["int8-dynamic-pc", "int8-static-pc", "bf16"],
        layers=LAYERS + ["encoder.embeddings.LayerNorm"], max_inputs=6,
    )


def test_every_layer_and_choice_gets_a_row_with_the_model_and_layer_error(report: SensitivityReport) -> None:
    assert report.metric == "cosine" and report.inputs == 6
    measured = [r for r in report.rows if r.status == "ok"]
    assert {(r.layer, r.choice) for r in measured} == {
        (n, c) for n in LAYERS for c in ("int8-dynamic-pc", "int8-static-pc", "bf16")
    }
    for r in measured:
        assert r.fidelity is not None and 0.99 < r.fidelity <= 1.0 + 1e-6
        assert r.rms is not None and r.rms > 0 and r.max_abs is not None and r.max_abs >= r.rms
        assert r.sqnr_db is not None and math.isfinite(r.sqnr_db) and r.sqnr_db > 10
        assert r.layer_sqnr_db is not None and r.layer_sqnr_db > 10
    ln = report.get("encoder.embeddings.LayerNorm", "int8-dynamic-pc")
    assert ln is not None and ln.fidelity is None and "cannot take" in ln.status


def test_a_row_is_the_error_of_building_that_one_layer(tiny_bert: dict[str, Any], report: SensitivityReport) -> None:
    row = report.get(LAYERS[1], "int8-dynamic-pc")
    assert row is not None
    ins = tiny_bert["inputs"][:6]
    built = build(tiny_bert["model"], Recipe(quantization=Quantization.of({LAYERS[1]: "int8-dynamic-pc"})))
    assert fidelity("cosine", outputs(tiny_bert["model"], ins), outputs(built.module, ins)) == pytest.approx(row.fidelity)


def test_ranking_puts_the_largest_error_first(report: SensitivityReport) -> None:
    ranked = report.ranked("int8-static-pc")
    assert len(ranked) == 3
    assert [r.fidelity for r in ranked] == sorted(r.fidelity for r in ranked)  # type: ignore[type-var]
    assert report.most_sensitive("int8-static-pc", 1) == [ranked[0].layer]


def test_report_round_trips_through_json(report: SensitivityReport) -> None:
    again = SensitivityReport.from_json(report.to_json())
    assert again.rows == report.rows and again.metric == report.metric
    json.loads(report.to_json(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_convolutions_take_static_int8_only(cnn_spec: dict[str, Any]) -> None:
    r = sensitivity(cnn_spec["model"], examples(cnn_spec, 4), [LayerQuant("int8", "static"), "int8-dynamic-pc"],
                    layers=["features.3"], max_inputs=4)
    assert r.metric == "top1"
    assert r.get("features.3", "int8-static-pc").status == "ok"  # type: ignore[union-attr]
    assert "cannot take" in r.get("features.3", "int8-dynamic-pc").status  # type: ignore[union-attr]


def test_sensitivity_is_stored_per_graph_and_read_back_most_sensitive_first(
    store: Any, tiny_bert: dict[str, Any], report: SensitivityReport
) -> None:
    from store import repo

    graph = fingerprint(tiny_bert["model"])
    with store.session() as s:
        model = repo.upsert_model(s, "tiny-bert", graph_hash=graph)
        assert repo.save_sensitivity(s, model.id, graph, report.to_rows()) == len(report.rows)
        model_id = model.id
    with store.session() as s:
        rows = repo.load_sensitivity(s, model_id)
        assert len(rows) == len(report.rows)
        assert rows[0].fidelity == min(r.fidelity for r in report.rows if r.fidelity is not None)
        assert rows[-1].fidelity is None and "cannot take" in rows[-1].status
        static = repo.load_sensitivity(s, model_id, graph, choice="int8-static-pc")
        assert [r.layer for r in static if r.fidelity is not None] == report.most_sensitive("int8-static-pc", 3)
        assert static[-1].layer == "encoder.embeddings.LayerNorm"
        # measured again: replaced, not duplicated
        first = report.to_rows()[0]
        repo.save_sensitivity(s, model_id, graph, [{**first, "fidelity": 0.5}])
    with store.session() as s:
        rows = repo.load_sensitivity(s, model_id)
        assert len(rows) == len(report.rows) and rows[0].fidelity == 0.5
        repo.save_sensitivity(s, model_id, "f" * 64, report.to_rows()[:2])  # a new model version
    with store.session() as s:
        assert len(repo.load_sensitivity(s, model_id)) == 2  # the graph measured last
        assert len(repo.load_sensitivity(s, model_id, graph)) == len(report.rows)
        assert repo.delete_sensitivity(s, model_id, graph) == len(report.rows)
        assert repo.load_sensitivity(s, model_id, graph) == []


def test_top1_reports_count_the_rows_behind_each_drop_and_keep_the_count(
    store: Any, cnn_spec: dict[str, Any]
) -> None:
    from store import repo

    ins = examples(cnn_spec, 4)
    r = sensitivity(cnn_spec["model"], ins, ["int8-static-pc"], layers=["features.3"], max_inputs=4)
    rows = sum(o.shape[0] for o in outputs(cnn_spec["model"], ins))
    assert r.metric == "top1" and r.samples == rows > 0
    assert SensitivityReport.from_json(r.to_json()).samples == rows
    row = r.get("features.3", "int8-static-pc")
    floor = r.floor(row) if row is not None else None
    assert row is not None and row.drop is not None and floor is not None and floor <= row.drop
    graph = fingerprint(cnn_spec["model"])
    with store.session() as s:
        model_id = repo.upsert_model(s, "cnn", graph_hash=graph).id
        repo.save_sensitivity(s, model_id, graph, r.to_rows())
    with store.session() as s:
        assert [x.samples for x in repo.load_sensitivity(s, model_id, graph)] == [rows]


def test_continuous_metrics_count_no_judgments(report: SensitivityReport) -> None:
    assert report.samples == 0
    row = report.get(LAYERS[0], "int8-dynamic-pc")
    assert row is not None and report.floor(row) == row.drop
