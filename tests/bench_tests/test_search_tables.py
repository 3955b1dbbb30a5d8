"""``bench/search.py`` measuring tables for real: a whole table saved recipe by recipe (a run
that dies goes on where it stopped), and a lazy one that measures only what strategies visit.
The digits CNN on the eager backend keeps each recipe to a second or two."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import search  # noqa: E402

CHOICES = ("fp32", "int8-dynamic-pc")


@pytest.fixture
def quiet_progress() -> Any:
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(file=io.StringIO()), transient=True) as progress:
        yield progress


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two small tables of the digits CNN at batch 1 (eager only, one hot layer), cached under
    ``tmp_path``."""
    monkeypatch.setattr(search, "ROOT", tmp_path)
    measurer_for = search.measurer_for

    def quick_measurer(*args: Any, **kwargs: Any) -> Any:
        """The bench's measurer with each recipe's timing capped at 3 s (20 s by default): on
        a 0.2 ms model the interleaved ratio rarely settles to the search's tolerance, and
        what these tests check is what is saved and measured, not the ratios."""
        measurer = measurer_for(*args, **kwargs)
        measurer.max_timing_s = 3.0
        return measurer

    monkeypatch.setattr(search, "measurer_for", quick_measurer)
    load = search._digits("cnn", 1)
    monkeypatch.setitem(search.TABLES, "t_whole", search.TableSpec(
        load, max_hot=1, backends=("eager",), choices=CHOICES))
    monkeypatch.setitem(search.TABLES, "t_lazy", search.TableSpec(
        load, max_hot=1, backends=("eager",), choices=CHOICES, lazy=True))
    return tmp_path / ".cache"


@pytest.mark.slow
def test_a_whole_table_is_saved_as_it_is_measured_and_goes_on_where_a_run_stopped(
    tables: Path, quiet_progress: Any
) -> None:
    prep = search.prepare_table("t_whole", False, quiet_progress, quiet_progress.console)
    (cache,) = tables.glob("search-table-t_whole-*.json")
    data = json.loads(cache.read_text())
    distinct = {prep.full.recipe(p).hash for p in prep.full.grid()}
    assert data["complete"] and set(data["entries"]) == distinct == set(prep.table.entries)
    top = sorted((e for e in data["entries"].values() if e["state"] == "complete"),
                 key=lambda e: e["ratio"])[:3]
    assert all(e.get("retimed") and len(e["ratios"]) >= 2 for e in top)
    # a run that died after one recipe: the next measures only the rest
    first = next(iter(data["entries"]))
    cache.write_text(json.dumps(data | {"complete": False,
                                        "entries": {first: data["entries"][first]}}))
    again = search.prepare_table("t_whole", False, quiet_progress, quiet_progress.console)
    assert again.table.entries[first] == data["entries"][first]  # kept, not measured again
    assert set(again.table.entries) == distinct and again.table.measure is None
    assert json.loads(cache.read_text())["complete"]


@pytest.mark.slow
def test_a_lazy_table_measures_what_the_strategies_visit_and_keeps_it(
    tables: Path, quiet_progress: Any
) -> None:
    prep = search.prepare_table("t_lazy", False, quiet_progress, quiet_progress.console)
    anchors = {prep.full.recipe(p).hash for p in search.anchors(prep.full)}
    assert set(prep.table.entries) == anchors  # one choice for every layer, each backend
    sc = search.Scenario("lazy", "t_lazy", 0.02)
    out = search.run_scenario(sc, prep, seeds=1, cap=3, progress=quiet_progress)
    assert out["lazy_table"] and out["table_recipes"] == len(prep.table.entries)
    assert anchors <= set(prep.table.entries)
    # judged against the best of what was measured (fp32 eager itself counts)
    labels = {e["label"] for e in prep.table.entries.values()} | {"fp32 · eager"}
    assert out["best_label"] in labels and out["best_score"] <= 1.0
    (cache,) = tables.glob("search-table-t_lazy-*.json")
    saved = json.loads(cache.read_text())["entries"]
    assert set(saved) == set(prep.table.entries)
    # a second run starts from what the first measured
    again = search.prepare_table("t_lazy", False, quiet_progress, quiet_progress.console)
    assert set(again.table.entries) == set(saved)


def test_a_table_of_any_size_can_be_measured() -> None:
    """Six hot layers with four choices on two backends (minilm_hot6's 32 768 recipes) are
    over a policy's trial cap: the measuring search refused to start before."""
    import torch

    from pgc_daemon.optimizer.search.space import Space

    choices = ("fp32", "int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt")
    space = Space(hot_layers=tuple("abcdef"), layer_choices=choices, default_choices=choices,
                  backends=("inductor", "eager"))
    assert space.size == 32_768
    model = torch.nn.Linear(4, 2)
    inputs = [((torch.randn(1, 4),), {}) for _ in range(4)]
    measurer = search.measurer_for("big", model, space, inputs, {"metric": "cosine"}, {})
    entry = search.measure_entry(measurer, space.params("fp32", "eager"),
                                 space.recipe(space.params("fp32", "eager")), 0)
    assert entry["state"] == "complete" and entry["drop"] == pytest.approx(0.0, abs=1e-6)
