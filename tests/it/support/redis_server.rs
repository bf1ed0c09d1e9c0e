//! A redis-server of a test's own, on a Unix socket in a temporary directory, stopped
//! (by its PID) when dropped.

use super::*;

/// A real `redis-server`, stopped by PID when dropped. `scripts/test` installs it
/// where missing.
pub struct RedisServer {
    child: Option<std::process::Child>,
    dir: tempfile::TempDir,
}

/// A redis-server of this test's own, on a Unix socket in a temporary directory: no TCP
/// port to find free, and a restart takes the same path back with nobody in between.
impl RedisServer {
    pub async fn start() -> RedisServer {
        let mut server = RedisServer {
            child: None,
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        server.restart().await;
        server
    }

    pub fn socket(&self) -> std::path::PathBuf {
        self.dir.path().join("redis.sock")
    }

    pub fn url(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    /// A connection to it.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url()).unwrap();
        client.get_multiplexed_async_connection().await.unwrap()
    }

    /// Waits until `key` exists.
    pub async fn wait_for_key(&self, key: &str) {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let exists = within_bound(async || {
            let exists: bool = redis::cmd("EXISTS")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
            exists.then_some(())
        })
        .await;
        assert!(exists.is_some(), "{key} never appeared in Redis");
    }

    /// Starts (again) on the same socket and waits until it answers PING.
    pub async fn restart(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(self.socket())
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        self.child = Some(child);
        let answers = within_bound(async || {
            let client = redis::Client::open(self.url()).ok()?;
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let pong = redis::cmd("PING").query_async::<String>(&mut conn).await;
            pong.ok().map(drop)
        })
        .await;
        assert!(answers.is_some(), "redis-server did not start");
    }

    /// Stops it for good (SIGKILL, like a crash).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let status = std::process::Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .expect("kill runs");
            assert!(status.success());
        }
    }

    /// Freezes it (SIGSTOP): connections stay open, nothing is answered.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    pub async fn keys(&self) -> Vec<String> {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut conn)
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.thaw();
        self.kill();
    }
}
