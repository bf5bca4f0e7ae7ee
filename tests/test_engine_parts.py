"""Engine parts without the async loop: model loading errors, KV copies, detokenisation, sampling."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from engine.block_pool import BlockPool
from engine.config import ModelConfig
from engine.context import RequestContext
from engine.kv_cache import KVCache, KVShape, size_device_blocks, size_host_blocks
from engine.model_loader import ModelLoadError, load_model, resolve_dtype
from engine.request import SamplingParams
from engine.sampling import IncrementalDetokenizer, SequenceSampler


def test_missing_directory_names_path_and_reason(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="nope.*directory not found"):
        load_model(ModelConfig(path=missing, device="cpu"))


def test_a_model_path_to_a_weights_file_says_to_give_the_directory(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="model.safetensors.*is a file; give a model directory"):
        load_model(ModelConfig(path=str(weights), device="cpu"))


def test_broken_model_directory_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))
    assert str(tmp_path) in str(info.value) and info.value.reason


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(ModelConfig(path=str(tmp_path / "m.gguf"), device="cpu"))


def test_a_converted_model_is_readable_by_other_users(tiny_model_dir, tmp_path, monkeypatch):
    # As a container's other runAsUser needs it; the conversion (here of the tiny
    # model, standing in for the GGUF) is written through a private temporary folder.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.model_loader as model_loader

    loaded = (AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir))
    monkeypatch.setattr(model_loader, "load_gguf", lambda gguf_file: loaded)
    target = tmp_path / "cache" / "model"
    model_loader.convert_gguf("tiny.gguf", str(target))
    assert target.stat().st_mode & 0o755 == 0o755 and (target / "config.json").exists()


def test_tiny_model_dir_loads(tiny_model_dir):
    cfg = ModelConfig(path=tiny_model_dir, device="cpu")
    loaded = load_model(cfg)
    assert loaded.name == os.path.basename(tiny_model_dir)
    assert loaded.dtype == resolve_dtype(cfg, torch.device("cpu")) in (torch.float32, torch.bfloat16)
    assert next(loaded.model.parameters()).dtype == loaded.dtype
    assert loaded.tokenizer.eos_token_id is not None


def _kv(device_blocks=4, host_blocks=4):
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, dtype=torch.float32)
    return KVCache(shape, device_blocks, host_blocks, torch.device("cpu"))


def test_copies_move_blocks_between_tiers_in_order():
    kv = _kv()
    kv.device_kv.normal_()
    before = kv.block(1)
    # Demote device 1 -> host 4 (id 4 = host index 0), then promote it into device 3.
    kv.apply_copies([(1, 4), (4, 3)])
    assert torch.equal(kv.block(4), before) and torch.equal(kv.block(3), before)
    assert kv.bytes_to_host == kv.bytes_to_device == kv.shape.bytes_per_block == 2 * 2 * 3 * 2 * 4 * 4


def test_pool_copies_drive_kv_copies():
    kv = _kv(device_blocks=2, host_blocks=2)
    pool = BlockPool(2, 2, record_copies=True)
    ctx = RequestContext()
    (block,) = pool.allocate(1)
    kv.device_kv[:, :, block] = 7.0
    pool.cache_block(block, 111, ctx, 0, 0.0)
    pool.release([block], ctx, 0.0)
    pool.allocate(2)  # evicts key 111 from the device tier: demotion
    kv.apply_copies(pool.drain_copies())
    host = pool.cached[111]
    assert not pool.is_device(host) and torch.all(kv.block(host) == 7.0)


def test_cpu_sizing_respects_the_cap():
    shape = KVShape(30, 3, 64, 16, torch.float32)
    blocks = size_device_blocks(shape, torch.device("cpu"), 0.9, 3.0)
    assert 1 <= blocks * shape.bytes_per_block * 4 <= 2 << 30


def test_gpu_host_tier_is_capped_by_available_ram(monkeypatch):
    # The bundled model's KV shape on an H200's free memory, with 64 GiB of RAM available.
    from engine import memory

    shape = KVShape(30, 3, 64, 16, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (139 * 10**9, 141 * 10**9))
    monkeypatch.setattr(memory, "available_ram", lambda: 64 << 30)
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)  # no container limit
    gpu = torch.device("cuda")
    device_blocks = size_device_blocks(shape, gpu, 0.9, 3.0)
    assert device_blocks * shape.bytes_per_block > 120 * 10**9
    host_blocks, capped = size_host_blocks(shape, gpu, device_blocks, 3.0)
    assert capped and host_blocks * shape.bytes_per_block <= 16 << 30 < 3 * device_blocks * shape.bytes_per_block
    # torch pins a power of two bytes at least as large: with 100 GiB available that is
    # 16 GiB of blocks (pinned as 16 GiB), not 25 GiB (pinned as 32 GiB).
    monkeypatch.setattr(memory, "available_ram", lambda: 100 << 30)
    host_blocks, _ = size_host_blocks(shape, gpu, device_blocks, 3.0)
    assert 15 << 30 < host_blocks * shape.bytes_per_block <= 16 << 30
    # In a pod whose memory limit leaves 45 GiB of room: 3/4 of it, 32 GiB as a power of two.
    monkeypatch.setattr(memory, "cgroup_room", lambda: 45 << 30)
    host_blocks, _ = size_host_blocks(shape, gpu, device_blocks, 3.0)
    assert 31 << 30 < host_blocks * shape.bytes_per_block <= 32 << 30
    # Room enough: the multiplier as configured; on CPU the device budget already covers both tiers.
    assert size_host_blocks(shape, gpu, 1000, 3.0) == (3000, False)
    assert size_host_blocks(shape, torch.device("cpu"), 10**9, 3.0) == (3 * 10**9, False)


def test_available_ram_respects_a_container_memory_limit(tmp_path):
    from engine.memory import cgroup_room

    def cgroup(limit: str, usage: str, inactive_file: int | None = None):
        (tmp_path / "max").write_text(limit + "\n")
        (tmp_path / "current").write_text(usage + "\n")
        if inactive_file is not None:
            (tmp_path / "stat").write_text(f"anon 1\nfile 2\nactive_file 3\ninactive_file {inactive_file}\n")
        return ((str(tmp_path / "max"), str(tmp_path / "current"), str(tmp_path / "stat"), "inactive_file"),)

    assert cgroup_room(cgroup(str(8 << 30), str(3 << 30))) == 5 << 30
    # Inactive page cache (weights just read) is reclaimable: room, not use.
    assert cgroup_room(cgroup(str(8 << 30), str(3 << 30), inactive_file=2 << 30)) == 7 << 30
    assert cgroup_room(cgroup("max", "123")) is None  # v2 without a limit
    assert cgroup_room(cgroup(str(1 << 62), "123")) is None  # v1 without a limit
    assert cgroup_room(((str(tmp_path / "nothing"), str(tmp_path / "here"), str(tmp_path / "x"), "inactive_file"),)) is None


def test_available_ram_counts_reclaimable_page_cache_as_psutil_does(tmp_path):
    """The kernel's MemAvailable, with or without psutil (a test extra, not in
    the image): free pages alone leave out the page cache a node is full of."""
    import psutil

    from engine.memory import mem_available

    ours, theirs = mem_available(), psutil.virtual_memory().available
    assert abs(ours - theirs) < 0.01 * theirs
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       64000000 kB\nMemFree:         1000000 kB\nMemAvailable:   40000000 kB\n")
    assert mem_available(str(meminfo)) == 40000000 * 1024
    assert mem_available(str(tmp_path / "missing")) > 0  # free pages, then


class _Tok:
    """Byte-per-token stand-in: decode like a byte-level BPE (invalid UTF-8 -> U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_emits_broken_utf8():
    data = "café 東京 🙂!".encode()
    detok = IncrementalDetokenizer(_Tok(), [])
    deltas = [detok.add(b) for b in data]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == data.decode()


@pytest.mark.parametrize("end", ["length", "eos"])
def test_a_character_cut_off_by_the_end_is_left_out_of_the_text(end):
    # "a 東" cut after the first two of 東's three bytes, by max_tokens or by EOS:
    # vLLM's text ends before it (it used to end in U+FFFD, as a whole decode).
    data = b"a " + "東".encode()[:2]
    eos = 300
    params = SamplingParams(max_tokens=len(data) + (1 if end == "eos" else 0))
    sampler = SequenceSampler(params, _Tok(), [], {eos})
    text = ""
    for b in data:
        delta, finish = sampler.accept(b, 0, 100)
        text += delta
    if end == "eos":
        assert finish is None
        delta, finish = sampler.accept(eos, 0, 100)
        text += delta
        assert finish == "stop"
    else:
        assert finish == "length"
    assert text == "a "


def test_a_stop_string_in_text_flushed_at_the_end_still_stops():
    class Pieces(_Tok):
        table = {1: b"ok ", 2: b"END\xe6"}  # the last token ends in part of a character

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")

    sampler = SequenceSampler(SamplingParams(max_tokens=2, stop=["END"]), Pieces(), [], set())
    text = sampler.accept(1, 0, 100)[0]
    delta, finish = sampler.accept(2, 0, 100)
    assert (text + delta, finish) == ("ok ", "stop")


def test_stop_string_spanning_tokens_is_held_back():
    params = SamplingParams(max_tokens=50, stop=["END"])
    sampler = SequenceSampler(params, _Tok(), [], set())
    emitted = []
    for b in b"abc EN":
        delta, finish = sampler.accept(b, 0, 100)
        emitted.append(delta)
        assert finish is None
    assert "".join(emitted) == "abc "  # "EN" may start the stop string
    delta, finish = sampler.accept(ord("D"), 0, 100)
    assert finish == "stop" and "".join(emitted) + delta == "abc "


@pytest.mark.parametrize("k", [5, 2])
def test_top_logprobs_list_ties_as_greedy_picks_them(k):
    """torch.topk orders equal values arbitrarily: a greedy token tied for the top
    (argmax takes the lowest id) was often not listed first, and which tied token
    took the last place varied.  Ties go in ascending id order."""
    from tests.tiny_model import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    logits = torch.zeros(len(tokenizer))
    logits[[300, 100, 7]] = 5.0
    logits[[400, 50]] = 4.0
    sampler = SequenceSampler(SamplingParams(temperature=0.0, logprobs=k), tokenizer, [1, 2, 3], set())
    token, logprob = sampler.sample(logits)
    assert token == 7 and [i for i, _, _ in logprob.top] == [7, 100, 300, 50, 400][:k]
    assert all(value == logprob.logprob for _, _, value in logprob.top[:min(k, 3)])


def test_top_k_one_is_greedy_and_penalties_apply():
    params = SamplingParams(temperature=1.0, top_k=1, presence_penalty=5.0)
    sampler = SequenceSampler(params, _Tok(), [], set())
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sampler.sample(logits)[0] == 1
    sampler.accept(1, 0, 100)
    assert sampler.sample(logits)[0] == 2


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = torch.tensor([2.0, 1.9, 0.0, -3.0])  # probabilities ~ .50 .45 .07 .003
    for seed in range(20):
        drawn = SequenceSampler(SamplingParams(temperature=1.0, min_p=0.5, seed=seed), _Tok(), [], set()).sample(logits)[0]
        assert drawn in (0, 1)
    # min_p = 1 leaves the likeliest token alone.
    assert all(SequenceSampler(SamplingParams(temperature=1.0, min_p=1.0, seed=s), _Tok(), [], set()).sample(logits)[0] == 0
               for s in range(10))


def test_repetition_penalty_counts_prompt_and_output_tokens_as_vllm():
    logits = torch.tensor([3.0, 2.0, 1.5, -1.0])
    sampler = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), _Tok(), [0], set())
    assert not sampler.plain_greedy
    # Token 0 is in the prompt: 3.0 / 2 = 1.5 < 2.0.
    assert sampler.sample(logits)[0] == 1
    sampler.accept(1, 0, 100)
    # Now 0 (3.0 -> 1.5) and 1 (2.0 -> 1.0) are penalised; the unseen 2 (1.6) wins.
    assert sampler.sample(torch.tensor([3.0, 2.0, 1.6, -1.0]))[0] == 2
    # A negative logit is multiplied, so it falls further.
    penal = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), _Tok(), [3], set())
    assert penal.sample(torch.tensor([-1.5, -1.6, -1.7, -1.0]))[0] == 0  # token 3: -1.0 x 2 = -2.0


