"""The bundled engine on the tiny random-init model: exactness, caching, batching, lifecycle."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re

import pytest
import torch

from engine.block_hash import block_hashes
from engine.request import GenerationRequest, SamplingParams
from tests.engine_helpers import (
    DEVICE,
    assert_no_references,
    collect,
    greedy,
    hf_greedy,
    hf_reference,
    make_engine,
    text,
    tokens,
)


@pytest.fixture
async def engines(tiny_model_dir):
    """Factory of engines on the tiny model; after the test every block reference must be back to zero."""
    made = []

    def factory(**kwargs):
        engine = make_engine(tiny_model_dir, **kwargs)
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        await engine.idle()
        assert_no_references(engine)
        await engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_reference(tiny_model_dir)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 500, (length,), generator=g).tolist()


async def test_greedy_matches_hf_generate(engines, reference):
    engine = engines()
    prompts = [prompt_of(n, seed=n) for n in (5, 23, 70)]
    results = await asyncio.gather(*(collect(engine, greedy(f"r{i}", p, 20)) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results):
        assert tokens(result[0]) == hf_greedy(reference, prompt, 20)
        final = result[0][-1]
        assert final.finish_reason == "length"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 20)


async def test_cached_prefix_gives_same_tokens(engines, reference):
    engine = engines()
    prompt = prompt_of(100, seed=1)
    cold = await collect(engine, greedy("cold", prompt, 12))
    assert cold[0][-1].usage.cached_tokens == 0
    warm = await collect(engine, greedy("warm", prompt, 12))
    # All full blocks but the one holding the last prompt token come from the cache.
    assert warm[0][-1].usage.cached_tokens == (len(prompt) - 1) // 16 * 16 == 96
    assert tokens(warm[0]) == tokens(cold[0]) == hf_greedy(reference, prompt, 12)
    # A different suffix after a shared prefix reuses the prefix only.
    branch = prompt[:64] + prompt_of(20, seed=2)
    out = await collect(engine, greedy("branch", branch, 12))
    assert out[0][-1].usage.cached_tokens == 64
    assert tokens(out[0]) == hf_greedy(reference, branch, 12)
    stats = engine.stats()
    assert stats["prefix_cache"]["hit_tokens"] == 96 + 64
    assert stats["prefix_cache"]["query_tokens"] == 100 + 100 + 84
    # n choices are one lookup, as their usage says: the siblings' blocks are the
    # prompt the first choice has just computed, not a hit (they read 303 and 192).
    fresh = prompt_of(101, seed=3)
    out = await collect(engine, greedy("n3", fresh, 4, n=3))
    assert len(out) == 3 and out[0][-1].usage.cached_tokens == 0
    assert engine.stats()["prefix_cache"] == {"query_tokens": 100 + 100 + 84 + 101, "hit_tokens": 96 + 64}


async def test_batch_of_mixed_lengths_equals_one_by_one(engines):
    # A small token budget forces chunked prefill next to running decodes.
    engine = engines(max_batched_tokens=48, max_num_seqs=4)
    prompts = [prompt_of(n, seed=10 + n) for n in (3, 17, 40, 64, 130)]
    alone = []
    for i, prompt in enumerate(prompts):
        alone.append(tokens((await collect(engine, greedy(f"one{i}", prompt, 16)))[0]))
    batched_engine = engines(max_batched_tokens=48, max_num_seqs=4)
    results = await asyncio.gather(*(collect(batched_engine, greedy(f"b{i}", p, 16)) for i, p in enumerate(prompts)))
    assert [tokens(r[0]) for r in results] == alone


@pytest.mark.parametrize("policy", ["lru", "wa"])
async def test_preempt_and_resume_gives_same_tokens(engines, reference, policy):
    # 10 blocks of 16 tokens cannot hold four 40+40-token sequences (5 blocks each).
    engine = engines(device_blocks=10, host_blocks_multiplier=0.0, max_num_seqs=4, policy=policy)
    prompts = [prompt_of(40, seed=20 + i) for i in range(4)]
    results = await asyncio.gather(*(collect(engine, greedy(f"p{i}", p, 40)) for i, p in enumerate(prompts)))
    assert engine.stats()["preemptions"] > 0
    for prompt, result in zip(prompts, results):
        assert tokens(result[0]) == hf_greedy(reference, prompt, 40)
        assert result[0][-1].usage.completion_tokens == 40


async def test_closing_the_stream_aborts_and_frees_blocks(engines):
    engine = engines()
    stream = engine.generate(greedy("long", prompt_of(50, seed=3), 500))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    await engine.idle()
    assert engine.stats()["blocks"]["device"]["in_use"] == 0


async def test_abort_by_id_ends_the_stream(engines):
    engine = engines()
    outputs = []
    async for out in engine.generate(greedy("victim", prompt_of(30, seed=4), 500)):
        outputs.append(out)
        if len(outputs) == 2:
            engine.abort("victim")
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].usage.prompt_tokens == 30
    await engine.idle()
    assert engine.stats()["blocks"]["device"]["in_use"] == 0


async def test_abort_or_shutdown_before_the_loop_takes_the_request_ends_its_stream(engines):
    """A request aborted (or the engine shut down) before the loop took it in has
    no sequences yet; its reader must still get every choice's end, not hang."""
    engine = engines()
    await engine.start()

    async def last_reason(request):
        outs = [out async for out in engine.generate(request)]
        return sorted((out.index, out.finish_reason) for out in outs if out.finish_reason)

    request = greedy("early", prompt_of(20, seed=7), 50)
    request.sampling.n = 2
    early = asyncio.create_task(last_reason(request))
    await asyncio.sleep(0)  # registered, not yet taken in by the loop
    engine.abort("early")
    assert await asyncio.wait_for(early, 10) == [(0, "abort"), (1, "abort")]

    busy = asyncio.create_task(last_reason(greedy("busy", prompt_of(40, seed=8), 200)))
    await asyncio.sleep(0.05)
    late = asyncio.create_task(last_reason(greedy("late", prompt_of(40, seed=9), 200)))
    await asyncio.sleep(0)
    await engine.shutdown()
    assert await asyncio.wait_for(late, 10) == [(0, "abort")]
    assert (await asyncio.wait_for(busy, 10))[0][1] in ("abort", "length")


