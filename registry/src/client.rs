//! The cluster client: routes every range read to the owner of its
//! segment, fails over to the next replicas and finally to S3.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use lakecache_protocol::{
    Chain, ClientError, Deadlines, ListResponse, ObjectStat, ObjectUri, ObjectVersion, ReadKind,
    UserMeta, WorkerClient,
};
use lakecache_store::{ObjectStore, StoreError};

use crate::membership::{Member, Membership, View};
use crate::ring::{Ring, RingOptions};
use lakecache_protocol::local_read::LocalChannel;

#[derive(Clone)]
pub struct ClusterOptions {
    pub ring: RingOptions,
    /// Whole-request timeout towards a worker (uploads, copies).
    pub timeout: Duration,
    /// TCP connect timeout towards a worker.
    pub connect_timeout: Duration,
    /// Reads, stats and listings: a worker that sends nothing for this
    /// long is marked suspect and the request goes to the next replica
    /// (or S3), so a hung worker costs about this much, not `timeout`.
    pub progress_timeout: Duration,
    /// Distinct workers tried per segment before S3.
    pub attempts: usize,
    /// How long a failed worker is skipped when it owns a segment.
    pub suspect_for: Duration,
    /// Read straight from S3 when no worker could answer.
    pub s3_fallback: bool,
    /// Access token sent to every worker (`Authorization: Bearer`).
    pub token: Option<String>,
    /// Speak HTTPS to workers, verifying them with this CA.
    pub tls: Option<lakecache_protocol::tls::ClientTls>,
    /// The local socket of a worker on this host: reads of that worker's
    /// segments go through its page files (short-circuit reads).
    pub local_socket: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for ClusterOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterOptions")
            .field("ring", &self.ring)
            .field("timeout", &self.timeout)
            .field("progress_timeout", &self.progress_timeout)
            .field("attempts", &self.attempts)
            .field("s3_fallback", &self.s3_fallback)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.is_some())
            .field("local_socket", &self.local_socket)
            .finish_non_exhaustive()
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            ring: RingOptions::default(),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_millis(500),
            progress_timeout: Duration::from_secs(2),
            attempts: 3,
            suspect_for: Duration::from_secs(5),
            s3_fallback: true,
            token: None,
            tls: None,
            local_socket: None,
        }
    }
}