def test_repetition_penalty_comes_before_frequency_and_presence_as_vllm():
    # vLLM: repetition first, then frequency, then presence.  Token 0 (2.0, generated
    # once): 2.0 / 2 - 1.0 = 0.0 < 0.3, so token 1 wins; the other order gives 0.5.
    logits = torch.tensor([2.0, 0.3, -5.0, -5.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    sampler = SequenceSampler(params, _Tok(), [2], set())
    sampler.accept(0, 0, 100)
    assert sampler.sample(logits)[0] == 1
    # Presence likewise: 1.0 / 2 - 0.6 = -0.1 < 0.0 (the other order: (1.0 - 0.6) / 2 = 0.2).
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.6)
    sampler = SequenceSampler(params, _Tok(), [2], set())
    sampler.accept(0, 0, 100)
    assert sampler.sample(torch.tensor([1.0, 0.0, -5.0, -5.0]))[0] == 1


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings():
    eos, stop_id = 300, 301
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop=["b"], stop_token_ids=[stop_id])
    sampler = SequenceSampler(params, _Tok(), [], {eos})
    logits = torch.full((302,), -5.0)
    logits[eos] = 5.0
    logits[stop_id] = 4.0
    logits[ord("b")] = 3.0
    # While short of min_tokens, EOS and the stop id cannot be drawn, and "b" does not stop.
    text = ""
    for _ in range(3):
        token = sampler.sample(logits)[0]
        assert token == ord("b")
        delta, finish = sampler.accept(token, 0, 100)
        text += delta
        assert finish is None
    assert sampler.plain_greedy  # the mask is off once min_tokens are out
    assert sampler.sample(logits)[0] == eos
    # A stop string that ends after the first min_tokens tokens stops as usual.
    delta, finish = sampler.accept(ord("b"), 0, 100)
    assert (text, delta, finish) == ("bbb", "", "stop")