async def test_a_reader_closed_after_its_request_ended_leaves_a_newer_one_of_that_id_alone(engines):
    """The reader of a finished request, closed before it read the last output,
    aborted by id: a newer request that had taken the id ended after 2 of its 30
    tokens with finish_reason "abort"."""
    engine = engines()
    old = engine.generate(greedy("job", prompt_of(20, seed=21), 2))
    await old.__anext__()
    await engine.idle()  # it has ended; its last output is still unread
    new = engine.generate(greedy("job", prompt_of(20, seed=22), 30))
    first = await new.__anext__()
    await old.aclose()
    rest = [out async for out in new]
    assert len(tokens([first, *rest])) == 30 and rest[-1].finish_reason == "length"


async def test_an_abort_queued_at_shutdown_does_not_outlive_it(engines):
    """A client gone while a step ran queues its abort; shut down before the loop
    applied it, the abort stayed queued and ended at once the next request that
    used the id after the engine started again."""
    engine = engines()
    gen = engine.generate(greedy("job-1", prompt_of(20, seed=23), 50))
    await gen.__anext__()
    while not engine._in_flight:
        await asyncio.sleep(0)
    await gen.aclose()  # queued: a step is in flight
    await engine.shutdown()
    outs = [out async for out in engine.generate(greedy("job-1", prompt_of(20, seed=24), 8))]
    assert len(tokens(outs)) == 8 and outs[-1].finish_reason == "length"


async def test_a_cancelled_shutdown_frees_no_block_under_the_step_in_flight(engines):
    """shutdown() cancelled (a stop's timeout, another signal) while a step ran
    cancelled the loop under it and aborted every request at once: the worker's
    step then used blocks already back in the pool (an IndexError, or KV written
    into freed blocks).  The step ends first; the aborts come after."""
    import threading
    import time

    engine = engines()
    events = []
    run = engine.runner.run

    def slow_run(batch):
        events.append("step")
        time.sleep(0.5)
        out = run(batch)
        events.append("step done")
        return out

    engine.runner.run = slow_run
    abort_now = engine._abort_now

    def recorded_abort(state):
        events.append(("abort", threading.current_thread() is threading.main_thread()))
        abort_now(state)

    engine._abort_now = recorded_abort
    gen = engine.generate(greedy("a", prompt_of(20, seed=25), 50))
    reader = asyncio.create_task(gen.__anext__())
    while "step" not in events:
        await asyncio.sleep(0.01)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.shutdown(), 0.05)
    assert events[:3] == ["step", "step done", ("abort", True)]
    await reader
    await gen.aclose()


async def test_an_id_reused_right_after_an_early_abort_gets_only_its_own_tokens(engines, reference):
    """A client retrying under its own request id: the aborted request, never
    taken in by the loop, must not run beside the new one and feed its queue."""
    engine = engines()
    await engine.start()
    old = greedy("x", prompt_of(30, seed=16), 8)
    old.sampling.n = 2
    stream = engine.generate(old)
    first = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)  # registered, not yet taken in by the loop
    engine.abort("x")
    prompt = prompt_of(20, seed=17)
    outs = [out async for out in engine.generate(greedy("x", prompt, 4))]
    assert (await first).finish_reason == "abort"
    assert {out.index for out in outs} == {0} and tokens(outs) == hf_greedy(reference, prompt, 4)
    await engine.idle()
    assert engine.stats()["running"] == 0 and engine.pool.num_in_use() == 0


