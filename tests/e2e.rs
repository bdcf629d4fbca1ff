//! End-to-end tests of the dprank filter (regular mode) in a real Envoy, with
//! simulated SGLang or vLLM workers (`dprank-sim`). Each test starts its own workers
//! and Envoy from the shipped `envoy/dprank.yaml` plus the overrides in its
//! scenario folder `tests/e2e/<scenario>/`. Needs Envoy, the wasm and the
//! simulator built: `make test` does all of it.

// Test code: a failed step panics, which fails the test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "e2e/routing.rs"]
mod routing;

#[path = "e2e/body.rs"]
mod body;

#[path = "e2e/burst.rs"]
mod burst;

#[path = "e2e/faults.rs"]
mod faults;

#[path = "e2e/input.rs"]
mod input;

#[path = "e2e/polling.rs"]
mod polling;

#[path = "e2e/layouts.rs"]
mod layouts;

#[path = "e2e/chaos_soak.rs"]
mod chaos_soak;

#[path = "e2e/client_faults.rs"]
mod client_faults;

#[path = "e2e/wire_faults.rs"]
mod wire_faults;

#[path = "e2e/fault_matrix.rs"]
mod fault_matrix;

#[path = "e2e/pd.rs"]
mod pd;

#[path = "e2e/membership.rs"]
mod membership;

#[path = "e2e/lifecycle.rs"]
mod lifecycle;

#[path = "e2e/input_matrix.rs"]
mod input_matrix;

#[path = "e2e/security.rs"]
mod security;

#[path = "e2e/admission.rs"]
mod admission;
#[path = "e2e/header.rs"]
mod header;
#[path = "e2e/health.rs"]
mod health;
#[path = "e2e/prefix.rs"]
mod prefix;
#[path = "e2e/vllm.rs"]
mod vllm;
