"""The full config.yaml schema and its loader."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal, Sequence
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.config import (
    HOUR_S,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    Section,
    format_config_error,
    not_empty,
)


# A tenant's name joins the client's cache_salt (at most 1,024) in the salt sent
# to a `kvgate engine`, whose cap (8,192) both then fit under.
MAX_TENANT_NAME = 1024


class ApiKeyConfig(Section):
    # The bearer token clients send (Authorization: Bearer KEY).  Spaces around
    # it are dropped (HTTP drops them from the header, so no client could send them).
    key: str = Field(min_length=1)
    # Tenant the key's requests are accounted to (classification, traces).  Its name
    # goes into every request's cache salt to a `kvgate engine`, which caps salts.
    tenant: str = Field("default", min_length=1, max_length=MAX_TENANT_NAME)
    # None lets the classifier decide; otherwise the key fixes the workload.
    workload: Literal["to-c", "to-b", "multimodal"] | None = None

    @field_validator("key")
    @classmethod
    def _key_as_sent(cls, key: str) -> str:
        if not key.strip():
            raise ValueError("the key is blank: give the token clients send")
        return key.strip()


class LimitsConfig(Section):
    # Larger request bodies get 413 before they are parsed.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # Upper bound on max_tokens / max_completion_tokens (400 above it); also a
    # chat request's max_tokens when it gives none and the model's
    # generation_config.json gives no max_new_tokens (a larger one is cut to this).
    max_tokens: int = Field(4096, ge=1)
    # Upper bound on n (choices per request).
    max_n: int = Field(8, ge=1)
    # Upper bound on the number of chat messages in one request.
    max_messages: int = Field(1024, ge=1)
    # Upper bound on the images in one chat request (OpenAI's is 500 a request).
    max_images: int = Field(500, ge=0)
    # Upper bound on the number of prompts in one /v1/completions request.
    max_prompts: int = Field(64, ge=1)
    # Upper bound on the sequences one request asks for: prompts x n (each is
    # decoded on its own, so this caps one request's share of the engines).
    max_choices: int = Field(128, ge=1)
    # A request body must arrive within this many seconds (408 after): a client
    # trickling its body holds no server slot for longer.
    body_timeout_s: float = Field(60.0, gt=0)
    # A request's headers must arrive within this many seconds of its first byte
    # (a new connection's first request: of the connection's opening); the
    # connection is closed after, with a 408 if part of a request came.  A client
    # trickling its headers (slow-loris) holds a connection no longer.  The idle
    # wait between requests on a keep-alive connection is not counted.  0 or
    # null: no limit.
    header_timeout_s: float | None = Field(10.0, ge=0)
    # A client that takes none of a response for this many seconds (its
    # receive window and the server's send buffer full) is disconnected, and its
    # request aborted: otherwise it holds its engine work, its in-flight count
    # and its slot under max_inflight_requests for as long as it stays connected.
    # 0 or null: no limit.
    send_timeout_s: float | None = Field(60.0, ge=0)
    # An idle keep-alive connection closes after this many seconds.  Above a load
    # balancer's idle timeout (60 s on AWS's), so that the balancer, not kvgate,
    # ends a pooled connection (aiohttp's own 3630 s held one open for an hour).
    keepalive_timeout_s: float = Field(75.0, gt=0)
    # Completion requests this server holds at once (in flight or queued in its
    # engines); more get 429 with Retry-After, which OpenAI's SDKs retry.  None
    # queues without bound, as vLLM does; set it to shed load rather than let
    # time to first token grow without limit.  Counted once a request's body has
    # arrived, so slow uploads cannot hold the slots.
    max_inflight_requests: int | None = Field(None, ge=1)
    # At most this many of them per tenant (an API key's tenant; requests without
    # one are not counted): more get 429, so one tenant's burst cannot fill the
    # engines' queues ahead of everyone else.  null: no per-tenant limit.
    max_inflight_per_tenant: int | None = Field(None, ge=1)
    # Request bodies still arriving may hold at most this many bytes together
    # (counted as they arrive, not by the Content-Length they declare, which
    # costs a client nothing to send).  More get 429 with Retry-After, so slow or
    # stalled uploads cannot fill memory with bodies of up to max_body_bytes each
    # until body_timeout_s.  A body that arrived with its
    # headers (any small request) is not counted.  null: no limit.
    max_pending_body_bytes: int | None = Field(256 * 1024 * 1024, ge=1024)
    # On a `kvgate engine`: /kv_events streams at once.  Each holds a snapshot of
    # the engine's cache and the events it has not read yet (100 readers that
    # never read held 50-130 MB for send_timeout_s); more get 503 with
    # Retry-After, which a gateway's follower retries.
    max_kv_event_followers: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _one_body_fits(self) -> "LimitsConfig":
        if "max_pending_body_bytes" not in self.model_fields_set and self.max_pending_body_bytes is not None:
            # The default grows with a larger body limit rather than refuse a config that set only that.
            self.max_pending_body_bytes = max(self.max_pending_body_bytes, self.max_body_bytes)
        if self.max_pending_body_bytes is not None and self.max_pending_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_pending_body_bytes ({self.max_pending_body_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes}), or no body of that size could be read")
        return self


class ServerConfig(Section):
    # Where `kvgate serve` listens (--host / --port override).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Keys also come from KVGATE_API_KEYS ("key[:tenant[:workload]],...").
    # With no keys at all the gateway is open; with any, a valid one is required.
    api_keys: list[ApiKeyConfig] = []
    # Each tenant's prompts get block hashes of their own (a per-tenant cache salt),
    # so one tenant never hits, nor learns from cached_tokens or TTFT whether,
    # another tenant sent a prompt.  Keys of one tenant share their cache.  Off:
    # every tenant shares one cache (more hits on common system prompts).
    isolate_tenant_caches: bool = True
    limits: LimitsConfig = LimitsConfig()
    # Web pages (origins, e.g. https://app.example.com) whose scripts may call the
    # API from a browser (CORS); "*": any.  Empty: none, and browsers' preflight
    # requests get 405 (vLLM allows every origin by default; a gateway holding
    # API keys should name its own).
    cors_allow_origins: list[str] = []
    # Write served requests as a Bailian-format trace (None: off).
    record_trace: str | None = None
    record_max_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    # Prompts with more characters than this are tokenised off the event loop
    # so one huge document cannot stall every other stream.
    offload_tokenize_chars: int = Field(32_768, ge=0)
    # Stopping (SIGTERM, Ctrl-C): /ready answers 503 at once, so load balancers
    # stop sending; requests are still taken for shutdown_delay_s (the time your
    # load balancer needs to notice: a few seconds behind a Kubernetes Service),
    # then the port closes and requests in flight get drain_timeout_s to finish.
    # Streams still running then end with an OpenAI error event.  A second
    # signal skips what is left of both waits.  On a `kvgate engine`, the delay is
    # also how long its gateways still send it requests when every engine is
    # stopping (gateway/dispatch.py: the last resort).
    shutdown_delay_s: float = Field(0.0, ge=0, le=HOUR_S)
    drain_timeout_s: float = Field(30.0, ge=0)
    # One log line per request (aiohttp's access log format) on logger aiohttp.access.
    access_log: bool = False
    # The event loop `kvgate serve` and `kvgate engine` run on: uvloop (libuv, as
    # vLLM's API server) took 2-13% less CPU per request than asyncio's own loop
    # (bench/RESULTS.md, "Gateway overhead"); asyncio where uvloop is missing.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # A status line every this many seconds while busy (requests, token rates,
    # cache hits, engine queues and KV use), as vLLM logs one.  0: none; else at
    # least 0.1 (the loop wakes this often even when idle: 1e-6 spun a core).
    log_stats_interval_s: float = Field(10.0, ge=0)

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """Each origin as a browser serialises it (RFC 6454): lower-case scheme and
        host, no default port.  "https://App.Example.com:443" would otherwise
        match no Origin header ever sent."""
        normal = []
        for origin in origins:
            if origin == "*":
                normal.append(origin)
                continue
            parts = urlsplit(origin)
            try:
                port = parts.port
            except ValueError:
                port = -1
            if not (parts.scheme.lower() in ("http", "https") and parts.hostname and not parts.path and port != -1
                    and not parts.query and not parts.fragment and "@" not in parts.netloc):
                raise ValueError(f"{origin!r} is no origin: give scheme://host[:port] as a browser sends it "
                                 "(e.g. https://app.example.com), or \"*\" for any")
            scheme, host = parts.scheme.lower(), parts.hostname  # urlsplit lower-cases the host
            host = f"[{host}]" if ":" in host else host
            default_port = 443 if scheme == "https" else 80
            normal.append(f"{scheme}://{host}" + (f":{port}" if port is not None and port != default_port else ""))
        return normal

    @field_validator("record_trace")
    @classmethod
    def _record_not_empty(cls, value: str | None) -> str | None:
        value = not_empty(value, "write null (or leave the key out) to record nothing")
        # ~/... is the home folder, as in model.path (not a folder named "~" here).
        return os.path.expanduser(value) if value is not None else None

    @field_validator("log_stats_interval_s")
    @classmethod
    def _stats_interval(cls, value: float) -> float:
        if 0 < value < 0.1:
            raise ValueError("give 0 (no status lines) or at least 0.1 seconds: the loop wakes this often, "
                             "busy or not")
        return value


# The replica name a `kvgate engine` gives its own series (its one in-process
# engine).  The Grafana dashboard drops series of that name, so that an engine's
# /metrics, should it be scraped too, is not counted beside the gateways': no
# replica of a gateway may have it.
ENGINE_REPLICA_NAME = "engine"
# Where a replica entry of several (count) numbers its url and name.
SLOT = "{i}"
MAX_REPLICA_SLOTS = 256
# The fields a slot's number goes in, each with an example of one that has it.
_NUMBERED = {"url": f"http://kvgate-engine-{SLOT}.kvgate-engine:8001", "name": f"engine-{SLOT}",
             "metrics_url": f"http://vllm-{SLOT}.vllm-engines:8000/metrics"}


class ReplicaConfig(Section):
    # inprocess: an engine inside the gateway; engine: a `kvgate engine` server;
    # openai: any OpenAI-compatible server (vLLM, SGLang) with an approximate index.
    kind: Literal["inprocess", "engine", "openai"] = "inprocess"
    # Base URL of an engine/openai replica, e.g. http://10.0.0.5:8001 (with or without /v1).
    url: str | None = None
    # Label in metrics and logs, one per replica; None: "inprocess-N" or the URL's
    # host:port (the scheme's port if the URL has none; never its user:password@).
    # "engine" is taken: a `kvgate engine` labels its own series so.
    name: str | None = None
    # Model name the upstream serves (openai kind); None: the name its /v1/models gives.
    model: str | None = None
    # Bearer token sent to the upstream (any remote kind), if it needs one.
    api_key: str | None = None
    # Or the name of an environment variable holding it (a Kubernetes Secret given
    # as env), which keeps the key out of this file and any ConfigMap of it.  Read
    # when the gateway starts; `kvgate engine`, which may share this file, ignores it.
    api_key_env: str | None = None
    # Seconds to wait for a TCP connection to the replica (and, at start, for a
    # `kvgate engine` to answer /kvgate/info, each try within what is left of it).
    # A replica that connects but never answers is left when its health checks
    # open the breaker.
    connect_timeout_s: float = Field(10.0, gt=0)
    # Seconds a request waits for the replica's next bytes (its response headers,
    # then each piece of the stream) before giving up on it: a request stuck in a
    # replica that still passes its health checks.  Before the first token the
    # request goes to another replica; after it, the stream ends with an error
    # event.  Generous, because a long prompt's prefill or a deep queue sends
    # nothing for a while (Envoy's stream idle timeout is five minutes too).
    # 0: wait forever.
    read_timeout_s: float = Field(300.0, ge=0)
    # Prometheus endpoint of an external server (vllm:num_requests_waiting, ...).
    metrics_url: str | None = None
    # openai kind: send the gateway's per-tenant cache salt (server.isolate_tenant_caches)
    # as vLLM's cache_salt, so the server keeps tenants' blocks apart too.  Off by
    # default: servers without the field (vLLM's V0 engine, strict OpenAI clones)
    # refuse it.  A cache_salt the client sent itself always passes through.
    send_cache_salt: bool = False
    # Replicas this entry stands for: a StatefulSet's pods, numbered in a url
    # (and a name and metrics_url, if given) with {i} from 0, e.g. http://kvgate-engine-{i}.kvgate-engine:8001
    # with count 8.  A slot whose host name does not resolve (a pod not created,
    # or scaled away) is absent: out of routing like a down replica, but not
    # counted, alerted or logged as one; it joins when its name resolves.  So the
    # engines scale within count without touching the gateways.
    count: int = Field(1, ge=1, le=MAX_REPLICA_SLOTS)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str | None) -> str | None:
        if name == ENGINE_REPLICA_NAME:
            raise ValueError(f"{name!r} is the name a `kvgate engine` gives its own series (dashboards drop them): "
                             "choose another")
        return name

    @model_validator(mode="after")
    def _url_for_remote(self, info: ValidationInfo) -> "ReplicaConfig":
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("api_key and api_key_env both give the replica's key: give one")
        key = "api_key" if self.api_key is not None else "api_key_env" if self.api_key_env is not None else None
        if self.kind == "inprocess" and key:
            # Nothing is sent to an engine inside the gateway; a key here is a mistake
            # (a missing kind), and an unset api_key_env must not stop the gateway.
            raise ValueError(f"{key} is for a remote replica (kind engine or openai); kind inprocess, the default, "
                             "runs inside the gateway")
        if self.api_key_env is not None:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
                raise ValueError(f"api_key_env {self.api_key_env!r} is no environment variable name (letters, digits, "
                                 "_), e.g. KVGATE_ENGINE_KEY")
            if (info.context or {}).get("gateway"):  # here, not at the first request after the model loads
                replica_api_key(self)
        if self.kind != "inprocess" and not self.url:
            raise ValueError(f"url is required for a replica of kind {self.kind!r}")
        if self.kind == "inprocess" and self.url is not None:
            # Not silently an engine inside the gateway (the default kind) that
            # loads the model here and never contacts the URL.
            raise ValueError(f"url {without_userinfo(self.url)!r} needs a remote kind: set kind: engine (a `kvgate "
                             "engine` server) or kind: openai (vLLM, SGLang); kind inprocess, the default, is an "
                             "engine inside the gateway and has no url")
        if self.url is not None:
            problem = replica_url_problem(self.url.replace(SLOT, "0"))
            if problem:
                raise ValueError(f"url {without_userinfo(self.url)!r} {problem}")
        if self.count > 1:
            # Else every slot would be one server (or one name) listed count times.
            if self.kind == "inprocess":
                raise ValueError("count is for remote replicas (kind engine or openai), numbered in their url")
            for field, example in _NUMBERED.items():
                value = getattr(self, field)
                if value is not None and SLOT not in value:
                    raise ValueError(f"{field} {without_userinfo(value)!r} has no {SLOT} for the slot's number "
                                     f"(0 to {self.count - 1}), e.g. {example}")
        for field in ("model", "send_cache_salt"):
            if getattr(self, field) and self.kind != "openai":
                # A `kvgate engine` serves its one model and salts every request
                # itself; set here, these would be silently unused (and a model
                # would make one engine listed twice look like two servers).
                raise ValueError(f"{field} is read for kind 'openai' only, not {self.kind!r}")
        if self.metrics_url is not None:
            if self.kind != "openai":
                # Only an external server's load comes from its /metrics; a `kvgate
                # engine` reports its own in its health probes.
                raise ValueError(f"metrics_url is read for kind 'openai' only, not {self.kind!r}")
            if not is_http_url(self.metrics_url.replace(SLOT, "0")):
                raise ValueError(f"metrics_url {without_userinfo(self.metrics_url)!r} is no http(s) URL with a host, "
                                 "e.g. http://vllm-0:8000/metrics")
        if self.metrics_url is not None and key and "@" in urlsplit(self.metrics_url).netloc:
            raise ValueError(f"the metrics_url's user:password@ and {key} are both credentials for the replica: "
                             "give one")
        if self.url is not None and key and "@" in urlsplit(self.url).netloc:
            # aiohttp sends a URL's user:password as basic auth, and refuses every
            # request that also carries the api_key's bearer token.
            raise ValueError(f"the url's user:password@ and {key} are both credentials for the replica: give one")
        return self


def replica_api_key(spec: ReplicaConfig) -> str | None:
    """The Bearer token for a replica: its api_key, or the value of the
    variable api_key_env names (ValueError when that is unset or empty)."""
    if spec.api_key_env is None:
        return spec.api_key
    value = os.environ.get(spec.api_key_env, "").strip()  # a Secret made --from-file ends with a newline
    if not value:
        raise ValueError(f"api_key_env: the environment variable {spec.api_key_env} is not set or is empty")
    if spec.kind == "engine" and ("," in value or ":" in value):
        # A kvgate engine reads its KVGATE_API_KEYS as key[:tenant[:workload]],...: a
        # value shared with it that lists more is no one key it would take.
        raise ValueError(f"api_key_env: {spec.api_key_env} holds ',' or ':'; give the one key sent to the engines "
                         "(their own KVGATE_API_KEYS may list several, as key[:tenant],...)")
    return value


def without_userinfo(url: str) -> str:
    """``url`` without its user:password@, for logs and messages (even one that
    does not parse)."""
    return re.sub(r"//[^/?#]*@", "//", url, count=1)


def is_http_url(url: str) -> bool:
    """http(s), a host and, if any, a valid port: what a replica can be reached at."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def replica_slots(specs: Sequence[ReplicaConfig]) -> list[tuple[int, ReplicaConfig]]:
    """Each replica ``specs`` stand for, with the index of its entry: an entry of
    ``count`` N is N replicas, {i} in its url, name and metrics_url numbered 0 to N-1."""
    out = []
    for index, spec in enumerate(specs):
        if spec.count == 1 and not any(SLOT in (getattr(spec, field) or "") for field in _NUMBERED):
            out.append((index, spec))
            continue
        for i in range(spec.count):
            out.append((index, spec.model_copy(update={
                field: value.replace(SLOT, str(i)) for field in _NUMBERED if (value := getattr(spec, field)) is not None})))
    return out