async def test_demotion_then_promotion_keeps_kv_bit_exact(engines, reference):
    engine = engines(device_blocks=8, host_blocks_multiplier=4.0)
    pool, kv = engine.pool, engine.kv
    prompt = prompt_of(65, seed=5)
    first = await collect(engine, greedy("a", prompt, 4))
    keys = block_hashes(prompt, 16, engine.hash_salt)
    snapshot = {key: kv.block(pool.cached[key]) for key in keys}
    assert all(pool.is_device(pool.cached[key]) for key in keys)
    # Other prompts push the first one's blocks down to the host tier.
    for i in range(3):
        await collect(engine, greedy(f"filler{i}", prompt_of(100, seed=30 + i), 2))
    demoted = [key for key in keys if key in pool.cached and not pool.is_device(pool.cached[key])]
    assert demoted, "expected some blocks of the first prompt on the host tier"
    for key in demoted:
        assert torch.equal(kv.block(pool.cached[key]), snapshot[key])
    again = await collect(engine, greedy("a-again", prompt, 4))
    assert engine.stats()["promotions"] > 0
    assert again[0][-1].usage.cached_tokens == 64
    for key in keys:
        assert pool.is_device(pool.cached[key])
        assert torch.equal(kv.block(pool.cached[key]), snapshot[key])
    assert tokens(again[0]) == tokens(first[0]) == hf_greedy(reference, prompt, 4)
    swap = engine.stats()["swap_bytes"]
    assert swap["device_to_host"] > 0 and swap["host_to_device"] > 0


async def test_seed_gives_same_sample(engines):
    engine = engines()
    prompt = prompt_of(20, seed=6)

    def sampled(rid, seed):
        params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return GenerationRequest(rid, prompt, params)

    a = tokens((await collect(engine, sampled("s1", 123)))[0])
    b = tokens((await collect(engine, sampled("s2", 123)))[0])
    c = tokens((await collect(engine, sampled("s3", 7)))[0])
    assert a == b
    assert a != c
    # Every bit of a 64-bit seed counts: torch's CPU generator alone keeps the low 32.
    for high in (123 + 2**32, 123 - 2**63, 123 + 2**63):
        assert tokens((await collect(engine, sampled(f"s{high}", high)))[0]) != a, high
    assert tokens((await collect(engine, sampled("m1", -1)))[0]) != tokens((await collect(engine, sampled("m2", 2**63 - 1)))[0])


async def test_a_vanishing_temperature_is_greedy_and_harms_no_neighbour(engines, reference):
    # logits / 1e-45 overflows to inf and NaN probabilities; as vLLM, a
    # temperature under 1e-5 means greedy, and the batch it shares goes on.
    engine = engines()
    prompt = prompt_of(30, seed=12)
    tiny = GenerationRequest("tiny", prompt, SamplingParams(max_tokens=10, temperature=1e-45, ignore_eos=True))
    neighbour = GenerationRequest("next", prompt_of(20, seed=13), SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    tiny_out, neighbour_out = await asyncio.gather(collect(engine, tiny), collect(engine, neighbour))
    assert tokens(tiny_out[0]) == hf_greedy(reference, prompt, 10)
    assert neighbour_out[0][-1].finish_reason in ("length", "stop")


@pytest.mark.parametrize("extreme", [{"top_p": 1e-46}, {"repetition_penalty": 1e-39}])
async def test_extreme_sampling_settings_harm_no_neighbour(engines, extreme):
    """A top_p that rounds to 0 in float32, or a repetition penalty that takes
    logits to inf, used to make NaN probabilities and fail the whole batch."""
    engine = engines()
    odd = GenerationRequest("odd", prompt_of(30, seed=14), SamplingParams(max_tokens=10, temperature=1.0, seed=1,
                                                                           ignore_eos=True, **extreme))
    neighbour = GenerationRequest("next", prompt_of(20, seed=15), SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                                                                                 ignore_eos=True))
    odd_out, neighbour_out = await asyncio.gather(collect(engine, odd), collect(engine, neighbour))
    assert len(tokens(odd_out[0])) == len(tokens(neighbour_out[0])) == 10


