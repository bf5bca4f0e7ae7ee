"""Workload classification: what kind of request is this, for the cache's sake.

Rules from config.yaml are tried in order and the first that holds decides the
workload and type (``ClassifierRule``).  Turn, session and tenant are facts of
the request, not rule outcomes.  Everything here works on what parsing and
tokenising already produced; nothing is tokenised again except the first few
characters of a file request's document for its signature.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from engine.context import REQUEST_TYPES, WORKLOADS, RequestContext
from gateway.config import ClassifierConfig, ClassifierRule
from gateway.prefix import PrefixHasher
from gateway.protocol import CHAT, ParsedRequest
from gateway.responses_api import RESPONSES

WORKLOAD_HEADER = "X-KVGate-Workload"
TYPE_HEADER = "X-KVGate-Type"
# Chat prompts remembered for parent chat ids (bounded: one entry per recent
# chat request, ~160 bytes each as measured: ~20 MB when full).
_MAX_PROMPTS = 131_072


@dataclass(slots=True)
class Principal:
    """Who is calling: from the API key, or anonymous when auth is off."""

    tenant: str | None = None
    workload: str | None = None


ANONYMOUS = Principal()


class Classifier:
    def __init__(self, cfg: ClassifierConfig, hasher: PrefixHasher | None = None) -> None:
        self.cfg = cfg
        self.hasher = hasher
        self._rules = list(cfg.rules)
        self._chat_ids = itertools.count(1)
        # A chat request's whole prompt (as a digest) -> its chat id.
        self._chat_by_prompt: OrderedDict[int, int] = OrderedDict()
        self._decisions: dict[tuple, tuple[str, str]] = {}

    def classify(
        self,
        req: ParsedRequest,
        principal: Principal,
        headers: "dict | object",
        prompt_tokens: int,
        prompt_blocks: int,
        first_tokens: list[int] | None = None,
        prompt_index: int = 0,
    ) -> RequestContext:
        """``prompt_index``: which of a completions request's prompts this is (each
        is classified, and has its session, on its own)."""
        header_workload = headers.get(WORKLOAD_HEADER)
        if header_workload is not None:
            header_workload = header_workload.strip().lower()
            if header_workload not in WORKLOADS:
                # An unknown value is the caller's mistake, but not worth failing the request over.
                header_workload = None
        header_type = headers.get(TYPE_HEADER)
        if header_type is not None:
            header_type = header_type.strip().lower()
            if header_type not in REQUEST_TYPES:
                header_type = None
        is_file = self._is_file(req, prompt_tokens)
        # Everything the rules can look at; their outcome is remembered per
        # combination (few: workloads, types and tenants are all bounded).
        facts = (principal.workload, principal.tenant, header_workload, header_type, bool(req.images), is_file,
                 req.user_turns > 1, req.endpoint, req.responses is not None)
        decided = self._decisions.get(facts)
        if decided is None:
            decided = self._decisions[facts] = self._decide(req, principal, header_workload, header_type, is_file)
        workload, rtype = decided
        session, prompt_digests = self._session(req, principal, prompt_index)
        chat_id = next(self._chat_ids)
        # parent_chat_id as in Alibaba's traces: the previous turn of the same
        # conversation (or agent step), -1 for a first turn (a user's new chat is
        # not a next turn).
        # The previous turn is the request whose prompt this one resends before
        # the answer it got, not merely the last one with the same opening: two
        # people who open alike are not each other's next turn.
        parent = -1
        if prompt_digests is not None:
            own, previous = prompt_digests
            if previous is not None:
                parent = self._chat_by_prompt.get(previous, -1)
            self._chat_by_prompt[own] = chat_id
            self._chat_by_prompt.move_to_end(own)  # a prompt sent again (a retry, a regenerate): the latest
            if len(self._chat_by_prompt) > _MAX_PROMPTS:
                self._chat_by_prompt.popitem(last=False)
        return RequestContext(
            workload=workload,
            type=rtype,
            turn=max(1, req.user_turns),
            session=session,
            tenant=principal.tenant,
            signature=self._signature(req, first_tokens) if rtype == "file" or is_file else None,
            prompt_tokens=prompt_tokens,
            prompt_blocks=prompt_blocks,
            chat_id=chat_id,
            parent_chat_id=parent,
        )

    def _decide(
        self, req: ParsedRequest, principal: Principal, header_workload: str | None, header_type: str | None,
        is_file: bool,
    ) -> tuple[str, str]:
        """(workload, type): the first rule that holds, then the defaults."""
        workload, rtype = None, None
        for rule in self._rules:
            matched, implied = self._match(rule, req, principal, header_workload, is_file)
            if matched:
                workload = rule.workload or implied
                rtype = rule.type
                break
        if workload is None:
            workload = self.cfg.completions_workload if req.endpoint != CHAT else self.cfg.default_workload
        if rtype is None:
            # The rule named no type: the client's X-KVGate-Type, else what the content implies.
            # A rule's own type is the operator's, which no client header overrides.
            rtype = header_type or self._implied_type(req, is_file, workload)
        return workload, rtype

    def _match(
        self, rule: ClassifierRule, req: ParsedRequest, principal: Principal, header_workload: str | None, is_file: bool
    ) -> tuple[bool, str | None]:
        when = rule.when
        if when == "api_key":
            return principal.workload is not None, principal.workload
        if when == "tenant":
            return principal.tenant == rule.tenant, None
        if when == "header":
            return header_workload is not None, header_workload
        if when == "image":
            return bool(req.images), "multimodal"
        if when == "file":
            return is_file, None
        if when == "multi_turn":
            return req.endpoint == CHAT and req.user_turns > 1, None
        if when == "endpoint":
            implied = self.cfg.completions_workload if req.endpoint != CHAT else self.cfg.default_workload
            # A Responses request is a chat one, but a rule may name it alone.
            return req.endpoint == rule.endpoint or (rule.endpoint == RESPONSES and req.responses is not None), implied
        return True, None  # always

    def _is_file(self, req: ParsedRequest, prompt_tokens: int) -> bool:
        """A single very long document: one message holding most of a long prompt.

        The message's token count is estimated from its share of the content
        characters, so the prompt is not tokenised per message.
        """
        if prompt_tokens < self.cfg.file_min_tokens:
            return False
        if req.endpoint != CHAT:
            return True
        return req.longest_share * prompt_tokens >= self.cfg.file_min_tokens

    @staticmethod
    def _implied_type(req: ParsedRequest, is_file: bool, workload: str) -> str:
        if req.images:
            return "image"
        if is_file:
            return "file"
        if req.endpoint != CHAT or workload == "to-b":
            # The paper's to-B traffic is all "api", whichever endpoint it calls (an
            # API key or header that says to-b on a chat request included).
            return "api"
        return "text"

    def _session(self, req: ParsedRequest, principal: Principal,
                 prompt_index: int = 0) -> tuple[str, tuple[int, int | None] | None]:
        """(session, prompt digests): the session is the `prompt_cache_key` when
        given, else the `user` field (or `safety_identifier`), else the
        conversation, a hash of a chat's opening (within the tenant and user),
        which every later turn repeats.  A chat's prompt digests are
        (its whole prompt, the previous turn's prompt or None for a first turn),
        both within the tenant and user.  A completions prompt is a session of
        its own (its whole prompt, as a single-turn chat's opening is): the
        template its calls share is reuse across sessions, which the
        workload-aware policy keeps in its shared class; no turns.
        """
        tenant = [principal.tenant.encode() + b"\x00"] if principal.tenant else []
        parts = list(tenant)
        user = req.user or req.safety_identifier  # OpenAI's successor of `user`
        if user:
            parts.append(b"u:" + user.encode())
        user_session = "u" + xxhash.xxh3_64_hexdigest(b"".join(parts)) if user else None
        if req.prompt_cache_key:
            # What the client says its requests that share a prefix have in common
            # (OpenAI routes on it): their session, over the user's.
            keyed = [*tenant, b"k:" + req.prompt_cache_key.encode()]
            user_session = "k" + xxhash.xxh3_64_hexdigest(b"".join(keyed))
        if req.messages:
            messages = req.messages
            # A next turn resends the previous prompt, the answer it got (and any
            # tool results) and a new user message: the previous prompt is all
            # before the last answer.
            # (An agent's request that sends a tool's result back follows the one
            # that called the tool, within the same user turn.)
            last_answer = -1
            for index in range(len(messages) - 1, 0, -1):
                if messages[index]["role"] == "assistant":
                    last_answer = index
                    break
            running = xxhash.xxh3_64(b"".join(parts))
            conversation = None
            previous = None
            images, image_ends, first_image = req.images, req.image_ends, 0
            for index, msg in enumerate(messages):
                if index == last_answer:
                    previous = running.intdigest()
                running.update(f"{msg['role']}\x00{msg['content']}\x01".encode())
                # A picture is only a placeholder in the text: its source tells two chats apart.
                end = image_ends[index] if index < len(image_ends) else first_image
                for source in images[first_image:end]:
                    running.update(source)
                    running.update(b"\x02")
                first_image = end
                if conversation is None and msg["role"] == "user":
                    # The system prompt(s) and the first user message.
                    conversation = "h" + running.hexdigest()
            if conversation is None:
                conversation = "h" + running.hexdigest()
            return user_session or conversation, (running.intdigest(), previous)
        if user_session is None and req.prompts:
            # The whole prompt, not its opening: a template's calls, one session,
            # never counted their template's reuse as shared (the policy then lost
            # its gain over LRU on API traffic).
            parts.append(_prompt_bytes(req.prompts[prompt_index]))
        return user_session or "h" + xxhash.xxh3_64_hexdigest(b"".join(parts)), None

    def _signature(self, req: ParsedRequest, first_tokens: list[int] | None) -> int | None:
        n = self.cfg.signature_tokens
        if self.hasher is None:
            return None
        if req.endpoint == CHAT and req.messages and req.longest_message >= 0:
            # The document's own first tokens: the template's preamble is the same for everyone.
            doc = req.messages[req.longest_message]["content"]
            # (Within the request's cache salt: the tokeniser's piece cache is per tenant.)
            tokens = self.hasher.encode(doc[: n * 16], req.cache_salt or "")[:n]
        else:
            tokens = (first_tokens or [])[:n]
        return self.hasher.signature(tokens)


def _prompt_bytes(prompt: str | list[int]) -> bytes:
    """A completions prompt as bytes to hash: its text, or its token ids."""
    if isinstance(prompt, str):
        return prompt.encode()
    try:
        return array("Q", prompt).tobytes()
    except OverflowError:  # ids past 64 bits, which only an external server judges
        return repr(prompt).encode()
