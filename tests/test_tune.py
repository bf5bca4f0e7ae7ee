"""`kvgate tune` on a small synthetic trace: the search, its report and its config snippet."""

from __future__ import annotations

import json

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from engine import synth
from engine.config import CacheConfig
from engine.replay import replay
from engine.traces import load_trace
from engine.tune import SEARCH_SPACE, Evaluation, TuneResult, config_snippet, format_report, tune, with_settings
from gateway.cli import main
from gateway.config import KvgateConfig
from tests.engine_helpers import interrupt_on_call


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
    # A budget that lasts the whole search: its last round meets only trials scored before,
    # which take no replay, so the search converged (it said the budget stopped it).
    whole = tune(trace, 500, time_limit_s=120.0, space=SMALL_SPACE)
    assert whole.stopped == "converged" and whole.rounds >= 2
    again = tune(trace, 500, time_limit_s=120.0, max_evaluations=whole.evaluations, space=SMALL_SPACE)
    assert (again.stopped, again.evaluations, again.best) == ("converged", whole.evaluations, whole.best)


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


def test_report_keeps_the_configs_policy_when_tuned_wa_does_not_beat_it():
    """The snippet switches a config that serves another policy to wa: it did so
    even when its own figures showed wa below that policy (s3fifo 0.0874 against
    tuned wa 0.0585 on a slice of the Mooncake trace)."""
    def report(policy: str, configured: float | None, **extra) -> str:
        lru = 0.30 if policy == "lru" else 0.20
        result = TuneResult(100, 0, lru, Evaluation({}, 0.25), Evaluation({"weights.spatial": 0.5}, 0.27), 10, 1, 1.0,
                            "converged", configured_policy=policy, configured=configured, **extra)
        return format_report(result, "t.jsonl", 50, 1000)

    for policy, configured in (("s3fifo", 0.28), ("lru", None)):
        losing = report(policy, configured)
        served = 0.28 if configured else 0.30
        assert f"tuned wa (0.2700) does not beat the config's {policy} ({served:.4f})" in losing
        assert yaml.safe_load(losing) == {"cache": {"policy": policy}}
    assert yaml.safe_load(report("s3fifo", 0.26))["cache"]["policy"] == "wa"  # it does beat it
    # On the held-out tail too: the config's own policy is replayed there beside the others.
    tail = {"lru": 0.15, "start": 0.19, "best": 0.20}
    behind = report("s3fifo", 0.26, holdout={**tail, "configured": 0.21})
    assert "held-out tail (cold cache): lru 0.1500, s3fifo 0.2100, starting 0.1900" in behind
    assert "does not beat the config's s3fifo on the held-out tail" in behind
    assert yaml.safe_load(behind) == {"cache": {"policy": "s3fifo"}}
    assert yaml.safe_load(report("s3fifo", 0.26, holdout={**tail, "configured": 0.19}))["cache"]["policy"] == "wa"


# -- stopping: Ctrl-C and the time limit -----------------------------------------------


def test_ctrl_c_prints_the_best_settings_so_far(trace_path, capsys, monkeypatch):
    import engine.tune

    # Replays 1 and 2 are the baselines (lru, the starting settings), 3 and 4 candidates.
    monkeypatch.setattr(engine.tune, "replay", interrupt_on_call(engine.tune.replay, 5))
    assert main(["tune", str(trace_path), "--capacity", "0.05", "--no-progress"]) == 130
    out = capsys.readouterr().out
    assert "# 4 replays in" in out and "stopped: interrupted" in out
    assert "wa, tuned             hit ratio" in out
    assert "the search is incomplete" in out
    # Two candidates are no search result: what is not commented out keeps the starting settings.
    assert yaml.safe_load(out) == {"cache": {"policy": "wa", "workload_aware": {}}}


