// An upstream limited by express-rate-limit, as an app would configure it: one key for
// every caller, `limit` requests per `windowMs`. `headers` is `legacy` (X-RateLimit-*,
// Reset in Unix seconds rounded up) or a standard draft (`draft-6`, `draft-7`,
// `draft-8`). Prints `listening <port>`, then `<CLOCK_MONOTONIC ns> <status>` for every
// request as it is answered (the time is its arrival). Loopback only.
//
//     node limiter-express.js LIMIT WINDOW_MS HEADERS
const express = require('express');
const { rateLimit } = require('express-rate-limit');

const [limit, windowMs, headers] = process.argv.slice(2);
const app = express();
app.use((req, res, next) => {
  const arrived = process.hrtime.bigint();
  res.on('finish', () => process.stdout.write(`${arrived} ${res.statusCode}\n`));
  next();
});
app.use(rateLimit({
  windowMs: Number(windowMs),
  limit: Number(limit),
  legacyHeaders: headers === 'legacy',
  standardHeaders: headers === 'legacy' ? false : headers,
  keyGenerator: () => 'every caller',
}));
app.use((req, res) => res.send('ok'));
const server = app.listen(0, '127.0.0.1', () => {
  process.stdout.write(`listening ${server.address().port}\n`);
});
