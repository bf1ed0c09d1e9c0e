//! Bytes copied both ways between a client and an upstream once HTTP is done with
//! them: a CONNECT tunnel ([`crate::tunnel`]) and a switch of protocols after a `101`
//! (`upstream/upgrade.rs`), and what keeps the client's connection open meanwhile.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// Something the client's connection needs kept alive while a tunnel opened on it is
/// open: an HTTP/2 connection counts its open streams to close itself when idle, and a
/// tunnel is an open stream long after its `200` (see `server.rs`). The server puts it
/// in the CONNECT request's extensions; the tunnel holds it until it closes.
#[derive(Clone)]
pub struct KeepWhileOpen {
    /// Held, never read: dropping it is what tells the connection.
    _open: Arc<dyn Any + Send + Sync>,
}

impl KeepWhileOpen {
    /// Keeps `open` alive while the tunnel is.
    pub fn new(open: Arc<dyn Any + Send + Sync>) -> KeepWhileOpen {
        KeepWhileOpen { _open: open }
    }
}

/// After one side of a tunnel has closed, how long the other may go on sending.
///
/// A plain bidirectional copy waits for both directions to end, so a client that hangs
/// up in front of an upstream that never speaks again would hold the tunnel (and its
/// concurrency permit) forever.
const LINGER: Duration = Duration::from_secs(5);

/// Copies bytes both ways until one side closes and the other has finished or lingered
/// [`LINGER`]; returns the bytes sent up and down. Tunnels and switched protocols
/// (WebSocket) use it.
pub async fn relay(
    client: impl AsyncRead + AsyncWrite,
    upstream: impl AsyncRead + AsyncWrite,
) -> (u64, u64) {
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut upstream_read, mut upstream_write) = tokio::io::split(upstream);
    let up = async {
        let sent = tokio::io::copy(&mut client_read, &mut upstream_write).await;
        let _ = upstream_write.shutdown().await;
        sent.unwrap_or(0)
    };
    let down = async {
        let sent = tokio::io::copy(&mut upstream_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
        sent.unwrap_or(0)
    };
    tokio::pin!(up, down);
    tokio::select! {
        sent_up = &mut up => {
            let sent_down = tokio::time::timeout(LINGER, &mut down).await.unwrap_or(0);
            (sent_up, sent_down)
        }
        sent_down = &mut down => {
            let sent_up = tokio::time::timeout(LINGER, &mut up).await.unwrap_or(0);
            (sent_up, sent_down)
        }
    }
}
