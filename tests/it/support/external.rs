//! Upstreams that are programs nobody here wrote (a limiter library behind its web
//! framework, nginx): started on loopback, each request's arrival and status read back
//! from their own log, stopped by PID when dropped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use super::*;

/// A running upstream program.
pub struct External {
    child: Child,
    port: u16,
    /// `<time> <status>` lines: from its standard output, or from `log_file`.
    lines: Arc<Mutex<Vec<String>>>,
    log_file: Option<PathBuf>,
    _dir: Option<tempfile::TempDir>,
}

impl External {
    /// Starts `program` with `args`; it prints `listening <port>`, then one
    /// `<CLOCK_MONOTONIC ns> <status>` line per request.
    pub fn start(program: &str, args: &[&str]) -> External {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} is needed by this test (scripts/test): {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        let port = first
            .strip_prefix("listening ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("{program} {args:?} said {first:?}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        External {
            child,
            port,
            lines,
            log_file: None,
            _dir: None,
        }
    }

    /// nginx on a free loopback port, limiting every request with `limit_req` at `rate`
    /// (its notation, e.g. `5r/s`) for the one client address tollgate dials from, no
    /// burst, refusing with `429`; its access log has
    /// `$msec $status` per request.
    pub async fn nginx_limit_req(rate: &str) -> External {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("index.html"), "ok").unwrap();
        let log = dir.path().join("access.log");
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let root = dir.path().display();
            let config = format!(
                "daemon off;\nworker_processes 1;\nerror_log {root}/error.log;\npid {root}/nginx.pid;\n\
                 events {{ worker_connections 256; }}\n\
                 http {{\n  log_format t '$msec $status';\n  access_log {root}/access.log t;\n\
                 limit_req_zone $binary_remote_addr zone=all:1m rate={rate};\n\
                 server {{\n    listen 127.0.0.1:{port};\n    root {root};\n\
                 location / {{ limit_req zone=all; limit_req_status 429; try_files /index.html =404; }}\n  }}\n}}\n"
            );
            let file = dir.path().join("nginx.conf");
            std::fs::write(&file, config).unwrap();
            let mut child = Command::new(nginx_binary())
                .arg("-c")
                .arg(&file)
                .arg("-p")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nginx");
            // Listening, or gone (someone took the port meanwhile: another one then).
            let listening = within_bound(async || {
                if child.try_wait().unwrap().is_some() {
                    return Some(false);
                }
                std::net::TcpStream::connect(("127.0.0.1", port))
                    .is_ok()
                    .then_some(true)
            })
            .await;
            if listening == Some(true) {
                return External {
                    child,
                    port,
                    lines: Arc::default(),
                    log_file: Some(log),
                    _dir: Some(dir),
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("nginx did not start");
    }

    /// A URL on it.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Every request it answered: (seconds on its clock, status), in arrival order.
    pub fn answered(&self) -> Vec<(f64, u16)> {
        let answered = self.answered_by();
        answered.into_iter().map(|(t, s, _)| (t, s)).collect()
    }

    /// Every request it answered: (seconds on its clock, status, the rest of its line:
    /// the caller, for the programs that print one), in arrival order.
    pub fn answered_by(&self) -> Vec<(f64, u16, String)> {
        let lines = match &self.log_file {
            Some(file) => std::fs::read_to_string(file)
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect(),
            None => self.lines.lock().unwrap().clone(),
        };
        let mut answered: Vec<(f64, u16, String)> = lines
            .iter()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let (time, status) = (fields.next()?, fields.next()?);
                let time: f64 = time.parse().ok()?;
                // nanoseconds from the programs that print them, seconds from nginx
                let seconds = if self.log_file.is_some() {
                    time
                } else {
                    time / 1e9
                };
                let rest = fields.collect::<Vec<_>>().join(" ");
                Some((seconds, status.parse().ok()?, rest))
            })
            .collect();
        answered.sort_by(|a, b| a.0.total_cmp(&b.0));
        answered
    }
}

impl Drop for External {
    /// Asks the program to stop (SIGTERM) and waits a little before killing it: nginx's
    /// master stops its workers on SIGTERM, while SIGKILL would leave them running.
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let asked = Command::new("kill").args(["-TERM", &pid]).status();
        if asked.is_ok_and(|s| s.success()) {
            for _ in 0..100 {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx, on the PATH or where Debian puts it.
pub fn nginx_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join("nginx"))
        .find(|candidate| candidate.is_file());
    let debian = PathBuf::from("/usr/sbin/nginx");
    on_path
        .or_else(|| debian.is_file().then_some(debian))
        .expect("nginx is needed by this test: run scripts/test, or apt-get install nginx-light")
}
