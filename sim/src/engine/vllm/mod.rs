//! The model of vLLM servers with data-parallel engines (`--engine vllm`):
//! each engine's scheduler and KV blocks (`engine`, `blocks`), the server
//! that steps them and its internal balancer (`worker`, `balancer`), and
//! the clairvoyant chooser's projection for them (`oracle`). See
//! sim/README.md, "vLLM mode", for the vLLM sources each follows.

pub mod balancer;
pub mod blocks;
pub(crate) mod engine;
pub(crate) mod oracle;
pub(crate) mod worker;

pub use engine::{EngineStats, QUEUE_TIME_BUCKETS};
