//! The kernel's table of TCP sockets (`/proc/net/tcp`, `/proc/net/tcp6`): what a test
//! can see of a connection that neither end reports, such as bytes still unread or a
//! close that has arrived.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The `st` of a connection that is open both ways.
pub const TCP_ESTABLISHED: u8 = 0x01;
/// The `st` of a listening socket.
pub const TCP_LISTEN: u8 = 0x0A;

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The TCP state (`TCP_ESTABLISHED`, `TCP_LISTEN`, …).
    pub state: u8,
    /// Bytes written and not yet acknowledged by the other end.
    pub tx_queue: u64,
    /// Bytes received and not yet read by the program (for a listener: connections
    /// waiting to be accepted).
    pub rx_queue: u64,
    /// The inode, as `/proc/PID/fd` links name the socket (`socket:[INODE]`).
    pub inode: String,
}

/// Every TCP socket of this network namespace, IPv4 and IPv6 (IPv4-mapped addresses as
/// IPv4).
pub fn tcp_sockets() -> Vec<TcpSocket> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|table| {
            let text = std::fs::read_to_string(table).unwrap_or_default();
            text.lines().skip(1).filter_map(row).collect::<Vec<_>>()
        })
        .collect()
}

/// `sl local_address rem_address st tx_queue:rx_queue tr tm->when retrnsmt uid timeout inode …`
fn row(line: &str) -> Option<TcpSocket> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (tx, rx) = fields.get(4)?.split_once(':')?;
    Some(TcpSocket {
        local: address(fields.get(1)?)?,
        remote: address(fields.get(2)?)?,
        state: u8::from_str_radix(fields.get(3)?, 16).ok()?,
        tx_queue: u64::from_str_radix(tx, 16).ok()?,
        rx_queue: u64::from_str_radix(rx, 16).ok()?,
        inode: fields.get(9)?.to_string(),
    })
}

/// `HEXIP:HEXPORT`: the address as the kernel holds it, printed one 32-bit word at a
/// time in this machine's byte order; the port as a number.
fn address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let mut bytes = Vec::with_capacity(16);
    for word in ip.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?).to_canonical(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_str_radix(port, 16).ok()?))
}

/// The waits that read this table pass vacuously if it is misread: a connection must
/// show, both its ends, established.
#[tokio::test]
async fn a_loopback_connection_shows_both_its_ends() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let _server = listener.accept().await.unwrap();
    let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
    let sockets = tcp_sockets();
    let state = |local, remote| {
        (sockets.iter())
            .find(|s| s.local == local && s.remote == remote)
            .map(|s| s.state)
    };
    assert_eq!(state(ours, theirs), Some(TCP_ESTABLISHED), "{sockets:?}");
    assert_eq!(state(theirs, ours), Some(TCP_ESTABLISHED), "{sockets:?}");
}
