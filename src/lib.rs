//! dprank: an Envoy proxy-wasm filter that sends each SGLang request to the
//! data-parallel rank holding the fewest tokens, across a fleet of workers.
//!
//! Everything but `envoy_host` and `filter` knows nothing of proxy-wasm and
//! is tested on the host through the `Host` trait: `request` (one request's
//! life), `router` (where it goes), `scheduler` (which worker and rank),
//! `body` (reading and rewriting bodies), `prefix` (the prefix index and
//! prompt hashing of prefix affinity), `poller`, `load` and `discovery`
//! (load reports and cluster membership), `health` (passive health and
//! Envoy's view of it), `store` and `state` (shared data),
//! `config`, `metrics`. `envoy_host` is the only caller of the host ABI and
//! `filter` only translates callbacks.

pub mod body;
pub mod codec;
pub mod config;
pub mod cost;
pub mod discovery;
pub mod envoy_host;
pub mod filter;
pub mod headers;
pub mod health;
pub mod health_updates;
pub mod host;
pub mod load;
pub mod metrics;
pub mod poller;
pub mod prefix;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod shared_data;
pub mod worker_state;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::<filter::DprankRoot>::default());
}}
