import json
import math
import re
from pathlib import Path

import pytest
import yaml

from engine.config import ConfigError
from gateway.cli import main
from gateway.config import KvgateConfig, ReplicaConfig, load_config
from gateway.replicas import build_replicas

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


def test_a_number_yaml_reads_as_text_gets_a_hint(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  device_blocks: 1e3\n")
    with pytest.raises(ConfigError, match=r"engine.device_blocks: .*\(got '1e3'\); YAML reads 1e3 as text"):
        load_config(path)
    path.write_text("engine:\n  device_blocks: 1000\n  kv_memory_fraction: 5.0e-1\n")
    config = load_config(path)
    assert (config.engine.device_blocks, config.engine.kv_memory_fraction) == (1000, 0.5)


@pytest.mark.parametrize("url", ["10.0.0.5:8001", "ftp://host:8001", "http://", "http://host:99999", "http://[::1"])
def test_replica_url_must_be_http_with_a_host(tmp_path, url):
    path = tmp_path / "c.yaml"
    path.write_text(f"replicas:\n  - kind: engine\n    url: '{url}'\n")
    with pytest.raises(ConfigError, match="replicas.0.*no http"):
        load_config(path)
    path.write_text("replicas:\n  - kind: openai\n    url: https://vllm-0.vllm:8000/v1\n")
    assert load_config(path).replicas[0].url == "https://vllm-0.vllm:8000/v1"


def test_a_replica_url_with_credentials_is_named_and_reported_without_them(tmp_path):
    """A replica's name is a label on /metrics, /stats and the dashboard, and in
    logs: its URL's user:password@ (aiohttp's basic auth) stays out of it, and
    out of the config's error messages."""
    config = KvgateConfig(replicas=[
        ReplicaConfig(kind="openai", url="http://alice:s3cret@vllm-0:8000/v1"),
        ReplicaConfig(kind="engine", url="https://bob:pw@[fd00::5]/"),
    ])
    assert [r.name for r in build_replicas(config)] == ["vllm-0:8000", "[fd00::5]:443"]
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - kind: openai\n    url: ftp://alice:s3cret@vllm-0:8000/v1\n    api_key: sk-123\n")
    with pytest.raises(ConfigError, match="replicas.0.*no http") as info:
        load_config(path)
    assert "s3cret" not in str(info.value) and "sk-123" not in str(info.value)
    # aiohttp refuses every request that has both: say so at start.
    path.write_text("replicas:\n  - kind: openai\n    url: http://alice:s3cret@vllm-0:8000/v1\n    api_key: sk-123\n")
    with pytest.raises(ConfigError, match="replicas.0: .*give one") as info:
        load_config(path)
    assert "s3cret" not in str(info.value) and "sk-123" not in str(info.value)


def test_no_replica_is_named_engine(tmp_path):
    """A `kvgate engine` labels its own series replica="engine", and the Grafana
    dashboard drops that name so that a scraped engine is not counted twice: a
    gateway's replica of that name would vanish from it."""
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - kind: engine\n    url: http://10.0.0.5:8001\n    name: engine\n")
    with pytest.raises(ConfigError, match=r"replicas\.0\.name: .*'engine'"):
        load_config(path)
    # Nor by default: a URL without a port is named with its scheme's.
    config = KvgateConfig(replicas=[ReplicaConfig(kind="engine", url="http://engine"),
                                    ReplicaConfig(kind="openai", url="https://engine/v1")])
    assert [r.name for r in build_replicas(config)] == ["engine:80", "engine:443"]


def kubernetes_manifests() -> dict:
    docs = {}
    for name in ("gateway.yaml", "engines.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy/kubernetes" / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_kubernetes_manifests_config_is_valid_and_the_grace_period_covers_the_drain():
    docs = kubernetes_manifests()
    config = KvgateConfig.model_validate(yaml.safe_load(docs["ConfigMap", "kvgate-config"]["data"]["config.yaml"]))
    drain = config.server.shutdown_delay_s + config.server.drain_timeout_s
    for workload in (docs["Deployment", "kvgate-gateway"], docs["StatefulSet", "kvgate-engine"]):
        pod = workload["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > drain
        assert pod["volumes"][0]["configMap"]["name"] == "kvgate-config"


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def test_kubernetes_pods_have_startup_probes_and_resources():
    docs = kubernetes_manifests()
    for workload, min_startup_s in ((docs["Deployment", "kvgate-gateway"], 60), (docs["StatefulSet", "kvgate-engine"], 600)):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        # Both bind their port before loading and answer only once loaded: without a
        # startupProbe, liveness would kill a slow start.
        startup = container["startupProbe"]
        assert startup["httpGet"]["path"] == "/health"
        assert startup["periodSeconds"] * startup["failureThreshold"] >= min_startup_s
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]


def test_engine_memory_limit_holds_its_pinned_host_kv_tier(monkeypatch):
    # The engine sizes its host tier (pinned RAM) within the pod's memory limit:
    # what it would choose on an H200 node with this limit, ~4 GiB already used.
    import torch

    import engine.kv_cache as kv_cache
    from engine import memory

    docs = kubernetes_manifests()
    engine = KvgateConfig.model_validate(yaml.safe_load(docs["ConfigMap", "kvgate-config"]["data"]["config.yaml"])).engine
    (container,) = docs["StatefulSet", "kvgate-engine"]["spec"]["template"]["spec"]["containers"]
    limit = _gib(container["resources"]["limits"]["memory"])
    assert _gib(container["resources"]["requests"]["memory"]) == limit  # pinned pages are not reclaimable
    monkeypatch.setattr(memory, "available_ram", lambda: 2048 << 30)  # the node's
    monkeypatch.setattr(memory, "cgroup_room", lambda: int((limit - 4) * 2**30))
    shape = kv_cache.KVShape(32, 8, 128, engine.block_size, torch.bfloat16)  # an 8B model's KV
    device_blocks = int(engine.kv_memory_fraction * 139e9) // shape.bytes_per_block
    host_blocks, _ = kv_cache.size_host_blocks(shape, torch.device("cuda"), device_blocks, engine.host_blocks_multiplier)
    host_gib = host_blocks * shape.bytes_per_block / 2**30
    # Pinned in a power of two, plus the process: inside the limit, and a tier worth having.
    assert 2 ** math.ceil(math.log2(host_gib)) + 4 <= limit and host_gib >= 16


def test_engines_take_traffic_from_the_gateways_only():
    docs = kubernetes_manifests()
    policy = docs["NetworkPolicy", "kvgate-engine-from-gateways"]["spec"]
    engine = docs["StatefulSet", "kvgate-engine"]["spec"]["template"]
    gateway = docs["Deployment", "kvgate-gateway"]["spec"]["template"]
    assert policy["podSelector"]["matchLabels"] == engine["metadata"]["labels"]
    (rule,) = policy["ingress"]
    assert [source["podSelector"]["matchLabels"] for source in rule["from"]] == [gateway["metadata"]["labels"]]
    (container,) = engine["spec"]["containers"]
    assert [p["port"] for p in rule["ports"]] == [port["containerPort"] for port in container["ports"]]


def test_engines_are_not_scraped_directly():
    # The gateway exports every engine's figures per replica; an engine's own
    # /metrics repeats them as replica="engine" and would double every count.
    docs = kubernetes_manifests()
    engine_pod = docs["StatefulSet", "kvgate-engine"]["spec"]["template"]["metadata"]
    assert "prometheus.io/scrape" not in engine_pod.get("annotations", {})
    gateway_pod = docs["Deployment", "kvgate-gateway"]["spec"]["template"]["metadata"]
    assert gateway_pod["annotations"]["prometheus.io/scrape"] == "true"


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/kvgate-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


ENGINE_TARGET = 'unless on(instance) kvgate_build_info{role="engine"}'
GATEWAYS_ONLY = 'kvgate_build_info{role="gateway"}'


def test_dashboard_counts_nothing_twice_if_an_engine_is_scraped():
    for expr in dashboard_exprs():
        for name, matchers in re.findall(r"(kvgate_\w+)(\{[^}]*\})?", expr):
            # Per-replica series drop the engine's self-labelled copy; series without a
            # replica label drop everything from a target whose build info says engine
            # (or keep only gateways').
            if 'replica!="engine"' in matchers or f"{name}{matchers}" in (ENGINE_TARGET.split()[-1], GATEWAYS_ONLY):
                continue
            assert ENGINE_TARGET in expr, f"{name} in {expr!r} would count an engine's own /metrics too"


def test_dashboard_plots_every_series():
    plotted = " ".join(dashboard_exprs())
    names = set(re.findall(r'"(kvgate_[a-z_]+)"', (ROOT / "gateway/metrics.py").read_text()))
    assert len(names) > 20
    assert not {n for n in names if not re.search(rf"\b{n}(_total|_bucket)?\b", plotted)}


def test_dockerfile_healthcheck_port_matches_the_documented_runs():
    text = (ROOT / "Dockerfile").read_text()
    # KVGATE_PORT is the healthcheck's alone; kvgate takes --port.
    assert "${KVGATE_PORT:-8000}" in text
    runs = re.findall(r"^#\s+(?:Run:)?\s*(docker run .*)$", text, re.M)
    assert any("kvgate engine" in line for line in runs)
    for line in runs:
        port = re.search(r"--port (\d+)", line)
        if port and port.group(1) != "8000":
            assert f"-e KVGATE_PORT={port.group(1)}" in line, line
    # The CPU variant takes torch from PyTorch's CPU index alone, not PyPI's CUDA build.
    cpu_args = re.search(r'FROM .* AS base-cpu\n(?:#.*\n)*ENV TORCH_INDEX_ARGS="([^"]*)"', text).group(1)
    assert cpu_args == "--index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("value", ["true", "'16'", "16.5"])
def test_numbers_are_numbers(tmp_path, value):
    # YAML gives each value its type: `true` for a count is a mistake, not 1.
    path = tmp_path / "c.yaml"
    path.write_text(f"engine:\n  max_num_seqs: {value}\n")
    with pytest.raises(ConfigError, match="engine.max_num_seqs"):
        load_config(path)
    path.write_text("engine:\n  max_num_seqs: 16\ncache:\n  workload_aware:\n    life_s: 5\n")
    assert load_config(path).engine.max_num_seqs == 16