def replica_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a replica's base URL (to follow the URL in a
    message), or None.  The gateway appends its paths (/v1/completions,
    /kvgate/info) to the base, so a ?query or #fragment (even an empty one)
    would swallow them: every request and probe would miss, the replica dead
    forever."""
    if not is_http_url(url):
        return "is no http(s) URL with a host, e.g. http://10.0.0.5:8001"
    if "?" in url or "#" in url:  # userinfo cannot hold either: they would end the host
        return "has a ?query or #fragment: a replica URL is scheme://host:port[/path], with neither"
    return None


def replica_base_url(url: str) -> str:
    """What the gateway puts its paths after: ``url`` without trailing slashes
    and /v1 (the replica's requests go to this plus /v1/... or /kvgate/...)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _server_of(url: str, model: str | None) -> tuple | None:
    """host, port (the scheme's if none), path and the model asked for (a proxy
    such as LiteLLM serves several models at one URL) of a replica; None for no
    valid replica URL (refused elsewhere).  No scheme and no user:password@:
    http and https to one host:port, or two credentials, are one server."""
    if replica_url_problem(url):
        return None
    parts = urlsplit(replica_base_url(url))
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), parts.path.rstrip("/"), model


def same_servers(urls: Sequence[str | None], models: Sequence[str | None] = ()) -> list[tuple[int, int]]:
    """(later, first) for each URL of ``urls`` (None: no remote replica) that
    reaches the same server for the same model (``models``, by position; none
    given: none set) as an earlier one: one server listed twice gets twice the
    traffic and two indexes of one cache."""
    first: dict[tuple, int] = {}
    pairs = []
    for i, url in enumerate(urls):
        model = models[i] if i < len(models) else None
        server = _server_of(url, model) if url is not None else None
        if server is None:
            continue
        if server in first:
            pairs.append((i, first[server]))
        else:
            first[server] = i
    return pairs


