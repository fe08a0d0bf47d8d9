//! What an upload has sent, kept until the write is acknowledged, so a
//! write whose worker stalls can be sent again, whole, to the next worker
//! of the ring. Kept within the mount's memory budget while that leaves a
//! quarter of it for writers; beyond that nothing more is kept, and the
//! upload fails on a stall as it would without this.

use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::data_plane::ByteStream;
use crate::memory::{MemoryBudget, Reservation};

pub struct Resend {
    rx: mpsc::Receiver<(Bytes, Reservation)>,
    kept: Vec<(Bytes, Reservation)>,
    /// False once a piece could not be kept: the write cannot be resent.
    whole: bool,
    budget: Arc<MemoryBudget>,
    /// How much of `kept` the current attempt has sent.
    replayed: usize,
}

impl Resend {
    pub fn new(
        rx: mpsc::Receiver<(Bytes, Reservation)>,
        budget: Arc<MemoryBudget>,
    ) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self {
            rx,
            kept: Vec::new(),
            whole: true,
            budget,
            replayed: 0,
        }))
    }

    fn lock(this: &Mutex<Self>) -> MutexGuard<'_, Self> {
        this.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The body of the next attempt: everything kept, then what the
    /// writer sends next.
    pub fn attempt(this: &Arc<Mutex<Self>>) -> ByteStream {
        Self::lock(this).replayed = 0;
        let this = this.clone();
        Box::pin(futures::stream::poll_fn(move |cx| {
            Self::lock(&this).poll_piece(cx)
        }))
    }

    /// Whether everything sent so far is kept.
    pub fn whole(this: &Mutex<Self>) -> bool {
        Self::lock(this).whole
    }

    pub fn kept_bytes(this: &Mutex<Self>) -> u64 {
        Self::lock(this)
            .kept
            .iter()
            .map(|(b, _)| b.len() as u64)
            .sum()
    }

    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if let Some((bytes, _)) = self.kept.get(self.replayed) {
            self.replayed += 1;
            return Poll::Ready(Some(bytes.clone()));
        }
        let Some((bytes, reservation)) = ready!(self.rx.poll_recv(cx)) else {
            return Poll::Ready(None);
        };
        if self.whole {
            // The piece's reservation is already taken: keep it only while
            // a quarter of the budget stays free for writers.
            if self.budget.available() >= self.budget.limit() / 4 {
                self.kept.push((bytes.clone(), reservation));
                self.replayed += 1;
            } else {
                tracing::debug!(
                    kept = self.kept.len(),
                    "memory budget low: this upload is no longer kept for a resend"
                );
                self.whole = false;
                self.kept.clear();
                self.replayed = 0;
            }
        }
        Poll::Ready(Some(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn a_second_attempt_replays_what_the_first_sent_then_goes_on() {
        let budget = MemoryBudget::new(64 << 20);
        let (tx, rx) = mpsc::channel(4);
        let resend = Resend::new(rx, budget.clone());
        for piece in [&b"ab"[..], b"cd"] {
            let r = budget.reserve(2).await;
            tx.send((Bytes::from_static(piece), r)).await.unwrap();
        }
        let mut first = Resend::attempt(&resend);
        assert_eq!(first.next().await.unwrap(), "ab");
        assert_eq!(first.next().await.unwrap(), "cd");
        drop(first);
        let r = budget.reserve(2).await;
        tx.send((Bytes::from_static(b"ef"), r)).await.unwrap();
        drop(tx);
        let second: Vec<Bytes> = Resend::attempt(&resend).collect().await;
        assert_eq!(second, ["ab", "cd", "ef"]);
        assert!(Resend::whole(&resend));
        assert_eq!(Resend::kept_bytes(&resend), 6);
        assert!(
            budget.available() < budget.limit(),
            "kept bytes are accounted"
        );
        drop(resend);
        assert_eq!(budget.available(), budget.limit());
    }

    #[tokio::test]
    async fn an_upload_that_would_leave_writers_short_is_no_longer_kept() {
        let budget = MemoryBudget::new(16 << 20);
        let (tx, rx) = mpsc::channel(4);
        let resend = Resend::new(rx, budget.clone());
        let big = Bytes::from(vec![7u8; 13 << 20]);
        let r = budget.reserve(big.len() as u64).await;
        tx.send((big, r)).await.unwrap();
        drop(tx);
        let sent: Vec<Bytes> = Resend::attempt(&resend).collect().await;
        assert_eq!(sent.len(), 1);
        assert!(!Resend::whole(&resend));
        assert_eq!(budget.available(), budget.limit(), "nothing held");
    }
}
