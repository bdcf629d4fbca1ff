//! Workers taken from an Envoy cluster: the poller reads the cluster's hosts
//! from the admin API and publishes them in shared data; every thread builds
//! its routing configuration from that list.

use crate::config::{default_worker_name, Config, Worker};
use crate::host::Host;
use crate::shared_data;
use serde::Deserialize;
use std::net::SocketAddr;
use std::rc::Rc;

/// Admin path listing only `cluster` (the admin API filters by regex), so a
/// gateway with many clusters does not serialise them all at every round.
pub fn admin_clusters_path(cluster: &str) -> String {
    let mut pattern = String::from("^");
    for c in cluster.chars() {
        if "\\.^$|?*+()[]{}".contains(c) {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('$');
    let mut encoded = String::new();
    for b in pattern.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    format!("/clusters?format=json&filter={encoded}")
}

#[derive(Deserialize)]
struct AdminClusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    address: HostAddress,
    #[serde(default)]
    health_status: HealthStatus,
}

#[derive(Deserialize)]
struct HostAddress {
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    #[serde(default)]
    port_value: u16,
}

#[derive(Deserialize, Default)]
struct HealthStatus {
    #[serde(default)]
    failed_active_health_check: bool,
    #[serde(default)]
    failed_outlier_check: bool,
    #[serde(default)]
    eds_health_status: Option<String>,
}

impl HealthStatus {
    /// Hosts Envoy itself would not send to are not offered to the scheduler.
    fn usable(&self) -> bool {
        !self.failed_active_health_check
            && !self.failed_outlier_check
            && !matches!(
                self.eds_health_status.as_deref(),
                Some("UNHEALTHY" | "DRAINING" | "TIMEOUT")
            )
    }
}

/// Every host of `cluster` in an admin `/clusters?format=json` answer, with
/// whether Envoy would send to it.
fn cluster_hosts(admin_json: &[u8], cluster: &str) -> Result<Vec<(SocketAddr, bool)>, String> {
    let clusters: AdminClusters = serde_json::from_slice(admin_json).map_err(|e| e.to_string())?;
    let status = clusters
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| format!("Envoy has no cluster `{cluster}`"))?;
    Ok(status
        .host_statuses
        .iter()
        .filter_map(|h| {
            let s = h.address.socket_address.as_ref()?;
            let ip = s.address.parse().ok()?;
            Some((SocketAddr::new(ip, s.port_value), h.health_status.usable()))
        })
        .collect())
}

/// The usable hosts of `cluster` in an admin `/clusters?format=json` answer, sorted.
pub fn cluster_members(admin_json: &[u8], cluster: &str) -> Result<Vec<SocketAddr>, String> {
    let mut members: Vec<SocketAddr> = cluster_hosts(admin_json, cluster)?
        .into_iter()
        .filter_map(|(address, usable)| usable.then_some(address))
        .collect();
    members.sort();
    members.dedup();
    Ok(members)
}

/// The hosts of `cluster` Envoy would not send to (failed active health
/// check, ejected by outlier detection, EDS unhealthy, draining or timed
/// out), sorted: `envoy_health` keeps them out of dprank's choice.
pub fn unhealthy_hosts(admin_json: &[u8], cluster: &str) -> Result<Vec<SocketAddr>, String> {
    let mut hosts: Vec<SocketAddr> = cluster_hosts(admin_json, cluster)?
        .into_iter()
        .filter_map(|(address, usable)| (!usable).then_some(address))
        .collect();
    hosts.sort();
    hosts.dedup();
    Ok(hosts)
}

/// The configuration to route with: the plugin's own, or with a cluster's
/// membership as its workers. Rebuilt only when the published list changes.
pub struct Membership {
    base: Rc<Config>,
    cas: Option<u32>,
    current: Rc<Config>,
}

impl Membership {
    pub fn new(base: Rc<Config>) -> Membership {
        Membership {
            current: base.clone(),
            base,
            cas: None,
        }
    }

    /// The plugin's configuration as written (headers-time decisions need nothing more).
    pub fn base(&self) -> Rc<Config> {
        self.base.clone()
    }