class RouterConfig(Section):
    # prefix-aware: cached blocks vs load; least-load: in-flight tokens only;
    # round-robin: rotate; session: sticky by session (rendezvous hashing, with
    # bounded loads: see gateway/router.py).
    policy: Literal["prefix-aware", "least-load", "round-robin", "session"] = "prefix-aware"
    # Cost = uncached prefill blocks + load_weight * in-flight blocks.  Below 1
    # because a batching engine shares its steps: a block already in flight delays
    # a newcomer far less than a block it must prefill (`kvgate replay --replicas`:
    # 1.0 kept 42-77% of a pooled cache's hit ratio, 0.1 kept 90-100%).
    load_weight: float = Field(0.1, ge=0)
    # Safety valve (SGLang's, whose 64 requests at ~4k tokens this is): when max-min
    # in-flight tokens exceeds imbalance_abs_tokens and max exceeds
    # imbalance_rel * min, route by load alone.  A threshold below one long prompt
    # fires on ordinary jitter and throws prefix locality away.
    imbalance_abs_tokens: int = Field(262_144, ge=0)
    imbalance_rel: float = Field(1.5, ge=1)
    # Hot-prefix spreading: once this many in-flight requests share one cached run
    # (the blocks a request matched, named by the last) on one replica, the next one
    # may go to a less loaded replica (which then caches it).  Also the in-flight
    # requests a replica always takes under session routing before a session spills.
    hot_prefix_inflight: int = Field(4, ge=1)
    # In-flight tokens charged per choice for decoding: min(max_tokens, this); the
    # real output length is unknown when routing, and max_tokens alone would drown
    # the prefix term.
    decode_tokens_estimate: int = Field(128, ge=0)
    # Approximate index for external replicas.
    approx_ttl_s: float = Field(300.0, gt=0)
    approx_capacity_blocks: int = Field(100_000, ge=1)
    health_interval_s: float = Field(2.0, gt=0)
    # How long a probe waits for an answer (also an engine's /kvgate/info, an external
    # server's /v1/models and its metrics_url).  A hung replica (accepting, never
    # answering) leaves routing after about breaker_failures x (interval + timeout).
    health_timeout_s: float = Field(5.0, gt=0, le=HOUR_S)
    breaker_failures: int = Field(3, ge=1)
    breaker_reset_s: float = Field(10.0, gt=0)
    # A request whose replica's connection broke while it ran it (the replica may
    # have died of it: a "query of death") is tried on at most this many replicas;
    # then it fails.  A prompt lost that often, and the only one common to those
    # losses, is then refused for lost_quarantine_s (0: never; gateway/quarantine.py),
    # so that one prompt cannot bring a fleet down one replica at a time, nor again
    # with each retry of its client.  (Replicas lost one after the other for other
    # reasons while running one request alone would refuse an innocent prompt that
    # long: hence minutes, not hours.)
    lost_attempts: int = Field(2, ge=1)
    lost_quarantine_s: float = Field(300.0, ge=0, le=24 * HOUR_S)