impl ClusterOptions {
    pub fn deadlines(&self) -> Deadlines {
        Deadlines {
            connect: self.connect_timeout.min(self.timeout),
            progress: self.progress_timeout.min(self.timeout),
            request: self.timeout,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("no workers in the cluster ({0})")]
    NoWorkers(String),
    /// A definite answer from a worker (not found, bad range, ...).
    #[error(transparent)]
    Worker(ClientError),
    /// Every worker tried failed; the last failure is the source.
    #[error("every worker failed and S3 fallback is off")]
    Unavailable(#[source] ClientError),
    #[error("S3 fallback failed")]
    S3(#[source] StoreError),
    #[error("the object changed during the read (expected ETag {expected}, got {got})")]
    Changed { expected: String, got: String },
}

pub(crate) struct State {
    pub(crate) ring: Ring,
    pub(crate) clients: HashMap<String, WorkerClient>,
}

pub struct ClusterClient {
    membership: Arc<dyn Membership>,
    state: RwLock<Arc<State>>,
    options: ClusterOptions,
    suspects: Mutex<HashMap<String, Instant>>,
    taken_elsewhere: crate::taken_elsewhere::TakenElsewhere,
    s3: Option<Arc<dyn ObjectStore>>,
    follower: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The socket of the worker on this host, when there is one.
    local: Option<Arc<LocalChannel>>,
}

impl Drop for ClusterClient {
    fn drop(&mut self) {
        if let Some(task) = self
            .follower
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

fn build_state(
    view: &View,
    options: &ClusterOptions,
    previous: Option<&State>,
    local: &Option<Arc<LocalChannel>>,
) -> State {
    let ring = Ring::new(view, options.ring.clone());
    let mut clients = HashMap::new();
    for m in ring.members() {
        let reuse = previous
            .and_then(|p| p.clients.get(&m.id))
            .filter(|c| c.base_url().ends_with(&m.address));
        let client = match reuse {
            Some(c) => c.clone(),
            None => {
                match WorkerClient::connect(&m.address, options.deadlines(), options.tls.as_ref())
                    .and_then(|c| c.with_token(options.token.as_deref()))
                {
                    // Every client may ask: the channel reads only for the
                    // member whose address its worker listens on.
                    Ok(c) => c.with_local(local.clone()),
                    Err(e) => {
                        tracing::warn!(member = %m.id, error = %e, "skipping member with a bad address");
                        continue;
                    }
                }
            }
        };
        clients.insert(m.id.clone(), client);
    }
    State { ring, clients }
}

impl ClusterClient {
    /// Builds the ring from the current view and follows later changes.
    pub fn new(
        membership: Arc<dyn Membership>,
        options: ClusterOptions,
        s3: Option<Arc<dyn ObjectStore>>,
    ) -> Arc<Self> {
        let mut rx = membership.subscribe();
        let local = options
            .local_socket
            .as_deref()
            .map(|p| Arc::new(LocalChannel::new(p, options.token.clone())));
        let initial = build_state(&rx.borrow_and_update(), &options, None, &local);
        let client = Arc::new(Self {
            membership,
            state: RwLock::new(Arc::new(initial)),
            options,
            suspects: Mutex::default(),
            taken_elsewhere: Default::default(),
            s3,
            follower: Mutex::new(None),
            local,
        });
        let weak = Arc::downgrade(&client);
        let task = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let Some(this) = weak.upgrade() else { return };
                let view = rx.borrow_and_update().clone();
                let previous = this.current();
                let next = build_state(&view, &this.options, Some(&previous), &this.local);
                tracing::info!(members = next.ring.members().len(), "ring rebuilt");
                *this.state.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
            }
        });
        *client.follower.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        client
    }

    /// Tells the worker on this host (its local socket) that this client
    /// writes back through it, so it prepares for the first burst; see
    /// [`LocalChannel::prepare_write_back`]. Without a socket, or with a
    /// worker that does not take the request, nothing changes: the
    /// worker learns from the bursts themselves.
    pub async fn prepare_write_back(&self) {
        let Some(local) = self.local.clone() else {
            return;
        };
        match tokio::task::spawn_blocking(move || local.prepare_write_back()).await {
            Ok(Ok(spare_bytes)) => tracing::info!(
                spare_bytes,
                "the worker on this host prepares for write-back bursts"
            ),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the worker on this host was not told of write-back")
            }
            Err(e) => tracing::debug!(error = %e, "telling the local worker of write-back failed"),
        }
    }

    pub(crate) fn describe_membership(&self) -> String {
        self.membership.describe()
    }

    pub(crate) fn current(&self) -> Arc<State> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn members(&self) -> Vec<Member> {
        self.current().ring.members().to_vec()
    }

    /// Each member now, with this client's connection to it.
    pub fn member_clients(&self) -> Vec<(Member, WorkerClient)> {
        let state = self.current();
        state
            .ring
            .members()
            .iter()
            .filter_map(|m| Some((m.clone(), state.clients.get(&m.id)?.clone())))
            .collect()
    }

    pub fn segment_size(&self) -> u64 {
        self.options.ring.segment_size
    }

    /// The worker that owns byte `offset` of `uri` in the current ring.
    pub fn owner_of(&self, uri: &ObjectUri, offset: u64) -> Option<Member> {
        let state = self.current();
        let segment = state.ring.segment_of(offset);
        state.ring.owner(&uri.to_string(), segment).cloned()
    }

    /// The owner of `segment` of `uri` and the distinct workers after it
    /// on the ring, up to `n`.
    pub fn replicas_of(&self, uri: &ObjectUri, segment: u64, n: usize) -> Vec<Member> {
        let state = self.current();
        state
            .ring
            .replicas(&uri.to_string(), segment, n)
            .into_iter()
            .cloned()
            .collect()
    }

    fn is_suspect(&self, id: &str) -> bool {
        let mut suspects = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        match suspects.get(id) {
            Some(since) if since.elapsed() < self.options.suspect_for => true,
            Some(_) => {
                suspects.remove(id);
                false
            }
            None => false,
        }
    }

    fn mark_suspect(&self, id: &str, error: &ClientError) {
        tracing::warn!(worker = %id, error = %Chain(error), "worker failed; trying the next replica");
        self.suspects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), Instant::now());
    }

    /// Runs `op` on the segment's owner, then on the next replicas; healthy
    /// workers before suspects. Returns the last retryable error if all fail.
    async fn on_replicas<T, F, Fut>(
        &self,
        key: &str,
        segment: u64,
        op: F,
    ) -> Result<T, ClusterError>
    where
        F: Fn(WorkerClient) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let state = self.current();
        let Some(owner) = state.ring.owner(key, segment) else {
            return Err(ClusterError::NoWorkers(self.membership.describe()));
        };
        let mut order: Vec<Member> = vec![owner.clone()];
        // A pending write-back taken by another worker lives there: that
        // worker answers for the object first (stats and pending reads
        // ask segment 0).
        if segment == 0 {
            if let Some(holder) = self.taken_elsewhere.holder(key) {
                if let Some(m) = state.ring.members().iter().find(|m| m.id == holder) {
                    if m.id != owner.id {
                        order.insert(0, m.clone());
                    }
                }
            }
        }
        let mut last: Option<ClientError> = None;
        let mut expanded = false;
        let mut i = 0;
        while i < order.len() {
            let member = order[i].clone();
            i += 1;
            let suspect = self.is_suspect(&member.id);
            if suspect && !expanded {
                // Push the owner behind the healthy replicas.
                order.extend(self.more_replicas(&state, key, segment, &order));
                expanded = true;
                order.push(member);
                continue;
            }
            let Some(client) = state.clients.get(&member.id) else {
                continue;
            };
            lakecache_telemetry::InFlight::note_worker(&member.address);
            match op(client.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() => {
                    self.mark_suspect(&member.id, &e);
                    last = Some(e);
                    if !expanded {
                        order.extend(self.more_replicas(&state, key, segment, &order));
                        expanded = true;
                    }
                }
                Err(e) => return Err(ClusterError::Worker(e)),
            }
        }
        match last {
            Some(e) => Err(ClusterError::Unavailable(e)),
            // Members without a usable client (bad addresses).
            None => Err(ClusterError::NoWorkers(self.membership.describe())),
        }
    }

    fn more_replicas(
        &self,
        state: &State,
        key: &str,
        segment: u64,
        have: &[Member],
    ) -> Vec<Member> {
        state
            .ring
            .replicas(key, segment, self.options.attempts.max(1))
            .into_iter()
            .filter(|m| !have.iter().any(|h| h.id == m.id))
            .cloned()
            .collect()
    }

    fn fallback(&self) -> Option<&Arc<dyn ObjectStore>> {
        self.s3.as_ref().filter(|_| self.options.s3_fallback)
    }

    /// Records which worker acknowledged a write of `uri` (its base URL,
    /// [`WorkerClient::base_url`]): a write-back pending on a worker other
    /// than the owner is asked for there until it is in S3.
    pub fn note_written(&self, uri: &ObjectUri, worker: &str, stat: &ObjectStat) {
        let key = uri.to_string();
        let state = self.current();
        let owner = state.ring.owner(&key, 0).map(|m| m.id.clone());
        let taker = state
            .clients
            .iter()
            .find(|(_, c)| c.base_url() == worker)
            .map(|(id, _)| id.clone());
        match taker {
            Some(id)
                if lakecache_protocol::is_cache_version(&stat.etag)
                    && Some(&id) != owner.as_ref() =>
            {
                tracing::debug!(%uri, worker = %id, "a write-back pending away from its owner: asking that worker for it");
                self.taken_elsewhere.note(&key, &id);
            }
            _ => self.taken_elsewhere.forget(&key),
        }
    }

    pub async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, ClusterError> {
        let key = uri.to_string();
        let answer = self
            .on_replicas(&key, 0, |c| async move { c.stat(uri).await })
            .await;
        if let Ok(stat) = &answer {
            // In S3 now: the owner can answer for it again.
            if !lakecache_protocol::is_cache_version(&stat.etag) {
                self.taken_elsewhere.forget(&key);
            }
        }
        match answer {
            Err(ClusterError::Unavailable(last)) => match self.fallback() {
                Some(s3) => {
                    tracing::warn!(%uri, last = %Chain(&last), "no worker answered stat; asking S3");
                    let meta = s3.head(uri).await.map_err(ClusterError::S3)?;
                    Ok(ObjectStat {
                        uri: key,
                        size: meta.size,
                        etag: meta.etag,
                        last_modified_ms: meta.last_modified_ms,
                        written_as: None,
                        meta: meta.user,
                        held_by: None,
                    })
                }
                None => Err(ClusterError::Unavailable(last)),
            },
            other => other,
        }
    }

    /// The object's current version (and S3 VersionId), from a worker or,
    /// when none answers, S3.
    pub async fn current_version(&self, uri: &ObjectUri) -> Result<ObjectVersion, ClusterError> {
        let key = uri.to_string();
        match self
            .on_replicas(&key, 0, |c| async move { c.current_version(uri).await })
            .await
        {
            Err(ClusterError::Unavailable(last)) => match self.fallback() {
                Some(s3) => {
                    let (meta, version_id) =
                        s3.current_version(uri).await.map_err(ClusterError::S3)?;
                    Ok(ObjectVersion {
                        size: meta.size,
                        etag: meta.etag,
                        last_modified_ms: meta.last_modified_ms,
                        version_id,
                    })
                }
                None => Err(ClusterError::Unavailable(last)),
            },
            other => other,
        }
    }

    /// Exactly `range` of version `version_id` (which must carry `etag`),
    /// read through from S3 by the object's owner, or directly when no
    /// worker answers.
    pub async fn read_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, ClusterError> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let key = uri.to_string();
        let seg = range.start / self.segment_size();
        let attempt = range.clone();
        match self
            .on_replicas(&key, seg, |c| {
                let r = attempt.clone();
                async move { c.read_version(uri, r, version_id, etag).await }
            })
            .await
        {
            Err(ClusterError::Unavailable(last)) => match self.fallback() {
                Some(s3) => s3
                    .get_range_version(uri, range, version_id, etag)
                    .await
                    .map_err(ClusterError::S3),
                None => Err(ClusterError::Unavailable(last)),
            },
            other => other,
        }
    }

    /// Reads `range` of `uri`; segments are fetched in parallel from their
    /// owners. With `etag`, every piece must come from that version.
    /// Asks the workers owning `uri`'s segments to fetch it whole into
    /// their caches, in the background (a load job of that one object,
    /// named by the version, so asking again joins the running job).
    /// Returns once every owner has taken the job.
    pub async fn warm_object(
        &self,
        uri: &ObjectUri,
        etag: &str,
        size: u64,
    ) -> Result<(), ClusterError> {
        let state = self.current();
        let seg_size = self.segment_size().max(1);
        let mut owners: Vec<Member> = Vec::new();
        for seg in 0..size.div_ceil(seg_size).max(1) {
            if let Some(m) = state.ring.owner(&uri.to_string(), seg) {
                if !owners.iter().any(|o| o.id == m.id) {
                    owners.push(m.clone());
                }
            }
            if owners.len() == state.clients.len() {
                break;
            }
        }
        if owners.is_empty() {
            return Err(ClusterError::NoWorkers(self.membership.describe()));
        }
        let mut named = uri.to_string().into_bytes();
        named.push(0);
        named.extend_from_slice(etag.as_bytes());
        let id = format!("whole-{:016x}", xxhash_rust::xxh3::xxh3_64(&named));
        // The object alone: the prefix is its key, and only the key
        // itself (nothing after it) is included.
        let spec = lakecache_protocol::LoadSpec {
            bucket: uri.bucket().to_string(),
            prefix: uri.key().to_string(),
            include: Some(String::new()),
            replicas: None,
        };
        for m in owners {
            let Some(client) = state.clients.get(&m.id) else {
                continue;
            };
            client
                .load_start(&id, &spec)
                .await
                .map_err(ClusterError::Worker)?;
        }
        Ok(())
    }

    pub async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: Option<&str>,
    ) -> Result<Bytes, ClusterError> {
        self.read_as(uri, range, etag, ReadKind::Demand).await
    }

    /// [`Self::read`], saying whether the reader asked for these bytes or
    /// reads ahead of what it was asked (plans on the workers count the
    /// two apart).
    pub async fn read_as(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: Option<&str>,
        kind: ReadKind,
    ) -> Result<Bytes, ClusterError> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let seg_size = self.segment_size();
        let mut pieces = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let seg = pos / seg_size;
            let end = range.end.min((seg + 1) * seg_size);
            pieces.push((seg, pos..end));
            pos = end;
        }
        // A version not yet in S3 lives only on the worker that took the
        // write (the owner of segment 0): every piece goes there.
        let pending = etag.is_some_and(lakecache_protocol::is_cache_version);
        let reads = pieces.into_iter().map(|(seg, r)| {
            let seg = if pending { 0 } else { seg };
            self.read_segment(uri, seg, r, etag, kind)
        });
        let mut parts = futures::future::try_join_all(reads).await?;
        let expected = etag.map(str::to_string).or_else(|| parts[0].1.clone());
        for (_, got) in &parts {
            if let (Some(want), Some(got)) = (&expected, got) {
                if want != got {
                    return Err(ClusterError::Changed {
                        expected: want.clone(),
                        got: got.clone(),
                    });
                }
            }
        }
        // The common case is one segment: hand its bytes over uncopied.
        if parts.len() == 1 {
            return Ok(parts.remove(0).0);
        }
        let mut out = BytesMut::with_capacity((range.end - range.start) as usize);
        for (bytes, _) in parts {
            out.extend_from_slice(&bytes);
        }
        Ok(out.freeze())
    }

    /// A reader's read of `range` of `uri` at `etag`, served on the
    /// calling thread by the segment's owner through its local socket,
    /// where that owner is this host's worker and holds every byte now.
    /// `None`: not this way (a range across segments, a pending version,
    /// another or a suspect owner, bytes it would fetch, any failure);
    /// read with [`Self::read_as`], which settles every such case.
    pub fn read_cached_now(&self, uri: &ObjectUri, range: Range<u64>, etag: &str) -> Option<Bytes> {
        // Mounts without a worker's socket (most) pay nothing for it.
        if self.options.local_socket.is_none()
            || range.is_empty()
            || lakecache_protocol::is_cache_version(etag)
        {
            return None;
        }
        let seg_size = self.segment_size();
        let segment = range.start / seg_size;
        if range.end > (segment + 1) * seg_size {
            return None;
        }
        let key = uri.to_string();
        if segment == 0 && self.taken_elsewhere.holder(&key).is_some() {
            return None;
        }
        let state = self.current();
        let owner = state.ring.owner(&key, segment)?;
        if self.is_suspect(&owner.id) {
            return None;
        }
        state
            .clients
            .get(&owner.id)?
            .read_cached_local_now(uri, &range, etag)
    }

    async fn read_segment(
        &self,
        uri: &ObjectUri,
        segment: u64,
        range: Range<u64>,
        etag: Option<&str>,
        kind: ReadKind,
    ) -> Result<(Bytes, Option<String>), ClusterError> {
        let key = uri.to_string();
        let attempt = self
            .on_replicas(&key, segment, |c| {
                let range = range.clone();
                async move { c.read_checked_as(uri, Some(range), etag, kind).await }
            })
            .await;
        match attempt {
            Err(ClusterError::Unavailable(last)) => {
                let Some(s3) = self.fallback() else {
                    return Err(ClusterError::Unavailable(last));
                };
                tracing::warn!(%uri, segment, last = %Chain(&last), "no worker could serve the segment; reading from S3");
                let version = match etag {
                    Some(e) => e.to_string(),
                    None => s3.head(uri).await.map_err(ClusterError::S3)?.etag,
                };
                let bytes = s3
                    .get_range(uri, range, &version)
                    .await
                    .map_err(ClusterError::S3)?;
                Ok((bytes, Some(version)))
            }
            other => other,
        }
    }

    pub async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, ClusterError> {
        let key = format!("s3://{bucket}/{prefix}");
        self.on_replicas(&key, 0, |c| async move {
            c.list(bucket, prefix, delimiter, token, max_keys).await
        })
        .await
    }

    /// [`Self::list`] with each object's user metadata.
    pub async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, ClusterError> {
        let key = format!("s3://{bucket}/{prefix}");
        self.on_replicas(&key, 0, |c| async move {
            c.list_with_meta(bucket, prefix, delimiter, token, max_keys)
                .await
        })
        .await
    }

    /// A client for the owner of the object's first segment, for
    /// streaming uploads (a stream cannot be replayed on a replica).
    pub fn writer_for(&self, uri: &ObjectUri) -> Result<WorkerClient, ClusterError> {
        let state = self.current();
        let key = uri.to_string();
        let mut candidates = state.ring.replicas(&key, 0, self.options.attempts.max(1));
        // Prefer a worker not marked suspect.
        candidates.sort_by_key(|m| self.is_suspect(&m.id));
        if let Some(m) = candidates.first() {
            lakecache_telemetry::InFlight::note_worker(&m.address);
        }
        candidates
            .first()
            .and_then(|m| state.clients.get(&m.id).cloned())
            .ok_or_else(|| ClusterError::NoWorkers(self.membership.describe()))
    }

    /// The worker to take a write of `uri` that the workers at `avoid`
    /// (their base URLs, [`WorkerClient::base_url`]) gave up on: the next on the ring, healthy ones first.
    /// Each worker avoided is marked suspect, so reads and writes leave it
    /// alone for `suspect_for` too.
    pub fn writer_avoiding(
        &self,
        uri: &ObjectUri,
        avoid: &[String],
    ) -> Result<WorkerClient, ClusterError> {
        if avoid.is_empty() {
            return self.writer_for(uri);
        }
        let state = self.current();
        let key = uri.to_string();
        let wanted = self.options.attempts.max(1) + avoid.len();
        let mut candidates = state.ring.replicas(&key, 0, wanted);
        let avoided = |m: &crate::Member| {
            state
                .clients
                .get(&m.id)
                .is_some_and(|c| avoid.iter().any(|a| a == c.base_url()))
        };
        for m in candidates.iter().filter(|m| avoided(m)) {
            let stalled = ClientError::Timeout {
                addr: m.address.clone(),
                timeout: Duration::ZERO,
            };
            self.mark_suspect(&m.id, &stalled);
        }
        candidates.retain(|m| !avoided(m));
        candidates.sort_by_key(|m| self.is_suspect(&m.id));
        candidates
            .first()
            .and_then(|m| state.clients.get(&m.id).cloned())
            .ok_or_else(|| ClusterError::NoWorkers(self.membership.describe()))
    }

    /// Writes through the owner of the object's first segment.
    pub async fn put(&self, uri: &ObjectUri, data: Bytes) -> Result<ObjectStat, ClusterError> {
        self.put_with_meta(uri, data, &UserMeta::new()).await
    }

    /// [`Self::put`] with the object's user metadata.
    pub async fn put_with_meta(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<ObjectStat, ClusterError> {
        let key = uri.to_string();
        self.on_replicas(&key, 0, |c| {
            let data = data.clone();
            async move { c.put_bytes_with(uri, data, meta).await }
        })
        .await
    }

    /// Deletes through the owner of the object's first segment (which
    /// forgets its cached pages).
    pub async fn delete(&self, uri: &ObjectUri) -> Result<(), ClusterError> {
        self.on_replicas(&uri.to_string(), 0, |c| async move { c.delete(uri).await })
            .await
    }

    /// Server-side copy, run by the owner of the destination.
    pub async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectStat, ClusterError> {
        self.on_replicas(&to.to_string(), 0, |c| async move {
            c.copy(from, etag, to, meta).await
        })
        .await
    }
}
