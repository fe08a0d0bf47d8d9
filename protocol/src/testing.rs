//! Helpers the project's tests share across crates.

/// Generated cases for a fuzz test: a tenth of `full` in the test
/// command; all of them (over 1,000,000 across the project) with
/// `LAKECACHE_FUZZ=full`.
pub fn fuzz_cases(full: u32) -> u32 {
    match std::env::var("LAKECACHE_FUZZ").as_deref() {
        Ok("full") => full,
        _ => full / 10,
    }
}