class ClassifierRule(Section):
    """One classification rule; the first rule whose condition holds decides.

    ``when`` picks the condition:
      api_key    - the caller's API key fixes a workload (ApiKeyConfig.workload)
      tenant     - the caller's tenant is ``tenant``
      header     - the request has an X-KVGate-Workload header (its value wins)
      image      - a message has image parts
      file       - a single very long document (classifier.file_min_tokens)
      multi_turn - a chat with more than one user message
      endpoint   - the endpoint is ``endpoint`` (chat or completions; responses
                   for /v1/responses only, which chat also matches)
      always     - unconditional (a catch-all at the end)
    """

    when: Literal["api_key", "tenant", "header", "image", "file", "multi_turn", "endpoint", "always"]
    # Condition arguments.
    tenant: str | None = None
    endpoint: Literal["chat", "completions", "responses"] | None = None
    # Outcome; None keeps the value the request itself implies (the key's or the
    # header's workload, or the type derived from its content).
    workload: Literal["to-c", "to-b", "multimodal"] | None = None
    type: Literal["text", "search", "image", "file", "api"] | None = None

    @model_validator(mode="after")
    def _arguments(self) -> "ClassifierRule":
        if self.when == "tenant" and not self.tenant:
            raise ValueError("a rule with when: tenant needs tenant")
        if self.when == "endpoint" and not self.endpoint:
            raise ValueError("a rule with when: endpoint needs endpoint (chat, completions or responses)")
        return self