async def test_stop_string_cuts_text(engines):
    engine = engines()
    prompt = prompt_of(12, seed=7)
    full = text((await collect(engine, greedy("full", prompt, 40)))[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    out = (await collect(engine, greedy("stopped", prompt, 40, stop=[stop])))[0]
    assert text(out) == full[: full.find(stop)]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == stop  # vLLM's stop_reason


async def test_stop_token_ids_and_eos(engines):
    engine = engines()
    prompt = prompt_of(12, seed=8)
    first_two = tokens((await collect(engine, greedy("probe", prompt, 2)))[0])
    out = (await collect(engine, greedy("stop-id", prompt, 10, stop_token_ids=[first_two[1]])))[0]
    assert tokens(out) == first_two and out[-1].finish_reason == "stop" and out[-1].stop_reason == first_two[1]
    # The same token as the model's EOS stops unless ignore_eos.
    engine.eos_ids = {first_two[0]}
    params = SamplingParams(max_tokens=10, temperature=0.0)
    out = (await collect(engine, GenerationRequest("eos", prompt, params)))[0]
    assert tokens(out) == first_two[:1] and out[-1].finish_reason == "stop" and out[-1].stop_reason is None


async def test_n_choices_share_the_prompt_blocks(engines):
    engine = engines()
    prompt = prompt_of(40, seed=9)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=2, ignore_eos=True)
    result = await collect(engine, GenerationRequest("two", prompt, params))
    assert sorted(result) == [0, 1]
    usage = [result[i][-1].usage for i in (0, 1)]
    assert all(u.completion_tokens == 8 and u.prompt_tokens == 40 for u in usage)
    assert usage[0].cached_tokens == 0 and usage[1].cached_tokens == 32
    assert tokens(result[0]) != tokens(result[1])


async def test_logprobs_match_the_model(engines, reference):
    engine = engines()
    prompt = prompt_of(15, seed=10)
    out = (await collect(engine, greedy("lp", prompt, 5, logprobs=3)))[0]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt], device=reference.device)).logits[0, -1]
    expected = torch.log_softmax(logits.float().cpu(), -1)
    first = out[0].logprobs[0]
    assert first.token_id == out[0].token_ids[0] == int(expected.argmax())
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    for o in out:
        (lp,) = o.logprobs
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0][2]) and lp.logprob <= 0
        assert [t[2] for t in lp.top] == sorted((t[2] for t in lp.top), reverse=True)


async def test_frequency_penalty_discourages_repeats(engines):
    engine = engines()
    out = (await collect(engine, greedy("pen", prompt_of(10, seed=11), 30, frequency_penalty=100.0)))[0]
    generated = tokens(out)
    assert len(set(generated)) == len(generated)


async def test_too_long_prompt_is_rejected_before_allocation(engines):
    engine = engines(device_blocks=8)
    assert engine.max_model_len == 128
    with pytest.raises(ValueError, match="at most 127"):
        async for _ in engine.generate(greedy("long", prompt_of(128), 4)):
            pass
    assert engine.stats()["blocks"]["device"]["free"] == 8


async def test_length_is_capped_by_max_model_len(engines):
    engine = engines(device_blocks=8)
    out = (await collect(engine, greedy("cap", prompt_of(120), 50)))[0]
    assert out[-1].finish_reason == "length"
    assert out[-1].usage.completion_tokens == 8


async def test_kv_events_and_cached_keys(engines):
    engine = engines()
    events = []
    engine.subscribe_kv_events(lambda kind, keys, tier: events.append((kind, list(keys), tier)))
    prompt = prompt_of(50, seed=12)
    await collect(engine, greedy("ev", prompt, 2))
    stored = [k for kind, keys, tier in events if kind == "stored" and tier == "device" for k in keys]
    expected = block_hashes(prompt, engine.block_size, engine.hash_salt)
    assert stored[: len(expected)] == expected
    assert set(expected) <= set(engine.cached_keys()["device"])


async def test_chat_template_tokens(engines, tiny_model_dir):
    from transformers import AutoTokenizer

    engine = engines()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.apply_chat_template(messages)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(expected) and all(isinstance(i, int) for i in ids)
    assert engine.hash_salt == engine.model_name


def _reference_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False, seqused_k=None, block_table=None):
    """varlen_attn's contract in plain SDPA; the paged form is refused like FA2 refuses small pages."""
    if block_table is not None:
        raise RuntimeError("paged KV needs a page size divisible by 256")
    assert window_size == (-1, 0) and enable_gqa
    out = []
    for i in range(len(cu_seq_q) - 1):
        qs = q[cu_seq_q[i] : cu_seq_q[i + 1]].transpose(0, 1)[None]
        ks = k[cu_seq_k[i] : cu_seq_k[i + 1]].transpose(0, 1)[None]
        vs = v[cu_seq_k[i] : cu_seq_k[i + 1]].transpose(0, 1)[None]
        n, m = qs.shape[2], ks.shape[2]
        pos = torch.arange(m, device=q.device)
        mask = pos[None, :] <= pos[m - n :, None]  # causal, aligned to the end
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


