"""Which prompts are refused after replicas died running them (gateway/quarantine.py)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.context import RequestContext
from gateway.config import RouterConfig
from gateway.dispatch import Dispatcher, Sub
from gateway.prefix import Prompt
from gateway.quarantine import LostPrompts


def _lost_prompts(**settings):
    clock = [100.0]
    cfg = RouterConfig(**settings)
    return LostPrompts(lambda: cfg, clock=lambda: clock[0]), clock


def test_only_the_prompt_common_to_every_loss_is_refused():
    lost, clock = _lost_prompts()  # two losses, 300 s
    assert not lost
    # Replica a dies holding P and two others; P and x move on to b, which dies too.
    for prompt in ("P", "x", "y"):
        lost.note((prompt,), ("a", 1), f"req-{prompt}")
    for prompt in ("P", "x", "z"):
        lost.note((prompt,), ("b", 1), f"req-{prompt}")
    assert lost and lost.refusal(("y",), "req-new") is None and lost.refusal(("z",), "req-new") is None
    assert lost.refusal(("P",), "req-new") is None and lost.refusal(("x",), "req-new") is None  # not singled out yet
    lost.note(("P",), ("a", 2), "req-P2")  # P's client retries, and kills a again (alone this time)
    refused = lost.refusal(("P",), "req-new")
    assert refused.status == 502 and refused.code == "request_quarantined" and "300 s" in refused.message
    assert lost.refusal(("x",), "req-new") is None
    clock[0] += 299
    assert lost.refusal(("P",), "req-new").message.count("1 s")
    clock[0] += 2  # the window has passed: served again, its losses forgotten
    assert lost.refusal(("P",), "req-new") is None
    clock[0] += 10
    assert lost.refusal(("Q",), "req-new") is None and not lost  # pruned: requests skip the check again


def test_a_long_loss_forgets_the_prompts_that_leave_the_bound(monkeypatch):
    """A replica losing requests less than a second apart is one loss for as long
    as it lasts; its map of prompts kept every one past the bound on prompts
    known (25,000 after 50,000 losses at 250 a second), which each request's
    check intersects.  A prompt forgotten leaves its losses too."""
    import gateway.quarantine as quarantine

    monkeypatch.setattr(quarantine, "_MAX_PROMPTS", 100)
    lost, _ = _lost_prompts()
    for n in range(1000):
        lost.note((f"p{n}",), ("a", 1), f"req-{n}")
    assert len(lost._prompts) == 100 and set(lost._losses[("a", 1)][1]) == {(f"p{n}",) for n in range(900, 1000)}


def test_a_loss_that_forgot_prompts_at_the_bound_singles_nobody_out(monkeypatch):
    """I and K die together twice: neither is singled out.  Losses elsewhere then
    push I out of the prompts known, and with it out of those two losses: what
    was left of them named K alone, refused with no new evidence against it."""
    import gateway.quarantine as quarantine

    monkeypatch.setattr(quarantine, "_MAX_PROMPTS", 10)
    lost, _ = _lost_prompts()
    for replica in ("a", "b"):
        for prompt in ("I", "K"):
            lost.note((prompt,), (replica, 1), f"req-{prompt}")
    assert lost.refusal(("K",), "req-new") is None
    for n in range(9):
        lost.note((f"other{n}",), ("c", 1), f"req-{n}")
    assert ("I",) not in lost._prompts and lost.refusal(("K",), "req-new") is None


def test_a_prompt_answered_in_full_after_a_loss_is_not_the_cause(caplog):
    lost, _ = _lost_prompts()
    # Replicas dying of something else, one after the other, while a canary's prompt runs.
    lost.note(("canary",), ("a", 1), "req-1")
    lost.served(("canary",))  # its retry was answered by b
    lost.note(("canary",), ("b", 1), "req-2")
    assert lost.refusal(("canary",), "req-3") is None
    # Answered in full, a prompt also leaves the losses it shared: the one common to the rest stands out sooner.
    for loss in (("a", 2), ("b", 2)):
        for prompt in ("P", "x"):
            lost.note((prompt,), loss, f"req-{prompt}{loss[1]}{loss[0]}")
    assert lost.refusal(("P",), "req-P3") is None  # x died beside it both times
    lost.served(("x",))
    with caplog.at_level("WARNING", logger="gateway.quarantine"):
        assert lost.refusal(("P",), "req-P3").code == "request_quarantined"
    # The log names the request refused and those that were lost, which the access log and clients quote.
    assert "req-P3: its prompt was lost with 2 replicas (in req-P2a, req-P2b)" in caplog.text


def test_a_request_lost_on_two_replicas_is_named_once(caplog):
    """One request retried on another replica and lost there too: its id was listed twice."""
    lost, _ = _lost_prompts()
    for replica in ("a", "b"):
        lost.note(("P",), (replica, 1), "chatcmpl-1")
    with caplog.at_level("WARNING", logger="gateway.quarantine"):
        assert lost.refusal(("P",), "chatcmpl-2").code == "request_quarantined"
    assert "chatcmpl-2: its prompt was lost with 2 replicas (in chatcmpl-1), alone" in caplog.text


def test_one_loss_is_enough_when_lost_attempts_is_one_and_nothing_is_kept_when_off():
    lost, _ = _lost_prompts(lost_attempts=1, lost_quarantine_s=60)
    lost.note(("P",), ("a", 1), "req-P")
    assert lost.refusal(("P",), "req-new").code == "request_quarantined"
    off, _ = _lost_prompts(lost_quarantine_s=0)
    off.note(("P",), ("a", 1), "req-P")
    assert not off and off.refusal(("P",), "req-new") is None


def test_a_prompts_identity_tells_images_salts_and_tenants_apart():
    dispatcher = Dispatcher.__new__(Dispatcher)  # _prompt_id reads the router's block size only
    dispatcher.router = SimpleNamespace(block_size=4)

    def identity(tokens, keys=(), images=(), salt=None, tenant=None):
        sub = Sub(Prompt(list(tokens), list(images), list(keys)), None, RequestContext(tenant=tenant), 0, 5)
        return dispatcher._prompt_id(sub, SimpleNamespace(cache_salt=salt))

    short = [1, 2, 3]
    assert identity(short) == identity(list(short))
    assert len({identity(short), identity(short, salt="s"), identity(short, tenant="t"),
                identity(short, images=[(0, b"cat")]), identity(short, images=[(0, b"dog")]),
                identity([1, 2, 4])}) == 6
    # Whole blocks are told apart by their last key (it chains the rest), the tail by its tokens.
    assert identity([1, 2, 3, 4, 5], keys=[11]) != identity([1, 2, 3, 4, 5], keys=[12])
    assert identity([1, 2, 3, 4, 5], keys=[11]) != identity([1, 2, 3, 4, 6], keys=[11])
