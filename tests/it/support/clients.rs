//! Real clients (curl, Python, reqwest) and raw sockets for what no client sends.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

/// A command with every `*_proxy` variable removed from its environment (curl and
/// Python read them), then `env` applied; killed if dropped before it exits.
pub fn clean_command(program: &str, env: &[(&str, &str)]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|n| n.to_ascii_lowercase().ends_with("_proxy"))
        {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// What one curl invocation produced.
#[derive(Debug)]
pub struct CurlOutput {
    /// curl's exit code.
    pub code: i32,
    /// Status of the last response (0 if none arrived).
    pub status: u16,
    /// Every response head curl received (`-D`), including a proxy's CONNECT answer.
    pub headers: String,
    /// The response body (stdout).
    pub body: Vec<u8>,
    /// curl's error messages.
    pub stderr: String,
}

impl CurlOutput {
    /// The last response head (after any CONNECT answer or `100 Continue`).
    pub fn final_head(&self) -> &str {
        self.headers
            .split("\r\n\r\n")
            .filter(|block| !block.trim().is_empty())
            .last()
            .unwrap_or("")
    }

    /// Every value of header `name` in the last response head.
    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.final_head()
            .lines()
            .skip(1)
            .filter_map(|line| line.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .collect()
    }

    /// The first value of header `name` in the last response head.
    pub fn header(&self, name: &str) -> Option<String> {
        self.header_all(name).into_iter().next()
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Runs `curl -q -sS -D <file> <args>` with a proxy-free environment plus `env`, bounded
/// by [`BOUND`].
pub async fn curl(args: &[&str], env: &[(&str, &str)]) -> CurlOutput {
    let dir = tempfile::tempdir().expect("tempdir");
    let head_file = dir.path().join("head");
    let mut cmd = clean_command("curl", env);
    // -q first: ignore any ~/.curlrc on the machine.
    cmd.args(["-q", "-sS", "--max-time", "30", "-D"])
        .arg(&head_file)
        .args(args);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("curl finished in time")
        .expect("curl runs");
    let headers = std::fs::read_to_string(&head_file).unwrap_or_default();
    let status = headers
        .lines()
        .rfind(|l| l.starts_with("HTTP/"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    CurlOutput {
        code: out.status.code().unwrap_or(-1),
        status,
        headers,
        body: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// What a Python script printed.
#[derive(Debug)]
pub struct PyOutput {
    /// Exit code.
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `python3 -I -c <script>` with a proxy-free environment plus `env`, bounded by
/// [`BOUND`].
pub async fn python(script: &str, env: &[(&str, &str)]) -> PyOutput {
    let mut cmd = clean_command("python3", env);
    cmd.args(["-I", "-c", script]);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("python finished in time")
        .expect("python3 runs");
    PyOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A reqwest client that sends everything through `proxy` (and ignores the
/// environment's proxy settings), optionally trusting `ca`.
pub fn reqwest_via(proxy: &Proxy, ca: Option<&TestCa>) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).expect("proxy URL"))
        .timeout(BOUND);
    if let Some(ca) = ca {
        builder = builder.add_root_certificate(
            reqwest::Certificate::from_pem(ca.ca_pem().as_bytes()).expect("CA PEM"),
        );
    }
    builder.build().expect("reqwest client")
}

/// Sends a GET of every URL through `proxy` at once (concurrent requests open
/// connections of their own) and returns the statuses, in order.
pub async fn get_all_at_once(proxy: &Proxy, urls: impl IntoIterator<Item = String>) -> Vec<u16> {
    let client = reqwest_via(proxy, None);
    let calls = urls.into_iter().map(|url| {
        let client = client.clone();
        async move { client.get(url).send().await.unwrap().status().as_u16() }
    });
    futures_util::future::join_all(calls).await
}

/// Sends `GET /first` through `proxy` and checks it was answered 200. In a group that
/// lets one request through per period, this takes the slot: the next request waits.
pub async fn take_the_slot(proxy: &Proxy, upstream: &Upstream) {
    let first = reqwest_via(proxy, None)
        .get(upstream.url("/first"))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
}

/// A reqwest client that talks to servers directly, never through a proxy.
pub fn reqwest_direct() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(BOUND)
        .build()
        .expect("reqwest client")
}

/// A response read by [`raw_request`].
#[derive(Debug)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Headers in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body (by `Content-Length`, else up to the connection's close).
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Its `Content-Length`, if it has a valid one.
    pub fn content_length(&self) -> Option<usize> {
        self.header("content-length").and_then(|v| v.parse().ok())
    }
}

/// Writes `request` verbatim to `addr` and reads one response; for requests no real
/// client will send (malformed CONNECT targets).
pub async fn raw_request(addr: SocketAddr, request: &[u8]) -> RawResponse {
    tokio::time::timeout(BOUND, async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request).await.expect("write request");
        read_response(&mut stream).await
    })
    .await
    .expect("response within the bound")
}

/// Reads from `stream` to the end of a message head (its blank line); returns the head
/// and the bytes read past it (the start of the body, if any).
pub async fn read_head(stream: &mut TcpStream) -> (Vec<u8>, Vec<u8>) {
    let mut buf = Vec::new();
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.expect("read a head");
        assert!(n > 0, "connection closed before a whole head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let rest = buf.split_off(end);
    (buf, rest)
}

/// Reads one response from `stream`, which stays open for the next request (when the
/// response has a `Content-Length`; without one, the body runs to the close). Bytes
/// read past the response are lost: not for pipelined requests.
pub async fn read_response(stream: &mut TcpStream) -> RawResponse {
    let (mut response, mut body) = read_response_head(stream).await;
    match response.content_length() {
        Some(len) => {
            while body.len() < len {
                let mut chunk = [0u8; 4096];
                let n = stream.read(&mut chunk).await.expect("read body");
                assert!(n > 0, "connection closed inside the body");
                body.extend_from_slice(&chunk[..n]);
            }
            body.truncate(len);
        }
        None => {
            let _ = stream.read_to_end(&mut body).await;
        }
    }
    response.body = body;
    response
}

/// Reads a response head from `stream`: the response with its status and headers and an
/// empty body, and the bytes read past the head.
pub async fn read_response_head(stream: &mut TcpStream) -> (RawResponse, Vec<u8>) {
    let (head, rest) = read_head(stream).await;
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let response = RawResponse {
        status,
        headers,
        body: Vec::new(),
    };
    (response, rest)
}

/// Sends `GET path` as plain HTTP/1.1 down an open tunnel to an upstream that answers
/// `saw <path>`, and reads until that answer has arrived; returns all it read.
pub async fn get_through_tunnel<T>(tunnel: &mut T, authority: &str, path: &str) -> String
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tunnel.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    while !got.ends_with(format!("saw {path}").as_bytes()) {
        let n = tokio::time::timeout(BOUND, tunnel.read(&mut chunk))
            .await
            .expect("an answer through the tunnel")
            .unwrap_or_else(|e| panic!("{path}: the tunnel broke: {e}"));
        assert!(n > 0, "{path}: the tunnel closed");
        got.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A Python script that GETs `{url_prefix}0` … `{url_prefix}{n-1}` one after the other
/// on one `requests` session (which reads the proxy variables) and prints
/// `status body` for each.
pub fn requests_script(url_prefix: &str, n: usize) -> String {
    format!(
        r#"
import requests
s = requests.Session()
for i in range({n}):
    r = s.get("{url_prefix}" + str(i))
    print(r.status_code, r.text)
"#
    )
}

/// A Python script that GETs `{url_prefix}0` … `{url_prefix}{n-1}` all at once with
/// aiohttp (`trust_env=True`: it reads the proxy variables) and prints the sorted
/// statuses.
pub fn aiohttp_script(url_prefix: &str, n: usize) -> String {
    format!(
        r#"
import asyncio, aiohttp
async def main():
    async with aiohttp.ClientSession(trust_env=True) as s:
        async def one(i):
            async with s.get("{url_prefix}" + str(i)) as r:
                return r.status
        print(sorted(await asyncio.gather(*(one(i) for i in range({n})))))
asyncio.run(main())
"#
    )
}
