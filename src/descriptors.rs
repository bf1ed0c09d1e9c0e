//! File descriptors, set up once at start: as many as the system allows, and the
//! process's descriptor table grown to its working size before any other thread exists.
//!
//! Every waiting request holds its client's socket, so a queue of 10 000 needs 10 000
//! descriptors, and the usual soft limit (1 024) would refuse connections long before
//! the queue is full. The soft limit is raised to the hard one, as most servers do.
//!
//! Why grow the table early: Linux grows a process's descriptor table by doubling (64,
//! 128, …, 4 096, …) when a new descriptor does not fit, and in a multi-threaded process
//! each growth waits out an RCU grace period (`synchronize_rcu` in the kernel's
//! `expand_fdtable`). Meanwhile every thread that opens a descriptor sleeps: accepts and
//! upstream connects stop, for 20–50 ms on a 2-core machine. A group at `50/s` then
//! sends one request that much late, and all later slots with it. Grown here, while the process has one thread,
//! the table never needs that wait below [`TABLE_AT_START`] descriptors. The table only
//! costs kernel memory: 8 bytes per slot, 128 KiB for 16 384.

use std::fs::File;
use std::io;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors the table is grown to at start (or the limit, if lower): the default
/// `queue` of 10 000 waiting requests plus room for in-flight requests, their upstream
/// connections and tunnels. Beyond it the table still grows, one grace period per
/// doubling.
pub const TABLE_AT_START: u64 = 16_384;

/// What [`prepare`] found and did.
#[derive(Debug)]
pub struct Descriptors {
    /// The soft limit on open descriptors before [`prepare`] (`None`: unlimited).
    pub limit_before: Option<u64>,
    /// The soft limit now: the hard limit, if raising it was allowed.
    pub limit: Option<u64>,
    /// Descriptors the table was asked to hold.
    pub table: u64,
    /// Steps that failed (raising the limit, growing the table). Neither is needed for
    /// correctness: the proxy runs on with what it has, and the caller logs these.
    pub errors: Vec<io::Error>,
}

/// Raises the soft descriptor limit to the hard one and grows the descriptor table to
/// [`TABLE_AT_START`] (or the limit, if lower). Call it first thing in `main`, before a
/// runtime or any other thread starts: in a process with one thread the kernel grows the
/// table without waiting for a grace period.
///
/// A huge hard limit (systemd's `LimitNOFILE=infinity` gives about 2^30) is taken as it
/// is: tollgate uses epoll, never `select`, and starts no child processes, so nothing in
/// it depends on a small limit; each group's `queue` bounds what it holds.
pub fn prepare() -> Descriptors {
    let before = getrlimit(Resource::Nofile);
    let mut limit = before.current;
    let mut errors = Vec::new();
    // An unlimited hard limit cannot be set as the soft one (the kernel caps it at
    // `fs.nr_open`), so only a finite one is taken.
    if let (Some(soft), Some(hard)) = (before.current, before.maximum) {
        if soft < hard {
            let raised = Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => limit = Some(hard),
                Err(e) => errors.push(e.into()),
            }
        }
    }
    // Grown to what the limit allows even if raising it failed.
    let table = limit.map_or(TABLE_AT_START, |l| l.min(TABLE_AT_START));
    if let Err(e) = grow_table(table) {
        errors.push(e);
    }
    Descriptors {
        limit_before: before.current,
        limit,
        table,
        errors,
    }
}

/// Makes the table hold `slots` descriptors: a duplicate numbered `slots - 1` makes the
/// kernel grow the table to fit it, and the table keeps its size once the duplicate is
/// closed (it never shrinks).
fn grow_table(slots: u64) -> io::Result<()> {
    let Some(highest) = slots.checked_sub(1) else {
        return Ok(());
    };
    let highest = i32::try_from(highest).unwrap_or(i32::MAX);
    let any = File::open("/dev/null")?;
    // Dropped at once: only the table's growth is wanted.
    rustix::io::fcntl_dupfd_cloexec(&any, highest)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `FDSize` line of /proc/self/status: the slots in this process's table.
    fn table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    // This runs inside the multi-threaded test harness: the table grows with the grace
    // period `prepare` exists to avoid at start (harmless here), and the raised limit
    // stays for the rest of this test binary.
    #[test]
    fn the_table_holds_the_working_size_and_the_limit_is_the_hard_one() {
        let done = prepare();
        assert!(done.errors.is_empty(), "{:?}", done.errors);
        let now = getrlimit(Resource::Nofile);
        assert_eq!(now.current, done.limit);
        if let Some(hard) = now.maximum {
            assert_eq!(now.current, Some(hard), "soft limit raised to the hard one");
        }
        // The documented working size (16 384, or the limit when lower), written out
        // rather than taken from the code under test, against what the kernel reports.
        let working = now.current.unwrap_or(u64::MAX).min(16_384);
        assert_eq!(done.table, working);
        assert!(
            table_size() >= working,
            "FDSize {} < {working}",
            table_size()
        );
        // The duplicate that grew it is closed again: the next descriptor is a low one.
        let next = File::open("/dev/null").unwrap();
        assert!(std::os::fd::AsRawFd::as_raw_fd(&next) < 1024);
    }
}
