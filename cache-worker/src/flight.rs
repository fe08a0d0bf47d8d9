//! Single-flight: concurrent callers for one key share one execution.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

pub struct SingleFlight<K, V> {
    calls: Mutex<HashMap<K, Arc<OnceCell<V>>>>,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        Self {
            calls: Mutex::default(),
        }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> SingleFlight<K, V> {
    /// Runs `work` unless a call for `key` is already running, in which
    /// case its result is shared. If the running caller is cancelled, a
    /// waiting caller takes over with its own `work`.
    pub async fn run<F, Fut>(&self, key: K, work: F) -> V
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V>,
    {
        let cell = {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            calls.entry(key.clone()).or_default().clone()
        };
        let value = cell.get_or_init(work).await.clone();
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        if calls.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
            calls.remove(&key);
        }
        value
    }

    pub fn in_flight(&self, key: &K) -> bool {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn concurrent_callers_share_one_run() {
        let flight = Arc::new(SingleFlight::<u32, u32>::default());
        let runs = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (flight, runs) = (flight.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                flight
                    .run(7, || async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        42
                    })
                    .await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 42);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(!flight.in_flight(&7));
    }
}
