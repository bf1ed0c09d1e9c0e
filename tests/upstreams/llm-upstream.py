#!/usr/bin/env python3
"""An LLM API upstream that limits tokens as OpenAI and Anthropic document it.

    llm-upstream.py openai    --tokens N [--period S]
    llm-upstream.py anthropic --input-tokens N --output-tokens M [--period S]
    ... [--tls CERT KEY]     (HTTPS with this certificate and key, PEM)

Each limit is a token bucket: N tokens when full, refilled continuously, full again
after `period` seconds (60 for the providers; shorter in tests). A request is
admitted on its prompt tokens plus its `max_tokens` (OpenAI: plus
`max_completion_tokens`), charged at once, and corrected to its usage when the answer
has been generated (before its usage is sent), as Anthropic documents; a request that does not fit gets the provider's 429 and
error body. Prompt tokens are counted by this server's own tokenizer (words and
punctuation), which is not the proxy's estimate, as a provider's is not.

Answers carry the provider's rate-limit headers (OpenAI: `x-ratelimit-*-tokens`,
resets as Go durations; Anthropic: `anthropic-ratelimit-{input,output}-tokens-*`,
resets as RFC 3339 times, `retry-after` on a 429), JSON or, with `"stream": true`,
server-sent events with usage as each provider sends it.

Each event of a stream's text carries `sent_ns`, the upstream's CLOCK_MONOTONIC when
it was written (scripts/bench-llm measures what passing through tollgate adds).

Prints `listening <port>`, then `<CLOCK_MONOTONIC ns> <status>` per request.
`GET /stats` answers what it admitted, refused and was told was used.
"""

import argparse
import asyncio
import datetime
import json
import random
import re
import ssl
import sys
import time

from aiohttp import web

WORD = re.compile(r"\w+|[^\w\s]")


class Bucket:
    def __init__(self, limit, period):
        self.limit = limit
        self.per_second = limit / period
        self.level = float(limit)
        self.at = time.monotonic()
        self.lowest = float(limit)

    def refill(self):
        now = time.monotonic()
        self.level = min(self.limit, self.level + (now - self.at) * self.per_second)
        self.at = now

    def take(self, n):
        self.refill()
        self.level = min(self.limit, self.level - n)
        self.lowest = min(self.lowest, self.level)

    def reset_seconds(self):
        self.refill()
        return max(0.0, (self.limit - self.level) / self.per_second)


