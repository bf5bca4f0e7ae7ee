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
    assert f"{path}:2: cache.polcy: unknown key" in message  # FILE:LINE, as every CLI error
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


@pytest.mark.parametrize("text, message", [
    ("engine:\n  seed: 1\x00\n", r":2: invalid YAML: control character U\+0000 is not allowed$"),
    ("engine:\n  block_size: " + "9" * 5000 + "\n", r": a number has over 4,300 digits$"),
])
def test_what_yaml_cannot_read_is_one_line(tmp_path, text, message):
    """A control character, or an integer too long for int(): tracebacks before."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}{message}"):
        load_config(path)


def test_an_error_through_an_alias_is_at_the_line_that_uses_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine: &d\n  block_size: 16\n  seed: -1\ncache:\n  s3fifo: *d\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}:3: engine.seed:")
    assert lines[1].startswith(f"{path}:5: cache.s3fifo.block_size: unknown key")


def test_aliases_of_aliases_are_read_in_linear_time(tmp_path):
    """Nine aliases nested nine deep name 9**9 values: walking each use for its
    line numbers never finished (the file is 1 KB)."""
    rows = ["engine:", "  x0: &a0 [x, x, x, x, x, x, x, x, x]"]
    rows += [f"  x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))}:11: engine.x9: unknown key"):
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
    # aiohttp refuses every request that has both: say so at start (for the metrics too).
    for key in ("url", "metrics_url"):
        urls = {"url": "http://vllm-0:8000/v1", "metrics_url": "http://vllm-0:8000/metrics"}
        urls[key] = urls[key].replace("//", "//alice:s3cret@")
        path.write_text(f"replicas:\n  - kind: openai\n    url: {urls['url']}\n    metrics_url: {urls['metrics_url']}\n"
                        "    api_key: sk-123\n")
        with pytest.raises(ConfigError, match="replicas.0: .*give one") as info:
            load_config(path)
        assert "s3cret" not in str(info.value) and "sk-123" not in str(info.value)


def test_a_yaml_alias_that_contains_itself_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas: &a [*a]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).count("\n") == 0 and "replicas.0" in str(info.value)


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


def test_a_replica_key_from_the_environment(tmp_path, monkeypatch):
    """api_key_env names a variable (a Kubernetes Secret as env) that holds the
    key: read for the gateway, where an unset one is refused at its line; one
    key given both ways, or no variable name, is refused for anyone."""
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - kind: engine\n    url: http://e:8001\n  - kind: engine\n    url: http://e:8002\n"
                    "    api_key_env: KVGATE_TEST_ENGINE_KEY\n")
    monkeypatch.delenv("KVGATE_TEST_ENGINE_KEY", raising=False)
    assert load_config(path).replicas[1].api_key_env == "KVGATE_TEST_ENGINE_KEY"  # `kvgate engine` has no use for it
    with pytest.raises(ConfigError) as info:
        load_config(path, gateway=True)
    assert str(info.value) == (f"{path}:4: replicas.1: api_key_env: the environment variable KVGATE_TEST_ENGINE_KEY "
                               "is not set or is empty")
    monkeypatch.setenv("KVGATE_TEST_ENGINE_KEY", "sk-engine\n")  # as a Secret made --from-file holds it
    config = load_config(path, gateway=True)
    assert [r.auth_headers() for r in build_replicas(config)] == [{}, {"Authorization": "Bearer sk-engine"}]
    monkeypatch.delenv("KVGATE_TEST_ENGINE_KEY")
    with pytest.raises(ConfigError, match="replica e:8002: api_key_env: the environment variable"):
        build_replicas(config)  # the variable gone since (the gateway built from code, not the CLI)
    for extra, why in (("    api_key: sk-1\n", "api_key and api_key_env both give the replica's key: give one"),
                       ("", "api_key_env 'engine-key' is no environment variable name")):
        path.write_text(f"replicas:\n  - kind: engine\n    url: http://e:8001\n{extra}    api_key_env: "
                        f"{'KEY' if extra else 'engine-key'}\n")
        with pytest.raises(ConfigError, match=f"{path}:2: replicas.0: {why}") as info:
            load_config(path)
        assert "sk-1" not in str(info.value)
    # An engine inside the gateway is sent nothing: a key there is a mistake, whose
    # unset variable must not stop the gateway either.
    for key in ("api_key: sk-1", "api_key_env: KVGATE_TEST_ENGINE_KEY"):
        path.write_text(f"replicas:\n  - kind: inprocess\n    {key}\n")
        with pytest.raises(ConfigError, match=f"{path}:2: replicas.0: {key.split(':')[0]} is for a remote replica"):
            load_config(path)
    path.write_text("replicas:\n  - kind: engine\n    url: http://alice:pw@e:8001\n    api_key_env: KVGATE_TEST_ENGINE_KEY\n")
    with pytest.raises(ConfigError, match="user:password@ and api_key_env are both credentials"):
        load_config(path)
    # A kvgate engine reads its KVGATE_API_KEYS as key[:tenant[:workload]],...: a shared
    # value that lists more is no key it would take, so every engine would stay out of routing.
    path.write_text("replicas:\n  - kind: engine\n    url: http://e:8001\n    api_key_env: KVGATE_TEST_ENGINE_KEY\n"
                    "  - kind: openai\n    url: http://v:8000/v1\n    api_key_env: KVGATE_TEST_VLLM_KEY\n")
    monkeypatch.setenv("KVGATE_TEST_VLLM_KEY", "sk:any:text")  # a vLLM key may hold anything
    for value in ("sk-new,sk-old", "sk-a:team-a"):
        monkeypatch.setenv("KVGATE_TEST_ENGINE_KEY", value)
        with pytest.raises(ConfigError, match=f"{path}:2: replicas.0: api_key_env: KVGATE_TEST_ENGINE_KEY holds ','"):
            load_config(path, gateway=True)
    monkeypatch.setenv("KVGATE_TEST_ENGINE_KEY", "sk-a")
    assert [r.auth_headers() for r in build_replicas(load_config(path, gateway=True))] == [
        {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk:any:text"}]


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


def test_kubernetes_engines_demand_the_key_the_gateway_sends():
    docs = kubernetes_manifests()
    config = KvgateConfig.model_validate(yaml.safe_load(docs["ConfigMap", "kvgate-config"]["data"]["config.yaml"]))

    def secrets(workload: str, name: str) -> dict:
        (container,) = docs[workload, name]["spec"]["template"]["spec"]["containers"]
        return {env["name"]: env["valueFrom"]["secretKeyRef"] for env in container["env"] if "valueFrom" in env}

    engine_key = secrets("StatefulSet", "kvgate-engine")["KVGATE_API_KEYS"]
    gateway_env = secrets("Deployment", "kvgate-gateway")
    engines = [spec for spec in config.replicas if spec.kind == "engine"]
    assert engines and all(gateway_env[spec.api_key_env] == engine_key for spec in engines)
    assert not engine_key["optional"] and gateway_env["KVGATE_API_KEYS"]["name"] != engine_key["name"]


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
        # Kubernetes' default is 1 s: a busy event loop or CPU-bound engine could
        # miss it three times and be restarted while serving.
        assert container["livenessProbe"]["timeoutSeconds"] >= 5
        assert container["readinessProbe"]["timeoutSeconds"] >= 3
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
        # The Service named kvgate would set KVGATE_PORT=tcp://IP:80 in the pods; the image reads none of it.
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False
    engine = docs["StatefulSet", "kvgate-engine"]["spec"]["template"]["spec"]
    # A hung engine (liveness failed) has nothing to drain: its GPU is freed in seconds, not the pod's grace.
    assert engine["containers"][0]["livenessProbe"]["terminationGracePeriodSeconds"] <= 15
    assert engine["terminationGracePeriodSeconds"] > 100
    # The gateway loads no model: the CPU image, not the CUDA one's GBs and visible GPUs.
    (gateway,) = docs["Deployment", "kvgate-gateway"]["spec"]["template"]["spec"]["containers"]
    assert gateway["image"].endswith(":cpu")


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


def test_the_pod_monitor_scrapes_the_gateways_metrics_port():
    # The Prometheus Operator's way in: a label or port renamed in gateway.yaml
    # alone would stop the scrapes without a word.
    (monitor,) = yaml.safe_load_all((ROOT / "deploy/prometheus-operator/podmonitor.yaml").read_text())
    gateway = kubernetes_manifests()["Deployment", "kvgate-gateway"]["spec"]["template"]
    (container,) = gateway["spec"]["containers"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (port,) = [port for port in container["ports"] if port.get("name") == endpoint["port"]]
    assert endpoint["path"] == "/metrics"
    assert str(port["containerPort"]) == gateway["metadata"]["annotations"]["prometheus.io/port"]


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
    # KVGATE_HEALTHCHECK_PORT is the healthcheck's alone; kvgate takes --port.  (Not
    # KVGATE_PORT: Kubernetes sets it to tcp://IP:80 for a Service named kvgate.)
    assert "${KVGATE_HEALTHCHECK_PORT:-8000}" in text and "${KVGATE_PORT" not in text and "e KVGATE_PORT" not in text
    runs = re.findall(r"^#\s+(?:Run:)?\s*(docker run .*)$", text, re.M)
    assert any("kvgate engine" in line for line in runs)
    for line in runs:
        port = re.search(r"--port (\d+)", line)
        if port and port.group(1) != "8000":
            assert f"-e KVGATE_HEALTHCHECK_PORT={port.group(1)}" in line, line
    # The CPU variant takes torch from PyTorch's CPU index alone, not PyPI's CUDA build.
    cpu_args = re.search(r'FROM .* AS base-cpu\n(?:#.*\n)*ENV TORCH_INDEX_ARGS="([^"]*)"', text).group(1)
    assert cpu_args == "--index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("key, value", [("threads", "100000"), ("host_blocks_multiplier", "1.0e+308")])
def test_engine_sizes_beyond_any_machine_are_refused_at_their_line(tmp_path, key, value):
    """threads: 100000 crashed torch (a segmentation fault after a message blaming the
    model); a huge multiplier shrank the device tier to one block and printed a 300-digit size."""
    path = tmp_path / "c.yaml"
    path.write_text(f"engine:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))}:2: engine.{key}: .*less than or equal"):
        load_config(path)


@pytest.mark.parametrize("value", ["true", "'16'", "16.5"])
def test_numbers_are_numbers(tmp_path, value):
    # YAML gives each value its type: `true` for a count is a mistake, not 1.
    path = tmp_path / "c.yaml"
    path.write_text(f"engine:\n  max_num_seqs: {value}\n")
    with pytest.raises(ConfigError, match="engine.max_num_seqs"):
        load_config(path)
    path.write_text("engine:\n  max_num_seqs: 16\ncache:\n  workload_aware:\n    life_s: 5\n")
    assert load_config(path).engine.max_num_seqs == 16


def _config_error(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value).replace(str(path), "c.yaml")


@pytest.mark.parametrize("key", [
    "engine.host_blocks_multiplier", "engine.kv_memory_fraction", "cache.s3fifo.ghost_size_ratio",
    "cache.workload_aware.model.window_s", "cache.workload_aware.model.refit_interval_s",
    "cache.workload_aware.fallback.window_s", "cache.workload_aware.fallback.sustain_s",
    "cache.workload_aware.alarm.window_s", "cache.workload_aware.weights.reuse", "cache.workload_aware.life_s",
    "cache.workload_aware.model.prior_lambda.to-c", "router.health_timeout_s", "server.shutdown_delay_s",
    "server.limits.header_timeout_s",
])
@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_inf_and_nan_are_no_setting(tmp_path, key, value):
    """A window of .inf overflows, a weight of .inf makes every score infinite (no block
    could ever be evicted), a health timeout of .inf keeps every replica out."""
    *sections, name = key.split(".")
    text = "".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(sections))
    text += f"{'  ' * len(sections)}{name}: {value}\n"
    assert f"c.yaml:{len(sections) + 1}: {key}: " in _config_error(tmp_path, text)


@pytest.mark.parametrize("key, value, bound", [
    # Finite, but past what the arithmetic takes: a ring of refit_interval_s / 9 s bins,
    # ghost entries of ratio x capacity, scores that overflow to inf (NoEvictableBlock).
    ("cache.workload_aware.model.refit_interval_s", "1.0e+20", "604800 (got 1e+20); a week is far beyond"),
    ("cache.s3fifo.ghost_size_ratio", "1.0e+308", "100 (got 1e+308)"),
    ("cache.workload_aware.weights.reuse", "1.0e+308", "1000000 (got 1e+308); a million is far beyond"),
    ("cache.workload_aware.weights.spatial", "1.0e+7", "1000000 (got 10000000.0)"),
    ("cache.workload_aware.long_prompt_boost", "1.0e+308", "1000000 (got 1e+308)"),
    ("router.health_timeout_s", "86400", "3600 (got 86400); an hour is far beyond"),
    ("server.shutdown_delay_s", "1.0e+300", "3600 (got 1e+300); an hour"),
    # A deque's maxlen: past 2**63, every request's engine step failed with an OverflowError.
    ("cache.workload_aware.topic_switch.turns", "100000000000000000000", "10000 (got 100000000000000000000)"),
])
def test_huge_finite_values_are_bounded_and_the_message_says_why(tmp_path, key, value, bound):
    *sections, name = key.split(".")
    text = "".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(sections))
    text += f"{'  ' * len(sections)}{name}: {value}\n"
    assert f": {key}: Input should be less than or equal to {bound}" in _config_error(tmp_path, text)


def test_prior_rates_are_bounded_and_no_limit_sentinels_still_work(tmp_path):
    message = _config_error(tmp_path, "cache:\n  workload_aware:\n    model:\n      prior_lambda: {to-b: 1.0e+308}\n")
    assert "c.yaml:4: cache.workload_aware.model.prior_lambda: " in message and "at most 1e+06" in message
    # 0 and null still mean "no limit" where they did; the bounds themselves are settings.
    path = tmp_path / "ok.yaml"
    path.write_text("server:\n  shutdown_delay_s: 3600\n  limits: {header_timeout_s: 0, send_timeout_s: null}\n"
                    "replicas:\n  - {kind: engine, url: 'http://e:8001', read_timeout_s: 0}\n"
                    "cache:\n  workload_aware:\n    fallback: {sustain_s: 0, window_s: 604800, check_interval_s: 3600}\n"
                    "    weights: {reuse: 1.0e+6}\n")
    config = load_config(path)
    assert config.server.limits.header_timeout_s == 0 and config.server.limits.send_timeout_s is None
    assert config.replicas[0].read_timeout_s == 0 and config.cache.workload_aware.fallback.window_s == 604800


@pytest.mark.parametrize("seed, why", [(10**23, "less than 18446744073709551616"), (-1, "greater than or equal to 0")])
def test_engine_seed_is_what_torch_takes(tmp_path, seed, why):
    # torch.manual_seed raises past 64 bits (a traceback at serve), and reads -1 as 2**64 - 1.
    assert f"c.yaml:2: engine.seed: Input should be {why}" in _config_error(tmp_path, f"engine:\n  seed: {seed}\n")
    path = tmp_path / "ok.yaml"
    path.write_text(f"engine:\n  seed: {2**64 - 1}\n")
    assert load_config(path).engine.seed == 2**64 - 1


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    # PyYAML keeps the last silently: the first engine section would be dropped whole.
    text = "engine:\n  max_num_seqs: 4\nserver:\n  port: 9000\nengine:\n  block_size: 32\n"
    assert _config_error(tmp_path, text) == "c.yaml:5: engine: given twice (first at line 1)"
    assert _config_error(tmp_path, "server: {port: 1, port: 2}\n") == "c.yaml:1: server.port: given twice (first at line 1)"
    text = "engine:\n  block_size: 16\n  block_size: 32\nreplicas:\n  - kind: engine\n    url: http://e:1\n    url: http://e:2\n"
    assert _config_error(tmp_path, text) == "c.yaml:3: engine.block_size: given twice (first at line 2)"
    assert _config_error(tmp_path, text.replace("  block_size: 32\n", "")) == (
        "c.yaml:6: replicas.0.url: given twice (first at line 5)")
    # Found by the key itself, not by its line and text: several on one line, or a
    # key YAML reads as no string.
    assert _config_error(tmp_path, "engine:\n  x: {block_size: 16, y: {block_size: 1, block_size: 2}}\n") == (
        "c.yaml:2: engine.x.y.block_size: given twice (first at line 2)")
    assert _config_error(tmp_path, "engine:\n  yes: 1\n  yes: 2\n") == "c.yaml:3: engine.yes: given twice (first at line 2)"
    # Merge keys override by design.
    path = tmp_path / "ok.yaml"
    path.write_text("router: &r {load_weight: 0.5}\nserver:\n  limits:\n    max_n: 2\n")
    assert load_config(path).router.load_weight == 0.5


def test_errors_give_the_line_of_their_key(tmp_path):
    text = ("model:\n  dtype: auto\nreplicas:\n  - kind: engine\n    url: http://e:8001\n"
            "  - kind: engine\n    name: engine\n    url: http://f:8001\nclassifier:\n  rules:\n    - when: tenant\n")
    assert _config_error(tmp_path, text).splitlines() == [
        "c.yaml:11: classifier.rules.0: a rule with when: tenant needs tenant",
        "c.yaml:7: replicas.1.name: 'engine' is the name a `kvgate engine` gives its own series "
        "(dashboards drop them): choose another (got 'engine')",
    ]


def test_an_empty_section_is_an_empty_section(tmp_path):
    """`engine:` with every key commented out is YAML's null: every key takes its default."""
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  # max_num_seqs: 4\ncache:\n  workload_aware:\n    fallback:\nserver:\n  limits:\n"
                    "replicas:\n  # - kind: engine\n")
    assert load_config(path) == KvgateConfig()
    # A list or mapping with its items commented out takes its defaults too; [] and {} are empty.
    path.write_text("classifier:\n  rules:\n    # - {when: api_key}\ncache:\n  workload_aware:\n    overrides:\n"
                    "    model:\n      prior_lambda:\n")
    assert load_config(path) == KvgateConfig()
    path.write_text("classifier:\n  rules: []\ncache:\n  workload_aware:\n    overrides: {}\n")
    assert load_config(path).classifier.rules == []
    # Not a section at all: said without the class name.
    assert _config_error(tmp_path, "engine: 5\n") == "c.yaml:1: engine: should be a section (a mapping of keys), got int"


