// Chat calls through tollgate with Node's official `openai` package, its retries off.
//
//   node llm-calls.js BASE_URL CALLS CLIENTS
//
// CALLS calls from CLIENTS concurrent loops, prompts of 0.1 to 4 KiB of words, max
// output 50 to 1 000 tokens, every third one streamed with `include_usage`. Prints one
// JSON line: {"ok": n, "failed": ["error", ...], "usage": [input, output]}.
//
// With HTTPS_PROXY set, calls go through it as undici's documentation shows: a
// ProxyAgent as the dispatcher of undici's fetch, handed to the client (Node's own
// fetch reads no proxy variable); NODE_EXTRA_CA_CERTS trusts an intercepting proxy.
"use strict";
const { OpenAI } = require("openai");
const undici = require("undici");

function proxiedFetch() {
  const proxy = process.env.HTTPS_PROXY;
  if (!proxy) return undefined;
  const dispatcher = new undici.ProxyAgent(proxy);
  return (url, init) => undici.fetch(url, { ...init, dispatcher });
}

const WORDS = ("the quick brown fox jumps over a lazy dog while rate limits " +
  "queue tokens and answers stream back to every patient client").split(" ");

// A small deterministic generator, so that every run asks the same.
function rng(seed) {
  let x = seed * 2654435761 % 4294967296 || 1;
  return (lo, hi) => {
    x = (x * 1664525 + 1013904223) % 4294967296;
    return lo + (x % (hi - lo + 1));
  };
}

async function call(client, i) {
  const r = rng(i + 1);
  let prompt = "";
  const size = r(100, 4096);
  while (prompt.length < size) prompt += WORDS[r(0, WORDS.length - 1)] + " ";
  const args = { model: "gpt-4o-mini", max_tokens: r(50, 1000),
    messages: [{ role: "user", content: prompt }] };
  if (i % 3 !== 0) {
    const answer = await client.chat.completions.create(args);
    return [answer.usage.prompt_tokens, answer.usage.completion_tokens];
  }
  const stream = await client.chat.completions.create({ ...args, stream: true,
    stream_options: { include_usage: true } });
  let usage = null;
  for await (const chunk of stream) if (chunk.usage) usage = chunk.usage;
  return [usage.prompt_tokens, usage.completion_tokens];
}

async function main() {
  const [base, calls, clients] = [process.argv[2], +process.argv[3], +process.argv[4]];
  const client = new OpenAI({ baseURL: base, apiKey: "sk-test", maxRetries: 0,
    timeout: 300000, fetch: proxiedFetch() });
  let next = 0;
  const used = [], failed = [];
  async function loop() {
    while (next < calls) {
      const i = next++;
      try { used.push(await call(client, i)); } catch (e) { failed.push(String(e)); }
    }
  }
  await Promise.all(Array.from({ length: clients }, loop));
  console.log(JSON.stringify({ ok: used.length, failed,
    usage: [used.reduce((s, u) => s + u[0], 0), used.reduce((s, u) => s + u[1], 0)] }));
}

main();