DEFAULT_RULES = [
    ClassifierRule(when="api_key"),
    ClassifierRule(when="header"),
    ClassifierRule(when="image", workload="multimodal", type="image"),
    # A long document is a file request of whoever sent it: to-C from chat, to-B from the API.
    ClassifierRule(when="file", type="file"),
    # No type on the three below: the content's (text, or api for to-B), or the client's X-KVGate-Type.
    ClassifierRule(when="multi_turn", workload="to-c"),
    ClassifierRule(when="endpoint", endpoint="completions", workload="to-b"),
    ClassifierRule(when="endpoint", endpoint="chat", workload="to-c"),
]


class ClassifierConfig(Section):
    # Prompts with a single user message longer than this are "file" requests.
    # 1024: half the bundled model's context, so a document and its answer fit.
    file_min_tokens: int = Field(1024, ge=1)
    # Tokens hashed into the prefix signature of file requests.
    signature_tokens: int = Field(10, ge=1)
    # When the matched rule gives no workload, or no rule matches (every default rule
    # but the file rule gives one itself), the workload by endpoint:
    # of a /v1/completions request (API-style callers) ...
    completions_workload: Literal["to-c", "to-b", "multimodal"] = "to-b"
    # ... and of a /v1/chat/completions one.
    default_workload: Literal["to-c", "to-b", "multimodal"] = "to-c"
    # Ordered rules, first match wins (see ClassifierRule); the default list is the
    # issue's order: API key, header, image parts, long document, multi-turn, endpoint.
    rules: list[ClassifierRule] = DEFAULT_RULES