def test_a_recording_under_home_is_under_home(tmp_path, monkeypatch):
    # "~/rec/served.jsonl" made a folder named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  record_trace: ~/rec/served.jsonl\n")
    assert load_config(path).server.record_trace == str(tmp_path / "rec" / "served.jsonl")


@pytest.mark.parametrize("key", ["model.path", "model.cache_dir", "model.served_name", "server.record_trace"])
def test_an_empty_string_is_refused(tmp_path, key):
    """cache_dir "" failed at start with `[Errno 2] No such file or directory: ''`, path ""
    as a hub id; served_name and record_trace "" quietly meant null."""
    section, name = key.split(".")
    message = _config_error(tmp_path, f"{section}:\n  {name}: ''\n")
    assert message.startswith(f"c.yaml:2: {key}: an empty string; ")
    assert ("leave the key out" in message) and ("null" in message or key == "model.cache_dir")


def test_a_tenant_name_fits_in_the_salt_an_engine_takes(tmp_path, monkeypatch):
    # Unbounded, a name of 8,000 characters made every request through a kvgate
    # engine a 400 naming the cache_salt the client never sent.
    from gateway.app import _load_keys

    message = _config_error(tmp_path, f"server:\n  api_keys:\n    - key: sk-a\n      tenant: {'t' * 1025}\n")
    assert message.startswith("c.yaml:4: server.api_keys.0.tenant: ") and "1024" in message, message
    monkeypatch.setenv("KVGATE_API_KEYS", f"sk-a:{'t' * 1025}")
    with pytest.raises(ConfigError, match="entry 1 has a tenant name of 1025 characters; at most 1024"):
        _load_keys(KvgateConfig())
    monkeypatch.setenv("KVGATE_API_KEYS", f"sk-a:{'t' * 1024}")
    assert len(_load_keys(KvgateConfig())) == 1