    pub fn current(&mut self, host: &dyn Host) -> Rc<Config> {
        if self.base.discovery().is_none() {
            return self.base.clone();
        }
        if let Some((members, cas)) = shared_data::members_if_changed(&self.base, host, self.cas) {
            let workers = members
                .0
                .into_iter()
                .map(|address| Worker {
                    name: default_worker_name(&address),
                    address,
                    dp_size: None,
                    bootstrap_port: None,
                    rank_numbering: None,
                    rank_ports: false,
                    loads_address: None,
                })
                .collect();
            self.current = Rc::new(self.base.with_members(workers));
            self.cas = Some(cas);
        }
        self.current.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::shared_data::Members;

    const ADMIN: &[u8] = br#"{"cluster_statuses":[
        {"name":"other","host_statuses":[{"address":{"socket_address":{"address":"10.9.9.9","port_value":1}}}]},
        {"name":"sglang","added_via_api":true,"host_statuses":[
          {"address":{"socket_address":{"address":"10.0.0.2","port_value":30000}},"health_status":{"eds_health_status":"HEALTHY"},"weight":1},
          {"address":{"socket_address":{"address":"10.0.0.1","port_value":30000}},"health_status":{"eds_health_status":"HEALTHY"}},
          {"address":{"socket_address":{"address":"10.0.0.3","port_value":30000}},"health_status":{"failed_active_health_check":true}},
          {"address":{"socket_address":{"address":"10.0.0.4","port_value":30000}},"health_status":{"eds_health_status":"DRAINING"}},
          {"address":{"pipe":{"path":"/tmp/x"}}}
        ]}]}"#;

    #[test]
    fn members_are_the_usable_hosts_of_the_named_cluster() {
        let m = cluster_members(ADMIN, "sglang").unwrap();
        assert_eq!(
            m,
            vec![
                "10.0.0.1:30000".parse().unwrap(),
                "10.0.0.2:30000".parse().unwrap()
            ]
        );
        assert!(cluster_members(ADMIN, "nope").unwrap_err().contains("nope"));
        assert!(cluster_members(b"<html>", "sglang").is_err());
    }

    #[test]
    fn unhealthy_hosts_are_those_envoy_would_not_send_to() {
        assert_eq!(
            unhealthy_hosts(ADMIN, "sglang").unwrap(),
            vec![
                "10.0.0.3:30000".parse().unwrap(),
                "10.0.0.4:30000".parse().unwrap()
            ]
        );
        let outlier = br#"{"cluster_statuses":[{"name":"w","host_statuses":[
            {"address":{"socket_address":{"address":"10.0.0.1","port_value":1}},"health_status":{"failed_outlier_check":true,"eds_health_status":"HEALTHY"}},
            {"address":{"socket_address":{"address":"10.0.0.2","port_value":1}},"health_status":{"eds_health_status":"UNHEALTHY"}},
            {"address":{"socket_address":{"address":"10.0.0.3","port_value":1}},"health_status":{"eds_health_status":"DEGRADED"}},
            {"address":{"socket_address":{"address":"10.0.0.4","port_value":1}},"health_status":{"eds_health_status":"TIMEOUT"}},
            {"address":{"socket_address":{"address":"10.0.0.5","port_value":1}},"health_status":{"failed_active_degraded_check":true}}
        ]}]}"#;
        let bad: Vec<SocketAddr> = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.4:1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(
            unhealthy_hosts(outlier, "w").unwrap(),
            bad,
            "degraded hosts still serve"
        );
        assert!(unhealthy_hosts(outlier, "x").is_err());
    }

    #[test]
    fn admin_path_filters_on_the_escaped_cluster_name() {
        assert_eq!(
            admin_clusters_path("sglang"),
            "/clusters?format=json&filter=%5Esglang%24"
        );
        assert_eq!(
            admin_clusters_path("outbound|30000||sglang.ns.svc"),
            "/clusters?format=json&filter=%5Eoutbound%5C%7C30000%5C%7C%5C%7Csglang%5C.ns%5C.svc%24"
        );
    }

    #[test]
    fn membership_follows_the_published_list() {
        let base = Rc::new(Config::from_json(br#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap());
        let host = FakeHost::default();
        let mut membership = Membership::new(base.clone());
        assert!(membership.current(&host).routed().is_empty());
        let publish = |list: &[&str]| {
            let members = Members(list.iter().map(|a| a.parse().unwrap()).collect());
            shared_data::publish_members(&base, &host, &members).unwrap();
        };
        publish(&["10.0.0.1:1", "10.0.0.2:1"]);
        let c = membership.current(&host);
        assert_eq!(c.routed().len(), 2);
        assert_eq!(c.routed()[1].name, "10_0_0_2_1");
        assert!(
            Rc::ptr_eq(&c, &membership.current(&host)),
            "unchanged list, same config"
        );
        publish(&["10.0.0.2:1"]);
        assert_eq!(membership.current(&host).routed()[0].endpoint(), "10.0.0.2:1");
    }

    #[test]
    fn static_workers_are_used_as_configured() {
        let base = Rc::new(Config::from_json(br#"{"workers":[{"address":"10.0.0.1:1"}]}"#).unwrap());
        let mut membership = Membership::new(base.clone());
        assert!(Rc::ptr_eq(&membership.current(&FakeHost::default()), &base));
    }
}
