//! Throttling: which group a request belongs to, and the queue it waits in.
//!
//! * this module — [`Limits`], the groups by name and host;
//! * [`group`] — one group: a request's way through it, from joining the queue to
//!   departing with a concurrency permit;
//! * [`queue`] — the queue and its turn: FIFO, or fair between flows ([`fair`]);
//! * [`pause`] — the upstream's pause;
//! * [`store`] — where the budget lives: [`rate`] in this process, [`redis`] shared;
//! * [`gcra`] — the rate decision, pure;
//! * [`budget`] — what the group learns of its upstream's budget (docs/budget.md):
//!   the probe, the announced window and the controller of its pace, pure;
//! * [`permits`] — concurrency permits;
//! * [`keys`] — a budget per key (API key, user, model) in a `[[limit]]` with `key`.
//!
//! Hosts listed in a `[[limit]]` share that group. Any other host gets a group of its
//! own, built from `[defaults]` when first seen and evicted when idle, so memory follows
//! the hosts in use, not every host ever seen.

pub mod budget;
pub mod fair;
pub mod gcra;
pub mod group;
pub mod keys;
pub mod pause;
pub mod permits;
pub mod queue;
pub mod rate;
pub mod redis;
pub mod store;
pub mod tokens;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::config::{Config, GroupSettings, HostPattern};
use crate::metrics::Metrics;
pub use group::{Group, Refusal};
pub use permits::Permit;
pub use redis::Redis;
pub use store::Store;
pub use tokens::Cost;

/// The maps looked up for every request, by host or by route name.
type Map<V> = HashMap<String, V>;

/// Dynamic groups are swept when their count reaches this, or twice the count left
/// after the last sweep, so sweeping costs O(1) per new host on average.
const FIRST_SWEEP: usize = 1024;

/// Every group, found by host or by name.
pub struct Limits {
    by_name: Map<Arc<Group>>,
    by_host: Map<Arc<Group>>,
    /// Hosts listed with a port (`host:port`), matched before `by_host`; apart so that
    /// a request's `host:port` is only spelled out when some `[[limit]]` lists one.
    by_host_port: Map<Arc<Group>>,
    /// `(".domain", group)`, longest first so the most specific pattern wins.
    by_suffix: Vec<(String, Arc<Group>)>,
    defaults: GroupSettings,
    /// Read-mostly: every request to an unlisted host looks its group up here, and only
    /// a new host (or a sweep) writes, so lookups from all threads proceed together.
    dynamic: RwLock<Dynamic>,
    metrics: Arc<Metrics>,
    /// Where every group keeps its budget.
    store: Store,
}

/// Groups of hosts that match no `[[limit]]`.
struct Dynamic {
    groups: Map<Arc<Group>>,
    sweep_at: usize,
}

impl Limits {
    /// Builds the configured groups, keeping their budgets in `store`.
    pub fn new(config: &Config, metrics: Arc<Metrics>, store: Store) -> Limits {
        Limits::new_keeping(config, metrics, store, |_| None)
    }

    /// [`Limits::new`], taking the group `kept(name)` gives, reconfigured, over a new one.
    fn new_keeping(
        config: &Config,
        metrics: Arc<Metrics>,
        store: Store,
        kept: impl Fn(&str) -> Option<Arc<Group>>,
    ) -> Limits {
        let mut by_name = Map::default();
        let mut by_host = Map::default();
        let mut by_host_port = Map::default();
        let mut by_suffix = Vec::new();
        for limit in &config.limits {
            let group = match kept(&limit.name) {
                Some(group) => {
                    group.reconfigure(limit.settings.clone());
                    group
                }
                None => Arc::new(Group::new(
                    limit.name.as_str().into(),
                    limit.settings.clone(),
                    metrics.group(&limit.name),
                    store.clone(),
                )),
            };
            for host in &limit.hosts {
                match host {
                    HostPattern::Exact(h) if h.contains(':') && !h.ends_with(']') => {
                        by_host_port.insert(h.clone(), group.clone())
                    }
                    HostPattern::Exact(h) => by_host.insert(h.clone(), group.clone()),
                    HostPattern::Suffix(s) => {
                        by_suffix.push((s.clone(), group.clone()));
                        None
                    }
                };
            }
            by_name.insert(limit.name.clone(), group);
        }
        by_suffix.sort_by_key(|(suffix, _)| std::cmp::Reverse(suffix.len()));
        Limits {
            by_name,
            by_host,
            by_host_port,
            by_suffix,
            defaults: config.defaults.clone(),
            dynamic: RwLock::new(Dynamic {
                groups: Map::default(),
                sweep_at: FIRST_SWEEP,
            }),
            metrics,
            store,
        }
    }

    /// The groups of `config` for a reload: a group whose name survives is this one's,
    /// with its queue, rate state, pause and permits, and takes its new settings (the
    /// groups of unlisted hosts take the new `[defaults]`); a new name starts empty. A
    /// group left out serves the requests that hold it and is dropped with the last.
    pub fn reconfigured(&self, config: &Config) -> Limits {
        let mut next =
            Limits::new_keeping(config, self.metrics.clone(), self.store.clone(), |name| {
                self.by_name.get(name).cloned()
            });
        let dynamic = self.dynamic.read().unwrap_or_else(|p| p.into_inner());
        for group in dynamic.groups.values() {
            group.reconfigure(config.defaults.clone());
        }
        let next_dynamic = next.dynamic.get_mut().unwrap_or_else(|p| p.into_inner());
        next_dynamic.groups = dynamic.groups.clone();
        next_dynamic.sweep_at = dynamic.sweep_at;
        next
    }

