//! A simulated SGLang server with data-parallel ranks (`--dp-size N
//! --enable-dp-attention`), speaking the real wire format, with a control
//! API for tests. See sim/README.md for the model.

pub mod config;
pub mod model;
pub mod protocol;
pub mod server;
pub mod worker;

pub use config::{Cli, Dispatch, Role, SimConfig};
pub use server::SimServer;