def test_include_stop_str_in_output_keeps_what_ended_the_choice():
    params = SamplingParams(max_tokens=50, stop=["END", "EN"], include_stop_str_in_output=True)
    sampler = SequenceSampler(params, _Tok(), [], set())
    emitted = ""
    for b in b"abc EN":
        delta, finish = sampler.accept(b, 0, 100)
        emitted += delta
    # "EN" is a stop string itself; kept, and nothing held back since it would be kept anyway.
    assert (emitted, finish) == ("abc EN", "stop")
    sampler = SequenceSampler(SamplingParams(max_tokens=50, stop=["ND"], include_stop_str_in_output=True), _Tok(), [], set())
    emitted = ""
    for b in b"aEND tail":
        delta, finish = sampler.accept(b, 0, 100)
        emitted += delta
        if finish:
            break
    assert (emitted, finish) == ("aEND", "stop")
    # A stop token's own text stays too (as vLLM's detokenizer keeps it on request).
    sampler = SequenceSampler(SamplingParams(max_tokens=5, stop_token_ids=[ord("!")], include_stop_str_in_output=True),
                              _Tok(), [], set())
    out = [sampler.accept(b, 0, 100) for b in b"hi!"]
    assert "".join(d for d, _ in out) == "hi!" and out[-1][1] == "stop"
    plain = SequenceSampler(SamplingParams(max_tokens=5, stop_token_ids=[ord("!")]), _Tok(), [], set())
    assert "".join(plain.accept(b, 0, 100)[0] for b in b"hi!") == "hi"


