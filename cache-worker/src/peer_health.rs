//! Which peers lately failed to answer this worker.
//!
//! Several worker-to-worker paths find out that a peer is hung (ordered
//! uploads probing it, the held-copy watcher asking it, a write-back copy
//! it stopped taking). Each tells this record, so the next write-back
//! does not pick that peer for its copy first and wait out the replica
//! deadline again: a stopped worker costs one deadline per outage, not
//! one per write. An answer from the peer clears it at once; without one
//! the mark fades after `remembered`, so a peer is never shunned for long
//! on one missed probe.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a peer that failed to answer is tried last.
const REMEMBERED: Duration = Duration::from_secs(30);

pub(crate) struct PeerHealth {
    /// Address -> when it last failed to answer.
    silent: Mutex<HashMap<String, Instant>>,
    remembered: Duration,
}

impl Default for PeerHealth {
    fn default() -> Self {
        Self::remembering(REMEMBERED)
    }
}

impl PeerHealth {
    pub(crate) fn remembering(remembered: Duration) -> Self {
        Self {
            silent: Mutex::default(),
            remembered,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.silent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `addr` did not answer (a probe, a request, a stream it stopped taking).
    pub(crate) fn note_silent(&self, addr: &str) {
        self.lock().insert(addr.to_string(), Instant::now());
    }

    /// A request to `addr` failed: a timeout or no connection counts as
    /// silence; a refusal (full, fenced) is an answer and does not.
    pub(crate) fn note_failure(&self, addr: &str, e: &lakecache_protocol::ClientError) {
        use lakecache_protocol::ClientError;
        if matches!(
            e,
            ClientError::Timeout { .. } | ClientError::Transport { .. }
        ) {
            self.note_silent(addr);
        }
    }

    /// `addr` answered: it is as good as any peer again.
    pub(crate) fn note_answered(&self, addr: &str) {
        self.lock().remove(addr);
    }

    /// Whether `addr` failed to answer within the remembered time and
    /// has not answered since.
    pub(crate) fn seems_silent(&self, addr: &str) -> bool {
        let mut silent = self.lock();
        match silent.get(addr) {
            Some(at) if at.elapsed() < self.remembered => true,
            Some(_) => {
                silent.remove(addr);
                false
            }
            None => false,
        }
    }

    /// Orders `addrs` (ring order) with peers that seem silent last,
    /// keeping the ring order within each group.
    pub(crate) fn answering_first(&self, addrs: &mut [String]) {
        addrs.sort_by_key(|a| self.seems_silent(a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_silent_peer_goes_last_and_ring_order_is_kept_otherwise() {
        let health = PeerHealth::default();
        health.note_silent("b:1");
        let mut ring = addrs(&["b:1", "c:1", "a:1"]);
        health.answering_first(&mut ring);
        assert_eq!(ring, addrs(&["c:1", "a:1", "b:1"]));
        health.note_silent("c:1");
        let mut ring = addrs(&["b:1", "c:1", "a:1"]);
        health.answering_first(&mut ring);
        assert_eq!(ring, addrs(&["a:1", "b:1", "c:1"]));
    }

    #[test]
    fn an_answer_clears_a_peer_at_once() {
        let health = PeerHealth::default();
        health.note_silent("b:1");
        assert!(health.seems_silent("b:1"));
        health.note_answered("b:1");
        assert!(!health.seems_silent("b:1"));
        let mut ring = addrs(&["b:1", "a:1"]);
        health.answering_first(&mut ring);
        assert_eq!(ring, addrs(&["b:1", "a:1"]));
    }

    #[test]
    fn a_mark_fades_after_the_remembered_time() {
        let health = PeerHealth::remembering(Duration::from_millis(20));
        health.note_silent("b:1");
        assert!(health.seems_silent("b:1"));
        std::thread::sleep(Duration::from_millis(40));
        assert!(!health.seems_silent("b:1"));
        assert!(health.lock().is_empty(), "a faded mark is dropped");
    }
}