def go_duration(seconds):
    """A Go duration as OpenAI sends it: 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    if minutes:
        return f"{int(minutes)}m{rest:.0f}s" if rest == int(rest) else f"{int(minutes)}m{rest:.2f}s"
    return f"{rest:.3g}s"


def rfc3339_in(seconds):
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def prompt_tokens(body):
    texts = []
    for message in body.get("messages", []):
        content = message.get("content", "")
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content)
        texts.append(content)
        texts.append("")  # a few tokens of overhead per message
    system = body.get("system")
    if isinstance(system, str):
        texts.append(system)
    return sum(len(WORD.findall(t)) + 3 for t in texts)


class Server:
    def __init__(self, args):
        self.dialect = args.dialect
        if self.dialect == "openai":
            self.buckets = {"total": Bucket(args.tokens, args.period)}
        else:
            self.buckets = {
                "input": Bucket(args.input_tokens, args.period),
                "output": Bucket(args.output_tokens, args.period),
            }
        self.stats = {"admitted": 0, "refused": 0, "used_input": 0, "used_output": 0,
                      "first": None, "last": None, "streamed": 0}
        self.rng = random.Random(7)

    def log(self, status):
        print(time.clock_gettime_ns(time.CLOCK_MONOTONIC), status, flush=True)

    def charges(self, prompt, max_out):
        if self.dialect == "openai":
            return {"total": prompt + max_out}
        return {"input": prompt, "output": max_out}

    def headers(self):
        if self.dialect == "openai":
            b = self.buckets["total"]
            return {
                "x-ratelimit-limit-requests": "10000",
                "x-ratelimit-remaining-requests": "9999",
                "x-ratelimit-reset-requests": "6ms",
                "x-ratelimit-limit-tokens": str(b.limit),
                "x-ratelimit-remaining-tokens": str(max(0, int(b.level))),
                "x-ratelimit-reset-tokens": go_duration(b.reset_seconds()),
            }
        out = {}
        for kind, b in self.buckets.items():
            prefix = f"anthropic-ratelimit-{kind}-tokens"
            out[f"{prefix}-limit"] = str(b.limit)
            out[f"{prefix}-remaining"] = str(max(0, int(b.level)))
            out[f"{prefix}-reset"] = rfc3339_in(b.reset_seconds())
        return out

    def refusal(self, short):
        wait = max(b.reset_seconds() for b in self.buckets.values())
        headers = self.headers()
        if self.dialect == "openai":
            body = {"error": {"message": f"Rate limit reached on tokens per min (TPM): "
                              f"Please try again in {wait:.3f}s.", "type": "tokens",
                              "param": None, "code": "rate_limit_exceeded"}}
        else:
            headers["retry-after"] = str(max(1, int(wait + 0.999)))
            body = {"type": "error", "error": {"type": "rate_limit_error",
                                               "message": f"Number of {short} tokens exceeds your rate limit."}}
        return web.json_response(body, status=429, headers=headers)

    async def complete(self, request):
        body = await request.json()
        prompt = prompt_tokens(body)
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 4096
        charges = self.charges(prompt, max_out)
        for kind, n in charges.items():
            b = self.buckets[kind]
            b.refill()
            if n > b.level:
                self.stats["refused"] += 1
                self.log(429)
                return self.refusal(kind)
        for kind, n in charges.items():
            self.buckets[kind].take(n)
        now = time.monotonic()
        self.stats["first"] = self.stats["first"] or now
        self.stats["admitted"] += 1
        output = self.rng.randint(max(1, max_out // 4), max_out)
        headers = self.headers()

        def generated():
            # The charge becomes the usage once the answer is generated, before its
            # usage is sent.
            used = self.charges(prompt, output)
            for kind, n in charges.items():
                self.buckets[kind].take(used[kind] - n)
            self.stats["used_input"] += prompt
            self.stats["used_output"] += output
            self.stats["last"] = time.monotonic()

        if body.get("stream"):
            self.stats["streamed"] += 1
            response = await self.stream(request, body, prompt, output, headers, generated)
        else:
            generated()
            response = web.json_response(self.answer(body, prompt, output), headers=headers)
        self.log(200)
        return response

    def answer(self, body, prompt, output):
        text = "word " * output
        if self.dialect == "openai":
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "m"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                              "total_tokens": prompt + output}}
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model", "m"),
                "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens",
                "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": output}}

    async def stream(self, request, body, prompt, output, headers, generated):
        headers = dict(headers, **{"content-type": "text/event-stream"})
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        parts = [output // 3, output // 3, output - 2 * (output // 3)]

        async def send(event, data):
            head = f"event: {event}\n" if event else ""
            await response.write(f"{head}data: {json.dumps(data)}\n\n".encode())

        if self.dialect == "openai":
            for n in parts:
                await send(None, {"id": "c", "object": "chat.completion.chunk", "created": 0,
                                  "model": "m", "choices": [{"index": 0, "delta": {"content": "word " * n},
                                                             "finish_reason": None}],
                                  "sent_ns": time.clock_gettime_ns(time.CLOCK_MONOTONIC)})
                await asyncio.sleep(0.005)
            generated()
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(None, {"id": "c", "object": "chat.completion.chunk", "created": 0,
                                  "model": "m", "choices": [],
                                  "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                                            "total_tokens": prompt + output}})
            await response.write(b"data: [DONE]\n\n")
        else:
            await send("message_start", {"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": 1}}})
            await send("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
            for n in parts:
                await send("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": "word " * n},
                                                   "sent_ns": time.clock_gettime_ns(time.CLOCK_MONOTONIC)})
                await asyncio.sleep(0.005)
            await send("content_block_stop", {"type": "content_block_stop", "index": 0})
            generated()
            await send("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                         "usage": {"output_tokens": output}})
            await send("message_stop", {"type": "message_stop"})
        await response.write_eof()
        return response

    async def stats_page(self, _request):
        limits = {kind: {"limit": b.limit, "per_second": b.per_second, "lowest": b.lowest}
                  for kind, b in self.buckets.items()}
        return web.json_response(dict(self.stats, limits=limits))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dialect", choices=["openai", "anthropic"])
    parser.add_argument("--tokens", type=int, default=0)
    parser.add_argument("--input-tokens", type=int, default=0)
    parser.add_argument("--output-tokens", type=int, default=0)
    parser.add_argument("--period", type=float, default=60.0)
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    args = parser.parse_args()
    server = Server(args)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.complete)
    app.router.add_post("/v1/messages", server.complete)
    app.router.add_get("/stats", server.stats_page)

    async def run():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        tls = None
        if args.tls:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(*args.tls)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(f"listening {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
