//! The checks every step of the validation shares: an error naming its
//! key, and names that must stay plain.

use super::{ConfigError, Discovery, DiscoveryJson, DEFAULT_ADMIN_CLUSTER};

pub(super) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A field name dprank writes into bodies verbatim: it must need no JSON escaping.
pub(super) fn field_name(key: &str, name: Option<String>, default: &str) -> Result<String, ConfigError> {
    match name {
        Some(n) if n.is_empty() || n.chars().any(|c| c == '"' || c == '\\' || c.is_control()) => Err(invalid(
            key,
            format!("{n:?} is not usable as a JSON key written verbatim (no quotes, backslashes or control characters)"),
        )),
        Some(n) => Ok(n),
        None => Ok(default.to_string()),
    }
}

/// `value`, or `default` when absent; never empty.
pub(super) fn non_empty(key: &str, value: Option<String>, default: &str) -> Result<String, ConfigError> {
    let value = value.unwrap_or_else(|| default.to_string());
    if value.is_empty() {
        return Err(invalid(key, "must not be empty"));
    }
    Ok(value)
}

/// Letters, digits, '-' and '_' only (a stat or shared-data key's part).
pub(super) fn is_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// An Envoy cluster to follow through the admin API (`key`:
/// `workers_from_cluster` or `envoy_health`): its name and the admin
/// cluster's (default `DEFAULT_ADMIN_CLUSTER`), neither empty.
pub(super) fn discovery(key: &str, d: DiscoveryJson) -> Result<Discovery, ConfigError> {
    let admin_cluster = d
        .admin_cluster
        .unwrap_or_else(|| DEFAULT_ADMIN_CLUSTER.to_string());
    if d.cluster.is_empty() || admin_cluster.is_empty() {
        return Err(invalid(key, "`cluster` and `admin_cluster` must not be empty"));
    }
    Ok(Discovery {
        cluster: d.cluster,
        admin_cluster,
    })
}