def test_an_empty_api_key_in_the_environment_is_refused(monkeypatch):
    # The config schema refuses `key: ""`; KVGATE_API_KEYS=":t1" registered one.
    from gateway.app import _load_keys

    monkeypatch.setenv("KVGATE_API_KEYS", "sk-a:t0, :t1")
    with pytest.raises(ConfigError) as info:
        _load_keys(KvgateConfig())
    assert str(info.value) == ("KVGATE_API_KEYS: entry 2 has an empty key (before its first ':'); "
                               "the format is key[:tenant[:workload]],...")
    monkeypatch.setenv("KVGATE_API_KEYS", "sk-a:t0,,")
    assert len(_load_keys(KvgateConfig())) == 1


@pytest.mark.parametrize("replica, why", [
    ("{kind: openai, url: 'http://v:8000', metrics_url: not a url}",
     "metrics_url 'not a url' is no http(s) URL with a host, e.g. http://vllm-0:8000/metrics"),
    ("{kind: openai, url: 'http://v:8000', metrics_url: ''}", "metrics_url '' is no http(s) URL"),
    ("{kind: engine, url: 'http://e:8001', metrics_url: 'http://e:8001/metrics'}",
     "metrics_url is read for kind 'openai' only, not 'engine'"),
    # Ignored for an engine, a model made one engine listed twice pass as two servers.
    ("{kind: engine, url: 'http://e:8001', model: a}", "model is read for kind 'openai' only, not 'engine'"),
    ("{kind: inprocess, send_cache_salt: true}", "send_cache_salt is read for kind 'openai' only, not 'inprocess'"),
])
def test_replica_metrics_url_is_checked_like_url(tmp_path, replica, why):
    # Unchecked, a bad one started fine and the external-load term silently disappeared.
    assert f"c.yaml:2: replicas.0: {why}" in _config_error(tmp_path, f"replicas:\n  - {replica}\n")


