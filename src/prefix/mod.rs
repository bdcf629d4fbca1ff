//! Prefix affinity's data: each request's prompt as chains of block hashes
//! (`blocks`), each worker's approximate index of the blocks routed to its
//! ranks, as kept in shared data (`index`), and one request's view of both
//! (`request`). The scorers that use them are in `scheduler/scorers/`; the
//! router reads and writes the indexes (docs/architecture.md).

pub mod blocks;
pub mod index;
pub mod request;

pub use blocks::PromptBlocks;
pub use request::RequestPrefix;