class KvgateConfig(Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    cache: CacheConfig = CacheConfig()
    server: ServerConfig = ServerConfig()
    router: RouterConfig = RouterConfig()
    classifier: ClassifierConfig = ClassifierConfig()
    # Empty: one in-process engine serving `model`.
    replicas: list[ReplicaConfig] = []

    @model_validator(mode="after")
    def _one_replica_per_server(self) -> "KvgateConfig":
        slots = replica_slots(self.replicas)
        pairs = same_servers([spec.url for _, spec in slots], [spec.model for _, spec in slots])
        if pairs:
            # Each at its own entry (replicas.N, with its line), not at the list.
            # The input is a mapping so that the message echoes no URL (credentials).
            raise ValidationError.from_exception_data(type(self).__name__, [
                {"type": PydanticCustomError("value_error", "the same server as replicas.{first} ({url})",
                                             {"first": slots[first][0], "url": without_userinfo(replica_base_url(slots[first][1].url))}),
                 "loc": ("replicas", slots[later][0]), "input": {}}
                for later, first in pairs])
        return self

    @model_validator(mode="after")
    def _one_replica_per_name(self) -> "KvgateConfig":
        # Two replicas named alike were renamed a and a-1 silently: their metrics,
        # dashboard rows and logs would not say which was which.
        first: dict[str, int] = {}
        errors = []
        for index, spec in replica_slots(self.replicas):
            if spec.name is not None and first.setdefault(spec.name, index) != index:
                errors.append({"type": PydanticCustomError("value_error", "the name {name} is replicas.{first}'s "
                                                           "already; give each replica its own",
                                                           {"name": repr(spec.name), "first": first[spec.name]}),
                               "loc": ("replicas", index, "name"), "input": {}})
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    @model_validator(mode="after")
    def _one_principal_per_key(self) -> "KvgateConfig":
        # A key listed twice with different tenants used to take the last one silently;
        # which tenant's cache and limits a caller gets must not hang on list order.
        keys = self.server.api_keys
        first: dict[str, int] = {}
        for index, entry in enumerate(keys):
            earlier = keys[first.setdefault(entry.key, index)]
            if (earlier.tenant, earlier.workload) != (entry.tenant, entry.workload):
                # At the second entry's line; the input is empty so no key is echoed.
                raise ValidationError.from_exception_data(type(self).__name__, [
                    {"type": PydanticCustomError("value_error", "the same key as server.api_keys.{first} with another "
                                                 "tenant or workload; give each key once", {"first": first[entry.key]}),
                     "loc": ("server", "api_keys", index), "input": {}}])
        return self


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, node: yaml.Node, key: object, first: int) -> None:
        super().__init__(f"duplicate key {key!r} (first at line {first})")
        self.node = node  # the second key's, to find its path by
        self.line = node.start_mark.line + 1
        self.key = key
        self.first = first


