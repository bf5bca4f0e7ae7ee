"""Sending engine requests to replicas: route, count in flight, retry, observe.

For each engine request (``Sub``) the router picks a replica; its in-flight
load is counted before the request is sent and released on every exit; a
replica that fails before its first output is excluded and another one tried;
a request a stopping `kvgate engine` had not started is offered to another
(the first of the two to answer serves it), and when no replica is in routing,
engines still stopping take new requests as a last resort (for their
server.shutdown_delay_s, until each port refuses a connection);
the engine iterator is closed on every exit, which aborts the engine work when
the client has gone.  What the replica reports on the way (tokens, usage,
queue time) feeds the request metrics and the observer.  The caller (the
response shapers in gateway/respond.py) only sees batches of outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from engine.context import RequestContext
from engine.request import EngineFailed, GenerationOutput, GenerationRequest, Usage, coalesce
from gateway import errors
from gateway.errors import bad_request
from gateway.metrics import GatewayMetrics, RequestSeries
from gateway.observe import Finished, Observer
from gateway.prefix import Prompt
from gateway.protocol import ParsedRequest, new_id
from gateway.quarantine import LostPrompts
from gateway.replicas import (
    Job,
    OfferedElsewhere,
    Replica,
    ReplicaAnswerFailed,
    ReplicaBusy,
    ReplicaLost,
    ReplicaStopping,
    ReplicaUnavailable,
    UpstreamError,
    engine_failure,
)
from gateway.router import Decision, Router
from gateway.upstream import USAGE_ALL
from gateway.usage import UsageSum

log = logging.getLogger(__name__)

# What ``Dispatcher.outputs`` yields when a non-streaming request's replica failed
# after some output: the sub-request starts over on another replica, and what it
# delivered so far is to be dropped.  (Nothing of it had reached the client.)
RESTART: list[GenerationOutput] = []


@dataclass(slots=True)
class Sub:
    """One engine request of a client request (completions may carry several prompts)."""

    prompt: Prompt
    source: object  # the prompt as the client sent it (for external replicas)
    context: RequestContext
    shift: int  # choice index offset of this prompt's choices
    max_tokens: int  # resolved for this prompt: a default fills the room its own length leaves
    replica: str = ""  # the replica serving it now (set by the dispatcher), for latency series
    fills_room: bool = False  # max_tokens is a default that fills the context's room (see Job)


class Dispatcher:
    """Runs a client request's engine requests on the replicas the router picks."""

    def __init__(self, router: Router, replicas: list[Replica], metrics: GatewayMetrics, observer: Observer) -> None:
        self.router = router
        self.replicas = replicas
        self.metrics = metrics
        self.observer = observer
        # Each replica keeps one index object for its life (reset in place).
        self._indexes = [r.index for r in replicas]
        # Prompts that bring replicas down, refused for a while (gateway/quarantine.py).
        self._lost = LostPrompts(lambda: router.cfg)

    def run(self, subs: list[Sub], parsed: ParsedRequest) -> tuple[AsyncIterator, bool]:
        """The outputs of all ``subs`` and whether there is a single one.

        One sub-request (the common case) yields its batches directly; several
        yield (choice shift, batch) groups (``merged``).  The caller closes it.
        """
        if len(subs) == 1:
            return self.outputs(subs[0], parsed), True
        return self.merged(subs, parsed), False

    async def outputs(self, sub: Sub, parsed: ParsedRequest) -> AsyncIterator[list[GenerationOutput]]:
        """One sub-request's outputs from the replica the router picks, in the
        batches the replica delivers them (what was ready together).

        In-flight work is counted before the request is sent and released in
        ``finally``; the engine iterator is closed there too, which aborts the
        engine request if we stop early (client gone, error).  A replica that
        fails before its first output is excluded and another one tried; so is
        one that fails after it, for a non-streaming request (nothing has reached
        the client yet), after a ``RESTART`` that tells the consumer to drop
        what came so far.
        """
        router = self.router
        # Engines only read the sampling parameters, so sub-requests share the
        # parsed ones, but for a max_tokens of their own (a default, several prompts).
        max_tokens = sub.max_tokens
        s = parsed.sampling
        if s.max_tokens != max_tokens:
            s = dataclasses.replace(s, max_tokens=max_tokens)
        request = GenerationRequest(new_id("req-"), sub.prompt.token_ids, s, sub.context, sub.prompt.mm_hashes,
                                    parsed.cache_salt, parsed.sent_as)
        job = Job(request, parsed, sub.prompt.keys, sub.source, max_tokens, sub.fills_room,
                  parsed.id if not sub.shift else f"{parsed.id}-{sub.shift}")
        load = router.load_tokens(len(sub.prompt.token_ids), max_tokens, s.n)
        prompt_len = len(sub.prompt.token_ids)
        if self._lost and (refusal := self._lost.refusal(self._prompt_id(sub, parsed), job.forwarded_id)):
            self.metrics.lost_requests.labels("refused").inc()
            raise refusal
        tries = _Tries(time.monotonic())
        try:
            while True:
                decision, offered = self._choose(sub, parsed, tries)
                replica = self.replicas[decision.replica]
                sub.replica = replica.name
                ticket = router.acquire(decision.replica, load, sub.prompt.keys, decision.matched_blocks)
                if offered is None:  # not a request taken back, already counted where it was sent
                    self.metrics.decisions.labels(replica.name, decision.reason).inc()
                # The engine never serves the block holding the prompt's last token from
                # cache (its logits must be computed), so neither is it predicted.
                bs = router.block_size
                predicted = min(decision.matched_blocks, (prompt_len - 1) // bs) * bs
                attempt = _Attempt(replica, self.metrics.request_series(sub.context.workload, replica.name),
                                   predicted, [] if self.observer.recording else None)
                restart = False
                gen = replica.generate(job) if offered is None else replica.generate(job, offered.sent)
                if tries.offered is not None:
                    gen = _unless_answered_first(gen, tries.offered[1])
                try:
                    async for batch in gen:
                        if not attempt.produced and (tries.answer_failed or tries.offered):
                            # Another replica serves it: the ones that failed it count it now,
                            # and a stopping one it was offered from gives it up.
                            for failed_replica, _ in tries.answer_failed:
                                failed_replica.note_request_failure()
                            tries.answer_failed.clear()
                            tries.withdraw_offer()
                        yield attempt.take(batch, prompt_len)
                    if replica.kind == "openai" and attempt.usage.unsaid(0):
                        # A server that sent no usage (Ollama before 0.5.2, early TGI) did
                        # not generate nothing: its deltas, one token each at least.
                        yield attempt.take([GenerationOutput(request.request_id, USAGE_ALL, [], "", usage=Usage(
                            prompt_len, attempt.received, None))], prompt_len)
                    attempt.exhausted = True
                    if self._lost:
                        # Answered in full: whatever this prompt was lost in, it was not the cause.
                        self._lost.served(self._prompt_id(sub, parsed))
                    return
                except ValueError as exc:
                    # The engine refuses requests it cannot run (prompt too long for its
                    # pool, token ids outside the vocabulary): the caller's problem.
                    if attempt.produced:
                        raise
                    raise bad_request(str(exc), parsed.prompt_param) from None
                except ReplicaBusy as exc:
                    tries.busy = exc  # at capacity (429) before any output: another replica may take it
                    if exc.retry_after is not None and (tries.retry_after is None or exc.retry_after < tries.retry_after):
                        tries.retry_after = exc.retry_after
                    tries.tried.append(decision.replica)
                except (ReplicaUnavailable, EngineFailed) as failure:
                    exc = failure if isinstance(failure, ReplicaUnavailable) else engine_failure(replica, failure)
                    if isinstance(exc, ReplicaLost):  # a stream under way too: its client may well retry
                        self._lost.note(self._prompt_id(sub, parsed), exc.event, job.forwarded_id)
                    self._failed(exc, attempt, parsed)  # raises when the client has had output
                    restart = attempt.produced
                    tries.tried.append(decision.replica)
                    tries.last_failure = _in_words(exc, replica)
                    if isinstance(exc, ReplicaAnswerFailed):
                        tries.answer_failed.append((replica, exc))
                    if isinstance(exc, OfferedElsewhere):
                        tries.offer(decision, exc)
                    if isinstance(exc, ReplicaLost):
                        tries.lost += 1
                        if tries.lost >= router.cfg.lost_attempts:
                            log.warning("%s: lost with the replicas running it, %d in a row: not tried on another",
                                        parsed.id, tries.lost)
                            self.metrics.lost_requests.labels("failed").inc()
                            raise errors.request_lost(tries.lost) from None
                except _AnsweredFirst:
                    # The stopping engine it was offered from started it first (its drain
                    # reached it while it queued here): given up here, read there (_choose).
                    log.debug("%s: replica %s gives it up: the stopping engine it was offered from answers it first",
                              parsed.id, replica.name)
                except (asyncio.CancelledError, GeneratorExit):
                    if not attempt.produced and tries.unrecorded is None:
                        self._record_prefill(attempt, sub, parsed, tries, request)
                    raise
                except UpstreamError as exc:
                    status = exc.status if 400 <= exc.status < 600 else 502
                    if attempt.produced and status >= 500:
                        # The replica's own error event after output (vLLM's way when
                        # generation fails): its failure, though it still talks HTTP.
                        self.metrics.replica_failures.labels(replica.name, "mid_stream").inc()
                    raise errors.relayed(status, exc.body, str(exc),
                                         "invalid_request_error" if status < 500 else "api_error") from None
                finally:
                    try:
                        try:
                            self._settle(attempt, sub, parsed, tries, restart, prompt_len)
                        finally:
                            if not attempt.exhausted:
                                await aclose(gen)
                    finally:
                        # Even when a second cancellation lands while the replica's stream closes.
                        router.release(ticket)
                if restart:
                    yield RESTART
        finally:
            tries.withdraw_offer()  # the client left, or it failed where it went
            if tries.unrecorded is not None:
                # Cut mid-answer, and no restart elsewhere produced anything: the
                # first replica did the prefill and cached the prompt all the same.
                self.observer.finished(tries.unrecorded)

    def _choose(self, sub: Sub, parsed: ParsedRequest, tries: _Tries) -> tuple[Decision, OfferedElsewhere | None]:
        """The router's pick among the usable replicas not tried yet; none left: the
        stopping replica that offered it, if one did (its request there stands, and
        is read now: OfferedElsewhere), else the error the tries so far call for."""
        if tries.offered is not None and tries.offered[1].answered:
            # The stopping engine it was offered from has started it after all: its
            # answer is there now, wherever else it would wait.
            return tries.take_back()
        if parsed.engine_unsupported is not None:
            # A request only an external server can honour (tools, JSON output) goes to one.
            usable = [r.healthy and r.kind == "openai" for r in self.replicas]
        else:
            usable = [r.healthy for r in self.replicas]
        decision = self.router.choose(sub.prompt.keys, self._indexes, usable, sub.context.session, tries.tried)
        if decision is not None:
            return decision, None
        if tries.offered is not None:
            # No other replica took it (every engine stopping at once: a node drain, a
            # scale to zero): the one it was sent to serves it in its drain, as before.
            return tries.take_back()
        if parsed.engine_unsupported is None and not any(r.healthy for r in self.replicas):
            # Every engine is stopping (a node drain, a single engine's restart): they
            # take requests for their server.shutdown_delay_s still, and serve them in
            # their drain, where a 503 would fail the client (its SDK's retries span ~2 s).
            # Not while a replica is in routing: one that refused it (at capacity) or
            # failed it answers the client, rather than a stopping engine's drain.
            stopping = [r.draining and not (r.breaker_open or r.port_closed) for r in self.replicas]
            if any(stopping):
                decision = self.router.choose(sub.prompt.keys, self._indexes, stopping, sub.context.session, tries.tried)
                if decision is not None:
                    return decision, None
        if tries.busy is not None:  # every replica that could take it refused: at capacity
            busy = errors.relayed(429, tries.busy.body, "Every replica is at capacity; retry shortly.",
                                  "rate_limit_error", "server_overloaded")
            if tries.retry_after is not None:  # the soonest a replica that refused it said to come back
                busy.retry_after = tries.retry_after
            raise busy
        if tries.answer_failed:  # every replica failed it: the client gets what the last one said
            failed = tries.answer_failed[-1][1]
            relayed = errors.relayed(failed.status, failed.body, "The model server failed the request.", "api_error")
            if failed.retry_after is not None:  # the server's own wait, as a 429's
                relayed.retry_after = failed.retry_after
            raise relayed from None
        if tries.last_failure is not None:
            # Replicas that failed it (a malformed answer, a dropped connection) may
            # still be healthy: the client is told what went wrong, not only "none".
            raise errors.no_replica(f"No healthy replica is available to serve this request (the last one "
                                    f"tried: {tries.last_failure}).")
        raise errors.no_replica()

    def _prompt_id(self, sub: Sub, parsed: ParsedRequest) -> tuple:
        """A prompt's identity: its length, its last full block's key (which chains
        every block before it, their images and the tenant's salt included), the
        tokens after it, its images and its cache salt (for the tail's sake)."""
        prompt = sub.prompt
        whole_blocks = len(prompt.keys) * self.router.block_size
        return (len(prompt.token_ids), prompt.keys[-1] if prompt.keys else None,
                tuple(prompt.token_ids[whole_blocks:]), tuple(prompt.mm_hashes), parsed.cache_salt,
                sub.context.tenant)

    def _failed(self, exc: ReplicaUnavailable, attempt: _Attempt, parsed: ParsedRequest) -> None:
        """A replica failed an attempt: counted, and the client's error if it has had
        output (a stream under way); otherwise another replica is to be tried."""
        replica = attempt.replica
        stopping = isinstance(exc, ReplicaStopping)  # a rolling restart, not a failure
        if not stopping:
            self.metrics.replica_failures.labels(
                replica.name, "mid_stream" if attempt.produced else "before_first_token").inc()
        if attempt.produced and parsed.stream:
            log.warning("%s failed mid-response: %s", parsed.id, exc)
            if stopping:  # its code tells the client that a retry will be served
                raise errors.shutting_down("The model server is shutting down; the output is "
                                           "incomplete.") from None
            reason = _in_words(exc, replica)
            raise errors.upstream_error(f"{reason[:1].upper()}{reason[1:]}; the output is incomplete.") from None
        # Before its first output, or mid-answer for a non-streaming request (its
        # client has had nothing yet): another replica.
        # A replica stopping is a rolling update or a scale-down at work, not a fault
        # (and its queued requests offered elsewhere are said in one line, by the replica).
        level = logging.DEBUG if isinstance(exc, OfferedElsewhere) else logging.INFO if stopping else logging.WARNING
        log.log(level, "%s: replica %s %s, trying another if one is left: %s",
                parsed.id, replica.name, "stopping" if stopping else "failed mid-response" if attempt.produced
                else "unavailable", exc)

    def _record_prefill(self, attempt: _Attempt, sub: Sub, parsed: ParsedRequest, tries: _Tries,
                        request: GenerationRequest) -> None:
        """Stopped before any output (its client left): recorded when the engine had
        scheduled its prompt, as far as it had (a long one's later chunks never ran),
        since it looked up its prefix and cached its blocks all the same.  Only an
        in-process engine says so; a remote one's stream says nothing before its first
        token.  The figures count a prefill at its first output, as vLLM's do."""
        computed = request.scheduled_prompt_tokens
        if not computed:
            return
        prompt = sub.prompt
        if computed < len(prompt.token_ids):
            prompt = prompt._replace(token_ids=prompt.token_ids[:computed],
                                     keys=prompt.keys[:computed // self.router.block_size])
        self.observer.record_line(dataclasses.replace(attempt.finished(sub, parsed, tries.arrival, computed), prompt=prompt))

    def _settle(self, attempt: _Attempt, sub: Sub, parsed: ParsedRequest, tries: _Tries, restart: bool,
                prompt_len: int) -> None:
        """An attempt ended, however it ended: its work counted, and its record
        (or, when it is to start over elsewhere, held until a later attempt's)."""
        if not (attempt.exhausted or attempt.produced):
            return  # no output: the replica did nothing the figures count
        # Run to its end, or cut short after its prefill (client gone, error
        # mid-stream): the replica cached its prompt all the same, which a
        # recording and the reuse figures must show (a restart elsewhere is the
        # request's one record, once it produces).
        if attempt.produced:  # the replica did the prefill (and generated what came)
            attempt.count_work(prompt_len)
        done = attempt.finished(sub, parsed, tries.arrival, prompt_len)
        if tries.unrecorded is not None:
            # An earlier cut attempt this one supersedes: the figures count its work.
            self.observer.finished(tries.unrecorded, record=False)
        if restart:
            tries.unrecorded = done
        else:
            tries.unrecorded = None  # this attempt is the record (one that ended empty, too)
            self.observer.finished(done)

    async def merged(
        self, subs: list[Sub], parsed: ParsedRequest
    ) -> AsyncIterator[list[tuple[int, list[GenerationOutput]]]]:
        """(choice shift, batch of outputs) of several sub-requests (completions
        with a list of prompts), grouped by what is ready together.

        One pump task per sub-request; the consumer takes everything queued at
        once, so outputs that arrive together still leave in one send.  (One
        sub-request needs none of this: callers read its ``outputs`` directly.)
        """
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(sub: Sub) -> None:
            gen = self.outputs(sub, parsed)
            try:
                async for batch in gen:
                    queue.put_nowait((sub.shift, batch))
                queue.put_nowait(end)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)
                raise
            finally:
                await aclose(gen)

        tasks = [asyncio.create_task(pump(sub)) for sub in subs]
        try:
            left = len(tasks)
            while left:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                group = []
                for item in items:
                    if item is end:
                        left -= 1
                    elif isinstance(item, BaseException):
                        if group:
                            yield group  # what came before the failure
                        raise item
                    else:
                        group.append(item)
                if group:
                    yield group
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _in_words(exc: Exception, replica: Replica) -> str:
    """What a replica's failure did, for its client: in words, but not where (a
    replica's name is by default its address, which is the operator's business)."""
    return str(exc).replace(f"replica {replica.name}", "the model server")


class _Tries:
    """A sub-request's attempts so far, on one replica after another."""

    __slots__ = ("arrival", "tried", "busy", "retry_after", "answer_failed", "unrecorded", "lost", "last_failure",
                 "offered")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival  # time.monotonic() when it was first routed
        self.tried: list[int] = []  # replicas excluded from the next choice
        self.busy: ReplicaBusy | None = None  # the last at-capacity refusal
        self.retry_after: int | None = None  # the soonest Retry-After of those refusals
        # Replicas that failed it with a server error: their failure is counted
        # once another replica serves it (the request was not the cause).
        self.answer_failed: list[tuple[Replica, ReplicaAnswerFailed]] = []
        # An attempt cut for a restart, until a later one that produced (or ended) records itself.
        self.unrecorded: Finished | None = None
        self.lost = 0  # attempts whose replica's connection broke while it ran them (ReplicaLost)
        self.last_failure: str | None = None  # what the last replica to fail it did, in words
        # A stopping engine that had not started it, and the decision that sent it there:
        # it stays sent there until another replica answers it (OfferedElsewhere).
        self.offered: tuple[Decision, OfferedElsewhere] | None = None

    def offer(self, decision: Decision, offered: OfferedElsewhere) -> None:
        if self.offered is None:
            self.offered = decision, offered
        else:
            offered.withdraw()  # offered by a second stopping engine: the first keeps it

    def take_back(self) -> tuple[Decision, OfferedElsewhere]:
        """Read where it was offered from after all (its request there still open)."""
        taken_back, self.offered = self.offered, None
        return taken_back

    def withdraw_offer(self) -> None:
        """Another replica answers it (or it ends): the stopping one gives it up."""
        if self.offered is not None:
            self.offered[1].withdraw()
            self.offered = None


class _Attempt:
    """One try of a sub-request on one replica.  What the replica did is counted
    once, when the attempt ends, however it ends (client gone, error, retried
    elsewhere): as vLLM counts the tokens of requests aborted after their prefill."""

    __slots__ = ("replica", "series", "predicted", "generated", "produced", "exhausted", "usage", "received",
                 "prefilled", "cached", "last_token")

    def __init__(self, replica: Replica, series: RequestSeries, predicted: int, generated: list[int] | None) -> None:
        self.replica = replica
        self.series = series
        self.predicted = predicted  # prompt tokens the router expected to hit
        self.generated = generated  # choice 0's token ids, collected only while recording
        self.produced = False  # some output came (so the replica did the prefill)
        self.exhausted = False  # ran to its end
        self.usage = UsageSum(1)
        self.received = 0  # generated tokens that arrived
        self.prefilled = 0  # prompt tokens counted at the first output
        self.cached: int | None = None  # prompt tokens the replica served from its cache, once it says
        self.last_token: float | None = None

    def take(self, batch: list[GenerationOutput], prompt_len: int) -> list[GenerationOutput]:
        """A batch as the replica delivered it, counted, its tokens that arrived
        together as one delta per choice (one frame to the client)."""
        series = self.series
        if not self.produced:
            self.produced = True
            if self.replica.kind != "openai":
                # The prefill is done, as vLLM counts it; a kvgate engine's prompt
                # is these very tokens (an external server's count comes at the end).
                self.prefilled = prompt_len
                series.prompt_tokens.inc(prompt_len)
        batch = coalesce(batch)
        # The inter-token gap is measured between deltas: what the client sees.
        now = time.perf_counter()
        received = arrived = self.received
        for out in batch:
            if out.index == 0 and (out.token_ids or out.text):
                if self.last_token is not None:
                    series.itl.observe(now - self.last_token)
                self.last_token = now
                if self.generated is not None:
                    self.generated.extend(out.token_ids)
            if out.token_ids:
                received += len(out.token_ids)
            elif out.text or out.extra:
                received += 1  # an external server's delta: no token ids, one token at least
            if out.cached_tokens is not None:
                self.cached = out.cached_tokens
            if out.usage is not None:
                self.usage.add(0, out)
                if out.index == 0 or out.index == USAGE_ALL:
                    self.cached = out.usage.cached_tokens
            if out.queue_time_s is not None:
                series.queue_time.observe(out.queue_time_s)
        if received > arrived:  # as they come (a long stream's rate shows while it runs)
            series.generation_tokens.inc(received - arrived)
            self.received = received
        return batch

    def count_work(self, prompt_len: int) -> None:
        """The token counters of an attempt that produced output, whether it ran
        to its end or not.  Prompt tokens were counted at the first output
        (``prefilled``, none for an external server) and generated ones as they
        arrived; the usage adds what those missed (an external server's delta
        counts as one token).  A stream cut short has no usage for its unfinished
        choices: their tokens are those that arrived.  The router's prediction
        counts with the cache hits it is compared to, so an attempt whose replica
        never said its hits (an external server cut short before its usage)
        counts on neither, and the ratio stays a ratio."""
        series, usage = self.series, self.usage
        prompt = usage.prompt[0] or prompt_len
        if prompt > self.prefilled:
            series.prompt_tokens.inc(prompt - self.prefilled)
        if usage.completion[0] > self.received:  # ``received`` were counted as they came
            series.generation_tokens.inc(usage.completion[0] - self.received)
        if self.cached is not None:
            series.prefix_queries.inc(prompt)
            series.prefix_hits.inc(self.cached)
            series.predicted_hits.inc(self.predicted)

    def finished(self, sub: Sub, parsed: ParsedRequest, arrival: float, prompt_len: int) -> Finished:
        """The observer's record of this attempt.  Cut short, it has usage for its
        finished choices only."""
        usage, whole = self.usage, self.exhausted
        return Finished(
            sub.context, self.replica.name, sub.prompt, usage.prompt[0] or prompt_len,
            usage.cached[0] if whole else self.cached,
            usage.completion[0] if whole else max(usage.completion[0], self.received),
            arrival, parsed.user or parsed.safety_identifier, self.generated, parsed.cache_salt,
        )


class _AnsweredFirst(Exception):
    """The stopping engine a request was offered from answered it before the
    replica it was offered to (see _unless_answered_first)."""


async def _unless_answered_first(gen: AsyncIterator, offered: OfferedElsewhere) -> AsyncIterator:
    """``gen``'s batches, unless the stopping engine that offered the request (its
    request there still open) answers it before ``gen``'s first batch comes:
    _AnsweredFirst.  That engine may start it in its drain while it queues here,
    and its answer, not read, was thrown away while the client waited on."""
    try:
        first = asyncio.ensure_future(anext(gen))
        try:
            await asyncio.wait((first, offered.sent), return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and offered.answered:
                raise _AnsweredFirst
            batch = await first
        except StopAsyncIteration:
            return
        except BaseException:
            if not first.done():
                first.cancel()  # its request here is given up (its connection closed)
                await asyncio.wait((first,))  # stopped before it is closed below
            if not first.cancelled():
                # Its failure, in the same turn as the client left: read, or asyncio
                # logs it as an error with its traceback ("never retrieved").
                first.exception()
            raise
        yield batch
        async for batch in gen:
            yield batch
    finally:
        await aclose(gen)


async def aclose(gen) -> None:
    """Close an async iterator that may have stopped early (None: nothing to close)."""
    close = getattr(gen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - a stream whose connection already failed: said, not raised
            log.debug("closing a replica's stream failed", exc_info=True)