async def test_varlen_metadata_and_fallback(engines, reference, monkeypatch):
    """The CUDA path's metadata, checked on CPU against a reference varlen_attn."""
    from engine import attention

    monkeypatch.setattr(attention, "varlen_attn", _reference_varlen)
    monkeypatch.setattr(attention, "_varlen_ok", True)
    monkeypatch.setattr(attention, "_varlen_paged_ok", True)
    engine = engines(max_batched_tokens=48)
    engine.runner.build_varlen = True
    prompts = [prompt_of(n, seed=40 + n) for n in (5, 33, 70)]
    await collect(engine, greedy("warm", prompts[2][:40], 2))  # so one prompt starts from cached blocks
    results = await asyncio.gather(*(collect(engine, greedy(f"v{i}", p, 10)) for i, p in enumerate(prompts)))
    assert attention._varlen_ok and not attention._varlen_paged_ok
    for prompt, result in zip(prompts, results):
        assert tokens(result[0]) == hf_greedy(reference, prompt, 10)


# wa: the default policy, whose bookkeeping of re-taken blocks once left them evictable in use.
@pytest.mark.parametrize("policy", ["lru", "wa"])
async def test_mixed_traffic_under_pressure(engines, policy):
    """Shared prefixes, aborts, n=2, preemption, demotion and promotion at once: every
    surviving request gets the tokens it gets alone, and the cache view matches the pool."""
    rnd = random.Random(0)
    base = [rnd.randrange(4, 500) for _ in range(200)]
    prompts = [
        base[: rnd.choice([0, 16, 40, 64, 100])] + [rnd.randrange(4, 500) for _ in range(rnd.randrange(1, 60))]
        for _ in range(24)
    ]
    roomy = engines(device_blocks=200)
    alone = [tokens((await collect(roomy, greedy(f"r{i}", p, 20)))[0]) for i, p in enumerate(prompts)]
    engine = engines(device_blocks=14, host_blocks_multiplier=2.0, max_num_seqs=6, max_batched_tokens=40, policy=policy)

    async def one(i, prompt):
        await asyncio.sleep(rnd.random() * 0.05)
        if i % 7 == 3:  # a client that goes away after three deltas
            stream = engine.generate(greedy(f"s{i}", prompt, 20))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()
            return
        n = 2 if i % 5 == 1 else 1
        result = await collect(engine, greedy(f"s{i}", prompt, 20, n=n))
        for index in range(n):
            assert tokens(result[index]) == alone[i], (i, index)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    await engine.idle()
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["demotions"] > 0 and stats["promotions"] > 0
    pool = engine.pool
    view = engine.cached_keys()
    assert sorted(view["device"]) == sorted(k for k, b in pool.cached.items() if pool.is_device(b))
    assert sorted(view["host"]) == sorted(k for k, b in pool.cached.items() if not pool.is_device(b))


async def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engines):
    """A step that raises half-way (here: a running sequence already taken off
    the scheduler's list) fails the requests in flight with an error; the loop
    keeps going and the next request is served, instead of every later request
    hanging."""
    engine = engines(device_blocks=32)
    real_step = engine._step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:  # mid-generation
            engine.scheduler.running.pop()
            raise RuntimeError("injected")
        return real_step()

    engine._step = failing_step
    with pytest.raises(RuntimeError, match="engine step failed: injected"):
        await asyncio.wait_for(collect(engine, greedy("a", list(range(5, 40)), 20)), 30)
    engine._step = real_step
    out = await asyncio.wait_for(collect(engine, greedy("b", list(range(5, 40)), 4)), 30)
    assert len(tokens(out[0])) == 4


async def test_engine_seed_makes_unseeded_requests_repeat_from_one_run_to_the_next(engines):
    """vLLM's --seed: requests that give no seed are seeded from engine.seed, so the
    same requests in the same order sample alike in another process; another
    engine.seed samples otherwise, and so does each request of a run."""
    prompt = prompt_of(20, seed=6)

    async def run(engine) -> list[list[list[int]]]:
        params = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True, n=2)
        out = []
        for i in range(3):
            choices = await collect(engine, GenerationRequest(f"u{i}", prompt, params))
            out.append([tokens(choices[0]), tokens(choices[1])])
        return out

    first, again, other = await run(engines(seed=5)), await run(engines(seed=5)), await run(engines(seed=6))
    assert first == again and first != other
    samples = [choice for request in first for choice in request]
    assert len({tuple(choice) for choice in samples}) == len(samples)  # every choice of every request its own


