//! A simulated SGLang server with data-parallel ranks (`--dp-size N
//! --enable-dp-attention`), or a vLLM server with data-parallel engines
//! (`--engine vllm`), speaking the real wire format, with a control API for
//! tests. See sim/README.md for the model.

pub mod answers;
pub mod chat;
pub mod config;
pub mod engine;
pub mod loads;
pub mod metrics;
pub mod offline;
pub mod output;
pub mod protocol;
pub mod server;
pub mod sync;
pub mod tokenizer;
pub mod worker;

pub use config::{
    Admission, Cli, Dispatch, EngineKind, RankHeader, RankPortLoads, Role, SimConfig, Toggle, VllmFrontend,
    VllmVersion,
};
pub use engine::cost::CostPreset;
pub use server::SimServer;