@pytest.mark.parametrize("interval", ["1.0e-6", "0.05"])
def test_status_lines_are_off_or_at_least_a_second_apart(tmp_path, interval):
    # 1e-6 made an idle gateway spin at 100% CPU.
    message = _config_error(tmp_path, f"server:\n  log_stats_interval_s: {interval}\n")
    assert message.startswith("c.yaml:2: server.log_stats_interval_s: give 0 (no status lines) or at "
                              "least 0.1 seconds")
    path = tmp_path / "ok.yaml"
    for ok in (0, 0.1):
        path.write_text(f"server:\n  log_stats_interval_s: {ok}\n")
        assert load_config(path).server.log_stats_interval_s == ok


async def test_a_failing_metrics_url_is_logged_once_and_so_is_its_return(caplog):
    """A debug line per poll hid a metrics_url that never answered (the router then
    counts none of the server's own queue): one warning per outage, one line back."""
    import asyncio
    import logging

    import aiohttp
    from aiohttp import web

    from gateway.config import RouterConfig
    from gateway.replicas import RemoteReplica, ReplicaInfo
    from gateway.server import start_server

    statuses = [500, 500, 500, 200, 200, 404, 404]
    answered = []

    async def metrics(request):
        status = statuses[len(answered)] if len(answered) < len(statuses) else 200
        answered.append(status)
        return web.Response(status=status, text='vllm:num_requests_waiting{model_name="m"} 3\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await start_server(app)
    cfg = ReplicaConfig(kind="openai", url=server.url, name="ext", metrics_url=server.url + "/metrics")
    replica = RemoteReplica(cfg, RouterConfig(health_interval_s=0.01), ReplicaInfo("m", 16, "m", 2048))
    replica._session = aiohttp.ClientSession()
    try:
        with caplog.at_level(logging.INFO, logger="gateway.replicas"):
            poll = asyncio.create_task(replica._poll_metrics())
            while len(answered) < len(statuses) + 1:
                await asyncio.sleep(0.01)
            poll.cancel()
    finally:
        await replica._session.close()
        await server.stop()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gateway.replicas"]
    url = server.url + "/metrics"
    assert lines == [
        ("WARNING", f"replica ext: cannot read its metrics at {url} (HTTP 500): routing goes by its last "
                    "figures, then by none, until they answer"),
        ("INFO", "replica ext: its metrics answer again: its queue counts in routing"),
        ("WARNING", f"replica ext: cannot read its metrics at {url} (HTTP 404): routing goes by its last "
                    "figures, then by none, until they answer"),
        ("INFO", "replica ext: its metrics answer again: its queue counts in routing"),
    ]
    assert replica.waiting == 3.0


async def test_a_file_rule_that_can_never_fire_is_warned_about_at_start(tiny_model_dir, caplog):
    """file_min_tokens at max_model_len (2048 each, the old default and the bundled
    model's): a prompt long enough to be a file leaves no room for an answer and
    gets a 400, so the file class, overrides.file and signatures silently never apply."""
    import logging

    from engine.config import EngineConfig, ModelConfig
    from gateway.app import GATEWAY, create_app
    from gateway.config import ClassifierConfig

    def config(file_min_tokens: int) -> KvgateConfig:
        return KvgateConfig(model=ModelConfig(path=tiny_model_dir, device="cpu", dtype="float32", max_model_len=2048),
                            engine=EngineConfig(device_blocks=256, threads=1),
                            classifier=ClassifierConfig(file_min_tokens=file_min_tokens))

    assert ClassifierConfig().file_min_tokens < 2048  # the defaults with the bundled model: no warning
    warnings = {}
    for file_min_tokens in (2048, 2047):
        gw = create_app(config(file_min_tokens))[GATEWAY]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gateway.app"):
            await gw.start()
            await gw.close()
        warnings[file_min_tokens] = [r.getMessage() for r in caplog.records if "file_min_tokens" in r.getMessage()]
    assert warnings == {2048: [
        "classifier.file_min_tokens (2048) is not below the 2048 tokens the model serves (max_model_len): no request "
        "can be classified as a file, so the file rule, cache.workload_aware.overrides.file and signatures never "
        "apply; set classifier.file_min_tokens below 2048"], 2047: []}


def test_the_pending_body_budget_must_hold_one_whole_body(tmp_path):
    message = _config_error(tmp_path, "server:\n  limits:\n    max_body_bytes: 2048\n    max_pending_body_bytes: 1024\n")
    assert "server.limits" in message and "must be at least max_body_bytes (2048)" in message
    path = tmp_path / "ok.yaml"
    path.write_text("server:\n  limits:\n    max_pending_body_bytes: null\n")
    assert load_config(path).server.limits.max_pending_body_bytes is None


@pytest.mark.parametrize("kind", ["", "kind: inprocess, "])
def test_a_replica_url_needs_a_remote_kind(tmp_path, kind):
    # Without kind (inprocess by default), the replica loaded the model inside the
    # gateway and never contacted its URL.
    why = _config_error(tmp_path, f"replicas:\n  - {{{kind}url: 'http://alice:s3cret@127.0.0.1:8001'}}\n")
    assert why == ("c.yaml:2: replicas.0: url 'http://127.0.0.1:8001' needs a remote kind: set kind: engine "
                   "(a `kvgate engine` server) or kind: openai (vLLM, SGLang); kind inprocess, the default, "
                   "is an engine inside the gateway and has no url")
    with pytest.raises(ValueError, match="needs a remote kind"):
        ReplicaConfig(url="http://127.0.0.1:8001")
    assert ReplicaConfig().kind == "inprocess" and ReplicaConfig(kind="engine", url="http://e:8001").url


@pytest.mark.parametrize("url", ["http://h:8001/?x=1", "http://h:8001#f", "http://h:8001?", "https://h/v1?key=1",
                                 "http://alice:s3cret@h:8001/#"])
@pytest.mark.parametrize("kind", ["engine", "openai"])
def test_a_replica_url_has_no_query_or_fragment(tmp_path, url, kind):
    # The gateway appends its paths to the URL: http://h:8001/?x=1/kvgate/info
    # reached no endpoint, and the replica stayed dead for good.
    why = _config_error(tmp_path, f"replicas:\n  - kind: {kind}\n    url: '{url}'\n")
    shown = url.replace("alice:s3cret@", "")
    assert why == (f"c.yaml:2: replicas.0: url {shown!r} has a ?query or #fragment: a replica URL is "
                   "scheme://host:port[/path], with neither")
    # A metrics_url is fetched as it is: a query there is the user's business.
    path = tmp_path / "ok.yaml"
    path.write_text("replicas:\n  - {kind: openai, url: 'http://h:8001/v1', metrics_url: 'http://h:8001/metrics?x=1'}\n")
    assert load_config(path).replicas[0].metrics_url == "http://h:8001/metrics?x=1"


def test_one_name_given_to_two_replicas_is_refused(tmp_path):
    """They were renamed a and a-1 in metrics and logs, silently."""
    text = ("replicas:\n"
            "  - {kind: engine, url: 'http://h:8001', name: a}\n"
            "  - {kind: engine, url: 'http://h:8002', name: b}\n"
            "  - kind: engine\n"
            "    url: http://h:8003\n"
            "    name: a\n")
    assert _config_error(tmp_path, text).splitlines() == [
        "c.yaml:6: replicas.2.name: the name 'a' is replicas.0's already; give each replica its own"]


def test_one_server_listed_twice_is_refused(tmp_path):
    # One server as two replicas (h:8001 and h:8001-1) got double the traffic and two
    # indexes of one cache; the same URLs the gateway builds its requests from
    # (no trailing / or /v1) are the same server, whatever the kind or credentials.
    text = ("replicas:\n"
            "  - {kind: engine, url: 'http://alice:s3cret@h:8001'}\n"
            "  - {kind: engine, url: 'http://h:8002'}\n"
            "  - {kind: engine, url: 'http://h:8001/'}\n"
            "  - {kind: openai, url: 'http://H:8001/v1/'}\n"
            "  - {kind: openai, url: 'https://h:8002/v1'}\n"
            "  - kind: engine\n"
            "    url: http://h\n"
            "  - {kind: engine, url: 'http://h:80/'}\n")
    assert _config_error(tmp_path, text).splitlines() == [
        "c.yaml:4: replicas.2: the same server as replicas.0 (http://h:8001)",
        "c.yaml:5: replicas.3: the same server as replicas.0 (http://h:8001)",
        "c.yaml:6: replicas.4: the same server as replicas.1 (http://h:8002)",
        "c.yaml:9: replicas.6: the same server as replicas.5 (http://h)",
    ]
    with pytest.raises(ValueError, match=r"replicas\.1\n.*the same server as replicas\.0 \(http://10\.0\.0\.5:8001\)"):
        KvgateConfig(replicas=[ReplicaConfig(kind="engine", url="http://10.0.0.5:8001/v1"),
                               ReplicaConfig(kind="openai", url="http://10.0.0.5:8001")])


def test_a_replica_entry_with_a_count_stands_for_numbered_slots(tmp_path):
    # A StatefulSet's pods, {i} from 0 in the url (and the name, if one is given).
    from gateway.config import replica_slots

    spec = ReplicaConfig(kind="engine", url="http://kvgate-engine-{i}.kvgate-engine:8001", name="e{i}", count=3)
    assert [(index, s.url, s.name) for index, s in replica_slots([ReplicaConfig(), spec])] == [
        (0, None, None), (1, "http://kvgate-engine-0.kvgate-engine:8001", "e0"),
        (1, "http://kvgate-engine-1.kvgate-engine:8001", "e1"), (1, "http://kvgate-engine-2.kvgate-engine:8001", "e2")]
    text = ("replicas:\n"
            "  - {kind: engine, url: 'http://e:8001', count: 2}\n"
            "  - {kind: engine, url: 'http://f{i}:8001', name: f, count: 2}\n"
            "  - {count: 2}\n"
            "  - {kind: engine, url: 'http://g{i}:8001', count: 0}\n")
    assert _config_error(tmp_path, text).splitlines() == [
        "c.yaml:2: replicas.0: url 'http://e:8001' has no {i} for the slot's number (0 to 1), e.g. "
        "http://kvgate-engine-{i}.kvgate-engine:8001",
        "c.yaml:3: replicas.1: name 'f' has no {i} for the slot's number (0 to 1), e.g. engine-{i}",
        "c.yaml:4: replicas.2: count is for remote replicas (kind engine or openai), numbered in their url",
        "c.yaml:5: replicas.3.count: Input should be greater than or equal to 1 (got 0)",
    ]
    # The slots are checked as the replicas they are: one of them listed again is refused.
    text = ("replicas:\n"
            "  - {kind: engine, url: 'http://e{i}:8001', count: 4}\n"
            "  - {kind: engine, url: 'http://e3:8001'}\n")
    assert _config_error(tmp_path, text).splitlines() == ["c.yaml:3: replicas.1: the same server as replicas.0 (http://e3:8001)"]


def test_every_config_in_the_vllm_page_is_valid():
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "deploy/vllm.md").read_text(), re.S)
    configs = [KvgateConfig.model_validate(yaml.safe_load(block)) for block in blocks]
    assert len(configs) >= 3 and any(spec.count == 8 for config in configs for spec in config.replicas)