class _ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error:
    PyYAML keeps the last silently, so a second `engine:` section would drop the
    first one whole."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat and is overridden by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if seen is not None:
                raise _DuplicateKey(key_node, key, seen)
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _key_lines(node: yaml.Node | None, path: tuple[str, ...] = (), seen: set[int] | None = None,
               nodes: dict[int, tuple[str, ...]] | None = None) -> dict[tuple[str, ...], int]:
    """Dotted path (as pydantic's error locations, each part a string) -> the line
    of its key, for errors that say where; list items by their index.  Each node
    is walked once: an alias (``*a``) is the very node its anchor names, so the
    keys inside it are found at the anchor, and an error inside an aliased value
    is placed at the key that uses the alias (the innermost path found, see
    ``_line_of``).  Walking every use again would take exponential time on
    aliases of aliases, and a node may even contain itself (``&a [*a]``).
    ``nodes``, if given, gets each key node's path by its id (a key given twice has two)."""
    lines: dict[tuple[str, ...], int] = {}
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return lines
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [(key.value, key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)]
    elif isinstance(node, yaml.SequenceNode):
        children = [(str(i), item, item) for i, item in enumerate(node.value)]
    else:
        return lines
    for name, where, value in children:
        lines[path + (name,)] = where.start_mark.line + 1
        if nodes is not None:
            nodes[id(where)] = path + (name,)
        lines.update(_key_lines(value, path + (name,), seen, nodes))
    return lines


