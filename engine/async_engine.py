"""The async engine: requests in, streamed token deltas out.

All engine state (scheduler, block pool, KV tensors) is touched by exactly one
piece of code at a time: model steps run in a single worker thread while the
event loop waits for them, and new requests, aborts and KV events are applied
on the event loop thread *between* steps.  So no locks, and KV-event callbacks
always run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from engine import memory
from engine.block_pool import DEVICE, HOST, BlockPool
from engine.chat_tokens import ChatTokenizer
from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from engine.kv_cache import HOST_KV_FRACTION, HOST_KV_FRACTION_OF_LIMIT, KVCache, KVShape, size_device_blocks, size_host_blocks
from engine.model_loader import LoadedModel, load_model
from engine.request import EngineFailed, GenerationOutput, GenerationRequest, Usage, coalesce, one_at_a_time
from engine.runner import ModelRunner
from engine.sampling import SequenceSampler, sample_batch
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.token_pieces import TokenPieces

log = logging.getLogger(__name__)

KVEventCallback = Callable[[str, list[int], str], None]


@dataclass(slots=True)
class _RequestState:
    request: GenerationRequest
    queue: asyncio.Queue
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)
    unfinished: int = 0


def _kv_key(engine_cfg: EngineConfig, host_blocks: int) -> tuple[str, str]:
    """The setting that sized the KV tiers (its line is the one an error points
    at) and the words naming every one that did, for an error that says what to change."""
    key = "engine.device_blocks" if engine_cfg.device_blocks else "engine.kv_memory_fraction"
    return key, f"{key} (and engine.host_blocks_multiplier)" if host_blocks else key


def _kv_blocks(shape: KVShape, device_blocks: int, host_blocks: int) -> str:
    tiers = " + ".join(f"{n:,} {tier}" for n, tier in ((device_blocks, "device"), (host_blocks, "host")) if n)
    return f"{tiers} blocks of {shape.bytes_per_block / 2**10:,.0f} KiB"


def _check_kv_room(shape: KVShape, device: torch.device, device_blocks: int, host_blocks: int,
                   engine_cfg: EngineConfig) -> None:
    """Refuse KV tiers that cannot fit, as one line naming the setting (the
    allocator's RuntimeError, or on CPU the OOM killer, would not): with a GPU
    the device tier in its free memory and the host tier in RAM; on CPU both in RAM."""
    per_block = shape.bytes_per_block
    if device.type == "cuda":
        tiers = [(_kv_key(engine_cfg, 0), device_blocks, 0, torch.cuda.mem_get_info(device)[0], "GPU memory is free"),
                 (("engine.host_blocks_multiplier",) * 2, 0, host_blocks, memory.available_ram(), "RAM is available")]
    else:
        tiers = [(_kv_key(engine_cfg, host_blocks), device_blocks, host_blocks, memory.available_ram(),
                  "RAM is available")]
    for (key, keys), on_device, on_host, room, what in tiers:
        need = (on_device + on_host) * per_block
        if need > room:
            raise ConfigError(f"{keys}: {_kv_blocks(shape, on_device, on_host)} need {need / 2**30:,.1f} GiB; "
                              f"{room / 2**30:,.1f} GiB of {what}", key)


# On a CPU with native bf16, torch's matmuls compile a oneDNN kernel per input
# shape and keep up to 1,024 in each of two caches; a step packs all its tokens
# into one row, whose length changes with nearly every prompt, so a CPU engine
# grew by ~600 MB of kernels.  These limits keep it near its loaded size at no
# measured cost on the bundled model (bench/engine_memory.py, bench/RESULTS.md).
# Read when the first such kernel runs: set before the model loads, they are in time.
KERNEL_CACHE_LIMITS = {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


class AsyncEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        engine_cfg: EngineConfig | None = None,
        cache_cfg: CacheConfig | None = None,
        max_model_len: int = 2048,
        tokenize_cache_tokens: int = 2_000_000,
    ) -> None:
        engine_cfg = engine_cfg or EngineConfig()
        cache_cfg = cache_cfg or CacheConfig()
        self.loaded = loaded
        self.engine_cfg = engine_cfg
        # Seeds for requests that give none, from engine.seed (vLLM's --seed): the
        # same requests taken in the same order sample alike from one run to the next.
        self._seeds = random.Random(engine_cfg.seed)
        self.chat_tokens = ChatTokenizer(loaded.tokenizer, tokenize_cache_tokens)
        self.token_pieces = TokenPieces(loaded.tokenizer)  # logprobs' token texts, shared by every sampler
        config = loaded.model.config
        bs = engine_cfg.block_size
        shape = KVShape.from_model_config(config, bs, loaded.dtype)
        # Beyond a few times what max_num_seqs full-length sequences hold, extra
        # CPU blocks only cost zeroed RAM (the host tier keeps the long tail).
        cpu_cap = 4 * engine_cfg.max_num_seqs * -(-max_model_len // bs)
        device_blocks = engine_cfg.device_blocks or size_device_blocks(
            shape, loaded.device, engine_cfg.kv_memory_fraction, engine_cfg.host_blocks_multiplier, cpu_cap
        )
        host_blocks, capped = size_host_blocks(shape, loaded.device, device_blocks, engine_cfg.host_blocks_multiplier)
        if capped:
            log.info("host KV tier capped at %d blocks (%.1f GiB of pinned RAM: a power of two within %d%% of the RAM "
                     "available, %d%% of a container limit's room) instead of %gx the device tier's %d", host_blocks,
                     host_blocks * shape.bytes_per_block / 2**30, HOST_KV_FRACTION * 100,
                     HOST_KV_FRACTION_OF_LIMIT * 100, engine_cfg.host_blocks_multiplier, device_blocks)
        _check_kv_room(shape, loaded.device, device_blocks, host_blocks, engine_cfg)
        self._events: list[tuple[str, list[int], str]] = []
        self.pool = BlockPool(
            device_blocks, host_blocks, cache_cfg.policy, cache_cfg, record_copies=True, on_event=self._on_pool_event
        )
        try:
            self.kv = KVCache(shape, device_blocks, host_blocks, loaded.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            # Past the check above (memory taken meanwhile, a limit it cannot see):
            # still the setting to change, not an allocator's traceback.
            key, keys = _kv_key(engine_cfg, host_blocks)
            raise ConfigError(f"{keys}: cannot allocate the KV cache ({_kv_blocks(shape, device_blocks, host_blocks)}): "
                              f"{str(exc).splitlines()[0]}", key) from None
        # One sequence must always fit in the device tier, or preemption could never make room.
        limits = [max_model_len, getattr(config, "max_position_embeddings", max_model_len), device_blocks * bs]
        self._max_model_len = min(limits)
        if self._max_model_len < max_model_len:
            log.warning("max_model_len lowered to %d (model or KV pool limit)", self._max_model_len)
        self.scheduler = Scheduler(self.pool, bs, engine_cfg.max_num_seqs, engine_cfg.max_batched_tokens,
                                   tenant_fair=engine_cfg.scheduling_policy == "tenant-fair")
        self.runner = ModelRunner(loaded.model, self.kv, bs, loaded.device, self._max_model_len)
        self.eos_ids = _eos_ids(loaded)
        self._requests: dict[str, _RequestState] = {}
        self._pending_adds: list[_RequestState] = []
        # Siblings of n > 1 waiting on their first choice's prefill, in no queue (Sequence.forks).
        self._parked = 0
        self._pending_aborts: list[_RequestState] = []
        self._subscribers: list[KVEventCallback] = []
        # The keys each tier holds, as the delivered events say: a dict per tier
        # (insertion-ordered, copied to a list at C speed for a snapshot).
        self._cached_view: dict[str, dict[int, None]] = {DEVICE: {}, HOST: {}}
        self._next_seq_id = 0
        self._in_flight = False
        self._step_started: float | None = None  # monotonic start of the step under way
        # Model steps that ran to their end: a replica's failures with none
        # between them are failures in a row (gateway.replicas.InProcessReplica).
        self.good_steps = 0
        self._last_stats: dict | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._stopping = False

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig | None = None,
        engine_cfg: EngineConfig | None = None,
        cache_cfg: CacheConfig | None = None,
    ) -> "AsyncEngine":
        """Load the model (blocking; seconds) and size the KV pool."""
        model_cfg = model_cfg or ModelConfig()
        engine_cfg = engine_cfg or EngineConfig()
        for name, value in KERNEL_CACHE_LIMITS.items():
            os.environ.setdefault(name, value)  # an operator's own setting wins
        if engine_cfg.threads:
            torch.set_num_threads(engine_cfg.threads)
        torch.manual_seed(engine_cfg.seed)
        began = time.monotonic()
        engine = cls(load_model(model_cfg), engine_cfg, cache_cfg, model_cfg.max_model_len,
                     model_cfg.tokenize_cache_tokens)
        engine.log_ready(time.monotonic() - began)
        return engine

    def log_ready(self, load_s: float) -> None:
        """What an operator checks first in a new pod's log: which model, where,
        and how much KV cache it got (vLLM says as much at start)."""
        loaded, kv, cfg = self.loaded, self.kv, self.engine_cfg
        per_block = kv.shape.bytes_per_block
        host = (f" + {kv.num_host} host blocks ({kv.num_host * per_block / 2**30:.2f} GiB)"
                if kv.num_host else "")
        log.info("engine ready in %.1f s: %s (%s, %s) from %s; KV %d device blocks (%.2f GiB)%s of %d tokens; "
                 "max_model_len %d, max_num_seqs %d, eviction %s", load_s, loaded.name, loaded.device,
                 str(loaded.dtype).removeprefix("torch."), loaded.source, kv.num_device,
                 kv.num_device * per_block / 2**30, host, cfg.block_size, self._max_model_len, cfg.max_num_seqs,
                 self.pool.policy_name)

    # ---- properties the gateway reads --------------------------------------

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def block_size(self) -> int:
        return self.engine_cfg.block_size

    @property
    def hash_salt(self) -> str:
        """Salt of the block hash chain (engine.block_hash); the router must use the same."""
        return self.loaded.name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def apply_chat_template(self, messages: list[dict], namespace: str = "") -> list[int]:
        """The exact prompt tokens the engine sees for a chat request (``namespace``:
        the tenant's cache salt, which keeps its cached pieces apart)."""
        return self.chat_tokens.encode_chat(messages, namespace)

    # ---- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = False
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvgate-engine")
        self._task = asyncio.create_task(self._run(), name="kvgate-engine-loop")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        self._stopping = True
        self._wakeup.set()
        try:
            # Shielded: cancelled here (a timeout, a second signal), the loop would be
            # cancelled under a step the worker thread is still running, and the
            # aborts below would free that step's blocks while it writes to them.
            await asyncio.shield(self._task)
        finally:
            if not self._task.done():
                await asyncio.wait((self._task,))  # the step under way ends; cancellation resumes below
            self._task = None
            for state in list(self._requests.values()):
                self._abort_now(state)
            # Taken in or aborted above: nothing left for a later start to apply
            # (an abort queued for an id a new request may reuse then).
            self._pending_adds.clear()
            self._pending_aborts.clear()
            self._flush_events()
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- requests ------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream the outputs of ``request``: deltas per choice, then its finish reason and usage.

        Closing the iterator early aborts the request and frees its blocks.
        """
        return one_at_a_time(self._batches(request, merge=False))

    def generate_batches(self, request: GenerationRequest) -> AsyncIterator[list[GenerationOutput]]:
        """``generate``'s outputs grouped: each list holds what is ready at that
        moment, one output per choice (``coalesce``: its deltas joined).

        A consumer that falls behind the engine (a busy gateway) gets the
        backlog in one piece and can send it as one frame per choice, as vLLM's
        output collector merges what a slow reader has not taken yet.  Closing
        the iterator early aborts the request and frees its blocks.
        """
        return self._batches(request, merge=True)

    async def _batches(self, request: GenerationRequest, merge: bool) -> AsyncIterator[list[GenerationOutput]]:
        self._validate(request)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        await self.start()
        queue: asyncio.Queue = asyncio.Queue()
        state = _RequestState(request, queue, time.monotonic(), unfinished=request.sampling.n)
        self._requests[request.request_id] = state
        self._pending_adds.append(state)
        self._wakeup.set()
        done = 0
        try:
            while done < request.sampling.n:
                item = await queue.get()
                batch = []
                while True:
                    if isinstance(item, BaseException):
                        if batch:
                            yield coalesce(batch) if merge else batch  # what came before the failure
                        raise item
                    if item.finish_reason is not None:
                        done += 1
                    batch.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                yield coalesce(batch) if merge else batch
        finally:
            if done < request.sampling.n:
                # This request's own state: a reader closed after its request ended
                # must not abort a newer one that took its id since.
                self._abort(state)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (now, or right after the step in flight)."""
        state = self._requests.get(request_id)
        if state is not None:
            self._abort(state)

    def unstarted(self) -> list[str]:
        """The senders' names (GenerationRequest.sent_as) of the requests no step has
        started: queued, or not yet taken in.  A stopping engine lists them for its
        gateways, which may have another replica for them (RemoteReplica)."""
        # first_scheduled is set by the step thread: one that a step in flight has
        # just taken in may be listed all the same (its prefill here is then lost
        # if another replica answers it first).
        return [state.request.sent_as for state in list(self._requests.values())
                if state.request.sent_as is not None and all(seq.first_scheduled is None for seq in state.seqs)]

    def _abort(self, state: _RequestState) -> None:
        if self._in_flight:
            self._pending_aborts.append(state)
        else:
            self._abort_now(state)
            self._flush_events()

    async def idle(self) -> None:
        """Wait until nothing is running or waiting (tests, graceful drain)."""
        await self.start()
        self._wakeup.set()
        while self._in_flight or self._pending_adds or self._pending_aborts or self.scheduler.has_work():
            self._idle.clear()
            await self._idle.wait()

    def _validate(self, request: GenerationRequest) -> None:
        count = len(request.prompt_token_ids)
        limit = self._max_model_len - 1
        if count == 0:
            raise ValueError("the prompt is empty")
        if count > limit:
            raise ValueError(
                f"the prompt has {count} tokens; this engine accepts at most {limit} "
                f"(max_model_len {self._max_model_len} minus one generated token)"
            )
        vocab = self.loaded.model.config.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        s = request.sampling
        if s.n < 1 or s.max_tokens < 1:
            raise ValueError(f"n and max_tokens must be >= 1 (got n={s.n}, max_tokens={s.max_tokens})")
        if not 0 < s.top_p <= 1 or s.top_k < 0 or s.temperature < 0:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0 and temperature >= 0")
        if s.logprobs is not None and s.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (got {s.logprobs})")
        if s.logit_bias and (min(s.logit_bias) < 0 or max(s.logit_bias) >= vocab):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        if s.stop_token_ids and (min(s.stop_token_ids) < 0 or max(s.stop_token_ids) >= vocab):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        if not 0 <= s.min_p <= 1 or s.repetition_penalty <= 0 or not 0 <= s.min_tokens <= s.max_tokens:
            raise ValueError("need 0 <= min_p <= 1, repetition_penalty > 0 and 0 <= min_tokens <= max_tokens")
        # Choice i is seeded with seed + i, in 64 bits (a negative seed wraps; sampling.generator_seed).
        if s.seed is not None and not -(2**63) <= s.seed <= 2**64 - s.n:
            raise ValueError(f"seed must lie in [-2**63, 2**64 - n] so that seed + choice index fits in 64 bits "
                             f"(got seed={s.seed}, n={s.n})")

    # ---- the loop (event loop thread) -----------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            try:
                self._apply_pending()
            except Exception:  # noqa: BLE001 - one request's bookkeeping must not stop the loop
                log.exception("engine bookkeeping failed")
            if not self.scheduler.has_work():
                self._flush_events()
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._in_flight = True
            self._step_started = time.monotonic()
            try:
                outputs = await self._watched(loop.run_in_executor(self._executor, self._step))
                self.good_steps += 1
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                outputs = []
                self._fail_all(exc)
            finally:
                self._in_flight = False
                self._step_started = None
            self._flush_events()
            self._deliver(outputs)
        self._idle.set()

    async def _watched(self, step: asyncio.Future) -> list[GenerationOutput]:
        """The step's outputs; a step past engine.step_timeout_s is said in the log
        once, and its end too: /health answers 503 meanwhile, and an operator
        (or a liveness probe's restart) should learn why from the log."""
        limit = self.engine_cfg.step_timeout_s
        if not limit:
            return await step
        done, _ = await asyncio.wait((step,), timeout=limit)
        if done:
            return step.result()
        running = len(self.scheduler.running)
        log.error("a model step has run for %g s, past engine.step_timeout_s, with %d %s in it: the engine is hung "
                  "(a stuck kernel or device?); /health answers 503 until the step ends", limit, running,
                  "sequence" if running == 1 else "sequences")
        try:
            return await step
        finally:
            if step.done():  # not when the engine is stopping under it
                log.warning("the stalled model step ended after %.1f s", self.step_running_s())

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for state in adds:
            # This very request, not only its id: one aborted before the loop
            # took it in may have had its id reused by a new request since.
            if self._requests.get(state.request.request_id) is state:
                try:
                    self._add(state)
                except Exception as exc:  # noqa: BLE001 - fail this request, not its reader's wait
                    log.exception("could not take in request %s", state.request.request_id)
                    self._fail_add(state, exc)
        aborts, self._pending_aborts = self._pending_aborts, []
        for state in aborts:
            self._abort_now(state)

    def _add(self, state: _RequestState) -> None:
        request = state.request
        unseeded = self._seeds.getrandbits(63) if request.sampling.seed is None else None
        for index in range(request.sampling.n):
            seq = Sequence(self._next_seq_id, request, index, self.block_size, self.hash_salt)
            self._next_seq_id += 1
            seq.sampler = SequenceSampler(request.sampling, self.tokenizer, request.prompt_token_ids, self.eos_ids, index,
                                          self.token_pieces, unseeded)
            state.seqs.append(seq)
        first, *forks = state.seqs
        # Siblings wait until the first choice has computed (and published) the
        # prompt, then take its blocks from the prefix cache.
        first.forks = forks
        self.scheduler.add(first)
        self._parked += len(forks)

    def _fail_add(self, state: _RequestState, exc: Exception) -> None:
        """Drop a request whose intake raised and hand the error to its reader."""
        for seq in state.seqs:
            try:
                self.scheduler.finish(seq, "abort")  # no-op bookkeeping if it never reached the scheduler
            except Exception:  # noqa: BLE001
                log.exception("could not release the blocks of %s", state.request.request_id)
                seq.status, seq.block_table = Status.FINISHED, []
        del self._requests[state.request.request_id]
        error = EngineFailed("engine could not take in the request", exc)
        error.__cause__ = exc
        state.queue.put_nowait(error)

    def _abort_now(self, state: _RequestState) -> None:
        request_id = state.request.request_id
        if self._requests.get(request_id) is not state:
            return  # ended already (its id may be a newer request's now)
        del self._requests[request_id]
        if not state.seqs:
            # Aborted before the loop took it in: no sequences yet, but its reader
            # still waits for every choice to end.
            for index in range(state.request.sampling.n):
                usage = Usage(len(state.request.prompt_token_ids), 0, 0)
                state.queue.put_nowait(GenerationOutput(request_id, index, [], "", finish_reason="abort", usage=usage))
            return
        self._unpark(state.seqs[0])
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                state.queue.put_nowait(self._final(seq, GenerationOutput(request_id, seq.index, [], ""), "abort"))

    def _unpark(self, first: Sequence) -> None:
        """``first``'s siblings leave the count of those waiting on its prefill
        (queued now, or ended with it)."""
        self._parked -= len(first.forks)
        first.forks = []

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request after a step raised; the loop serves on.  A
        sequence the failed step left half-updated is dropped even if its blocks
        cannot be given back (logged): a hung engine would be worse."""
        for request_id, state in list(self._requests.items()):
            if state.seqs:
                self._unpark(state.seqs[0])
            for seq in state.seqs:
                try:
                    self.scheduler.finish(seq, "abort")
                except Exception:  # noqa: BLE001
                    log.exception("could not release the blocks of %s after the failed step", request_id)
                    seq.status, seq.block_table = Status.FINISHED, []
            state.queue.put_nowait(EngineFailed("engine step failed", exc))
            del self._requests[request_id]

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            state.queue.put_nowait(out)
            if out.finish_reason is not None:
                state.unfinished -= 1
                if state.unfinished == 0:
                    del self._requests[out.request_id]

    # ---- one step (worker thread) ---------------------------------------------

    def _step(self) -> list[GenerationOutput]:
        batch = self.scheduler.schedule()
        for seq, count in batch:
            if seq.index == 0 and seq.num_computed < seq.num_prompt_tokens:  # a prompt chunk (GenerationRequest)
                request = seq.request
                reached = min(seq.num_computed + count, seq.num_prompt_tokens)
                request.scheduled_prompt_tokens = max(request.scheduled_prompt_tokens or 0, reached)
        # Demotions and promotions recorded while scheduling must land before the forward.
        self.kv.apply_copies(self.pool.drain_copies())
        if not batch:
            return []
        logits, seqs = self.runner.run(batch)
        self.scheduler.after_step(batch)
        outputs = []
        if logits is not None:
            results = sample_batch(logits, [seq.sampler for seq in seqs])
            outputs = [self._accept(seq, token, logprob) for seq, (token, logprob) in zip(seqs, results)]
        for seq, _ in batch:
            if seq.forks and seq.num_computed >= seq.num_prompt_tokens:
                for fork in reversed(seq.forks):
                    self.scheduler.add(fork, front=True)
                self._unpark(seq)
        return outputs

    def _accept(self, seq: Sequence, token: int, logprob) -> GenerationOutput:
        first = seq.num_tokens == seq.num_prompt_tokens
        seq.append(token)
        text, finish = seq.sampler.accept(token, seq.num_tokens, self._max_model_len)
        if (logprob is not None and finish == "stop" and seq.sampler.is_end_token(token)
                and not seq.sampler.params.include_stop_str_in_output):
            # The end token is not part of the text; OpenAI's logprobs cover the text's tokens only.
            logprob = None
        out = GenerationOutput(seq.request_id, seq.index, [token], text, [logprob] if logprob is not None else None)
        if first and seq.index == 0:
            # The request's figures, once: its other choices start from this one's
            # prompt (a remote engine's stream carries them once too, as headers).
            if seq.first_scheduled is not None:
                out.queue_time_s = max(0.0, seq.first_scheduled - self._requests_arrival(seq))
            out.cached_tokens = seq.cached_tokens
        if finish is not None:
            self.scheduler.finish(seq, finish)
            self._final(seq, out, finish)
        return out

    def _requests_arrival(self, seq: Sequence) -> float:
        state = self._requests.get(seq.request_id)
        return state.arrival if state is not None else seq.first_scheduled

    def _final(self, seq: Sequence, out: GenerationOutput, reason: str) -> GenerationOutput:
        out.finish_reason = reason
        if reason == "stop" and seq.sampler is not None:
            out.stop_reason = seq.sampler.stop_reason
        out.usage = Usage(seq.num_prompt_tokens, len(seq.output_ids), seq.cached_tokens or 0)
        return out

    # ---- KV events and stats ---------------------------------------------------

    def _on_pool_event(self, kind: str, keys: list[int], tier: str) -> None:
        # Called wherever the pool changes (worker thread during a step); delivered later.
        self._events.append((kind, keys, tier))

    def _flush_events(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        batches: list[tuple[str, list[int], str]] = []
        for kind, keys, tier in events:
            view = self._cached_view.setdefault(tier, {})
            if kind == "stored":
                view.update(dict.fromkeys(keys))
            else:
                for key in keys:
                    view.pop(key, None)
            if batches and batches[-1][0] == kind and batches[-1][2] == tier:
                batches[-1][1].extend(keys)
            else:
                batches.append((kind, list(keys), tier))
        for callback in list(self._subscribers):
            for kind, keys, tier in batches:
                try:
                    callback(kind, keys, tier)
                except Exception:  # noqa: BLE001 - a bad subscriber must not stop the engine
                    log.exception("KV event subscriber failed")

    def subscribe_kv_events(self, callback: KVEventCallback) -> Callable[[], None]:
        """``callback(kind, keys, tier)`` on the event loop thread; kind "stored"|"removed",
        tier "device"|"host".  Returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def cached_keys(self) -> dict[str, list[int]]:
        """Block keys cached now, by tier, consistent with the events delivered so far.
        (A copy at C speed: a snapshot for a gateway, of up to millions of keys, is
        taken on the event loop.)"""
        return {tier: list(view) for tier, view in self._cached_view.items()}

    def step_running_s(self) -> float:
        """How long the model step under way has run; 0 between steps.  Read by
        /health (the event loop answers it whatever the step's thread does)."""
        started = self._step_started
        return time.monotonic() - started if started is not None else 0.0

    def load(self) -> dict:
        """What a gateway prices a replica by, O(1) for every health probe: the
        requests this engine holds (every client's; a request of n choices is one),
        its sequences running and waiting, and the device KV usage (blocks held by
        requests, as vLLM's kv_cache_usage_perc).  Read while the worker steps,
        like ``stats``: counts may be mid-step."""
        pool = self.pool
        return {
            "requests": len(self._requests),
            "running": len(self.scheduler.running),
            "waiting": self._waiting_sequences(),
            "kv_usage": pool.num_in_use() / pool.num_device if pool.num_device else 0.0,
        }

    def stats(self) -> dict:
        """Pool, cache and queue figures.

        During a step the counts are read while the worker changes them (list
        reads are safe; the figures may be mid-step); if the policy's state is
        being resized right then, the previous figures are returned.
        """
        try:
            self._last_stats = self._compute_stats()
        except RuntimeError:  # "changed size during iteration" in a policy's state()
            if self._last_stats is None:
                raise
        return self._last_stats

    def _waiting_sequences(self) -> int:
        """Sequences not running: those queued, all n of each request not yet taken
        in, and the siblings of a first choice whose prefill they wait for (n > 1:
        parked on it, in no queue; left out, n=4 requests read as one sequence each)."""
        pending = sum(state.request.sampling.n for state in list(self._pending_adds))
        return len(self.scheduler.waiting) + self._parked + pending

    def _compute_stats(self) -> dict:
        pool = self.pool
        nd = pool.num_device
        device = {"total": nd, "free": 0, "cached": 0, "in_use": 0}
        for block in range(nd):
            if pool.ref_count[block]:
                device["in_use"] += 1
            elif pool.block_key[block] is not None:
                device["cached"] += 1
            else:
                device["free"] += 1
        host_cached = sum(1 for key in pool.block_key[nd:] if key is not None)
        host = {"total": pool.num_host, "free": pool.num_host - host_cached, "cached": host_cached, "in_use": 0}
        sched = self.scheduler
        return {
            "model": self.model_name,
            "block_size": self.block_size,
            "blocks": {DEVICE: device, HOST: host},
            "evictions": {DEVICE: pool.stats.device_evictions, HOST: pool.stats.host_evictions},
            "demotions": pool.stats.demotions,
            "promotions": pool.stats.promotions,
            "swap_bytes": {"device_to_host": self.kv.bytes_to_host, "host_to_device": self.kv.bytes_to_device},
            "prefix_cache": {"query_tokens": sched.prefix_query_tokens, "hit_tokens": sched.prefix_hit_tokens},
            "running": len(sched.running),
            "waiting": self._waiting_sequences(),
            "preemptions": sched.num_preemptions,
            "policy_name": pool.policy_name,
            "policy": pool.device_policy.state(sched.clock()),
        }


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    gen = getattr(loaded.model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    return ids
