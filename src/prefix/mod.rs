//! Prefix affinity's data: each request's prompt as chains of block hashes
//! (`blocks`), each worker's approximate index of the blocks routed to its
//! ranks, kept in shared data (`index`), and one request's use of both
//! (`affinity`). The scorers that use them are `scheduler/prefix.rs` and
//! `scheduler/queue.rs`; the README's "Prefix affinity" explains the rule.

pub mod affinity;
pub mod blocks;
pub mod index;

pub use affinity::Affinity;
pub use blocks::PromptBlocks;
