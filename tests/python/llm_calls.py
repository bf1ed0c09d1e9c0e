#!/usr/bin/env python3
"""Chat calls through tollgate with the official OpenAI or Anthropic Python SDK.

    llm_calls.py openai|anthropic BASE_URL CALLS CLIENTS

CALLS calls from CLIENTS threads, prompts of 0.1 to 4 KiB of words, max output 50 to
1 000 tokens, every third one streamed (OpenAI's with `include_usage`). The SDKs' own
retries are off: a call that fails is tollgate's failure. Prints one JSON line:
`{"ok": n, "failed": ["error", ...], "usage": [input, output]}` (the usage the SDK read).
"""

import concurrent.futures
import json
import random
import sys

WORDS = ("the quick brown fox jumps over a lazy dog while rate limits "
         "queue tokens and answers stream back to every patient client").split()


def prompt(rng):
    size = rng.randint(100, 4096)
    words = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def openai_call(client, rng, stream):
    args = dict(model="gpt-4o-mini", messages=[{"role": "user", "content": prompt(rng)}],
                max_tokens=rng.randint(50, 1000))
    if not stream:
        answer = client.chat.completions.create(**args)
        return answer.usage.prompt_tokens, answer.usage.completion_tokens
    usage = None
    chunks = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args)
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
    return usage.prompt_tokens, usage.completion_tokens


def anthropic_call(client, rng, stream):
    args = dict(model="claude-sonnet-4-5", max_tokens=rng.randint(50, 1000),
                messages=[{"role": "user", "content": prompt(rng)}])
    if not stream:
        answer = client.messages.create(**args)
        return answer.usage.input_tokens, answer.usage.output_tokens
    with client.messages.stream(**args) as events:
        final = events.get_final_message()
    return final.usage.input_tokens, final.usage.output_tokens


def main():
    dialect, base_url, calls, clients = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if dialect == "openai":
        import openai
        client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=300)
        call = openai_call
    else:
        import anthropic
        client = anthropic.Anthropic(base_url=base_url, api_key="sk-ant-test", max_retries=0, timeout=300)
        call = anthropic_call

    def one(i):
        rng = random.Random(i)
        try:
            return call(client, rng, stream=(i % 3 == 0)), None
        except Exception as e:  # every failure is reported, none is fatal
            return None, f"{type(e).__name__}: {e}"

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(calls)))
    used = [r for r, _ in results if r]
    print(json.dumps({
        "ok": len(used),
        "failed": [e for _, e in results if e],
        "usage": [sum(u[0] for u in used), sum(u[1] for u in used)],
    }))


if __name__ == "__main__":
    main()
