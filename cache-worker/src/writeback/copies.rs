//! Copies of a write-back body on the next workers of the ring, taken
//! before the write is acknowledged, so losing one worker's disk loses
//! no acknowledged write.
//!
//! The primary (the worker the client wrote to) streams the body to its
//! first replica candidates while it stages its own pages. A candidate
//! that fails (down, full) is replaced after staging by the next one,
//! which gets the body read back from the primary's synced dirty pages.
//! The write is acknowledged only once enough copies are durable.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{BoxError, ClientError, ObjectStat, ObjectUri, WorkerClient};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::WriteBack;
use crate::cache::{Cache, CacheError};
use crate::journal::PendingObject;
use crate::peer_health::PeerHealth;

/// Chunks buffered per replica stream before the primary waits for it.
const STREAM_DEPTH: usize = 8;

/// How often a copy waiting on its replica looks whether another path
/// has found that replica silent.
const SILENCE_CHECK: Duration = Duration::from_secs(1);

/// When another candidate could take a copy: how long its replica may
/// take nothing before it is probed, and how long it has to answer.
const SPARE_PROBE: Duration = Duration::from_secs(2);

struct Stream {
    addr: String,
    tx: Option<mpsc::Sender<Result<Bytes, BoxError>>>,
    task: JoinHandle<Result<ObjectStat, ClientError>>,
    /// For probing the replica's liveness.
    client: WorkerClient,
}

/// The copies of one body being taken.
pub(super) struct Copies {
    /// Copies wanted besides the primary's own.
    wanted: usize,
    /// Candidates not tried yet, in ring order.
    spare: VecDeque<String>,
    streams: Vec<Stream>,
    /// `<journal id> <address>` of this worker, sent with every copy.
    replica_of: String,
}

impl Stream {
    /// Whether the replica answers a probe within `within`, recorded in
    /// `health` either way.
    async fn probe(&self, within: Duration, health: &PeerHealth) -> bool {
        let answered = self.client.answers_within(within).await;
        if answered {
            health.note_answered(&self.addr);
        } else {
            health.note_silent(&self.addr);
        }
        answered
    }
}

impl Copies {
    /// No copies (a replica's own body, or a one-copy setting).
    pub(super) fn none() -> Self {
        Self {
            wanted: 0,
            spare: VecDeque::new(),
            streams: Vec::new(),
            replica_of: String::new(),
        }
    }

    /// Whether copies were wanted (their streams took the body's
    /// metadata at the start).
    pub(super) fn any(&self) -> bool {
        self.wanted > 0
    }

    /// Forwards a chunk of the body to every live stream. A stream whose
    /// replica failed is left behind; it is replaced at [`Cache::finish_copies`].
    /// So is one whose replica takes nothing for `progress` and then does
    /// not answer a probe: a hung replica must not hold the write (with
    /// another candidate to take the copy, the probe comes after 2 s). One
    /// that takes nothing while another path has found it silent is left
    /// sooner, when another candidate can take the copy: the outage was
    /// already paid for once.
    pub(super) async fn send(&mut self, chunk: &Bytes, progress: Duration, health: &PeerHealth) {
        for stream in &mut self.streams {
            let given_up = {
                let Some(tx) = &stream.tx else { continue };
                let another = || self.spare.iter().any(|a| !health.seems_silent(a));
                match room(tx, stream, progress, health, another).await {
                    Ok(slot) => {
                        slot.send(Ok(chunk.clone()));
                        continue;
                    }
                    Err(given_up) => given_up,
                }
            };
            if given_up {
                stream.task.abort();
            }
            stream.tx = None;
        }
    }

    /// The primary's own write failed: the replicas abort their bodies
    /// and record nothing.
    pub(super) async fn abort(&mut self) {
        for stream in &mut self.streams {
            if let Some(tx) = stream.tx.take() {
                let _ = tx.send(Err("the primary refused the write".into())).await;
            }
            stream.task.abort();
        }
    }
}