def test_coalesce_joins_each_choices_deltas_in_order():
    from engine.request import GenerationOutput, TokenLogprob, Usage, coalesce

    usage = Usage(10, 3, 0)
    lp = lambda t: [TokenLogprob(t, str(t), -0.1)]  # noqa: E731
    batch = [
        GenerationOutput("r", 0, [1], "a", lp(1), None, None, 0.25),
        GenerationOutput("r", 1, [7], "x", lp(7)),
        GenerationOutput("r", 0, [2], "b", lp(2)),
        GenerationOutput("r", 0, [3], "c", lp(3), "length", usage),
        GenerationOutput("r", 1, [8], "y", lp(8), "stop", Usage(10, 2, 0), stop_reason="###"),
    ]
    merged = coalesce(batch)
    assert [o.index for o in merged] == [0, 1]
    first, second = merged
    assert (first.token_ids, first.text, first.finish_reason, first.usage, first.queue_time_s) == (
        [1, 2, 3], "abc", "length", usage, 0.25)
    assert [x.token_id for x in first.logprobs] == [1, 2, 3]
    assert (second.token_ids, second.text, second.finish_reason, second.usage.completion_tokens) == ([7, 8], "xy", "stop", 2)
    assert second.stop_reason == "###" and first.stop_reason is None
    # Nothing to join: the very same list comes back; no logprobs stay None.
    alone = [GenerationOutput("r", 0, [1], "a"), GenerationOutput("r", 1, [2], "b")]
    assert coalesce(alone) is alone
    assert coalesce([GenerationOutput("r", 0, [1], "a"), GenerationOutput("r", 0, [2], "b")])[0].logprobs is None


def test_the_conversion_draws_no_bar_into_a_log_and_says_how_long_it_took(tiny_model_dir, tmp_path, monkeypatch,
                                                                          caplog):
    """transformers' dequantisation bar went into a pod's log (stderr no terminal)
    as one long line of carriage returns; the conversion now draws it on a
    terminal only, and its end is said with the time it took."""
    import logging

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.model_loader as model_loader

    drawn = []

    def load_with_a_bar(gguf_file):
        bar = gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")
        drawn.append(bar.disable)
        list(bar)
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)

    monkeypatch.setattr(model_loader, "load_gguf", load_with_a_bar)
    original = gguf_utils.tqdm
    with caplog.at_level(logging.INFO, logger="engine.model_loader"):
        model_loader.convert_gguf("tiny.gguf", str(tmp_path / "model"))
    assert drawn == [True]  # pytest's stderr is no terminal
    assert gguf_utils.tqdm is original
    assert any(re.fullmatch(r"converted tiny\.gguf in \d+ s", r.getMessage()) for r in caplog.records)


