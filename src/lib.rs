//! dprank: an Envoy proxy-wasm filter that sends each SGLang request to the
//! data-parallel rank holding the fewest tokens, across a fleet of workers.
//!
//! Pure logic (`config`, `load`, `body`, `state`, `scheduler`, `router`,
//! `poller`) knows nothing of proxy-wasm and is tested on the host;
//! `envoy_host` is the only caller of the host ABI and `filter` only
//! translates callbacks.

pub mod body;
pub mod config;
pub mod discovery;
pub mod envoy_host;
pub mod filter;
pub mod host;
pub mod load;
pub mod poller;
pub mod router;
pub mod scheduler;
pub mod state;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::<filter::DprankRoot>::default());
}}