async def test_queued_sequences_count_every_choice_of_every_request(engines):
    """kvgate_engine_requests{state} and the load a gateway prices an engine by count
    sequences (a request of n choices is n): the n-1 siblings waiting for their first
    choice's prefill, parked on it, were in no count (8 requests of n=4 read 11, not 32)."""
    from tests.engine_procs import wait_for
    from tests.gateway_helpers import hung_model_steps

    engine = engines(max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3)
    with hung_model_steps(engine):
        tasks = [asyncio.create_task(collect(engine, GenerationRequest(f"n{i}", prompt_of(20, seed=i), params)))
                 for i in range(3)]
        await asyncio.sleep(0)  # submitted, not yet taken in: all n of each
        for taken_in in (False, True):
            if taken_in:  # by the worker, whose step then hangs: first choices queued, siblings parked
                await wait_for(lambda: not engine._pending_adds, what="the requests taken in")
            stats, load = engine.stats(), engine.load()
            assert stats["running"] + stats["waiting"] == 9 == load["running"] + load["waiting"], taken_in
    outputs = await asyncio.gather(*tasks)
    assert all(len(choices) == 3 for choices in outputs)


async def test_a_seed_whose_choices_overflow_64_bits_is_refused(engines):
    """Choice i is seeded with seed + i: past 2**64 - 1 torch cannot take it, so
    the request is refused up front (it used to hang its reader)."""
    engine = engines()
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, n=2)
    with pytest.raises(ValueError, match=r"seed must lie in \[-2\*\*63, 2\*\*64 - n\]"):
        await asyncio.wait_for(collect(engine, GenerationRequest("seed", [5, 6, 7], params)), 30)
    # The largest seed that fits still runs.
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 2, n=2)
    out = await asyncio.wait_for(collect(engine, GenerationRequest("seed", [5, 6, 7], params)), 30)
    assert sorted(out) == [0, 1] and all(len(tokens(v)) == 3 for v in out.values())


async def test_a_request_that_fails_to_be_taken_in_fails_its_reader_and_the_engine_serves_on(engines):
    """An exception while the loop takes a request in reaches that request's
    reader (it used to be only logged, the reader waiting forever); its state is
    dropped and later requests are served."""
    engine = engines()
    real_add = engine.scheduler.add

    def failing_add(seq, front=False):
        raise RuntimeError("injected")

    engine.scheduler.add = failing_add
    with pytest.raises(RuntimeError, match="could not take in the request: injected"):
        await asyncio.wait_for(collect(engine, greedy("a", list(range(5, 20)), 4, n=2)), 30)
    assert not engine._requests
    engine.scheduler.add = real_add
    out = await asyncio.wait_for(collect(engine, greedy("a", list(range(5, 20)), 4)), 30)
    assert len(tokens(out[0])) == 4


@pytest.mark.parametrize("policy", ["tenant-fair", "fcfs"])
async def test_a_tenants_many_choices_do_not_hold_back_another_tenant(engines, policy):
    """With every sequence slot taken by one tenant's request of many choices,
    another tenant's request that arrives next takes the next free slot
    (tenant-fair, the default), not the slot after all of the first tenant's
    choices (fcfs, as vLLM: 8.2 s against 12 ms in a review)."""
    engine = engines(max_num_seqs=2, scheduling_policy=policy)
    big = GenerationRequest("big", prompt_of(20, seed=1), SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=8,
                                                                        ignore_eos=True))
    big.context.tenant = "acme"
    small = greedy("small", prompt_of(20, seed=2), 1)
    small.context.tenant = "globex"
    finished: list[str] = []

    async def run(request):
        async for out in engine.generate(request):
            if out.finish_reason is not None:
                finished.append(f"{request.request_id}-{out.index}")

    big_task = asyncio.create_task(run(big))
    while not engine.scheduler.running:  # the big request holds the slots
        await asyncio.sleep(0.001)
    await run(small)
    await big_task
    before = finished.index("small-0")
    if policy == "tenant-fair":
        assert before <= 2  # the first free slot: at most the two choices that held them
    else:
        assert before >= 6  # behind every choice of the first request but the last two
    assert len(finished) == 9


_SEQUENCE_IDS = itertools.count(10)


def _waiting(scheduler, request_id: str, tenant: str, tokens: int):
    """A sequence of ``tokens`` prompt tokens from ``tenant``, waiting in ``scheduler``."""
    from engine.sequence import Sequence

    request = GenerationRequest(request_id, prompt_of(tokens, seed=len(request_id) + tokens))
    request.context.tenant = tenant
    seq = Sequence(next(_SEQUENCE_IDS), request, 0, scheduler.block_size, "salt")
    scheduler.add(seq)
    return seq


