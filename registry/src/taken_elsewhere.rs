//! Write-backs this client saw acknowledged by a worker other than the
//! object's owner (the owner had stalled, so the write went on to the next
//! worker). Until the version reaches S3 only that worker (and its copies'
//! holders) can answer for it; the owner would answer from S3 and say the
//! file is missing. Stats and reads of such an object ask that worker
//! first, so a writer reads its own write.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Objects remembered at once; the oldest is forgotten past it (its reads
/// then go to the owner, as before, until the version is uploaded).
const MAX_OBJECTS: usize = 4096;

#[derive(Default)]
pub(crate) struct TakenElsewhere {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Object URI to the member id of the worker holding its pending write.
    by_uri: HashMap<String, String>,
    /// Insertion order, for the bound (may name URIs since forgotten).
    order: VecDeque<String>,
}

impl TakenElsewhere {
    pub(crate) fn note(&self, uri: &str, member_id: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner
            .by_uri
            .insert(uri.to_string(), member_id.to_string())
            .is_none()
        {
            inner.order.push_back(uri.to_string());
        }
        while inner.by_uri.len() > MAX_OBJECTS {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            inner.by_uri.remove(&oldest);
        }
        if inner.order.len() > 2 * MAX_OBJECTS {
            let Inner { by_uri, order } = &mut *inner;
            order.retain(|u| by_uri.contains_key(u));
        }
    }

    pub(crate) fn forget(&self, uri: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_uri.remove(uri);
    }

    pub(crate) fn holder(&self, uri: &str) -> Option<String> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_uri.get(uri).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_latest_holder_forgets_on_request_and_stays_bounded() {
        let taken = TakenElsewhere::default();
        taken.note("s3://b/a", "w1");
        taken.note("s3://b/a", "w2");
        assert_eq!(taken.holder("s3://b/a").as_deref(), Some("w2"));
        taken.forget("s3://b/a");
        assert_eq!(taken.holder("s3://b/a"), None);
        for i in 0..MAX_OBJECTS + 10 {
            taken.note(&format!("s3://b/{i}"), "w1");
        }
        // The oldest went first; the newest stay.
        assert_eq!(taken.holder("s3://b/0"), None);
        assert_eq!(taken.holder("s3://b/9"), None);
        assert!(taken
            .holder(&format!("s3://b/{}", MAX_OBJECTS + 9))
            .is_some());
        let inner = taken.inner.lock().unwrap();
        assert_eq!(inner.by_uri.len(), MAX_OBJECTS);
        assert!(inner.order.len() <= 2 * MAX_OBJECTS);
    }
}