def test_servers_that_differ_are_all_replicas(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n"
                    "  - {kind: engine, url: 'http://h:8001'}\n"
                    "  - {kind: engine, url: 'http://h:8002'}\n"
                    "  - {kind: openai, url: 'http://g:8001/v1'}\n"
                    "  - {kind: openai, url: 'http://proxy:80/a/v1'}\n"
                    "  - {kind: openai, url: 'http://proxy:80/b/v1'}\n"
                    "  - {kind: inprocess}\n"
                    "  - {kind: inprocess}\n")
    config = load_config(path)
    assert [r.name for r in build_replicas(config)] == [
        "h:8001", "h:8002", "g:8001", "proxy:80", "proxy:80-4", "inprocess-5", "inprocess-6"]


def test_deployments_behind_one_proxy_url_are_distinct_replicas(tmp_path):
    """A proxy (LiteLLM, KServe) serves several models at one URL: the same URL
    for another model is another replica, not a duplicate."""
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n"
                    "  - {kind: openai, url: 'http://litellm:4000', model: llama-a}\n"
                    "  - {kind: openai, url: 'http://litellm:4000', model: llama-b}\n")
    assert len(load_config(path).replicas) == 2
    message = _config_error(tmp_path, "replicas:\n  - {kind: openai, url: 'http://p:4000', model: m}\n"
                                      "  - {kind: openai, url: 'http://p:4000/v1', model: m}\n")
    assert "c.yaml:3: replicas.1: the same server as replicas.0 (http://p:4000)" in message