def test_the_fair_pick_lacking_blocks_keeps_out_no_earlier_request_that_fits():
    """A tenant with nothing running comes first, but its request that does not
    fit the free blocks yet must not stop the earlier ones that do (as first
    come, first served would run them meanwhile)."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 16, 8192, clock=lambda: 0.0, tenant_fair=True)

    def waiting(request_id: str, tenant: str, tokens: int) -> Sequence:
        return _waiting(scheduler, request_id, tenant, tokens)

    waiting("hog", "acme", bs * 58)
    scheduler.after_step(scheduler.schedule())  # acme runs one sequence on 58 of the 64 blocks
    small = [waiting(f"a{i}", "acme", 8) for i in range(4)]  # one block each, earlier
    big = waiting("b", "globex", 200)  # 13 blocks: does not fit yet, though globex runs nothing
    admitted = [seq for seq, _ in scheduler.schedule()[1:]]
    assert admitted == small and big in scheduler.waiting and len(scheduler.waiting) == 1


def test_a_fair_pick_lacking_blocks_lets_the_next_tenant_that_fits_in():
    """Tenants with nothing running, one whose request does not fit yet and one
    whose request does: the second was kept behind the first tenant's backlog too
    (first come, first served took over from the fair pick that lacked blocks).
    The earliest request of all still goes before later ones that overtake it."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 16, 8192, clock=lambda: 0.0, tenant_fair=True)
    _waiting(scheduler, "hog", "acme", bs * 58)
    scheduler.after_step(scheduler.schedule())  # acme runs one sequence on 58 of the 64 blocks
    backlog = [_waiting(scheduler, f"a{i}", "acme", bs * 2) for i in range(3)]  # two blocks each
    big = _waiting(scheduler, "b", "globex", 200)  # 13 blocks: does not fit yet
    small = _waiting(scheduler, "c", "initech", bs * 2)  # fits
    admitted = [seq for seq, _ in scheduler.schedule()[1:]]
    # initech first (nothing running, fits), then acme's earliest in the blocks left.
    assert admitted == [small, backlog[0], backlog[1]] and big in scheduler.waiting


def test_a_full_pool_with_many_tenants_waiting_tries_a_few_heads_a_step(monkeypatch):
    """Each try looks up a prompt's cached prefix: with a thousand tenants waiting
    on a full pool, every step looked up every one (2.9 ms a step, against 0.26
    before tenants' heads were tried in turn).  A few are tried, then the earliest."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 64, 8192, clock=lambda: 0.0, tenant_fair=True)
    _waiting(scheduler, "hog", "acme", bs * 58)
    scheduler.after_step(scheduler.schedule())
    earliest = _waiting(scheduler, "a1", "acme", bs * 2)
    for i in range(20):
        _waiting(scheduler, f"t{i}", f"tenant{i}", 200)  # 13 blocks each: none fits
    looked_up = []
    prefix_cost = pool.prefix_cost
    monkeypatch.setattr(pool, "prefix_cost", lambda keys: looked_up.append(keys) or prefix_cost(keys))
    admitted = [seq for seq, _ in scheduler.schedule()[1:]]
    assert admitted == [earliest] and len(looked_up) <= 8 + 1  # then the next admission's first try


@pytest.mark.parametrize("big", [6, 7, 12])
def test_the_heads_tried_a_step_move_on_so_a_tenant_that_fits_is_not_passed_over(big):
    """The bound on heads tried took the fairest few only: with seven tenants or
    more ahead whose requests did not fit, a tenant with nothing running whose
    request fitted was never tried, and the earliest request's tenant took every
    free block.  The others are tried a few at a time, each within a few tries."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 64, 8192, clock=lambda: 0.0, tenant_fair=True)
    _waiting(scheduler, "hog", "acme", bs * 50)
    scheduler.after_step(scheduler.schedule())  # 14 blocks free
    backlog = [_waiting(scheduler, f"a{i}", "acme", bs * 2) for i in range(7)]
    for i in range(big):
        _waiting(scheduler, f"t{i}", f"tenant{i}", bs * 20)  # none fits
    small = _waiting(scheduler, "c", "initech", bs * 2)
    admitted = [seq for seq, _ in scheduler.schedule()[1:]]
    assert small in admitted and admitted.index(small) <= 2 and backlog[0] in admitted


