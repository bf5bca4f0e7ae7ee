"""Engine outputs shaped as OpenAI responses: one JSON object, or a stream of server-sent events.

Everything that arrived together leaves in one write.  A stream sends its
headers with its first output, so that failures before it (no replica, an
upstream 4xx) still get a proper status code; a failure after it ends the
stream with an OpenAI error event and [DONE] (the status is already sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import AsyncIterator, Callable

from aiohttp import web

from engine.request import GenerationOutput
from gateway import errors
from gateway.dispatch import RESTART, Sub, aclose
from gateway.errors import ApiError
from gateway.observe import Observer
from gateway.protocol import CHAT, ParsedRequest
from gateway.replicas import CACHED_TOKENS_HEADER, QUEUE_TIME_HEADER
from gateway.responses_shape import ResponseShaper, began_order, reasoning_of, refusal_of
from gateway.shapes import (
    DONE,
    ChoiceState,
    StreamFormatter,
    chat_completion,
    merge_delta_extra,
    now_s,
    sse_error,
    text_completion,
)
from gateway.upstream import USAGE_ALL
from gateway.usage import UsageSum

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _SseResponse(web.StreamResponse):
    # Headers ride with the first frames (one send, not two); aiohttp's own
    # web.Response does the same.
    _send_headers_immediately = False
    # The status of the error event that ended the stream, if one did: the HTTP
    # status went out as 200, but the request failed, and the metrics say so.
    failed_status: int | None = None
    # Set once its last frames and end are handed to write_eof: nothing may follow
    # them, even if that last wait for the client is cut short.
    ending = False


class Responder:
    """Shapes a client request's outputs for the wire, under the served model name.

    ``gen`` and ``single`` come from ``Dispatcher.run``: the batches of the one
    sub-request when ``single``, else (choice shift, batch) groups.  Both
    shapers close ``gen`` on every exit, which aborts the engine work.
    """

    def __init__(self, model_name: str, observer: Observer, engine_mode: bool = False,
                 kv_seq: Callable[[], int] | None = None) -> None:
        self.model_name = model_name
        self.observer = observer
        # `kvgate engine`: streams tell the calling gateway how long the request
        # queued before its first step (QUEUE_TIME_HEADER), for its queue-time series,
        # and its prefix-cache hit (CACHED_TOKENS_HEADER), for a stream cut short;
        # and, with the usage, the engine's last KV event (``kv_seq()``) by then.
        self.engine_mode = engine_mode
        self.kv_seq = kv_seq
        # Set when the server, stopping, cancels the streams still running.
        self.cutting = False
        # Set when the server begins to stop (Gateway.begin_drain): streams opened
        # from then on close their connections after them, and say so up front.
        self.draining = False

    async def complete(
        self, gen: AsyncIterator, single: bool, parsed: ParsedRequest, subs: list[Sub], start: float
    ) -> web.Response:
        """The whole response as one JSON object, once every choice has finished."""
        created = now_s()  # when the completion began, as a stream's chunks carry it
        n = parsed.sampling.n
        # Asked for logprobs: a choice whose only token ended it still has them (empty).
        lp = [] if parsed.sampling.logprobs is not None else None
        choices = [ChoiceState(logprobs=lp) for _ in range(n * len(subs))]
        usage = UsageSum(len(subs))
        workload = subs[0].context.workload
        first = True
        try:
            async for group in gen:
                if single:
                    group = ((0, group),)
                if first:
                    first = False
                    self.observer.first_token(workload, subs[group[0][0] // n].replica, time.perf_counter() - start)
                for shift, batch in group:
                    if batch is RESTART:
                        # Its replica failed mid-way: the sub-request starts over on another.
                        choices[shift : shift + n] = [ChoiceState(logprobs=lp) for _ in range(n)]
                        usage.forget(shift // n)
                        continue
                    for out in batch:
                        _collect(choices, usage, shift // n, shift, out)
            gen = None  # exhausted: nothing to close
        finally:
            await aclose(gen)
        if parsed.echo_texts is not None:
            for i, choice in enumerate(choices):
                choice.text.insert(0, parsed.echo_texts[i // n])
        if parsed.responses is not None:
            shaper = ResponseShaper(parsed.id, created, self.model_name, parsed.responses)
            choice = choices[0]
            obj = shaper.whole("".join(choice.text), choice.extra, choice.finish_reason, usage.as_dict(subs), now_s(),
                               choice.began)
        elif parsed.endpoint == CHAT:
            obj = chat_completion(parsed.id, created, self.model_name, choices, usage.as_dict(subs))
        else:
            obj = text_completion(parsed.id, created, self.model_name, choices, usage.as_dict(subs),
                                  parsed.top_with_sampled)
        # OpenAI's SDKs expose x-request-id (response._request_id) for logs and support;
        # here it is the completion's own id, so one string finds both.
        return web.Response(body=json.dumps(obj).encode(), content_type="application/json",
                            headers={"x-request-id": obj["id"]})

    async def stream(
        self, request: web.Request, gen: AsyncIterator, single: bool, parsed: ParsedRequest, subs: list[Sub], start: float
    ) -> web.StreamResponse:
        """Server-sent events: a chunk per choice as its tokens arrive, then usage (if asked) and [DONE]."""
        n = parsed.sampling.n
        chat = parsed.endpoint == CHAT
        rid = parsed.id
        fmt = StreamFormatter(parsed.endpoint, rid, now_s(), self.model_name, parsed.include_usage, parsed.top_with_sampled)
        echo = parsed.echo_texts
        with_ids = parsed.token_ids_out and not chat
        states = [ChoiceState() for _ in range(n * len(subs))]
        usage = UsageSum(len(subs))
        workload = subs[0].context.workload
        resp: _SseResponse | None = None
        choices_left = len(states)
        tail_frames = b""
        try:
            async for group in gen:
                # Everything that arrived together leaves in one send; the outputs
                # that finish the last choice wait for the stream's tail and end
                # (usage, [DONE]) and leave with them.
                frames = []
                try:
                    for sub, shift, out in _each_output(group, single, n, usage):
                        if resp is None:
                            resp = await self._open(request, rid, out)
                            self.observer.first_token(workload, subs[sub].replica, time.perf_counter() - start)
                            if chat:
                                # Every choice's role chunk first, in index order, as vLLM sends them:
                                # the SDK's accumulator files a choice it has not seen yet in the next
                                # place of its list, so a choice 1 that spoke before choice 0 took its place.
                                frames += [fmt.role(i) for i in range(len(states))]
                        index = shift + out.index
                        state = states[index]
                        text = out.text
                        if not state.started:
                            if echo is not None:
                                text = echo[sub] + text  # the prompt leads the choice's first chunk
                            state.started = True
                        if out.finish_reason is not None:
                            _check_finish(out.finish_reason)
                            choices_left -= 1
                        if with_ids:
                            # Tokens whose text is held back (a partial character, a
                            # possible stop string) still leave: the gateway counts them.
                            if text or out.logprobs or out.token_ids:
                                frames.append(fmt.delta(index, text, out.logprobs, state, token_ids=out.token_ids))
                        elif text or out.logprobs or out.extra:
                            frames.append(fmt.delta(index, text, out.logprobs, state, None, out.extra))
                        if out.finish_reason is not None:
                            # As OpenAI ends a choice: a chunk of its own, an empty delta and the reason.
                            frames.append(fmt.delta(index, "", None, state, out.finish_reason,
                                                    stop_reason=out.stop_reason))
                except ApiError:
                    if frames:
                        await resp.write(b"".join(frames))  # what came before the failure
                    raise
                if choices_left <= 0:
                    tail_frames += b"".join(frames)
                elif frames:
                    await resp.write(b"".join(frames))
            gen = None  # exhausted: nothing to close
            if resp is None:
                resp = await self._open(request, rid)
            if parsed.include_usage:
                kv_seq = self.kv_seq() if with_ids and self.kv_seq is not None else None  # for a gateway
                tail = fmt.usage(usage.as_dict(subs), kv_seq) + DONE
            else:
                tail = DONE
            resp.ending = True
            await resp.write_eof(tail_frames + tail)  # one send for the last frames, the tail and the end
            return resp
        except BaseException as exc:
            # Mid-stream: the status is already sent; OpenAI clients raise on an error
            # event, and [DONE] still ends the stream for clients that wait for it.
            ended = await self._end_under_way(resp, exc, rid, lambda e: tail_frames + sse_error(e.body()) + DONE)
            if ended is None:
                raise
            return ended
        finally:
            await aclose(gen)

    async def stream_events(
        self, request: web.Request, gen: AsyncIterator, single: bool, parsed: ParsedRequest, subs: list[Sub], start: float
    ) -> web.StreamResponse:
        """A Responses API stream: its opening events with the first output, then
        each output's reasoning, text, refusal and tool call deltas (an item added as its first output
        comes), then each item done and completed (or incomplete)."""
        shaper = ResponseShaper(parsed.id, now_s(), self.model_name, parsed.responses)
        usage = UsageSum(len(subs))
        resp: _SseResponse | None = None
        finish: str | None = None
        tail_frames = b""
        try:
            async for group in gen:
                frames = []
                try:
                    for sub, _, out in _each_output(group, single, 1, usage):
                        if resp is None:
                            resp = await self._open(request, parsed.id, out)
                            self.observer.first_token(subs[0].context.workload, subs[sub].replica,
                                                      time.perf_counter() - start)
                            frames.append(shaper.opening())
                        if out.extra and (thought := reasoning_of(out.extra)):
                            frames.append(shaper.reasoning(thought))
                        if out.text:
                            frames.append(shaper.delta(out.text))
                        if out.extra:  # one check for the text alone the kvgate engine sends
                            if refused := refusal_of(out.extra):
                                frames.append(shaper.refusal(refused))
                            if out.extra.get("tool_calls"):
                                frames.append(shaper.tool_calls(out.extra["tool_calls"]))
                        if out.finish_reason is not None:
                            _check_finish(out.finish_reason)
                            finish = out.finish_reason
                except ApiError:
                    if frames:
                        await resp.write(b"".join(frames))
                    raise
                if finish is not None:
                    tail_frames += b"".join(frames)  # they leave with the closing events, in one send
                elif frames:
                    await resp.write(b"".join(frames))
            gen = None  # exhausted: nothing to close
            if resp is None:
                resp = await self._open(request, parsed.id)
                tail_frames = shaper.opening()
            closing = tail_frames + shaper.closing(finish, usage.as_dict(subs), now_s())
            resp.ending = True
            await resp.write_eof(closing)
            return resp
        except BaseException as exc:
            ended = await self._end_under_way(resp, exc, parsed.id, lambda e: tail_frames + shaper.failed(e))
            if ended is None:
                raise
            return ended
        finally:
            await aclose(gen)

    async def _open(self, request: web.Request, rid: str, out: GenerationOutput | None = None) -> _SseResponse:
        """The stream's headers, sent with its first output so that failures before it
        (no replica, an upstream 4xx) still get a proper status code."""
        resp = _SseResponse(headers=SSE_HEADERS)
        resp.headers["x-request-id"] = rid
        if self.engine_mode and out is not None:
            if out.queue_time_s is not None:
                resp.headers[QUEUE_TIME_HEADER] = f"{out.queue_time_s:.6f}"
            if out.cached_tokens is not None:
                resp.headers[CACHED_TOKENS_HEADER] = str(out.cached_tokens)
        if self.draining:
            # In its headers, as a plain answer says it (Gateway.serve): a keep-alive
            # client told only by the close after the stream reuses the connection
            # meanwhile and loses that request (a gateway routing to stopping engines).
            resp.force_close()
        await resp.prepare(request)
        return resp

    async def _end_under_way(self, resp: _SseResponse | None, exc: BaseException, rid: str,
                             last_frames: Callable[[ApiError], bytes]) -> _SseResponse | None:
        """A stream already under way, ended by ``exc``: ``last_frames`` of its error
        are its end, and the response is returned (the caller must not answer a
        second time).  None: the caller re-raises (nothing sent yet, the client
        gone, a cancellation that is not the server's own)."""
        if resp is None:
            return None
        cut = isinstance(exc, asyncio.CancelledError)
        if cut:
            if not self.cutting:
                return None  # the client left
            # The server is stopping and the stream outlived the drain: say so.
            uncancel(asyncio.current_task())
            exc = errors.shutting_down()
        elif not isinstance(exc, Exception) or isinstance(exc, ConnectionError):
            return None  # the client is gone; nobody to tell
        elif not isinstance(exc, ApiError):
            log.error("stream %s failed after its first byte", rid, exc_info=exc)
            exc = errors.internal_error()
        if resp.ending:
            return resp  # its end is already with the transport: an error after it would corrupt the stream
        resp.failed_status = exc.status
        try:
            with contextlib.suppress(ConnectionError):
                await resp.write(last_frames(exc))
                await resp.write_eof()
        except asyncio.CancelledError:
            if not cut:
                raise
            # cancelled again (a reader too slow for the last wait): the stream simply ends
        return resp


def uncancel(task: asyncio.Task | None) -> None:
    """Take back a cancellation the gateway itself sent and has now handled
    (Task.uncancel exists from Python 3.11; before it there is no count to undo)."""
    undo = getattr(task, "uncancel", None)
    if undo is not None:
        undo()


def _collect(choices: list[ChoiceState], usage: UsageSum, sub: int, shift: int, out: GenerationOutput) -> None:
    """One output into the whole answer a non-streaming response builds."""
    usage.add(sub, out)
    if out.index == USAGE_ALL:
        return
    choice = choices[shift + out.index]
    if out.extra or (out.text and choice.began and choice.began[-1][0] != "t"):  # text after another item: a run
        if choice.extra is None:
            choice.extra = {}
        choice.began = began_order(choice.began, out, choice.text, reasoning_of(choice.extra),
                                   len(choice.extra.get("tool_calls") or ()), refusal_of(choice.extra))
    if out.extra:
        merge_delta_extra(choice.extra, out.extra)
    if out.text:
        choice.text.append(out.text)
    if out.logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + out.logprobs  # a new list: the empty one is shared
    if out.finish_reason is not None:
        _check_finish(out.finish_reason)
        choice.finish_reason = out.finish_reason
        choice.stop_reason = out.stop_reason


def _each_output(group, single: bool, n: int, usage: UsageSum):
    """(sub-request, choice shift, output) of each output a stream shows in a
    group: a batch of the one sub-request when ``single``, else (choice shift,
    batch) pairs, ``n`` choices per sub-request.  Every output's usage is counted;
    usage-only outputs are not shown."""
    if single:
        group = ((0, group),)
    for shift, batch in group:
        sub = shift // n
        for out in batch:
            usage.add(sub, out)
            if out.index != USAGE_ALL:
                yield sub, shift, out


def _check_finish(reason: str) -> None:
    if reason == "abort":
        raise ApiError(503, "The engine aborted the request (it is shutting down or overloaded).", "server_error", None, "engine_abort")