def test_a_larger_body_limit_raises_the_default_pending_budget(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  limits:\n    max_body_bytes: 536870912\n")
    limits = load_config(path).server.limits
    assert limits.max_pending_body_bytes == limits.max_body_bytes == 536870912


@pytest.mark.parametrize("origin", ["app.example.com", "https://app.example.com/", "https://a.example/path", "ftp://x"])
def test_cors_origins_are_origins(tmp_path, origin):
    message = _config_error(tmp_path, f"server:\n  cors_allow_origins: ['{origin}']\n")
    assert "c.yaml:2: server.cors_allow_origins" in message and "is no origin" in message


def test_cors_origins_are_read_as_browsers_send_them(tmp_path):
    """Browsers send an origin lower-case and without its scheme's default port:
    written otherwise, it used to match no page ever."""
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  cors_allow_origins: ['HTTPS://App.Example.com:443', 'http://LOCALHOST:80',\n"
                    "    'http://localhost:8080', 'http://[::1]:3000', '*']\n")
    assert load_config(path).server.cors_allow_origins == [
        "https://app.example.com", "http://localhost", "http://localhost:8080", "http://[::1]:3000", "*"]
    message = _config_error(tmp_path, "server:\n  cors_allow_origins: ['https://a.example:99999']\n")
    assert "c.yaml:2: server.cors_allow_origins" in message and "is no origin" in message


def test_api_keys_are_read_as_clients_can_send_them(tmp_path):
    """HTTP drops the spaces around a header's value: a key written with them
    could never match.  A blank key or tenant is refused where it is written."""
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  api_keys:\n    - {key: ' sk-space ', tenant: team-s}\n")
    assert load_config(path).server.api_keys[0].key == "sk-space"
    message = _config_error(tmp_path, "server:\n  api_keys:\n    - {key: '   ', tenant: t}\n")
    assert "c.yaml:3: server.api_keys.0.key" in message and "blank" in message
    message = _config_error(tmp_path, "server:\n  api_keys:\n    - {key: sk-1, tenant: ''}\n")
    assert "c.yaml:3: server.api_keys.0.tenant" in message


@pytest.mark.parametrize("text, where", [
    ("server:\n  api_keys:\n    - {key: 8412345678901234}\n", "c.yaml:3: server.api_keys.0.key"),
    ("replicas:\n  - {name: a, kind: engine, url: 'http://h:1', api_key: 0x1234abcd}\n", "c.yaml:2: replicas.0.api_key"),
])
def test_a_key_yaml_reads_as_a_number_is_not_echoed(tmp_path, text, where):
    """Config errors end up in logs: a key that is no string is named by where it is, never shown."""
    message = _config_error(tmp_path, text)
    assert where in message and "valid string" in message
    assert "8412345678901234" not in message and "305441741" not in message and "0x1234abcd" not in message


def test_a_key_listed_twice_with_different_tenants_is_refused(tmp_path, monkeypatch):
    """The last entry used to win silently, so a caller's tenant hung on list order."""
    from gateway.app import _load_keys

    message = _config_error(tmp_path, "server:\n  api_keys:\n    - {key: sk-a, tenant: t1}\n"
                                      "    - {key: sk-b, tenant: t2}\n    - {key: sk-a, tenant: t3}\n")
    assert message == ("c.yaml:5: server.api_keys.2: the same key as server.api_keys.0 with another tenant or "
                       "workload; give each key once")
    path = tmp_path / "same.yaml"
    path.write_text("server:\n  api_keys:\n    - {key: sk-a, tenant: t1}\n    - {key: sk-a, tenant: t1}\n")
    config = load_config(path)  # the same entry twice means one thing: kept
    monkeypatch.setenv("KVGATE_API_KEYS", "sk-b:t2,sk-a:t1")
    assert len(_load_keys(config)) == 2
    for env in ("sk-a:t9", "sk-b:t2,sk-b:t2:to-b"):
        monkeypatch.setenv("KVGATE_API_KEYS", env)
        with pytest.raises(ConfigError) as info:
            _load_keys(config)
        assert "listed earlier (there or in server.api_keys) another tenant or workload" in str(info.value)
        assert "sk-" not in str(info.value)
