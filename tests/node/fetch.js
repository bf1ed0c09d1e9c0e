// Fetches each URL given on the command line, one after the other, with Node's fetch as
// an app would set it up to honour HTTP_PROXY / HTTPS_PROXY: undici's EnvHttpProxyAgent.
// Prints "<status> <body>" per URL.
const { EnvHttpProxyAgent, fetch } = require("undici");

async function main() {
  const dispatcher = new EnvHttpProxyAgent();
  for (const url of process.argv.slice(2)) {
    const response = await fetch(url, { dispatcher });
    console.log(`${response.status} ${await response.text()}`);
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
