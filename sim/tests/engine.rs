//! The model in virtual time: SGLang's admission, retraction, lockstep,
//! prefix cache, published loads and dispatch.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use dprank_sim::offline::{Fleet, Prompt, Report, Request};
use dprank_sim::SimConfig;

fn text(words: usize, salt: &str) -> String {
    (0..words).map(|i| format!(" w{salt}{}", i % 97)).collect()
}

#[test]
fn smoke() {
    let mut fleet = Fleet::new(SimConfig::default(), 1).unwrap();
    let id = fleet
        .submit(0.0, 0, Request::new(Prompt::Text(text(1000, "a")), 10))
        .unwrap();
    let reports: Vec<Report> = fleet.run_to_end();
    println!("{reports:#?}");
    assert_eq!(reports.len(), 2);
    assert!(reports.iter().all(|r| r.req == id));
    println!("{}", fleet.v1_loads(0));
}