def test_fairness_preemption_looks_up_a_few_heads_a_step(monkeypatch):
    """With every slot taken, each waiting tenant's head was looked up every step
    (1,000 lookups, 3.6 ms a step, with a thousand tenants waiting)."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 4, 8192, clock=lambda: 0.0, tenant_fair=True)
    for i in range(4):
        _waiting(scheduler, f"hog{i}", "acme", bs * 14)
    scheduler.after_step(scheduler.schedule())
    for i in range(100):
        _waiting(scheduler, f"t{i}", f"tenant{i}", 480)  # 30 blocks: more than a preemption frees
    looked_up = []
    prefix_cost = pool.prefix_cost
    monkeypatch.setattr(pool, "prefix_cost", lambda keys: looked_up.append(keys) or prefix_cost(keys))
    scheduler.schedule()
    assert len(looked_up) <= 8 and scheduler.num_preemptions == 0


def test_a_tenant_holding_every_slot_gives_one_up_to_a_tenant_waiting():
    """Admission alone left a waiting tenant until the other's sequences ended (a
    review measured 13 s at max_tokens 40, minutes at 2,000): with every slot
    taken, the holder's newest sequence is preempted for it, and only while
    the two differ by two or more running sequences; never for a request whose
    blocks could not be found, which would only hand the slot back each step."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, Status

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 4, 8192, clock=lambda: 0.0, tenant_fair=True)

    def waiting(request_id: str, tenant: str, tokens: int) -> Sequence:
        return _waiting(scheduler, request_id, tenant, tokens)

    acme = [waiting(f"a{i}", "acme", 40) for i in range(4)]
    scheduler.after_step(scheduler.schedule())
    assert scheduler.running == acme
    # globex's request needs more blocks than are free even with one acme sequence's: it waits.
    huge = waiting("huge", "globex", bs * 60)
    scheduler.after_step(scheduler.schedule())
    assert scheduler.running == acme and huge in scheduler.waiting
    scheduler.finish(huge, "abort")
    small = waiting("small", "globex", 8)
    scheduled = scheduler.schedule()
    assert small.status is Status.RUNNING and [seq for seq, _ in scheduled][-1] is small
    assert acme[3].status is Status.WAITING and scheduler.num_preemptions == 1  # the newest gave way
    scheduler.after_step(scheduled)
    # 3 against 1: nothing more to even out while globex has nothing else waiting.
    scheduler.after_step(scheduler.schedule())
    assert scheduler.num_preemptions == 1 and acme[3] in scheduler.waiting


def test_no_sequence_gives_way_for_blocks_it_shares_with_others():
    """The newest sequence gives way only if its blocks then cover the waiting
    request: the blocks it shares (its tenant's system prompt, held by the others
    too) do not come free.  Counted as freed, they let it be preempted for a
    request that then could not start, so it went back in, and was preempted
    again at the next step: a preemption every step, the waiting one no sooner in."""
    from engine.block_pool import BlockPool
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    bs = 16
    pool = BlockPool(64, 0, "lru")
    scheduler = Scheduler(pool, bs, 4, 8192, clock=lambda: 0.0, tenant_fair=True)
    system = prompt_of(10 * bs, seed=1)  # ten blocks every acme sequence shares

    def waiting(request_id: str, tenant: str, prompt: list[int]) -> Sequence:
        request = GenerationRequest(request_id, prompt)
        request.context.tenant = tenant
        seq = Sequence(next(_SEQUENCE_IDS), request, 0, bs, "salt")
        scheduler.add(seq)
        return seq

    def step() -> None:
        batch = scheduler.schedule()
        scheduler.after_step(batch)
        for seq, _ in batch:
            if seq.num_computed == seq.num_tokens:
                seq.append(7)  # a token sampled

    acme = [waiting("a0", "acme", system + [1] * 8)]
    step()
    acme += [waiting(f"a{i}", "acme", system + [i + 1] * 8) for i in range(1, 4)]
    step()
    assert scheduler.running == acme and len(acme[3].block_table) == 11
    # 55 blocks: 50 free, and one more from acme's newest (ten of its eleven are shared).
    waiting("g", "globex", [3] * (55 * bs - 5))
    for _ in range(6):
        step()
    assert scheduler.num_preemptions == 0 and scheduler.running == acme


def test_the_engine_limits_torchs_cpu_kernel_caches_unless_the_operator_set_them(tiny_model_dir, monkeypatch):
    """oneDNN keeps a compiled kernel per matmul shape (up to 1,024 in each of two
    caches): the engine sets smaller limits before its model loads, since its
    steps' shapes vary with every prompt (bench/engine_memory.py: ~600 MB less on
    the tiny model), and keeps an operator's own."""
    from engine.async_engine import KERNEL_CACHE_LIMITS

    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    make_engine(tiny_model_dir)
    assert os.environ["LRU_CACHE_CAPACITY"] == KERNEL_CACHE_LIMITS["LRU_CACHE_CAPACITY"] == "1"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_a_loaded_engine_says_what_it_runs_and_its_kv_cache(tiny_model_dir, caplog):
    """The first thing an operator checks in a new pod's log, as vLLM prints it:
    the model, device and dtype, and the KV cache it got.  Start-up said only
    how many objects it moved out of the garbage collector's scans."""
    import logging

    with caplog.at_level(logging.INFO, logger="engine.async_engine"):
        make_engine(tiny_model_dir, device_blocks=64, host_blocks_multiplier=2.0, block_size=16, max_num_seqs=4)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in")]
    assert re.fullmatch(
        rf"engine ready in \d+\.\d s: \S+ \({DEVICE}, float32\) from {re.escape(tiny_model_dir)}; KV 64 device blocks "
        r"\(\d+\.\d\d GiB\) \+ 128 host blocks \(\d+\.\d\d GiB\) of 16 tokens; max_model_len \d+, max_num_seqs 4, "
        r"eviction lru", line), line