/// Room for one more chunk on `stream`'s copy, or `Err(true)` when its
/// replica is given up here, `Err(false)` when its request ended by
/// itself (its result says how).
async fn room<'a>(
    tx: &'a mpsc::Sender<Result<Bytes, BoxError>>,
    stream: &Stream,
    progress: Duration,
    health: &PeerHealth,
    another_candidate: impl Fn() -> bool,
) -> Result<mpsc::Permit<'a, Result<Bytes, BoxError>>, bool> {
    loop {
        let mut waited = Duration::ZERO;
        let mut probed = false;
        while waited < progress {
            let slice = SILENCE_CHECK.min(progress - waited);
            match tokio::time::timeout(slice, tx.reserve()).await {
                Ok(Ok(slot)) => return Ok(slot),
                Ok(Err(_)) => return Err(false),
                Err(_) => waited += slice,
            }
            if health.seems_silent(&stream.addr) && another_candidate() {
                tracing::warn!(replica = %stream.addr, "a replica found silent elsewhere is taking nothing; giving its write-back copy to the next candidate");
                return Err(true);
            }
            // Another candidate could take the copy: ask a replica that
            // has taken nothing for a while whether it runs at all. A
            // busy one answers and keeps the copy; a stopped one is
            // given up now, not after `progress`.
            if !probed && waited >= SPARE_PROBE && another_candidate() {
                probed = true;
                if !stream.probe(SPARE_PROBE, health).await {
                    tracing::warn!(replica = %stream.addr, ?waited, probe = ?SPARE_PROBE, "a replica takes nothing and did not answer a probe; giving its write-back copy to the next candidate");
                    return Err(true);
                }
            }
        }
        if stream.probe(progress, health).await {
            continue;
        }
        tracing::warn!(replica = %stream.addr, ?progress, "a replica made no progress on a write-back copy; giving it up for the next candidate");
        return Err(true);
    }
}

/// The replica's answer to a copy whose body is all sent. With another
/// candidate to take the copy, a replica that does not answer is probed
/// after 2 s and every `progress` after, and given up (its task
/// aborted) when silent here or elsewhere: a worker stopped after it
/// took the body must not hold the write until the request's own
/// deadline.
async fn answer(
    stream: &mut Stream,
    progress: Duration,
    health: &PeerHealth,
    another_candidate: impl Fn() -> bool,
) -> Result<Result<ObjectStat, ClientError>, tokio::task::JoinError> {
    let (mut waited, mut probe_at) = (Duration::ZERO, SPARE_PROBE);
    loop {
        if let Ok(done) = tokio::time::timeout(SILENCE_CHECK, &mut stream.task).await {
            return done;
        }
        waited += SILENCE_CHECK;
        if !another_candidate() {
            continue;
        }
        let silent = if health.seems_silent(&stream.addr) {
            true
        } else if waited >= probe_at {
            probe_at = waited + progress;
            !stream.probe(SPARE_PROBE, health).await
        } else {
            false
        };
        if silent {
            stream.task.abort();
            tracing::warn!(replica = %stream.addr, ?waited, "a replica that took a whole write-back copy does not answer; giving the copy to the next candidate");
            return Ok(Err(ClientError::Timeout {
                addr: stream.addr.clone(),
                timeout: waited,
            }));
        }
    }
}

fn deadline(wb: &WriteBack) -> Duration {
    // A replica may wait for staging space itself, up to its stall timeout.
    (wb.config.stall_timeout * 2).max(Duration::from_secs(600))
}