def test_ctrl_c_before_the_baselines_finish_says_so_in_one_line(trace_path, capsys, monkeypatch):
    import engine.tune

    monkeypatch.setattr(engine.tune, "replay", interrupt_on_call(engine.tune.replay, 2))
    # 20%: above the longest prompt, so the only line is the one about Ctrl-C.
    assert main(["tune", str(trace_path), "--capacity", "0.2", "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("kvgate: tune interrupted before the first replays (lru and the starting settings) "
                            "finished: nothing to report\n")


def _signal_a_running_tune(tmp_path, signum: int) -> str:
    """Send ``signum`` to the console script mid-search (what a terminal's Ctrl-C or a
    scheduler's kill does): its exit status is 128 + signum and it prints the report,
    returned."""
    path = tmp_path / "slow.jsonl"
    synth.write_trace(synth.synthesize("mixed", 300.0, 4.0, 5), path)  # about a second per wa replay
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    for wait in (4, 8, 16, 32):  # a slow machine may still be on the baselines: wait longer
        child = subprocess.Popen(
            [kvgate, "tune", str(path), "--no-progress", "--time-limit", "600"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # A background job starts with SIGINT ignored; a terminal's foreground job does not.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(wait)
        child.send_signal(signum)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 128 + signum, err
        assert "Traceback" not in err
        if "nothing to report" not in err:
            return out
    raise AssertionError(f"tune was still on its baselines after {wait} s")


def test_sigint_to_a_running_tune_prints_the_report(tmp_path):
    out = _signal_a_running_tune(tmp_path, signal.SIGINT)
    assert "stopped: interrupted" in out and "wa, tuned" in out


def _slow_trace(tmp_path, monkeypatch):
    """A trace of over 1,000 requests, and tune's clock turned to one where each
    replayed request takes one second (timing that does not hang on this machine)."""
    import engine.tune as tune_module

    path = tmp_path / "slow.jsonl"
    synth.write_trace(synth.synthesize("mixed", 300.0, 4.0, 5), path)
    clock = [0.0]

    def replay_one_second_a_request(*args, progress=None, **kwargs):
        def step(requests_done: int) -> None:
            clock[0] += requests_done
            if progress is not None:
                progress(requests_done)
        return replay(*args, progress=step, **kwargs)

    monkeypatch.setattr(tune_module, "replay", replay_one_second_a_request)
    monkeypatch.setattr(tune_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return load_trace(path)


def test_time_limit_abandons_a_replay_that_runs_past_it(tmp_path, monkeypatch):
    """On a clock where each replayed request takes one second, so that the
    outcome does not hang on how fast this machine replays (wall-clock limits
    sized from a timed baseline came out either side of the candidate's end)."""
    trace = _slow_trace(tmp_path, monkeypatch)
    capacity = max(1, round(0.05 * trace.unique_blocks()))
    one_replay = len(trace.requests)
    assert one_replay > 1000  # replay checks the deadline every 1000 requests: one check inside it
    # Room for the two baselines, and not a second more.
    limit = 2 * one_replay + 1
    result = tune(trace, capacity, CacheConfig(), time_limit_s=limit, space=SMALL_SPACE)
    assert result.stopped == "time limit"
    assert result.evaluations == 2  # the candidate cut short is not counted
    assert not result.first_round_done
    # Abandoned at its first deadline check past the limit, not at its end.
    assert limit <= result.elapsed_s < 3 * one_replay


def test_cli_time_limit_before_the_baselines_finish(tmp_path, capsys):
    path = tmp_path / "long.jsonl"  # over 1,000 requests: replay checks the deadline every 1,000
    synth.write_trace(synth.synthesize("mixed", 300.0, 4.0, 5), path)
    started = time.monotonic()
    assert main(["tune", str(path), "--time-limit", "0.001", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvgate: tune: the time limit (0.001 s) ran out before the first replays")
    assert captured.err.count("\n") == 1 and "raise --time-limit" in captured.err
    assert time.monotonic() - started < 30


def test_report_of_an_incomplete_search_recommends_nothing_new():
    def report(**extra) -> str:
        result = TuneResult(100, 0, 0.20, Evaluation({}, 0.25), Evaluation({"weights.spatial": 0.5}, 0.27), 4, 1, 300.0,
                            "time limit", first_round_done=False, **extra)
        return format_report(result, "t.jsonl", 50, 1000)

    cut = report()
    assert "the search is incomplete" in cut and "raise --time-limit" in cut
    assert "#         spatial: 0.5" in cut  # the best so far, as a comment
    assert yaml.safe_load(cut) == {"cache": {"policy": "wa", "workload_aware": {}}}
    # Checked on the held-out tail, and winning there, the settings stand even from a short search.
    checked = report(holdout={"lru": 0.15, "start": 0.19, "best": 0.20})
    assert "the search is incomplete" in checked
    assert yaml.safe_load(checked) == {"cache": {"policy": "wa", "workload_aware": {"weights": {"spatial": 0.5}}}}
    # A tie on the tail is no reason to change from the start on a short search.
    tied = report(holdout={"lru": 0.15, "start": 0.19, "best": 0.19})
    assert yaml.safe_load(tied) == {"cache": {"policy": "wa", "workload_aware": {}}}
    unchecked = report(holdout_skipped="time limit")
    assert "held-out tail not checked (time limit)" in unchecked
    assert yaml.safe_load(unchecked) == {"cache": {"policy": "wa", "workload_aware": {}}}


def test_cli_capacities_read_as_replay_reads_them_in_one_line_errors(trace_path, capsys):
    # 4e3 blocks was refused here and taken by replay; a bad value printed argparse's usage.
    for argv, error in [(["--capacity", "5%"], "--capacity: '5%' is not a number; give a fraction such as 0.05"),
                        (["--capacity", "0"], "--capacity: '0' must be a positive, finite number"),
                        (["--capacity", "0.05,0.1"], "--capacity: tune searches at one capacity; give one value"),
                        (["--capacity-blocks", "12.5"], "--capacity-blocks: '12.5' is not a whole number"),
                        (["--capacity-blocks", "-5"], "--capacity-blocks: '-5' must be a positive, finite number")]:
        assert main(["tune", str(trace_path), *argv, "--no-progress"]) == 2
        assert capsys.readouterr().err == f"kvgate: {error}\n"
    assert main(["tune", str(trace_path), "--capacity-blocks", "2e2", "--max-evals", "2", "--no-progress"]) == 0
    assert "200 blocks" in capsys.readouterr().out


def test_a_replay_finished_at_the_deadline_counts(trace_path):
    """Its last progress call comes after its last request: raising there threw the
    finished result away (a short trace never got past its baselines)."""
    result = tune(load_trace(trace_path), 200, time_limit_s=1e-6, space=SMALL_SPACE)
    assert result.stopped == "time limit" and result.evaluations == 2 and 0 < result.lru <= 1


def test_the_held_out_check_runs_when_the_time_limit_stops_the_search(tmp_path, monkeypatch):
    """The search stopped by the time limit is the very one that needs the check;
    the limit cut it (its replays overran what the search left) in every such run."""
    trace = _slow_trace(tmp_path, monkeypatch)
    search_part = int(len(trace.requests) * 0.7)
    tail = len(trace.requests) - search_part
    # The baselines overrun what the search may use; the check's replays (a tail each) run past the limit.
    result = tune(trace, 300, time_limit_s=2 * search_part + tail, space=SMALL_SPACE, holdout=0.3)
    assert result.stopped == "time limit"
    assert result.holdout is not None and result.holdout_skipped is None
    assert set(result.holdout) == {"lru", "start", "best"}


def test_the_snippet_is_the_whole_section_that_was_scored(trace_path):
    """Settings of the starting config outside the search stay in the snippet: a
    snippet of changes alone, pasted over the section, dropped them unscored."""
    trace = load_trace(trace_path)
    capacity = max(1, round(0.05 * trace.unique_blocks()))
    # A small float (printed 5e-05 it is text to YAML), and one prior of three (the
    # others, their defaults, are left out of the snippet and must stay so on loading).
    base = CacheConfig.model_validate({"workload_aware": {"weights": {"reuse": 0.7}, "lifetime_c": 4.0,
                                                          "fallback": {"margin": 0.00005},
                                                          "model": {"prior_lambda": {"to-c": 0.3, "to-b": 0.8}}}})
    result = tune(trace, capacity, base, time_limit_s=120.0, space=SMALL_SPACE)
    section = yaml.safe_load(config_snippet(result))
    assert section["cache"]["workload_aware"]["weights"]["reuse"] == 0.7
    assert section["cache"]["workload_aware"]["lifetime_c"] == 4.0
    assert section["cache"]["workload_aware"]["fallback"]["margin"] == 0.00005
    assert section["cache"]["workload_aware"]["model"]["prior_lambda"] == {"to-c": 0.3}
    cfg = KvgateConfig.model_validate(section)
    assert cfg.cache.workload_aware == with_settings(result.base, result.best.settings)  # what was scored
    assert replay(trace, "wa", capacity, cfg.cache).hit_ratio == pytest.approx(result.best.hit_ratio, abs=1e-12)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_config_serving_another_policy_is_the_baseline_and_the_switch_is_said(trace_path, policy):
    trace = load_trace(trace_path)
    capacity = max(1, round(0.05 * trace.unique_blocks()))
    result = tune(trace, capacity, CacheConfig(policy=policy), time_limit_s=120.0, max_evaluations=4,
                  space=SMALL_SPACE)
    assert result.configured_policy == policy
    report = format_report(result, "t.jsonl", len(trace.requests), trace.unique_blocks())
    assert f"the config serves cache.policy {policy}; the settings below are wa's" in report
    if policy == "s3fifo":
        expected = replay(trace, "s3fifo", capacity).hit_ratio
        assert result.configured == pytest.approx(expected, abs=1e-12)
        assert f"#   s3fifo (the config's) hit ratio {expected:.4f}" in report
    else:
        assert result.configured is None  # lru's row is there already
    assert f"policy: wa  # was {policy}" in config_snippet(result)
    # Unsure (an incomplete search), the uncommented part keeps the config's own policy.
    assert yaml.safe_load(report) == {"cache": {"policy": policy}}


def test_a_search_on_too_few_requests_says_so(trace_path, tmp_path, capsys):
    """--holdout 0.99 leaves the search a handful of requests: the header says how
    many were searched, and the report that they are too few for the reuse model;
    a search whose requests reuse nothing recommends no change."""
    assert main(["tune", str(trace_path), "--holdout", "0.99", "--time-limit", "30", "--no-progress"]) == 0
    out = capsys.readouterr().out
    total = len(load_trace(str(trace_path)).requests)
    searched = int(total * (1 - 0.99))
    assert f"{total} requests ({searched} searched, {total - searched} held out)" in out.splitlines()[0]
    assert f"# only {searched} requests searched: too few for the reuse model" in out
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"timestamp": 0, "input_length": 48, "output_length": 4, "hash_ids": [1, 2, 3]}) + "\n")
    assert main(["tune", str(one), "--capacity-blocks", "2", "--time-limit", "30", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "the searched requests reuse no block" in out
    assert yaml.safe_load(out) == {"cache": {"policy": "wa", "workload_aware": {}}}
    # Reuse there is, but a cache of one block keeps none of these two-block prefixes.
    alternating = tmp_path / "alternating.jsonl"
    alternating.write_text("".join(json.dumps({"timestamp": t * 1000, "input_length": 1024, "output_length": 4,
                                               "hash_ids": [10 * (t % 2) + 1, 10 * (t % 2) + 2]}) + "\n"
                                   for t in range(40)))
    assert main(["tune", str(alternating), "--capacity-blocks", "1", "--time-limit", "30", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "reuse no block" not in out and "no setting scored a hit at this capacity" in out


def test_sigterm_to_a_running_tune_prints_the_report_and_exits_143(tmp_path):
    """A job scheduler's time limit or `kill`: the best settings so far are
    printed, as for Ctrl-C, and the status says SIGTERM (128 + 15)."""
    out = _signal_a_running_tune(tmp_path, signal.SIGTERM)
    assert "stopped: interrupted" in out and "wa, tuned" in out
