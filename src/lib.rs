//! dprank: an Envoy proxy-wasm filter that sends each SGLang request to the
//! data-parallel rank holding the fewest tokens, across a fleet of workers.
//!
//! Everything but `envoy_host` and `filter` knows nothing of proxy-wasm and
//! is tested on the host through the `Host` trait. The modules form floors,
//! each importing only from those below: docs/architecture.md lists them,
//! says what each does and follows a request through the routing pipeline.

pub mod admission;
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
pub mod reply;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod shared_data;
pub mod worker_state;

proxy_wasm::main! {{
    envoy_host::install_logger(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|id| Box::new(filter::DprankRoot::new(id)));
}}