impl Cache {
    /// Starts copies of a body this worker takes as primary. Fails when
    /// the ring has fewer workers than the replica setting asks for.
    pub(super) fn start_copies(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        version: &str,
        user: &lakecache_protocol::UserMeta,
    ) -> Result<Copies, CacheError> {
        let placement = self.peers.placement();
        let mut candidates = placement.map_or_else(Vec::new, |p| p.replica_candidates(uri));
        // Ring order, but not a peer that lately failed to answer first:
        // it would hold the write for the replica deadline again.
        let ring_order = candidates.clone();
        self.peers.health().answering_first(&mut candidates);
        if candidates != ring_order {
            tracing::debug!(%uri, ?candidates, "replica candidates that lately failed to answer are tried last");
        }
        let me = placement.and_then(|p| p.me()).unwrap_or_default();
        let members = candidates.len() + 1;
        let copies = wb
            .config
            .replicas
            .unwrap_or(if members >= 2 { 2 } else { 1 });
        if copies > members {
            return Err(CacheError::ReplicasUnavailable(format!(
                "write-back is set to keep {copies} copies, but the ring has {members} worker(s)"
            )));
        }
        let mut out = Copies {
            wanted: copies.saturating_sub(1),
            spare: candidates.into(),
            streams: Vec::new(),
            replica_of: format!("{} {me}", wb.id),
        };
        while out.streams.len() < out.wanted {
            let Some(addr) = out.spare.pop_front() else {
                break;
            };
            let client = match self.replica_client(wb, &addr) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%uri, %addr, error = %e, "cannot reach a replica candidate");
                    continue;
                }
            };
            let (tx, mut rx) = mpsc::channel(STREAM_DEPTH);
            let body = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let (uri, version, replica_of, user) = (
                uri.clone(),
                version.to_string(),
                out.replica_of.clone(),
                user.clone(),
            );
            let progress = wb.config.replica_progress;
            let probe = client.clone();
            let task = tokio::spawn(async move {
                client
                    .put_replica(&uri, &version, &replica_of, body, &user, Some(progress))
                    .await
            });
            out.streams.push(Stream {
                addr,
                tx: Some(tx),
                task,
                client: probe,
            });
        }
        Ok(out)
    }

    fn replica_client(&self, wb: &WriteBack, addr: &str) -> Result<WorkerClient, CacheError> {
        Ok(self.peers.client(addr)?.with_timeout(deadline(wb)))
    }

    /// Ends the streams and waits for the replicas; replaces failed ones
    /// with further candidates fed from this worker's synced dirty pages.
    /// Returns the addresses holding a durable copy.
    pub(super) async fn finish_copies(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        object: &PendingObject,
        mut copies: Copies,
    ) -> Result<Vec<String>, CacheError> {
        let mut held = Vec::new();
        let mut failures = Vec::new();
        for stream in &mut copies.streams {
            stream.tx = None;
        }
        let health = self.peers.health();
        for mut stream in copies.streams {
            let spare = &copies.spare;
            let another = || spare.iter().any(|a| !health.seems_silent(a));
            match answer(&mut stream, wb.config.replica_progress, health, another).await {
                Ok(Ok(stat)) => {
                    health.note_answered(&stream.addr);
                    match copy_answer_checks(&stat, object, &stream.addr) {
                        Ok(()) => held.push(stream.addr),
                        Err(e) => failures.push(e.to_string()),
                    }
                }
                Ok(Err(e)) => {
                    health.note_failure(&stream.addr, &e);
                    failures.push(format!("{}: {e}", stream.addr));
                }
                Err(e) => failures.push(format!("{}: {e}", stream.addr)),
            }
        }
        while held.len() < copies.wanted {
            let Some(addr) = copies.spare.pop_front() else {
                break;
            };
            match self
                .copy_from_pages(wb, object, &addr, &copies.replica_of)
                .await
            {
                Ok(()) => held.push(addr),
                Err(e) => failures.push(format!("{addr}: {e}")),
            }
        }
        if !failures.is_empty() {
            tracing::warn!(uri = %object.uri, failures = ?failures, held = ?held, "some replica candidates refused a write-back copy");
        }
        if held.len() < copies.wanted {
            self.forget_copies(object, &held);
            return Err(CacheError::ReplicasUnavailable(format!(
                "write-back needs {} copies besides this worker's, but only {} worker(s) took one ({}); nothing was acknowledged",
                copies.wanted,
                held.len(),
                failures.join("; ")
            )));
        }
        Ok(held)
    }

    /// Sends a copy read back from the dirty pages, part by part, each
    /// checked against its recorded CRC32C.
    async fn copy_from_pages(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        object: &PendingObject,
        addr: &str,
        replica_of: &str,
    ) -> Result<(), CacheError> {
        let client = self.replica_client(wb, addr)?;
        let uri = super::visible::parse_uri(&object.uri)?;
        let (tx, mut rx) = mpsc::channel::<Result<Bytes, BoxError>>(2);
        let body = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let feed = {
            let (this, wb, object) = (self.clone(), wb.clone(), object.clone());
            tokio::spawn(async move {
                for i in 0..object.part_crcs.len() {
                    let part = this.read_part(&wb, &object, i).await;
                    let failed = part.is_err();
                    let item = part.map_err(|e| -> BoxError { e.to_string().into() });
                    if tx.send(item).await.is_err() || failed {
                        return;
                    }
                }
            })
        };
        let progress = wb.config.replica_progress;
        let sent = client
            .put_replica(
                &uri,
                &object.version,
                replica_of,
                body,
                &object.meta,
                Some(progress),
            )
            .await;
        feed.abort();
        let stat = sent.map_err(|e| {
            self.peers.health().note_failure(addr, &e);
            CacheError::ReplicasUnavailable(e.to_string())
        })?;
        self.peers.health().note_answered(addr);
        copy_answer_checks(&stat, object, addr)
    }

    /// Sends a journaled delete to every worker in `record.replicas`;
    /// all must take it, or the delete is not acknowledged.
    pub(super) async fn copy_delete(
        self: &Arc<Self>,
        wb: &WriteBack,
        uri: &ObjectUri,
        record: &PendingObject,
    ) -> Result<(), CacheError> {
        if record.replicas.is_empty() {
            return Ok(());
        }
        let me = self
            .peers
            .placement()
            .and_then(|p| p.me())
            .unwrap_or_default();
        let replica_of = format!("{} {me}", wb.id);
        let mut done = Vec::new();
        for addr in &record.replicas {
            let sent = match self.peers.client(addr) {
                Ok(c) => c
                    .put_replica_delete(uri, &record.version, &replica_of)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = sent {
                self.forget_copies(record, &done);
                return Err(CacheError::ReplicasUnavailable(format!(
                    "the worker {addr} holding a copy of {uri} did not take its delete ({e}); the delete was not acknowledged"
                )));
            }
            done.push(addr.clone());
        }
        Ok(())
    }

    /// Tells every replica holding a copy of `object` (just journaled
    /// here) that the write is acknowledged; all must record it before
    /// the client hears so. A copy left unconfirmed would be dropped by a
    /// replica taking over from this worker's lost disk. On failure the
    /// client is told the write was not acknowledged, though this
    /// worker's journal holds it and uploads it: a retry, journaled
    /// later, reaches S3 after it.
    pub(super) async fn confirm_copies(
        self: &Arc<Self>,
        object: &PendingObject,
    ) -> Result<(), CacheError> {
        let Ok(uri) = super::visible::parse_uri(&object.uri) else {
            return Ok(());
        };
        let confirms = object.replicas.iter().map(|addr| {
            let uri = uri.clone();
            async move {
                let done = match self.peers.client(addr) {
                    Ok(c) => c
                        .confirm_replica(&uri, &object.version)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                done.map_err(|e| format!("{addr}: {e}"))
            }
        });
        let failed: Vec<String> = futures::future::join_all(confirms)
            .await
            .into_iter()
            .filter_map(Result::err)
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(CacheError::ReplicasUnavailable(format!(
            "a worker holding a copy of {} did not confirm it ({}); the write was not acknowledged, though this worker will still upload it",
            object.uri,
            failed.join("; ")
        )))
    }

    /// Tells replicas holding a copy of `object` that it is settled
    /// (uploaded, replaced, or never acknowledged), in the background.
    /// A copy whose drop is lost is found settled by the replica itself.
    pub(crate) fn forget_copies(self: &Arc<Self>, object: &PendingObject, replicas: &[String]) {
        if replicas.is_empty() {
            return;
        }
        let Ok(uri) = super::visible::parse_uri(&object.uri) else {
            return;
        };
        let (this, version, replicas) = (self.clone(), object.version.clone(), replicas.to_vec());
        tokio::spawn(async move {
            for addr in replicas {
                let dropped = match this.peers.client(&addr) {
                    Ok(c) => c
                        .drop_replica(&uri, &version)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = dropped {
                    tracing::debug!(%uri, %addr, error = %e, "telling a replica to drop its copy failed; it will ask");
                }
            }
        });
    }
}

impl Cache {
    /// The pending (not yet uploaded) version of `from` that another
    /// worker holds, asked of the source's workers in ring order; `None`
    /// when write-back is off, this worker has it, or the first worker
    /// that answers has none (S3 is then the source of truth).
    pub(crate) async fn pending_on_peer(self: &Arc<Self>, from: &ObjectUri) -> Option<String> {
        self.writeback.as_ref()?;
        if !matches!(self.pending_meta(from), Ok(None)) {
            return None;
        }
        let placement = self.peers.placement()?;
        for addr in placement.replica_candidates(from) {
            let Ok(client) = self.peers.client(&addr) else {
                continue;
            };
            match client
                .with_timeout(Duration::from_secs(10))
                .stat(from)
                .await
            {
                Ok(stat) if super::is_cache_version(&stat.etag) => return Some(stat.etag),
                Ok(_) => return None,
                Err(lakecache_protocol::ClientError::Api { status: 404, .. }) => return None,
                // A peer that does not answer: the next one may hold a copy.
                Err(e) => {
                    tracing::debug!(%from, %addr, error = %e, "asking a peer for a copy's pending source failed");
                }
            }
        }
        None
    }

    /// A copy whose source is a pending version another worker holds (a
    /// rename onto a key this worker owns): the bytes come from the
    /// first worker of the source's ring order that has that version, and
    /// are written back here under `to`. `None` when no worker has it.
    pub(crate) async fn copy_from_peer(
        self: &Arc<Self>,
        from: &ObjectUri,
        version: &str,
        to: &ObjectUri,
        user: Option<&lakecache_protocol::UserMeta>,
    ) -> Result<Option<crate::store::ObjectMeta>, CacheError> {
        use futures::StreamExt;
        let Some(placement) = self.peers.placement() else {
            return Ok(None);
        };
        for addr in placement.replica_candidates(from) {
            let client = match self.peers.client(&addr) {
                Ok(c) => c.with_timeout(Duration::from_secs(30)),
                Err(_) => continue,
            };
            // The source's own metadata travels with it unless replaced.
            let user = match user {
                Some(u) => u.clone(),
                None => match client.stat(from).await {
                    Ok(stat) if stat.etag == version => stat.meta,
                    _ => {
                        tracing::debug!(%from, %addr, "the copy's source metadata is not known here; the copy has none");
                        Default::default()
                    }
                },
            };
            let resp = match client.read_stream_if(from, None, Some(version)).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(%from, %addr, error = %e, "a peer does not have the pending source of a copy");
                    continue;
                }
            };
            let body = http_body_util::BodyStream::new(resp.into_body()).filter_map(|frame| {
                std::future::ready(match frame {
                    Ok(frame) => frame.into_data().ok().map(Ok),
                    Err(e) => Some(Err(CacheError::Body(format!(
                        "reading the copy's source from a peer: {e}"
                    )))),
                })
            });
            let written = self
                .write_back(
                    to,
                    Box::pin(body),
                    Arc::new(std::sync::OnceLock::new()),
                    super::WriteRole::Primary,
                    user,
                )
                .await?;
            return Ok(Some(written));
        }
        Ok(None)
    }
}

/// A copy counts only when its answer describes this write, held by the
/// worker it was sent to: not another version or size, and not another
/// worker answering at that address (a stale ring, a reused address).
fn copy_answer_checks(
    stat: &ObjectStat,
    object: &PendingObject,
    addr: &str,
) -> Result<(), CacheError> {
    let refused = |why: String| {
        tracing::warn!(uri = %object.uri, version = %object.version, worker = %addr, "{why}");
        Err(CacheError::ReplicasUnavailable(format!("{addr}: {why}")))
    };
    if stat.etag != object.version || stat.size != object.size {
        return refused(format!(
            "the copy's answer describes {} ({} bytes), not version {} ({} bytes)",
            stat.etag, stat.size, object.version, object.size
        ));
    }
    match stat.held_by.as_deref() {
        Some(holder) if holder == addr => Ok(()),
        Some(holder) => refused(format!(
            "the copy sent to {addr} was answered by the worker at {holder}"
        )),
        None => refused("the copy's answer does not say which worker holds it".to_string()),
    }
}