def _tiny_arch_dir(path, config) -> str:
    """A random tiny model of another architecture, with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_model import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_models_the_paged_attention_would_serve_wrongly_are_refused_at_load(tmp_path):
    """Answers that differ from the model's own are worse than no answers: a model
    whose layers ask for what the engine's attention does not apply, or bypass it,
    is refused when it loads, naming why and model.path (the CLI puts its FILE:LINE
    in front).  What it does apply loads."""
    from transformers import (BloomConfig, Gemma2Config, GraniteMoeHybridConfig, Lfm2Config, Llama4TextConfig,
                              LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig)

    from engine.config import ConfigError
    from tests.engine_helpers import make_engine

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    refused = {
        "a sliding window of 8 tokens": MistralConfig(sliding_window=8, **small),
        "attention logit soft-capping": Gemma2Config(head_dim=8, query_pre_attn_scalar=8, sliding_window=4096,
                                                     **small),
        "do not call transformers' attention interface": BloomConfig(hidden_size=32, n_layer=2, n_head=4),
        # Windows applied through the mask alone, layers with state of their own, and
        # rope factors that follow the longest position in the (packed) forward: each
        # loaded and answered unlike the model past a few dozen tokens.
        "a sliding window of 8 tokens, which": Qwen2MoeConfig(
            use_sliding_window=True, sliding_window=8, max_window_layers=1, num_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, **small),
        "attention chunks of 8 tokens": Llama4TextConfig(
            attention_chunk_size=8, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
            **small),
        "conv layers besides attention": Lfm2Config(layer_types=["conv", "full_attention"], **small),
        "longrope rope scaling": Phi3Config(
            original_max_position_embeddings=64, pad_token_id=0, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}, **small),
    }
    for why, config in refused.items():
        with pytest.raises(ConfigError) as info:
            make_engine(_tiny_arch_dir(tmp_path / config.model_type, config))
        assert info.value.key == "model.path" and why in str(info.value), str(info.value)
        assert f"cannot serve {config.model_type} exactly" in str(info.value)
    # A window no request can outgrow (max_model_len 1024 here), or none (Qwen2's default): served.
    # So are Granite 4's dense checkpoints (every layer attention, mamba_* settings unused)
    # and dynamic rope within max_position_embeddings, whatever original length it names.
    granite_dense = GraniteMoeHybridConfig(layer_types=["attention"] * 2, num_local_experts=0, num_experts_per_tok=0,
                                           shared_intermediate_size=64, position_embedding_type="rope",
                                           mamba_n_heads=4, mamba_d_head=16, **small)
    dynamic = LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128},
                          **small)
    for config in (MistralConfig(sliding_window=4096, **small), Qwen2Config(**small), granite_dense, dynamic):
        engine = make_engine(_tiny_arch_dir(tmp_path / f"{config.model_type}-ok", config))
        assert engine._max_model_len == 1024


def test_a_models_generation_config_gives_the_sampling_defaults_vllm_takes(tmp_path, caplog):
    from engine.model_loader import sampling_defaults

    folder = tmp_path / "model"
    folder.mkdir()
    assert sampling_defaults(ModelConfig(path=str(folder))) == {}  # none given
    (folder / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_k": 20, "top_p": 1.0, "repetition_penalty": 1.05, "do_sample": True,
        "min_p": 5, "eos_token_id": 2, "max_new_tokens": 512}))
    with caplog.at_level("WARNING", logger="engine.model_loader"):
        given = sampling_defaults(ModelConfig(path=str(folder)))
    # transformers' own defaults (top_p 1.0) are no setting of the model's; what no request could say is left out.
    assert given == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512}
    assert "min_p 5 is out of range for a request" in caplog.text
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with caplog.at_level("WARNING", logger="engine.model_loader"):
        assert sampling_defaults(ModelConfig(path=str(folder))) == {}
    assert "max_new_tokens 0 is not a positive whole number" in caplog.text
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert sampling_defaults(ModelConfig(path=str(gguf))) == {}
    assert sampling_defaults(ModelConfig(path="no-such-org/no-such-model")) == {}  # a hub id not cached here
    # The bundled model not converted yet: not converted to learn (its GGUF sets no sampling).
    empty = tmp_path / "cache"
    assert sampling_defaults(ModelConfig(cache_dir=str(empty))) == {} and not empty.exists()