    /// The group for a request to `host` (canonical) on `port`, or the group `named` by
    /// its route. A `[[limit]]` host listed with a port matches that port only, before
    /// the same host listed without one.
    pub fn group_for(&self, host: &str, port: u16, named: Option<&str>) -> Arc<Group> {
        if let Some(group) = named.and_then(|name| self.by_name.get(name)) {
            return group.clone();
        }
        if !self.by_host_port.is_empty() {
            if let Some(group) = self.by_host_port.get(&format!("{host}:{port}")) {
                return group.clone();
            }
        }
        if let Some(group) = self.by_host.get(host) {
            return group.clone();
        }
        if let Some((_, group)) = self
            .by_suffix
            .iter()
            .find(|(s, _)| host.ends_with(s.as_str()))
        {
            return group.clone();
        }
        let found = self
            .dynamic
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .groups
            .get(host)
            .cloned();
        if let Some(group) = found {
            return group;
        }
        let mut dynamic = self.dynamic.write().unwrap_or_else(|p| p.into_inner());
        // Another thread may have made it between the two locks.
        if let Some(group) = dynamic.groups.get(host) {
            return group.clone();
        }
        if dynamic.groups.len() >= dynamic.sweep_at {
            self.sweep(&mut dynamic);
        }
        let group = Arc::new(Group::new(
            host.into(),
            self.defaults.clone(),
            self.metrics.group(host),
            self.store.clone(),
        ));
        dynamic.groups.insert(host.to_string(), group.clone());
        group
    }

    /// Every group that exists now, configured ones first.
    pub fn groups(&self) -> Vec<Arc<Group>> {
        let mut all: Vec<Arc<Group>> = self.by_name.values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        let dynamic = self.dynamic.read().unwrap_or_else(|p| p.into_inner());
        let mut hosts: Vec<Arc<Group>> = dynamic.groups.values().cloned().collect();
        hosts.sort_by(|a, b| a.name.cmp(&b.name));
        all.extend(hosts);
        all
    }

    /// Drops dynamic groups nobody uses: no request holds them (the map's reference is
    /// the only one, and references are only handed out under this lock, which the sweep
    /// holds for writing) and their state is idle.
    fn sweep(&self, dynamic: &mut Dynamic) {
        let before = dynamic.groups.len();
        dynamic.groups.retain(|host, group| {
            let keep = Arc::strong_count(group) > 1 || !group.is_idle();
            if !keep {
                group.metrics.upstream.forget();
                self.metrics.forget(host);
            }
            keep
        });
        dynamic.sweep_at = FIRST_SWEEP.max(2 * dynamic.groups.len());
        tracing::debug!(
            before,
            after = dynamic.groups.len(),
            "swept idle host groups"
        );
    }

    /// How many groups for unlisted hosts exist (for tests and benchmarks).
    pub fn dynamic_groups(&self) -> usize {
        self.dynamic
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .groups
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        let config = Config::parse(
            "[[limit]]\nname = \"gh\"\nhosts = [\"api.github.com\", \"*.ghusercontent.com\"]\n",
            "t",
        )
        .unwrap();
        Limits::new(&config, Arc::new(Metrics::new()), Store::Memory)
    }

    #[test]
    fn hosts_find_their_group() {
        let l = limits();
        assert_eq!(&*l.group_for("api.github.com", 443, None).name, "gh");
        assert_eq!(&*l.group_for("raw.ghusercontent.com", 443, None).name, "gh");
        assert_eq!(&*l.group_for("a.b.ghusercontent.com", 443, None).name, "gh");
        assert_eq!(
            &*l.group_for("ghusercontent.com", 443, None).name,
            "ghusercontent.com"
        );
        assert_eq!(&*l.group_for("example.com", 443, Some("gh")).name, "gh");
        let a = l.group_for("example.com", 443, None);
        assert!(
            Arc::ptr_eq(&a, &l.group_for("example.com", 443, None)),
            "one group per host"
        );
    }

    #[test]
    fn a_host_listed_with_a_port_matches_that_port_first() {
        let config = Config::parse(
            "[[limit]]\nname = \"tls\"\nhosts = [\"api.example.com:8443\"]\n\
             [[limit]]\nname = \"any\"\nhosts = [\"API.example.com.\"]\n",
            "t",
        )
        .unwrap();
        let l = Limits::new(&config, Arc::new(Metrics::new()), Store::Memory);
        assert_eq!(&*l.group_for("api.example.com", 8443, None).name, "tls");
        assert_eq!(&*l.group_for("api.example.com", 443, None).name, "any");
    }

    #[test]
    fn idle_groups_of_unlisted_hosts_are_evicted() {
        let l = limits();
        let kept = l.group_for("busy.example", 443, None);
        for i in 0..20_000 {
            l.group_for(&format!("host-{i}.example"), 443, None);
        }
        // Sweeps keep the map within twice what is in use (here: one group).
        assert!(
            l.dynamic_groups() <= 2 * FIRST_SWEEP,
            "{}",
            l.dynamic_groups()
        );
        assert!(
            Arc::ptr_eq(&kept, &l.group_for("busy.example", 443, None)),
            "a group in use stays"
        );
        // Their metric series went with them.
        let text = l.metrics.encode();
        assert!(text.matches("tollgate_queue_depth{").count() <= 2 * FIRST_SWEEP + 1);
    }
}
