//! What a front in virtual time decides for a request, and the seeded
//! mixing its tie-breaks use: shared by dprank's driver and the models of
//! the peers (`smg.rs`, `gie.rs`).

/// Where a request goes: a worker, the rank it names (None: the worker's
/// own controller picks), and the scheduling priority it carries (dprank's
/// `admission.server_priority`; None: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub worker: usize,
    /// The worker's rank by its local index (SGLang's `routed_dp_rank`).
    pub rank: Option<usize>,
    /// vLLM: the `X-data-parallel-rank` value sent, which the server's
    /// frontend reads as it does (a local index or a global rank); a value
    /// it refuses fails the run.
    pub rank_header: Option<u32>,
    pub priority: Option<i64>,
}

/// splitmix64.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
