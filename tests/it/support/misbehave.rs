//! Servers that misbehave, and addresses nothing listens on.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// A TCP listener on 127.0.0.1:0 that accepts connections, reads whatever arrives and
/// never writes a byte: a TLS handshake never completes, a request is never answered.
pub struct Silent {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Silent {
    /// Starts listening.
    pub async fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind silent");
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                conns.spawn(async move {
                    let mut buf = [0u8; 4096];
                    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        Silent {
            addr,
            connections,
            task,
        }
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback port that refuses connections, held for as long as the guard lives: its
/// socket is bound but never listens, so a connection gets a reset and no other socket
/// can take the port meanwhile (a port bound and released could be reused by anyone).
pub struct ClosedPort(tokio::net::TcpSocket);

impl ClosedPort {
    pub fn new() -> ClosedPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.1:0".parse().unwrap()).expect("bind");
        ClosedPort(socket)
    }

    /// Its address: connections to it are refused.
    pub fn addr(&self) -> SocketAddr {
        self.0.local_addr().expect("bound")
    }
}

impl Default for ClosedPort {
    fn default() -> ClosedPort {
        ClosedPort::new()
    }
}
