//! The operations a process is working on right now, so a stuck read can
//! be named: which file, which offset, for how long, waiting on which
//! worker.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use serde::Serialize;

tokio::task_local! {
    static CURRENT: Arc<InFlightOp>;
}

#[derive(Debug)]
pub struct InFlightOp {
    op: &'static str,
    path: String,
    offset: Option<u64>,
    size: Option<u64>,
    started: Instant,
    worker: Mutex<Option<String>>,
}

impl InFlightOp {
    /// Runs `fut` with this operation as the task's current one, so
    /// [`note_worker`](InFlight::note_worker) calls below it land here.
    pub async fn scope<F: std::future::Future>(self: Arc<Self>, fut: F) -> F::Output {
        CURRENT.scope(self, fut).await
    }
}

/// The table of operations in flight.
#[derive(Debug, Default)]
pub struct InFlight {
    next_id: AtomicU64,
    ops: Mutex<BTreeMap<u64, Arc<InFlightOp>>>,
}

/// Removes its operation from the table when dropped (finished, failed
/// or cancelled alike).
#[derive(Debug)]
pub struct OpGuard {
    table: Weak<InFlight>,
    id: u64,
    op: Arc<InFlightOp>,
}

impl OpGuard {
    pub fn op(&self) -> Arc<InFlightOp> {
        self.op.clone()
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if let Some(table) = self.table.upgrade() {
            if let Ok(mut ops) = table.ops.lock() {
                ops.remove(&self.id);
            }
        }
    }
}

/// One row of [`InFlight::snapshot`].
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct InFlightView {
    pub op: String,
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    pub age_ms: u64,
    /// The worker the operation last sent a request to, if any.
    pub worker: Option<String>,
}

impl InFlight {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn start(
        self: &Arc<Self>,
        op: &'static str,
        path: String,
        offset: Option<u64>,
        size: Option<u64>,
    ) -> OpGuard {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(InFlightOp {
            op,
            path,
            offset,
            size,
            started: Instant::now(),
            worker: Mutex::new(None),
        });
        if let Ok(mut ops) = self.ops.lock() {
            ops.insert(id, entry.clone());
        }
        OpGuard {
            table: Arc::downgrade(self),
            id,
            op: entry,
        }
    }

    /// Records the worker the current task's operation is waiting on; a
    /// no-op outside an operation's scope.
    pub fn note_worker(worker: &str) {
        let _ = CURRENT.try_with(|op| {
            if let Ok(mut w) = op.worker.lock() {
                if w.as_deref() != Some(worker) {
                    *w = Some(worker.to_string());
                }
            }
        });
    }

    /// The operation the current task works for, if any; a task spawned
    /// on its behalf runs under it with [`InFlightOp::scope`].
    pub fn current() -> Option<Arc<InFlightOp>> {
        CURRENT.try_with(Arc::clone).ok()
    }

    /// The operations in flight, oldest first.
    pub fn snapshot(&self) -> Vec<InFlightView> {
        let ops: Vec<Arc<InFlightOp>> = match self.ops.lock() {
            Ok(ops) => ops.values().cloned().collect(),
            Err(_) => Vec::new(),
        };
        let mut rows: Vec<InFlightView> = ops
            .iter()
            .map(|o| InFlightView {
                op: o.op.to_string(),
                path: o.path.clone(),
                offset: o.offset,
                size: o.size,
                age_ms: o.started.elapsed().as_millis() as u64,
                worker: o.worker.lock().ok().and_then(|w| w.clone()),
            })
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.age_ms));
        rows
    }

    pub fn len(&self) -> usize {
        self.ops.lock().map(|o| o.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn operations_show_while_running_with_their_worker_and_leave_when_done() {
        let table = InFlight::new();
        let guard = table.start("read", "a/b.bin".into(), Some(4096), Some(131072));
        let other = table.start("lookup", "a".into(), None, None);
        guard
            .op()
            .scope(async {
                InFlight::note_worker("10.0.0.2:7070");
            })
            .await;
        // Outside any scope, nothing is recorded and nothing fails.
        InFlight::note_worker("elsewhere:1");
        let rows = table.snapshot();
        assert_eq!(rows.len(), 2);
        let read = rows.iter().find(|r| r.op == "read").unwrap();
        assert_eq!(read.worker.as_deref(), Some("10.0.0.2:7070"));
        assert_eq!(read.offset, Some(4096));
        assert_eq!(rows.iter().find(|r| r.op == "lookup").unwrap().worker, None);
        drop(guard);
        assert_eq!(table.len(), 1);
        drop(other);
        assert!(table.is_empty());
    }
}