def load_config(path: str | os.PathLike | None = None, *, gateway: bool = False) -> KvgateConfig:
    """Read and validate a config file; None gives the defaults.  ``gateway``:
    also what only the gateway reads at start (replicas' api_key_env).

    Raises ConfigError with one ``FILE:LINE: key: why`` line per problem
    (``FILE: key: why`` where no line applies).
    """
    if path is None:
        return KvgateConfig()
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        loader = _ConfigLoader(text)  # checks every character: a control character fails here
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(f"{source}:{line}: invalid YAML: control character U+{code:04X} is not allowed") from None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _DuplicateKey as exc:
        # Named by its whole path (engine.block_size), as every other error is.
        nodes: dict[int, tuple[str, ...]] = {}
        _key_lines(root, nodes=nodes)
        path = nodes.get(id(exc.node))
        where = ".".join(path) if path else repr(exc.key)
        raise ConfigError(f"{source}:{exc.line}: {where}: given twice (first at line {exc.first})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    except ValueError:  # Python's guard on int(): no setting is a number that long
        raise ConfigError(f"{source}: a number has over {sys.get_int_max_str_digits():,} digits") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        return KvgateConfig.model_validate(data, context={"gateway": gateway})
    except ValidationError as exc:
        raise ConfigError(format_config_error(exc, source, KvgateConfig, _key_lines(root))) from None


def located(path: str | os.PathLike | None, key: str) -> str:
    """Where config file ``path`` sets a dotted setting, as the prefix of an error
    found only at start-up (the model, the KV tiers, the address): ``FILE:LINE: ``,
    or nothing (no file, or the setting left at its default).  The file is read
    again: it validated at start, and this runs only on the way out."""
    if path is None:
        return ""
    try:
        loader = _ConfigLoader(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # changed since: the error still says what is wrong
        return ""
    try:
        line = _key_lines(loader.get_single_node()).get(tuple(key.split(".")))
    except yaml.YAMLError:
        return ""
    finally:
        loader.dispose()
    return f"{path}:{line}: " if line else ""
