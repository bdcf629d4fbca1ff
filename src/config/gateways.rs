//! Settings for several gateways sharing one fleet (docs/gateways.md):
//! `gateways`, `pick` and `pick_choices`, their defaults and
//! their validation.

use super::json::ConfigJson;
use super::ConfigError;
use serde::{Deserialize, Serialize};

/// `pick_choices` when `pick: "headroom"` and the key is absent.
pub const DEFAULT_CHOICES: u32 = 2;
/// Most candidates the headroom picker draws among (it keeps them on the stack).
pub const MAX_CHOICES: u32 = 16;

/// Most gateways `gateways` may name (beyond it one request counts for a crowd).
pub const MAX_GATEWAYS: u32 = 1024;

/// How the picker takes one candidate among those scored (JSON `pick`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PickRule {
    LeastCost,
    Headroom,
}

/// The picker in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case", tag = "rule")]
pub enum Pick {
    /// The lowest cost, ties spread (`scheduler/pickers/least_cost.rs`).
    #[default]
    LeastCost,
    /// One of the `choices` lowest costs, drawn with chance proportional to
    /// its headroom below the next cost (`scheduler/pickers/headroom.rs`): gateways
    /// that see the same stale minimum no longer all send to it.
    Headroom { choices: u32 },
}

/// `gateways`: how many gateways (Envoys, each with its own dprank) share
/// these workers; 1..=MAX_GATEWAYS, default 1.
pub fn gateways(json: &ConfigJson) -> Result<u32, ConfigError> {
    let n = json.gateways.unwrap_or(1);
    if !(1..=MAX_GATEWAYS).contains(&n) {
        return Err(ConfigError::Invalid {
            key: "gateways".into(),
            reason: format!("must be 1..={MAX_GATEWAYS}, got {n}"),
        });
    }
    Ok(n)
}

/// `pick` and `pick_choices`; `pick_choices` only goes with `headroom`.
pub fn pick(json: &ConfigJson) -> Result<Pick, ConfigError> {
    let invalid = |key: &str, reason: String| ConfigError::Invalid {
        key: key.into(),
        reason,
    };
    match json.pick.unwrap_or(PickRule::LeastCost) {
        PickRule::LeastCost => match json.pick_choices {
            Some(_) => Err(invalid(
                "pick_choices",
                "applies only with pick: \"headroom\"".into(),
            )),
            None => Ok(Pick::LeastCost),
        },
        PickRule::Headroom => {
            let choices = json.pick_choices.unwrap_or(DEFAULT_CHOICES);
            if !(2..=MAX_CHOICES).contains(&choices) {
                return Err(invalid(
                    "pick_choices",
                    format!("must be 2..={MAX_CHOICES}, got {choices}"),
                ));
            }
            Ok(Pick::Headroom { choices })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    fn with(keys: &str) -> Result<Config, ConfigError> {
        Config::from_json(format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}]{keys}}}"#).as_bytes())
    }

    #[test]
    fn least_cost_by_default_headroom_with_its_choices() {
        assert_eq!(with("").unwrap().pick, Pick::LeastCost);
        assert_eq!(with(r#","pick":"least_cost""#).unwrap().pick, Pick::LeastCost);
        assert_eq!(
            with(r#","pick":"headroom""#).unwrap().pick,
            Pick::Headroom {
                choices: DEFAULT_CHOICES
            }
        );
        assert_eq!(
            with(r#","pick":"headroom","pick_choices":4"#).unwrap().pick,
            Pick::Headroom { choices: 4 }
        );
    }

    #[test]
    fn bad_picks_name_their_key() {
        let key = |keys: &str| match with(keys) {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => format!("{other:?}"),
        };
        assert_eq!(key(r#","pick":"headroom","pick_choices":1"#), "pick_choices");
        assert_eq!(key(r#","pick":"headroom","pick_choices":17"#), "pick_choices");
        assert_eq!(key(r#","pick_choices":3"#), "pick_choices", "needs headroom");
        assert!(matches!(with(r#","pick":"random""#), Err(ConfigError::Json(_))));
        assert_eq!(key(r#","gateways":0"#), "gateways");
        assert_eq!(key(r#","gateways":1025"#), "gateways");
    }

    #[test]
    fn one_gateway_by_default() {
        assert_eq!(with("").unwrap().gateways, 1);
        assert_eq!(with(r#","gateways":8"#).unwrap().gateways, 8);
    }
}
