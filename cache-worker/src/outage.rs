//! A breaker for S3 outages: after S3 was found unreachable, metadata
//! calls fail at once for a short while instead of each paying the SDK's
//! retries (which can outlast a client's patience). The write-back
//! uploader keeps probing; any success closes the breaker.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use crate::store::StoreError;

/// While S3 is unreachable, one call per this many milliseconds goes
/// through to find out whether it is back; the others fail fast.
const OPEN_MS: i64 = 5_000;
/// Calls (each already retried by the SDK) that must fail in a row
/// before the breaker opens: one reset connection is not an outage.
const FAILURES_TO_OPEN: u32 = 2;

/// Why a call may not go to S3 now.
#[derive(Debug, PartialEq, Eq)]
pub enum Blocked {
    Open,
    Probe,
}

#[derive(Default)]
pub struct OutageBreaker {
    /// Until when (ms since the epoch) calls fail fast; 0: closed.
    open_until: AtomicI64,
    failures: AtomicU32,
}

impl OutageBreaker {
    /// `Ok(())`: call S3. `Err(Probe)`: S3 was down and it is time to
    /// look again; the caller starts that call in the background (so no
    /// client waits out the SDK's retries) and fails this one fast.
    /// `Err(Open)`: fail fast.
    pub fn check(&self) -> Result<(), Blocked> {
        let until = self.open_until.load(Ordering::Relaxed);
        if until == 0 {
            return Ok(());
        }
        let now = crate::writeback::now_ms();
        if until <= now
            && self
                .open_until
                .compare_exchange(until, now + OPEN_MS, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return Err(Blocked::Probe);
        }
        Err(Blocked::Open)
    }

    pub fn unavailable() -> StoreError {
        StoreError::Unavailable(
            "S3 was unreachable moments ago; failing fast while the worker retries in the background".into(),
        )
    }

    /// Notes how a call to S3 went and passes its result on.
    pub fn observe<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        match &result {
            Err(StoreError::Unavailable(_)) => {
                if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= FAILURES_TO_OPEN {
                    self.open_until
                        .store(crate::writeback::now_ms() + OPEN_MS, Ordering::Relaxed);
                }
            }
            Ok(_) => {
                self.failures.store(0, Ordering::Relaxed);
                self.open_until.store(0, Ordering::Relaxed);
            }
            Err(_) => {}
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_on_unavailable_and_closes_on_success() {
        let b = OutageBreaker::default();
        assert!(b.check().is_ok());
        let _ = b.observe::<()>(Err(StoreError::NotFound));
        assert!(b.check().is_ok(), "a 404 is an answer, not an outage");
        let _ = b.observe::<()>(Err(StoreError::Unavailable("reset".into())));
        assert!(b.check().is_ok(), "one failure is not an outage");
        let _ = b.observe::<()>(Err(StoreError::Unavailable("refused".into())));
        assert_eq!(b.check(), Err(Blocked::Open));
        // Once the window passed, one caller is told to probe.
        b.open_until.store(1, Ordering::Relaxed);
        assert_eq!(b.check(), Err(Blocked::Probe));
        assert_eq!(b.check(), Err(Blocked::Open));
        let _ = b.observe(Ok(()));
        assert!(b.check().is_ok());
    }
}
