from pathlib import Path

import pytest
import yaml

from engine.config import ConfigError
from gateway.cli import main
from gateway.config import KvgateConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_yaml_equals_the_defaults():
    # config.yaml documents the defaults: it must not drift from the code.
    assert load_config(ROOT / "config.yaml") == KvgateConfig()
    # The engine evicts in the workload-aware order unless told otherwise.
    assert KvgateConfig().cache.policy == "wa"


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == KvgateConfig()


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  polcy: lru\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}: cache.polcy: unknown key" in message
    assert "policy" in message and "s3fifo" in message


def test_bad_value_names_the_allowed_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  policy: lfu\nrouter:\n  load_weight: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert any("cache.policy" in line and "'lru'" in line and "'wa-paper'" in line and "'lfu'" in line for line in lines)
    assert any("router.load_weight" in line and "greater than or equal to 0" in line for line in lines)


def test_invalid_yaml_gives_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  policy: [lru\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_cli_reports_config_errors_without_traceback(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  block_size: zero\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n')
    assert main(["replay", str(trace), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "engine.block_size" in err and "Traceback" not in err


@pytest.mark.parametrize("url", ["10.0.0.5:8001", "ftp://host:8001", "http://", "http://host:99999", "http://[::1"])
def test_replica_url_must_be_http_with_a_host(tmp_path, url):
    path = tmp_path / "c.yaml"
    path.write_text(f"replicas:\n  - kind: engine\n    url: '{url}'\n")
    with pytest.raises(ConfigError, match="replicas.0.*no http"):
        load_config(path)
    path.write_text("replicas:\n  - kind: openai\n    url: https://vllm-0.vllm:8000/v1\n")
    assert load_config(path).replicas[0].url == "https://vllm-0.vllm:8000/v1"


def test_kubernetes_manifests_config_is_valid_and_the_grace_period_covers_the_drain():
    docs = {}
    for name in ("gateway.yaml", "engines.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy/kubernetes" / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    config = KvgateConfig.model_validate(yaml.safe_load(docs["ConfigMap", "kvgate-config"]["data"]["config.yaml"]))
    drain = config.server.shutdown_delay_s + config.server.drain_timeout_s
    for workload in (docs["Deployment", "kvgate-gateway"], docs["StatefulSet", "kvgate-engine"]):
        pod = workload["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > drain
        assert pod["volumes"][0]["configMap"]["name"] == "kvgate-config"


@pytest.mark.parametrize("value", ["true", "'16'", "16.5"])
def test_numbers_are_numbers(tmp_path, value):
    # YAML gives each value its type: `true` for a count is a mistake, not 1.
    path = tmp_path / "c.yaml"
    path.write_text(f"engine:\n  max_num_seqs: {value}\n")
    with pytest.raises(ConfigError, match="engine.max_num_seqs"):
        load_config(path)
    path.write_text("engine:\n  max_num_seqs: 16\ncache:\n  workload_aware:\n    life_s: 5\n")
    assert load_config(path).engine.max_num_seqs == 16
