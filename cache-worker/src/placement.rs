//! Written objects end up where readers look for them.
//!
//! A write streams through one worker (the owner of segment 0), which
//! keeps every page it stages. Readers ask each segment's ring owner, so
//! once S3 has the object that worker hands the pages of every segment it
//! does not own to the segment's owner (`PUT /v1/pages/...`) and drops its
//! own copy after the owner has them. A failed hand-off costs a future
//! miss, never wrong bytes: pages are keyed by the ETag they were written
//! under, and the receiver accepts them only for the object's current one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, StreamBody};
use lakecache_protocol::tls::ClientTls;
use lakecache_protocol::token::{Claims, SigningKey};
use lakecache_protocol::{Deadlines, ObjectUri, WorkerClient};

use crate::cache::{Cache, CacheError};
use crate::pages::{PageId, PageKey};
use crate::peer_health::PeerHealth;
use crate::store::{ObjectMeta, StoreError};

/// Who owns what, as the worker's view of the ring tells it.
pub trait Placement: Send + Sync {
    /// The address of the worker owning `segment` of `uri`, or `None`
    /// when this worker owns it (or no ring is known).
    fn remote_owner(&self, uri: &ObjectUri, segment: u64) -> Option<String>;

    /// Addresses of the other workers, in ring order from the owner of
    /// `uri`'s first segment: where copies of a write taken here go.
    fn replica_candidates(&self, _uri: &ObjectUri) -> Vec<String> {
        Vec::new()
    }

    /// This worker's address in the ring.
    fn me(&self) -> Option<String> {
        None
    }

    /// Whether this worker is among the first `copies` workers on the
    /// ring for `segment` of `uri` (the owner, then its successors).
    fn holds(&self, uri: &ObjectUri, segment: u64, copies: usize) -> bool {
        let _ = copies;
        self.remote_owner(uri, segment).is_none()
    }

    /// How many workers this worker's ring view holds now.
    fn ring_workers(&self) -> usize {
        1
    }
}

/// The ring view and a pooled client per peer.
pub(crate) struct Peers {
    /// Random per process: names this worker in hand-offs.
    instance: String,
    placement: OnceLock<Arc<dyn Placement>>,
    clients: Mutex<HashMap<String, WorkerClient>>,
    /// Signs the peer tokens of hand-offs when workers require tokens.
    peer_key: OnceLock<SigningKey>,
    /// TLS towards peers when workers serve HTTPS.
    peer_tls: OnceLock<ClientTls>,
    /// Peers that lately failed to answer: tried last for copies.
    health: PeerHealth,
}

const HAND_OFF_DEADLINES: Deadlines = Deadlines {
    connect: Duration::from_millis(500),
    progress: Duration::from_secs(2),
    request: Duration::from_secs(120),
};

impl Default for Peers {
    fn default() -> Self {
        Self {
            instance: uuid::Uuid::new_v4().simple().to_string(),
            placement: OnceLock::new(),
            clients: Mutex::default(),
            peer_key: OnceLock::new(),
            peer_tls: OnceLock::new(),
            health: PeerHealth::default(),
        }
    }
}

impl Peers {
    pub(crate) fn placement(&self) -> Option<&Arc<dyn Placement>> {
        self.placement.get()
    }

    pub(crate) fn health(&self) -> &PeerHealth {
        &self.health
    }

    pub(crate) fn client(&self, addr: &str) -> Result<WorkerClient, CacheError> {
        let pooled = {
            let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
            match clients.get(addr) {
                Some(c) => c.clone(),
                None => {
                    let client =
                        WorkerClient::connect(addr, HAND_OFF_DEADLINES, self.peer_tls.get())
                            .map_err(|e| CacheError::Local(e.to_string()))?;
                    clients.insert(addr.to_string(), client.clone());
                    client
                }
            }
        };
        // A short-lived peer token per hand-off: a pooled client keeps none.
        let token = self.peer_key.get().map(|key| {
            key.mint(&Claims {
                tenant: "cluster-peer".into(),
                kid: String::new(),
                exp: now_secs() + 600,
                read: Vec::new(),
                write: Vec::new(),
                peer: true,
                operator: false,
                members_key: None,
            })
        });
        pooled
            .with_token(token.as_deref())
            .map_err(|e| CacheError::Local(e.to_string()))
    }
}

impl Cache {
    /// This worker's address in the ring, when it knows its ring.
    pub(crate) fn ring_address(&self) -> Option<String> {
        self.peers.placement().and_then(|p| p.me())
    }

    /// Workers require tokens: hand-offs carry peer tokens signed with
    /// `key`. Set once.
    pub fn set_peer_key(&self, key: SigningKey) {
        let _ = self.peers.peer_key.set(key);
    }

    /// Workers serve HTTPS: hand-offs verify peers with this (and present
    /// this worker's certificate where peers require one). Set once.
    pub fn set_peer_tls(&self, tls: ClientTls) {
        let _ = self.peers.peer_tls.set(tls);
    }

    /// Tells the worker the ring it is part of; written objects' pages
    /// then go to their segments' owners. Set once.
    pub fn set_placement(&self, placement: Arc<dyn Placement>) {
        if self.peers.placement.set(placement).is_err() {
            tracing::warn!("placement was already set; keeping the first");
        }
    }

