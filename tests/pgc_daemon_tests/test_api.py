"""The REST API over a real SQLite store (contents written through the store's own
functions), through FastAPI's test client."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

import store as st
from pgc_daemon import states
from compiler import Backend, Quantization, Recipe

from .helpers import TEST_TOKEN, api_client

INT8 = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))


@pytest.fixture
def populated(store: st.Store) -> st.Store:
    now = time.time()
    with store.session() as s:
        m = st.repo.upsert_model(s, "mini", spec="pkg:build", graph_hash="g" * 64, metric="cosine")
        base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), Recipe().label())
        fast = st.repo.get_or_create_variant(s, m.id, INT8.hash, INT8.to_dict(), INT8.label())
        st.repo.put_policy(s, m.id, {"max_accuracy_drop": 0.01})
        d0 = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        states.move(s, d0.id, "active", "base")
        st.repo.add_window_stats(s, requests=[st.RequestStatRow(
            model_id=m.id, variant_id=base.id, window_start=now - 100, window_end=now - 90,
            shape_bucket="b1 s128", count=100, mean_ms=20, p50_ms=20, p95_ms=25, p99_ms=30,
            sampled=5, overhead=0.002)])
        st.repo.add_window_stats(s, layers=[st.LayerStatRow(
            model_id=m.id, variant_id=base.id, window_start=now - 100, window_end=now - 90,
            layer=f"l{i}", op_type="Linear", shape_bucket="b1 s128", count=5, mean_ms=m_,
            p50_ms=m_, p95_ms=m_, p99_ms=m_, share=0) for i, m_ in enumerate([4.0, 1.0])])
        run = st.repo.create_search_run(s, m.id, study_name="s", policy_version=1, trigger="t", trials_budget=2)
        for n, (v, sp, drop) in enumerate([(base.id, 1.2, 0.0), (fast.id, 2.5, 0.004)]):
            st.repo.add_trial(s, run_id=run.id, model_id=m.id, variant_id=v, number=n, state="complete",
                              speedup=sp, latency_ms=20 / sp, baseline_ms=20, fidelity=1 - drop,
                              accuracy_drop=drop, feasible=True, params={}, duration_s=3.0)
        st.repo.update_search_run(s, run.id, state="done", trials_done=2, chosen_variant_id=fast.id)
        d1 = st.repo.create_deployment(s, m.id, fast.id, source="search", reason="found",
                                       expected_speedup=2.5, expected_fidelity=0.996)
        for state in ("building", "warming", "verifying", "canary"):
            states.move(s, d1.id, state, state)
        states.move(s, d0.id, "superseded", "replaced")
        states.move(s, d1.id, "active", "ok", previous_variant_id=base.id)
        st.repo.add_window_stats(s, requests=[st.RequestStatRow(
            model_id=m.id, variant_id=fast.id, window_start=time.time() + 1, window_end=time.time() + 11,
            shape_bucket="b1 s128", count=50, mean_ms=8, p50_ms=8, p95_ms=9, p99_ms=10,
            sampled=0, overhead=0.0)])
    return store


def client(store: st.Store, token: str = TEST_TOKEN, *, auth: bool = True) -> TestClient:
    return api_client(store, token, auth=auth)


def test_health_and_models(populated: st.Store) -> None:
    c = client(populated)
    assert c.get("/healthz").json()["status"] == "ok"
    models = c.get("/api/models").json()
    assert [m["name"] for m in models] == ["mini"]
    m = c.get("/api/models/mini").json()
    assert m["active"]["label"] == INT8.label() and m["active"]["expected_speedup"] == 2.5
    assert m["latency"]["baseline"]["p50_ms"] == 20 and m["latency"]["current"]["p50_ms"] == 8
    assert m["latency"]["speedup"] == pytest.approx(2.5)
    assert m["search"]["state"] == "done" and m["search"]["trials_done"] == 2


def test_unknown_model_is_404_with_a_message(populated: st.Store) -> None:
    c = client(populated)
    for path in ("/api/models/nope", "/api/models/nope/policy", "/api/models/nope/profile",
                 "/api/models/nope/front", "/api/models/nope/deployments", "/api/models/nope/trials"):
        r = c.get(path)
        assert r.status_code == 404, path
        assert "nope" in r.json()["detail"]


def test_policy_get_put_and_readable_422(populated: st.Store) -> None:
    c = client(populated)
    p = c.get("/api/models/mini/policy").json()
    assert p["max_accuracy_drop"] == 0.01 and p["version"] == 1
    r = c.put("/api/models/mini/policy", json={"max_accuracy_drop": 0.02, "latency_target_ms": 10})
    assert r.status_code == 200 and r.json()["version"] == 2
    assert c.get("/api/models/mini/policy").json()["latency_target_ms"] == 10
    bad = c.put("/api/models/mini/policy", json={"max_accuracy_drop": "lots"})
    assert bad.status_code == 422
    assert bad.json()["detail"].startswith("max_accuracy_drop:")
    assert c.put("/api/models/mini/policy", json={"nope": 1}).status_code == 422
    bad_json = c.put("/api/models/mini/policy", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 422
    assert c.put("/api/models/mini/policy", content=b"{not json").status_code == 415  # not sent as JSON
    assert c.get("/api/models/mini/policy").json()["version"] == 2  # bad bodies changed nothing


def test_the_policy_names_the_backends_a_search_may_choose(populated: st.Store) -> None:
    c = client(populated)
    assert c.get("/api/models/mini/policy").json()["backends"] is None  # every installed one
    # a JSON list, checked against the names pgc knows
    r = c.put("/api/models/mini/policy", json={"backends": ["inductor", "onnxruntime"]})
    assert r.status_code == 200 and r.json()["backends"] == ["inductor", "onnxruntime"]
    bad = c.put("/api/models/mini/policy", json={"backends": ["tvm"]})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("backends.0:")
    assert c.get("/api/models/mini/policy").json()["backends"] == ["inductor", "onnxruntime"]


def test_profile_front_and_deployments(populated: st.Store) -> None:
    c = client(populated)
    prof = c.get("/api/models/mini/profile").json()
    assert [l["layer"] for l in prof["layers"]] == ["l0", "l1"]
    assert prof["layers"][0]["share"] == pytest.approx(0.8)
    front = c.get("/api/models/mini/front").json()
    assert len(front["points"]) == 2 and front["feasible"] == 2
    deployed = [p for p in front["points"] if p["deployed"]]
    assert len(deployed) == 1 and deployed[0]["label"] == INT8.label()
    assert all(p["pareto"] for p in front["points"])  # faster vs more accurate
    deps = c.get("/api/models/mini/deployments").json()
    assert deps[0]["state"] == "active" and deps[0]["transitions"][-1]["to_state"] == "active"
    assert deps[1]["state"] == "superseded"


def test_mutations_need_the_token(populated: st.Store) -> None:
    c = client(populated, token="s3cret", auth=False)
    assert c.put("/api/models/mini/policy", json={}).status_code == 401
    assert c.put("/api/models/mini/policy", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = c.put("/api/models/mini/policy", json={}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert c.get("/api/models/mini").status_code == 200  # reads stay open


def test_deploy_and_rollback_create_candidates_and_conflict_while_busy(populated: st.Store) -> None:
    c = client(populated)
    r = c.post("/api/models/mini/rollback", json={"reason": "testing"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "candidate" and body["source"] == "rollback" and body["label"] == "fp32 · eager"
    again = c.post("/api/models/mini/deployments", json={"recipe": Recipe().to_dict()})
    assert again.status_code == 409 and "still candidate" in again.json()["detail"]


def test_deploy_validates_its_body(populated: st.Store) -> None:
    c = client(populated)
    assert c.post("/api/models/mini/deployments", json={}).status_code == 422
    bad = c.post("/api/models/mini/deployments", json={"recipe": {"backend": {"kind": "tvm"}}})
    assert bad.status_code == 422 and "backend" in bad.json()["detail"]
    assert c.post("/api/models/mini/deployments", json={"variant_id": 9999}).status_code == 404


def test_deploy_takes_every_recipe_part(populated: st.Store) -> None:
    from compiler import Fusion, Layout, ShapeBuckets

    recipe = Recipe(
        quantization=Quantization.of({"_default": "int8-static-pc", r"re:.*\.output\.dense": "fp32"}),
        backend=Backend("onnxruntime"),
        fusion=Fusion(conv_bn=True),
        layout=Layout("channels_last"),
        buckets=ShapeBuckets((64, 128)),
    )
    c = client(populated)
    r = c.post("/api/models/mini/deployments", json={"recipe": recipe.to_dict(), "reason": "every part"})
    assert r.status_code == 202, r.text
    with populated.session() as s:
        stored = st.repo.get_variant(s, r.json()["variant_id"])
    assert Recipe.from_dict(stored.recipe) == recipe and stored.recipe_hash == recipe.hash
    again = c.post("/api/models/mini/deployments", json={"recipe": recipe.to_dict()})
    assert again.status_code == 409  # the first one is still a candidate
    bad = c.post("/api/models/mini/deployments",
                 json={"recipe": {"buckets": {"sizes": [64, 64]}}})
    assert bad.status_code == 422 and "distinct" in bad.json()["detail"]


def test_optimize_without_an_optimizer_loop_is_503(populated: st.Store) -> None:
    assert client(populated).post("/api/models/mini/optimize", json={}).status_code == 503


def test_metrics_are_prometheus_text(populated: st.Store) -> None:
    text = client(populated).get("/metrics").text
    assert 'pgc_requests_total{model="mini",variant="fp32 · eager",variant_id="1"} 100.0' in text
    # deployments by outcome: both reached active (the base, then the int8 variant)
    assert 'pgc_deployments_total{model="mini",outcome="deployed"} 2.0' in text
    assert 'pgc_trials_total{model="mini",state="complete"} 2.0' in text


def test_openapi_documents_the_error_bodies(populated: st.Store) -> None:
    doc: dict[str, Any] = client(populated).get("/openapi.json").json()
    put = doc["paths"]["/api/models/{name}/policy"]["put"]["responses"]
    assert {"200", "401", "404", "413", "415", "422", "429"} <= set(put)


def test_timeline_has_a_series_per_variant_and_deployment_markers(populated: st.Store) -> None:
    tl = client(populated).get("/api/models/mini/timeline", params={"points": 50}).json()
    assert [s["label"] for s in tl["series"]] == ["fp32 · eager", INT8.label()]  # the base first
    assert tl["series"][0]["is_baseline"] and tl["series"][0]["points"][0]["p50_ms"] == 20
    assert [(m["kind"], m["label"]) for m in tl["markers"]] == [
        ("deployed", "fp32 · eager"), ("deployed", INT8.label())
    ]
    assert 0 < tl["step_s"] and tl["since"] <= tl["until"]
    later = client(populated).get("/api/models/mini/timeline", params={"since": time.time() + 3600}).json()
    assert later["series"] == [] and later["markers"] == []


def test_method_not_allowed_names_every_method_of_the_path(populated: st.Store) -> None:
    r = client(populated).delete("/api/models/mini/policy")
    assert r.status_code == 405 and r.headers["allow"] == "GET, PUT"


def test_bodies_are_strict_as_their_schema_says(populated: st.Store) -> None:
    c = client(populated)
    assert c.put("/api/models/mini/policy", json={"max_trials": "3"}).status_code == 422
    assert c.put("/api/models/mini/policy", json={"auto_deploy": "true"}).status_code == 422
    assert c.put("/api/models/mini/policy", json={"objective": "most_accurate"}).status_code == 422
    ok = c.put("/api/models/mini/policy", json={"max_trials": 3.0, "objective": "most_accurate",
                                                 "latency_target_ms": 9})
    assert ok.status_code == 200 and ok.json()["max_trials"] == 3
    assert c.post("/api/models/mini/deployments", json={"variant_id": 2**60}).status_code == 422
    assert c.post("/api/models/mini/deployments", json={"variant_id": 1, "recipe": {}}).status_code == 422
    bad_key = {"recipe": {"quantization": {"re:(": {"precision": "bf16"}}}}
    assert c.post("/api/models/mini/deployments", json=bad_key).status_code == 422


def test_the_recipe_body_is_derived_from_the_compiler_types() -> None:
    from compiler.parts import LinearKernel, MemoryFormat, PartitionStrategy
    from compiler.recipe import BACKEND_MODES, BackendKind, Granularity, Precision, Scheme
    from pgc_daemon.api.schemas import RecipeBody

    defs = RecipeBody.model_json_schema()["$defs"]

    def enum(model: str, field: str) -> set[str]:
        prop = defs[model]["properties"][field]
        return set(prop.get("enum", [prop.get("const")]))

    assert enum("FloatChoice", "precision") | enum("Int8Choice", "precision") == set(Precision)
    assert enum("Int8Choice", "scheme") == set(Scheme)
    assert enum("FloatChoice", "granularity") == set(Granularity)
    backends = {enum(name, "kind").pop(): enum(name, "mode") for name in defs if name.endswith("Backend")}
    assert backends == {k.value: {m.value for m in modes} for k, modes in BACKEND_MODES.items()}
    assert set(backends) == set(BackendKind)
    assert enum("LayoutBody", "memory_format") == set(MemoryFormat)
    assert enum("KernelsBody", "linear") == set(LinearKernel)
    assert enum("PartitionBody", "strategy") == set(PartitionStrategy)


@pytest.mark.parametrize(
    "recipe",
    [
        Recipe(),
        INT8,
        Recipe(quantization=Quantization.of({"_default": "bf16", "re:enc.*": "int8-weight_only-pt"}),
               backend=Backend("inductor", "max-autotune")),
        Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}),
               backend=Backend("inductor", "max-autotune", autocast="bf16")),
        Recipe(quantization=Quantization.of({"_default": "fp8", "classifier": "fp16"}),
               backend=Backend("inductor", "max-autotune")),
        Recipe.from_dict({"quantization": {}, "layout": {"memory_format": "channels_last"},
                          "kernels": {"linear": "triton"}, "partition": {"strategy": "memory"},
                          "buckets": {"sizes": [32, 64]}}),
    ],
    ids=lambda r: r.label(),
)
def test_every_recipe_goes_through_the_body_unchanged(recipe: Recipe) -> None:
    from pgc_daemon.api.schemas import RecipeBody

    body = RecipeBody.model_validate(recipe.to_dict())
    assert body.to_recipe() == recipe and body.to_recipe().hash == recipe.hash


def test_autocast_is_a_word_of_the_inductor_body_only() -> None:
    from pydantic import ValidationError

    from pgc_daemon.api.schemas import RecipeBody

    with pytest.raises(ValidationError):
        RecipeBody.model_validate({"quantization": {},
                                   "backend": {"kind": "onnxruntime", "autocast": "bf16"}})
    with pytest.raises(ValidationError):
        RecipeBody.model_validate({"quantization": {},
                                   "backend": {"kind": "inductor", "autocast": "fp16"}})


def test_model_list_and_metrics_are_computed_once_per_tick(populated: st.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from pgc_daemon.api import routes_models

    calls = 0
    real = routes_models.model_summary

    def counting(s: Any, m: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return real(s, m)

    monkeypatch.setattr(routes_models, "model_summary", counting)
    c = client(populated)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(c.get("/api/models").status_code)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8 and calls == 1  # one model, one computation for 8 callers
    time.sleep(1.1)
    assert c.get("/api/models").status_code == 200 and calls == 2


def test_replicas_are_listed_with_what_they_serve(populated: st.Store) -> None:
    with populated.session() as s:
        m = st.repo.get_model(s, "mini")
        fast = next(v for v in st.repo.list_variants(s, m.id) if v.recipe_hash == INT8.hash)
        base = next(v for v in st.repo.list_variants(s, m.id) if v.recipe_hash == Recipe().hash)
        st.repo.register_replica(s, m.id, "h:1:a", "h", 1)
        st.repo.register_replica(s, m.id, "h:2:b", "h", 2)
        st.repo.register_replica(s, m.id, "h:3:c", "h", 3)
        st.repo.beat_replica(s, "h:1:a", state="serving", variant_id=fast.id, loads=1, live_ms=7.5)
        st.repo.beat_replica(s, "h:2:b", state="serving", variant_id=base.id, compiles=1)
        st.repo.stop_replica(s, "h:3:c")
    c = client(populated)
    rows = c.get("/api/models/mini/replicas").json()
    assert [r["name"] for r in rows] == ["h:3:c", "h:2:b", "h:1:a"]
    one = rows[2]
    assert one["serving"] == INT8.label() and one["alive"] and one["loads"] == 1 and one["live_ms"] == 7.5
    assert not rows[0]["alive"] and rows[0]["state"] == "stopped"
    counts = c.get("/api/models/mini").json()["replicas"]
    assert counts == {"live": 2, "on_active": 1, "compiles": 1}
    assert c.get("/api/models/nope/replicas").status_code == 404


def test_the_serving_variants_kernel_rows_show_beside_fp32_and_rank_a_re_search(populated: st.Store) -> None:
    """A compiled variant's sampled calls, split over the layers its kernels fuse, come back
    in the profile's ``active`` part (fp32 stays in ``layers``), and once sampled enough they
    are what a re-search ranks hot layers by."""
    from pgc_daemon.optimizer.search.hotprofile import MIN_SAMPLED_CALLS, search_profile

    c = client(populated)
    assert c.get("/api/models/mini/profile").json()["active"] is None  # no rows of it yet

    def add(count: int) -> None:
        now = time.time()
        rows = [("l1", "k_fused (fused with l0)", 2.0), ("l0", "k_fused (fused with l1)", 2.0),
                ("l1", "k_norm", 1.5), ("(between kernels)", "wrapper", 0.5)]
        with populated.session() as s:
            m = st.repo.get_model(s, "mini")
            fast = st.repo.active_deployment(s, m.id).variant_id
            st.repo.add_window_stats(s, layers=[st.LayerStatRow(
                model_id=m.id, variant_id=fast, window_start=now, window_end=now + 5, layer=layer,
                op_type=op, shape_bucket="b1 s128", count=count, mean_ms=ms, p50_ms=ms, p95_ms=ms,
                p99_ms=ms, share=0) for layer, op, ms in rows])
            # the window they were sampled in: busier than the variant's other window (8 ms)
            st.repo.add_window_stats(s, requests=[st.RequestStatRow(
                model_id=m.id, variant_id=fast, window_start=now, window_end=now + 5,
                shape_bucket="b1 s128", count=150, mean_ms=6.2, p50_ms=6.2, p95_ms=7,
                p99_ms=8, sampled=count, overhead=0.0)])

    add(MIN_SAMPLED_CALLS - 1)
    body = c.get("/api/models/mini/profile").json()
    assert [r["layer"] for r in body["layers"]] == ["l0", "l1"]  # fp32's, hottest first
    active = body["active"]
    assert active["label"] == INT8.label()
    assert {(r["layer"], r["op_type"]) for r in active["layers"]} == {
        ("l1", "k_fused (fused with l0)"), ("l0", "k_fused (fused with l1)"), ("l1", "k_norm"),
        ("(between kernels)", "wrapper")}
    # beside the live latency of the windows the rows were sampled in, not of every window
    assert active["layer_sum_ms"] == pytest.approx(6.0) and active["live_ms"] == pytest.approx(6.2)
    assert active["live_ms_all"] == pytest.approx((50 * 8 + 150 * 6.2) / 200)
    assert active["sampled_calls"] == MIN_SAMPLED_CALLS - 1
    with populated.session() as s:
        m = st.repo.get_model(s, "mini")
        base = next(v.id for v in st.repo.list_variants(s, m.id) if v.recipe_hash == Recipe().hash)
        rows, whose = search_profile(s, m.id, base, 0.0)
        assert whose == "fp32" and rows[0]["layer"] == "l0"  # too few samples of the variant
    add(MIN_SAMPLED_CALLS)
    with populated.session() as s:
        rows, whose = search_profile(s, m.id, base, 0.0)
    assert whose.startswith("the serving variant") and INT8.label() in whose
    assert [r["layer"] for r in rows][:2] == ["l1", "l0"]  # l1 now carries the most time
    assert rows[0]["mean_ms"] == pytest.approx(3.5)
