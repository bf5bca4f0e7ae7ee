"""`kvgate tune` on a small synthetic trace: the search, its report and its config snippet."""

from __future__ import annotations

import pytest
import yaml

from engine import synth
from engine.config import CacheConfig
from engine.replay import replay
from engine.traces import load_trace
from engine.tune import SEARCH_SPACE, Evaluation, TuneResult, config_snippet, format_report, tune, with_settings
from gateway.cli import main
from gateway.config import KvgateConfig


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "mixed.jsonl"
    synth.write_trace(synth.synthesize("mixed", 150.0, 2.0, 11), path)
    return path


SMALL_SPACE = [("weights.spatial", [0.0, 0.3, 1.5]), ("life_s", [None, 5.0, 120.0]), ("no.such_knob", [1, 2])]


def test_search_improves_or_keeps_and_the_snippet_reproduces_it(trace_path):
    trace = load_trace(trace_path)
    capacity = max(1, round(0.05 * trace.unique_blocks()))
    calls = []
    result = tune(trace, capacity, CacheConfig(), time_limit_s=120.0, space=SMALL_SPACE,
                  progress=lambda done, planned, label: calls.append((done, planned, label)))
    assert result.skipped == ["no.such_knob"]
    assert result.best.hit_ratio >= result.start.hit_ratio
    assert [c[0] for c in calls] == list(range(1, result.evaluations + 1))
    assert all(done <= planned for done, planned, _ in calls)
    assert result.stopped == "converged" and result.evaluations <= 2 + 3 * 4
    # The printed snippet is valid config.yaml and gives the reported hit ratio when replayed.
    snippet = yaml.safe_load(config_snippet(result))
    cfg = KvgateConfig.model_validate(snippet)
    assert cfg.cache.policy == "wa"
    again = replay(trace, "wa", capacity, cfg.cache).hit_ratio
    assert again == pytest.approx(result.best.hit_ratio, abs=1e-12)
    assert replay(trace, "lru", capacity).hit_ratio == pytest.approx(result.lru, abs=1e-12)


def test_budget_stops_the_search(trace_path):
    trace = load_trace(trace_path)
    result = tune(trace, 500, time_limit_s=120.0, max_evaluations=4, space=SMALL_SPACE)
    assert result.stopped == "evaluation limit" and result.evaluations == 4


def test_search_space_names_real_knobs():
    # Every knob the default search tries exists in the config and accepts its values.
    from engine.config import WorkloadAwareConfig

    base = WorkloadAwareConfig()
    for dotted, values in SEARCH_SPACE:
        for value in values:
            with_settings(base, {dotted: value})


def test_cli_prints_baselines_and_a_config_snippet(trace_path, capsys):
    assert main(["tune", str(trace_path), "--capacity", "0.05", "--max-evals", "8", "--holdout", "0.3",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "lru                   hit ratio" in out and "wa, starting settings hit ratio" in out
    assert "wa, tuned" in out and "held-out tail" in out and "stopped: evaluation limit" in out
    assert KvgateConfig.model_validate(yaml.safe_load(out)).cache.policy == "wa"  # the report is YAML as it is
    assert main(["tune", str(trace_path), "--holdout", "1.5"]) == 2
    assert main(["tune", str(trace_path), "--max-evals", "0"]) == 2
    assert main(["tune", str(trace_path), "--time-limit", "-1"]) == 2


def test_report_warns_when_the_held_out_tail_disagrees():
    def report(best_on_tail: float) -> str:
        result = TuneResult(100, 0, 0.20, Evaluation({}, 0.25), Evaluation({"weights.spatial": 0.5}, 0.27), 10, 1, 1.0,
                            "converged", holdout={"lru": 0.15, "start": 0.19, "best": best_on_tail})
        return format_report(result, "t.jsonl", 50, 1000)

    # What is not commented out (what a reader pastes, or yaml.safe_load reads) is
    # the starting settings when the tuned ones lose on the tail, else the tuned ones.
    losing, winning = report(0.18), report(0.20)
    assert "lose on the held-out tail" in losing and "#         spatial: 0.5" in losing
    assert yaml.safe_load(losing) == {"cache": {"policy": "wa", "workload_aware": {}}}
    assert "lose on the held-out tail" not in winning
    assert yaml.safe_load(winning) == {"cache": {"policy": "wa", "workload_aware": {"weights": {"spatial": 0.5}}}}