    /// Starts handing the pages of segments owned elsewhere to their
    /// owners, in the background (the writer already has its answer).
    pub(crate) fn hand_off_segments(self: &Arc<Self>, uri: &ObjectUri, meta: &ObjectMeta) {
        let (Some(placement), Some(segment)) = (
            self.peers.placement.get().cloned(),
            self.config.segment_size.filter(|s| *s > 0),
        ) else {
            return;
        };
        let segments = meta.size.div_ceil(segment);
        let targets: Vec<(u64, String)> = (0..segments)
            .filter_map(|s| placement.remote_owner(uri, s).map(|addr| (s, addr)))
            .collect();
        if targets.is_empty() {
            return;
        }
        let (this, uri, meta) = (self.clone(), uri.clone(), meta.clone());
        tokio::spawn(async move {
            for (segment, addr) in targets {
                match this.hand_off_segment(&uri, &meta, segment, &addr).await {
                    Ok(pages) => {
                        this.metrics.handed_off_pages(pages);
                        tracing::debug!(%uri, segment, %addr, pages, "handed segment to its owner");
                    }
                    Err(e) => {
                        tracing::warn!(%uri, segment, %addr, error = %e, "handing a written segment to its owner failed; it stays here")
                    }
                }
            }
        });
    }

    /// Sends the segment's pages that are here, in order, stopping at the
    /// first one that is not; drops them here once the owner has them.
    async fn hand_off_segment(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        segment: u64,
        addr: &str,
    ) -> Result<u64, CacheError> {
        let ps = self.config.page_size;
        let seg = self.config.segment_size.unwrap_or(ps);
        let start = segment * seg;
        let end = (start + seg).min(meta.size);
        let key = uri.to_string();
        let first = start / ps;
        let pages: Vec<u64> = (first..end.div_ceil(ps))
            .take_while(|idx| self.lru.contains(&PageKey::new(&key, &meta.etag, *idx)))
            .collect();
        if pages.is_empty() {
            return Ok(0);
        }
        let len = pages
            .last()
            .map_or(0, |last| (last * ps + ps).min(meta.size))
            - first * ps;
        let client = self.peers.client(addr)?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, CacheError>>(1);
        let reader = {
            let (this, key, etag, pages) =
                (self.clone(), key.clone(), meta.etag.clone(), pages.clone());
            let size = meta.size;
            tokio::spawn(async move {
                for idx in pages {
                    let page_key = PageKey::new(&key, &etag, idx);
                    let id = PageId::new(&key, &etag, idx, ps, size);
                    let len = id.len;
                    let item = this
                        .read_local(page_key, id, 0..len)
                        .await
                        .map_err(|e| CacheError::Local(format!("page {idx}: {e}")));
                    let failed = item.is_err();
                    if tx.send(item).await.is_err() || failed {
                        return;
                    }
                }
            })
        };
        let body = StreamBody::new(tokio_stream_from(rx).map(|r| {
            r.map(hyper::body::Frame::data)
                .map_err(|e| Box::new(e) as _)
        }));
        let sent = client
            .put_pages(
                uri,
                &meta.etag,
                first * ps,
                len,
                &self.peers.instance,
                BodyExt::boxed(body),
            )
            .await;
        reader.abort();
        sent.map_err(|e| CacheError::Local(format!("worker {addr}: {e}")))?;
        for idx in &pages {
            self.drop_page(&PageKey::new(&key, &meta.etag, *idx)).await;
        }
        Ok(pages.len() as u64)
    }

    /// Keeps `len` bytes another worker handed over for the version `etag`
    /// of `uri`, starting at page-aligned `offset`; returns the pages kept.
    pub async fn accept_pages<S>(
        self: &Arc<Self>,
        uri: &ObjectUri,
        etag: &str,
        offset: u64,
        len: u64,
        from: &str,
        mut body: S,
    ) -> Result<u64, CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        if from == self.peers.instance {
            // The sender would drop the pages it just handed to itself.
            return Err(CacheError::Invalid(
                "a worker cannot hand pages to itself".into(),
            ));
        }
        let ps = self.config.page_size;
        if !offset.is_multiple_of(ps) {
            return Err(CacheError::Invalid(format!(
                "offset {offset} is not a multiple of this worker's page size {ps}"
            )));
        }
        let mut meta = self.stat(uri).await?;
        if meta.etag != etag {
            meta = self.revalidate(uri).await?;
            if meta.etag != etag {
                return Err(StoreError::PreconditionFailed.into());
            }
        }
        if offset >= meta.size || len > meta.size - offset {
            return Err(CacheError::Invalid(format!(
                "{len} bytes at offset {offset} do not fit an object of {} bytes",
                meta.size
            )));
        }
        let key = uri.to_string();
        let mut idx = offset / ps;
        let mut page = BytesMut::new();
        let mut kept = 0;
        let mut received = 0u64;
        // One page is buffered at a time.
        let _memory = self.memory.reserve(ps).await;
        loop {
            let chunk = body.next().await.transpose()?;
            if let Some(chunk) = &chunk {
                received += chunk.len() as u64;
                if received > len {
                    return Err(CacheError::Invalid(format!(
                        "body is longer than its Content-Length {len}"
                    )));
                }
                page.extend_from_slice(chunk);
            }
            while idx * ps < meta.size {
                let id = PageId::new(&key, etag, idx, ps, meta.size);
                if (page.len() as u64) < id.len {
                    break;
                }
                let data = page.split_to(id.len as usize).freeze();
                let page_key = PageKey::new(&key, etag, idx);
                if !self.lru.contains(&page_key) {
                    self.keep_page(key.clone(), etag.to_string(), idx, page_key, id, data)
                        .await;
                    kept += 1;
                }
                idx += 1;
            }
            if chunk.is_none() {
                // A trailing piece short of a page is not a page: dropped.
                return Ok(kept);
            }
        }
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn tokio_stream_from<T>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
{
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
