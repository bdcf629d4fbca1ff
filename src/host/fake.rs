//! The in-memory host (`memory.rs`) under the name the unit tests use.

pub use super::memory::{Call, MemoryHost as FakeHost, Reply};
