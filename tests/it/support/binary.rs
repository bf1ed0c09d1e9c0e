//! The built `tollgate` binary as a child process: what users run, started the way
//! they start it, on ports the kernel chooses.
//!
//! The config a test writes goes to a file in a temporary directory; the proxy listens
//! on 127.0.0.1:0 (`--listen`), and the address it bound is read from its first log
//! line, as is the admin listener's when the config asks for `[admin] listen =
//! "127.0.0.1:0"` ([`ADMIN_ON_PORT_0`]). The process is killed when its handle drops.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};

use super::*;

/// A config section that puts the admin endpoints on a port the kernel chooses.
pub const ADMIN_ON_PORT_0: &str = "\n[admin]\nlisten = \"127.0.0.1:0\"\n";

/// How to start the binary: the config, and what to add to its command line and
/// environment. [`Launch::start`] runs it.
pub struct Launch {
    config: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    listen_flag: bool,
    wrapper: Vec<String>,
}

impl Launch {
    /// Runs the binary through `program args…` (a wrapper that execs it, such as
    /// `prlimit`), so the process is still tollgate's.
    pub fn via(mut self, program: &str, args: &[&str]) -> Launch {
        self.wrapper = std::iter::once(program)
            .chain(args.iter().copied())
            .map(String::from)
            .collect();
        self
    }

    /// One more command-line argument (after `--config FILE`).
    pub fn arg(mut self, arg: &str) -> Launch {
        self.args.push(arg.to_string());
        self
    }

    /// One more environment variable (the environment is otherwise proxy-free, with
    /// `RUST_LOG=info`).
    pub fn env(mut self, name: &str, value: &str) -> Launch {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Leaves `--listen 127.0.0.1:0` off the command line: the config or the
    /// environment says where to listen (it should still be port 0).
    pub fn without_listen_flag(mut self) -> Launch {
        self.listen_flag = false;
        self
    }

    /// Starts the binary and waits until it listens; panics, with its log, if it exits
    /// first.
    pub async fn start(self) -> Tollgate {
        let dir = tempfile::tempdir().expect("temporary directory");
        let config = write_file(dir.path(), "config.toml", &self.config);
        let log = dir.path().join("stderr.log");
        let mut env: Vec<(&str, &str)> = vec![("RUST_LOG", "info")];
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let binary = env!("CARGO_BIN_EXE_tollgate");
        let mut command = match self.wrapper.split_first() {
            None => clean_command(binary, &[]),
            Some((program, args)) => {
                let mut command = clean_command(program, &[]);
                command.args(args).arg(binary);
                command
            }
        };
        // Only what the test says: none of the runner's own settings for tollgate.
        for name in [
            "TOLLGATE_CONFIG",
            "TOLLGATE_LISTEN",
            "TOLLGATE_WORKER_THREADS",
            "NO_COLOR",
        ] {
            command.env_remove(name);
        }
        command.envs(env).arg("--config").arg(&config);
        if self.listen_flag {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        let child = command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("tollgate runs");
        let mut tollgate = Tollgate {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: None,
            config,
            log,
            _dir: dir,
        };
        let line = tollgate.wait_for_log("tollgate listening").await;
        tollgate.addr = listen_field(&line).expect("the listening line names the address");
        tollgate.admin = tollgate
            .log()
            .lines()
            .find(|l| l.contains("admin endpoints listening"))
            .and_then(listen_field);
        tollgate
    }
}

/// The `listen` field of a log line, text (`listen=ADDR`) or JSON (`"listen":"ADDR"`).
fn listen_field(line: &str) -> Option<SocketAddr> {
    let text = line
        .split_once("listen=")
        .map(|(_, rest)| rest.split_whitespace().next().unwrap_or(""));
    let json = || {
        line.split_once("\"listen\":\"")
            .and_then(|(_, rest)| rest.split('"').next())
    };
    text.or_else(json)?.parse().ok()
}

/// A running `tollgate` process.
pub struct Tollgate {
    child: tokio::process::Child,
    /// Where the proxy listens.
    pub addr: SocketAddr,
    /// Where the admin endpoints listen, when the config has `[admin]`.
    pub admin: Option<SocketAddr>,
    config: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tollgate {
    /// Starts the binary with `config_toml` (loopback allowed unless it has an
    /// `[access]` table of its own).
    pub async fn start(config_toml: &str) -> Tollgate {
        Tollgate::launch(config_toml).start().await
    }

    /// Prepares a start with `config_toml` (loopback allowed unless it has an
    /// `[access]` table), to add arguments or environment first.
    pub fn launch(config_toml: &str) -> Launch {
        Launch {
            config: allowing_loopback(config_toml),
            args: Vec::new(),
            env: Vec::new(),
            listen_flag: true,
            wrapper: Vec::new(),
        }
    }

    /// `http://ADDR`, the value of `HTTP_PROXY` for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The config file it was started with, to rewrite before a reload.
    pub fn config_path(&self) -> &std::path::Path {
        &self.config
    }

    /// Everything it has logged so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// Waits until a log line contains `needle`, and returns that line; panics, with
    /// the log, if the process exits first or [`BOUND`] passes.
    pub async fn wait_for_log(&mut self, needle: &str) -> String {
        let found = within_bound(async || {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| l.contains(needle)) {
                return Some(line.to_string());
            }
            if let Some(status) = self.child.try_wait().expect("child status") {
                panic!("tollgate exited ({status}) before logging {needle:?}:\n{log}");
            }
            None
        })
        .await;
        found.unwrap_or_else(|| panic!("tollgate never logged {needle:?}:\n{}", self.log()))
    }

    /// The process id, to signal it.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("still running")
    }

    /// Sends `signal` (`"TERM"`, `"INT"`, `"HUP"`) with kill(1).
    pub async fn signal(&self, signal: &str) {
        let status = clean_command("kill", &[])
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .await
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits, at most [`BOUND`], for the process to exit.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        tokio::time::timeout(BOUND, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("tollgate did not exit:\n{}", self.log()))
            .expect("child status")
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("child status").is_none()
    }

    /// GETs `path` from the admin listener and returns the status and body.
    pub async fn admin(&self, path: &str) -> (u16, String) {
        let admin = self
            .admin
            .expect("the config has [admin] (ADMIN_ON_PORT_0)");
        let resp = reqwest_direct()
            .get(format!("http://{admin}{path}"))
            .send()
            .await
            .expect("admin answers");
        let status = resp.status().as_u16();
        (status, resp.text().await.expect("admin body"))
    }

    /// The value of the metric whose line starts with `series` (name and labels),
    /// 0 when `/metrics` has no such line yet.
    pub async fn metric(&self, series: &str) -> f64 {
        let (_, metrics) = self.admin("/metrics").await;
        metric_value(&metrics, series).unwrap_or(0.0)
    }

    /// Waits until the metric `series` reaches `value`.
    pub async fn wait_metric(&self, series: &str, value: f64) {
        let reached = within_bound(async || {
            let (_, metrics) = self.admin("/metrics").await;
            (metric_value(&metrics, series) == Some(value)).then_some(())
        })
        .await;
        if reached.is_none() {
            let (_, metrics) = self.admin("/metrics").await;
            panic!("{series} never reached {value}:\n{metrics}");
        }
    }
}

/// The value on the line of `metrics` that starts with `series` and a space.
pub fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}
