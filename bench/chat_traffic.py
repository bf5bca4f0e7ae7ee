"""Chat and completions traffic for a running gateway, as the README's
observability walkthrough sends it (record -> replay -> tune).

Several concurrent `openai` SDK clients hold multi-turn chats (1-4 turns, each
turn resending the history with the model's own answers, `user` one of five
people, one of two shared system prompts) and make `/v1/completions` calls that
share a template.  What reaches the cache depends on the answers, so two runs
differ by a few points; the seed fixes the questions and their order per client.

    pip install openai
    python bench/chat_traffic.py --url http://127.0.0.1:8000/v1 --requests 89
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

SYSTEM_PROMPTS = (
    "You are the help desk of a mid-sized online bookshop. Answer briefly and politely. Orders ship within two "
    "working days from the Leipzig warehouse; returns are free within thirty days if the book is unread; gift "
    "cards never expire; the loyalty programme gives one point per euro and a voucher at two hundred points. "
    "Never promise a delivery date, never share another customer's data, and hand payment disputes to a person.",
    "You are a travel assistant for a rail operator. Give short, concrete answers. Tickets are flexible until the "
    "day before travel; seat reservations cost four euros; bicycles need a reservation on long-distance trains; "
    "children under six travel free; delays over an hour earn a quarter of the fare back. If a question is about "
    "another operator's trains, say so and suggest checking with them.",
)

QUESTIONS = (
    "Where is my order?", "Can I return a book I started reading?", "Do gift cards expire?",
    "How do loyalty points work?", "Can you recommend a novel for a long train ride?",
    "What if the parcel arrives damaged?", "Is there a student discount?", "Can I change my delivery address?",
    "How much is a seat reservation?", "Can I take my bike on the train?", "My train was late, what do I get?",
    "Do children need a ticket?", "Can I change the date of my ticket?", "Is there wifi on board?",
)

FOLLOW_UPS = (
    "Thanks. And how long does that take?", "Could you say that more briefly?", "What if that does not work?",
    "Is there anything else I should know?", "Can you give me an example?",
)

TEMPLATE = (
    "Classify the customer message below into one of: billing, delivery, returns, account, other. Reply with the "
    "label only, then one sentence of reasoning.\n\nExamples:\nMessage: I was charged twice.\nLabel: billing\n"
    "Message: The parcel never came.\nLabel: delivery\nMessage: I want my money back for a torn book.\n"
    "Label: returns\n\nMessage: "
)

USERS = tuple(f"user-{i}" for i in range(1, 6))


class Budget:
    """Requests left to send, shared by the clients."""

    def __init__(self, total: int) -> None:
        self.left = total

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def chat(client, model: str, rng: random.Random, budget: Budget, max_tokens: int, stats: dict) -> None:
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                {"role": "user", "content": rng.choice(QUESTIONS)}]
    user = rng.choice(USERS)
    for turn in range(rng.randint(1, 4)):
        if not budget.take():
            return
        if turn:
            messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
        reply = await client.chat.completions.create(model=model, messages=messages, user=user,
                                                     max_tokens=max_tokens, seed=rng.randrange(2**31))
        count(stats, reply.usage)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


async def completion(client, model: str, rng: random.Random, budget: Budget, max_tokens: int, stats: dict) -> None:
    if not budget.take():
        return
    ticket = f"Ticket {rng.randrange(10_000)}: {rng.choice(QUESTIONS)} {rng.choice(FOLLOW_UPS)}\nLabel:"
    reply = await client.completions.create(model=model, prompt=TEMPLATE + ticket, max_tokens=max_tokens // 2,
                                            seed=rng.randrange(2**31))
    count(stats, reply.usage)


def count(stats: dict, usage) -> None:
    stats["requests"] += 1
    stats["prompt"] += usage.prompt_tokens
    details = usage.prompt_tokens_details
    stats["cached"] += (details.cached_tokens or 0) if details is not None else 0


async def one_client(client, model: str, seed: int, budget: Budget, args, stats: dict) -> None:
    rng = random.Random(seed)
    while budget.left > 0:
        task = completion if rng.random() < args.completions_share else chat
        await task(client, model, rng, budget, args.max_tokens, stats)


async def run(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.url, api_key=args.api_key, timeout=300)
    try:
        model = args.model or (await client.models.list()).data[0].id
        budget, stats = Budget(args.requests), {"requests": 0, "prompt": 0, "cached": 0}
        await asyncio.gather(*(one_client(client, model, args.seed * 1000 + i, budget, args, stats)
                               for i in range(args.clients)))
    finally:
        await client.close()
    share = stats["cached"] / stats["prompt"] if stats["prompt"] else 0.0
    print(f"{stats['requests']} requests, {stats['prompt']} prompt tokens, {stats['cached']} cached ({share:.1%})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 base URL")
    parser.add_argument("--model", help="model name (default: the first /v1/models lists)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--requests", type=int, default=89, help="requests in all (default 89)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients (default 3)")
    parser.add_argument("--completions-share", type=float, default=0.2,
                        help="share of tasks that are completions calls (default 0.2)")
    parser.add_argument("--max-tokens", type=int, default=48, help="a chat answer's max_tokens (default 48)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.clients < 1 or not 0 <= args.completions_share <= 1 or args.max_tokens < 2:
        parser.error("--requests, --clients and --max-tokens must be positive, --completions-share within 0-1")
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the SDK's connection and API errors: one line, no traceback
        print(f"chat_traffic: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
