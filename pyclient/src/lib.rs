//! `lakecache._native`: the cluster client the mount uses, for Python.
//!
//! Reads go through the same [`ClusterClient`] as the FUSE mount (ring
//! placement, replica failover, ETag-pinned reads) and, with a snapshot,
//! through the same [`SnapshotDataPlane`]. Every blocking call releases
//! the GIL, so reader threads in Python run in parallel.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lakecache_fuse::data_plane::{load_manifest, read_exact, ManifestError, SnapshotDataPlane};
use lakecache_fuse::{DataError, DataPlane};
use lakecache_protocol::snapshot::Snapshot;
use lakecache_protocol::tier_socket::{TierChannel, TierClientError, TierErrorKind, TierRead};
use lakecache_protocol::ObjectUri;
use lakecache_registry::{ClusterClient, ClusterOptions, RegistryUrl, RingOptions};
use lakecache_store::{NoMetrics, ObjectStore, S3Config, S3Store};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Reads larger than this are split into pieces fetched concurrently.
const READ_PIECE: u64 = 2 << 20;
const PIECES_IN_FLIGHT: usize = 8;

pyo3::create_exception!(
    _native,
    SnapshotMismatchError,
    PyOSError,
    "An object changed in S3 since the snapshot it is read through was taken."
);
pyo3::create_exception!(
    _native,
    ObjectChangedError,
    PyOSError,
    "The object is no longer the version that was opened."
);

fn to_py(uri: &str, e: DataError) -> PyErr {
    match e {
        DataError::NotFound => PyFileNotFoundError::new_err(format!("{uri}: no such object")),
        DataError::Denied(why) => PyPermissionError::new_err(format!("{uri}: {why}")),
        e @ DataError::SnapshotMismatch { .. } => SnapshotMismatchError::new_err(e.to_string()),
        e @ DataError::Changed { .. } => ObjectChangedError::new_err(format!("{uri}: {e}")),
        e @ DataError::InvalidRange { .. } => PyValueError::new_err(format!("{uri}: {e}")),
        e => PyOSError::new_err(format!("{uri}: {}", lakecache_fuse::Chain(&e))),
    }
}

fn parse_uri(uri: &str) -> PyResult<ObjectUri> {
    let s3 = match uri.strip_prefix("lakecache://") {
        Some(rest) => format!("s3://{rest}"),
        None => uri.to_string(),
    };
    s3.parse::<ObjectUri>()
        .map_err(|e| PyValueError::new_err(format!("{uri:?}: {e} (expected s3://bucket/key)")))
}

/// A connection to a lakecache cluster.
#[pyclass(frozen, module = "lakecache._native")]
struct Client {
    rt: tokio::runtime::Runtime,
    data: Arc<dyn DataPlane>,
    /// The ring-aware client under `data`, for calls outside the data
    /// plane (publishing plans).
    cluster: Arc<ClusterClient>,
    snapshot_checksum: Option<String>,
    /// The node's mount, whose local tier reads go through first.
    tier: Option<TierChannel>,
}

#[pymethods]
impl Client {
    /// registry: `static:HOST:PORT,...`, `file:/path` or `etcd://HOST:PORT[/prefix]`;
    /// worker: a single HOST:PORT when no registry is given.
    /// local_cache: the `--local-cache` directory of a mount on this node:
    /// reads go through its node-local tier (shared with the mount, so an
    /// object both read is fetched once); the mount must be running.
    #[new]
    #[pyo3(signature = (registry=None, worker=None, token_file=None, tls_ca=None,
                        snapshot=None, segment_size=None, progress_timeout_s=2.0, threads=4,
                        s3_fallback=false, s3_endpoint=None, s3_region=None,
                        s3_path_style=false, local_cache=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        registry: Option<String>,
        worker: Option<String>,
        token_file: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
        snapshot: Option<String>,
        segment_size: Option<u64>,
        progress_timeout_s: f64,
        threads: usize,
        s3_fallback: bool,
        s3_endpoint: Option<String>,
        s3_region: Option<String>,
        s3_path_style: bool,
        local_cache: Option<PathBuf>,
    ) -> PyResult<Self> {
        let tier =
            match local_cache {
                Some(dir) => Some(py.detach(|| TierChannel::connect(&dir)).map_err(|e| {
                    PyOSError::new_err(format!("local_cache {}: {e}", dir.display()))
                })?),
                None => None,
            };
        let registry: RegistryUrl = match (registry, worker) {
            (Some(r), _) => r.parse(),
            (None, Some(w)) => format!("static:{w}").parse(),
            (None, None) => "static:127.0.0.1:9500".parse(),
        }
        .map_err(|e| PyValueError::new_err(format!("registry: {e}")))?;
        let token = match token_file {
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    PyOSError::new_err(format!("reading token_file {}: {e}", path.display()))
                })?;
                let t = text.trim().to_string();
                if t.is_empty() {
                    return Err(PyValueError::new_err(format!(
                        "token_file {} is empty",
                        path.display()
                    )));
                }
                Some(t)
            }
            None => None,
        };
        let tls = match tls_ca {
            Some(ca) => Some(
                lakecache_protocol::tls::ClientTls::load(&ca, None)
                    .map_err(|e| PyValueError::new_err(format!("tls_ca: {e}")))?,
            ),
            None => None,
        };
        if !(progress_timeout_s.is_finite() && progress_timeout_s > 0.0) {
            return Err(PyValueError::new_err("progress_timeout_s must be > 0"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.clamp(1, 64))
            .enable_all()
            .thread_name("lakecache-client")
            .build()
            .map_err(|e| PyOSError::new_err(format!("starting the client runtime: {e}")))?;
        let mut options = ClusterOptions {
            ring: RingOptions {
                segment_size: segment_size.unwrap_or(lakecache_registry::DEFAULT_SEGMENT_SIZE),
                ..RingOptions::default()
            },
            progress_timeout: Duration::from_secs_f64(progress_timeout_s),
            s3_fallback,
            token,
            tls,
            ..ClusterOptions::default()
        };
        let (data, cluster, checksum) = py.detach(|| {
            rt.block_on(async {
                let membership = registry
                    .open(Duration::from_secs(5))
                    .await
                    .map_err(|e| PyOSError::new_err(format!("opening the registry: {e}")))?;
                if let Ok(Some(recorded)) = registry.advertised_ring(Duration::from_secs(5)).await {
                    options.ring.segment_size = recorded.segment_size;
                    options.ring.vnodes = recorded.vnodes;
                }
                // When no worker answers, read S3 directly (credentials from
                // the standard AWS chain), as the mount does.
                let s3: Option<Arc<dyn ObjectStore>> = if s3_fallback {
                    let config = S3Config {
                        endpoint: s3_endpoint,
                        region: s3_region.unwrap_or_else(|| "us-east-1".into()),
                        path_style: s3_path_style,
                        ..S3Config::default()
                    };
                    Some(Arc::new(S3Store::new(&config, Arc::new(NoMetrics)).await))
                } else {
                    None
                };
                let client = ClusterClient::new(membership, options, s3);
                if client.members().is_empty() {
                    return Err(PyOSError::new_err("no workers registered in the registry"));
                }
                let cluster = client.clone();
                let plane: Arc<dyn DataPlane> = client;
                match snapshot {
                    None => Ok((plane, cluster, None)),
                    Some(manifest) => {
                        let snap = load_snapshot(plane.as_ref(), &manifest).await?;
                        let sum = snap.checksum.clone();
                        let pinned: Arc<dyn DataPlane> =
                            Arc::new(SnapshotDataPlane::new(plane, snap));
                        Ok((pinned, cluster, Some(sum)))
                    }
                }
            })
        })?;
        Ok(Self {
            rt,
            data,
            cluster,
            snapshot_checksum: checksum,
            tier,
        })
    }

    /// The checksum of the snapshot this client is pinned to, if any.
    #[getter]
    fn snapshot_checksum(&self) -> Option<String> {
        self.snapshot_checksum.clone()
    }

    /// `{"size", "etag", "last_modified_ms"}` of one object.
    fn stat(&self, py: Python<'_>, uri: &str) -> PyResult<(u64, String, i64)> {
        let parsed = parse_uri(uri)?;
        let stat = py
            .detach(|| self.rt.block_on(self.data.stat(&parsed)))
            .map_err(|e| to_py(uri, e))?;
        Ok((stat.size, stat.etag, stat.last_modified_ms))
    }

    /// Bytes `start..end` of the object's version `etag`; exactly that many.
    fn read<'py>(
        &self,
        py: Python<'py>,
        uri: &str,
        start: u64,
        end: u64,
        etag: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let parsed = parse_uri(uri)?;
        if end < start {
            return Err(PyValueError::new_err(format!(
                "range {start}..{end} is reversed"
            )));
        }
        if end == start {
            return Ok(PyBytes::new(py, b""));
        }
        // Pieces fetched concurrently, as the mount's read-ahead would: one
        // large read is otherwise one sequential stream.
        let pieces: Vec<Range<u64>> = (start..end)
            .step_by(READ_PIECE as usize)
            .map(|s| s..(s + READ_PIECE).min(end))
            .collect();
        // Each piece is copied into the bytes object as it arrives, with
        // the GIL released: one copy, and no second whole-sized buffer
        // (a 146 MB sample was held twice, and copied under the GIL), and
        // no zeroing first (30 ms of a 146 MB sample's 140 ms from the
        // tier). The object is not shared until it is returned, so nothing
        // else can see it while it is filled.
        let len = (end - start) as usize;
        bytes_filled_by(py, len, |out| {
            let fetched = py.detach(|| {
                if self.read_tier(&parsed, start, etag, out)? {
                    return Ok(());
                }
                self.rt.block_on(async {
                    let (data, parsed) = (self.data.as_ref(), &parsed);
                    // read_exact answers each piece whole or fails.
                    let mut stream = futures::stream::iter(pieces)
                        .map(|r| read_exact(data, parsed, r, etag))
                        .buffered(PIECES_IN_FLIGHT);
                    let mut at = 0usize;
                    while let Some(bytes) = stream.next().await {
                        let bytes = bytes?;
                        out[at..at + bytes.len()].write_copy_of_slice(&bytes);
                        at += bytes.len();
                    }
                    if at != len {
                        return Err(DataError::ShortBody {
                            expected: len as u64,
                            got: at as u64,
                        });
                    }
                    Ok::<_, DataError>(())
                })
            });
            fetched.map_err(|e| to_py(uri, e))
        })
    }

    /// Bytes each path served when reads go through a mount's local tier
    /// (`local_cache`): `{"file_bytes", "inline_bytes", "unavailable"}`
    /// (tier files read here, bytes the mount sent, reads it sent to the
    /// workers); `None` without `local_cache`.
    fn tier_stats(&self) -> Option<std::collections::HashMap<&'static str, u64>> {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = self.tier.as_ref()?.stats();
        Some(std::collections::HashMap::from([
            ("file_bytes", stats.file_bytes.load(Relaxed)),
            ("inline_bytes", stats.inline_bytes.load(Relaxed)),
            ("unavailable", stats.unavailable.load(Relaxed)),
        ]))
    }

    /// Publishes plan `name` (`job/rank`): this rank's reads for the coming
    /// epoch, in order, as `(uri, start, end)` byte ranges. Each worker gets
    /// the part it serves and evicts by it; the plan lives `ttl_s` seconds
    /// unless published again. Returns `{"workers", "pages",
    /// "skipped_entries", "skipped"}`, and with `local_cache` the entries
    /// the mount's tier took (`"tier_entries"`, it fetches ahead of them)
    /// or why it took none (`"tier_error"`); a malformed plan raises
    /// ValueError.
    #[pyo3(signature = (name, entries, ttl_s=900))]
    fn publish_plan(
        &self,
        py: Python<'_>,
        name: &str,
        entries: Vec<(String, u64, u64)>,
        ttl_s: u64,
    ) -> PyResult<std::collections::HashMap<String, Py<PyAny>>> {
        lakecache_protocol::validate_plan_name(name).map_err(PyValueError::new_err)?;
        if ttl_s == 0 || ttl_s > lakecache_protocol::MAX_PLAN_TTL_SECONDS {
            return Err(PyValueError::new_err(format!(
                "ttl_s is {ttl_s}; it must be 1 to {}",
                lakecache_protocol::MAX_PLAN_TTL_SECONDS
            )));
        }
        let mut ranges = Vec::with_capacity(entries.len());
        for (i, (uri, start, end)) in entries.into_iter().enumerate() {
            let parsed = parse_uri(&uri)
                .map_err(|e| PyValueError::new_err(format!("plan entry {i}: {e}")))?;
            ranges.push((parsed, start..end));
        }
        let published = py
            .detach(|| {
                self.rt
                    .block_on(self.cluster.publish_plan(name, &ranges, ttl_s))
            })
            .map_err(|e| match &e {
                lakecache_registry::ClusterError::Worker(
                    lakecache_protocol::ClientError::Api {
                        code: lakecache_protocol::ErrorCode::BadRequest,
                        ..
                    },
                ) => PyValueError::new_err(format!("plan {name}: {e}")),
                _ => PyOSError::new_err(format!("publishing plan {name}: {e}")),
            })?;
        let mut out = std::collections::HashMap::new();
        // The mount's tier fetches ahead of the plan too; a tier that
        // cannot take it is reported, never raised (reads go on).
        if let Some(tier) = &self.tier {
            let taken = py.detach(|| tier.publish_plan(name, ttl_s, &ranges));
            match taken {
                Ok(entries) => {
                    out.insert(
                        "tier_entries".into(),
                        entries.into_pyobject(py)?.into_any().unbind(),
                    );
                }
                Err(e) => {
                    out.insert(
                        "tier_error".into(),
                        e.to_string().into_pyobject(py)?.into_any().unbind(),
                    );
                }
            }
        }
        out.insert(
            "workers".into(),
            published.workers.into_pyobject(py)?.into_any().unbind(),
        );
        out.insert(
            "pages".into(),
            published.pages.into_pyobject(py)?.into_any().unbind(),
        );
        out.insert(
            "skipped_entries".into(),
            published
                .skipped_entries
                .into_pyobject(py)?
                .into_any()
                .unbind(),
        );
        out.insert(
            "skipped".into(),
            published.skipped.into_pyobject(py)?.into_any().unbind(),
        );
        Ok(out)
    }

    /// Every object and common prefix under `uri` (a bucket and key
    /// prefix), all pages: `([(key, size, etag)], [prefix])`.
    #[pyo3(signature = (uri, delimiter=None))]
    #[allow(clippy::type_complexity)]
    fn list(
        &self,
        py: Python<'_>,
        uri: &str,
        delimiter: Option<&str>,
    ) -> PyResult<(Vec<(String, u64, String)>, Vec<String>)> {
        let (bucket, prefix) = split_prefix(uri)?;
        py.detach(|| {
            self.rt.block_on(async {
                let mut objects = Vec::new();
                let mut prefixes = Vec::new();
                let mut token: Option<String> = None;
                loop {
                    let page = self
                        .data
                        .list(&bucket, &prefix, delimiter, token.as_deref(), None)
                        .await
                        .map_err(|e| to_py(uri, e))?;
                    objects.extend(page.objects.into_iter().map(|o| (o.key, o.size, o.etag)));
                    prefixes.extend(page.common_prefixes);
                    match page.next_token {
                        Some(t) if Some(&t) != token.as_ref() => token = Some(t),
                        _ => break,
                    }
                }
                Ok((objects, prefixes))
            })
        })
    }
}

impl Client {
    /// Fills `out` from the mount's local tier when there is one and it
    /// serves the object: `Ok(true)`. `Ok(false)`: read from the workers.
    fn read_tier(
        &self,
        uri: &ObjectUri,
        start: u64,
        etag: &str,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<bool, DataError> {
        let Some(tier) = self
            .tier
            .as_ref()
            .filter(|t| t.serves(uri.bucket(), uri.key()))
        else {
            return Ok(false);
        };
        match tier.read_into_uninit(&uri.to_string(), etag, start, out) {
            Ok(TierRead::Done) => Ok(true),
            Err(TierClientError::Refused {
                kind: TierErrorKind::InvalidRange,
                ..
            }) => Err(DataError::InvalidRange {
                start,
                end: start + out.len() as u64,
            }),
            // Anything else (a changed or missing object included) is
            // answered by the workers, through this client's data plane:
            // a snapshot client then names a snapshot mismatch as such.
            Ok(TierRead::Unavailable(_)) | Err(_) => Ok(false),
        }
    }
}

/// A new `bytes` of `len` bytes, all written by `fill` before anyone can
/// see it (without zeroing them first); dropped unread if `fill` fails.
fn bytes_filled_by<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = pyo3::ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyValueError::new_err(format!("a read of {len} bytes is too large")))?;
    // SAFETY: with a null pointer, PyBytes_FromStringAndSize returns a new
    // bytes object of `size` bytes not yet initialised, owned here and
    // seen by no one else until returned; PyBytes_AsString points at its
    // `size` bytes. `fill` writes every one of them or fails, and a
    // failed object is dropped without being read.
    unsafe {
        let raw = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
        let object = Bound::from_owned_ptr_or_err(py, raw)?;
        let data = pyo3::ffi::PyBytes_AsString(raw).cast::<MaybeUninit<u8>>();
        fill(std::slice::from_raw_parts_mut(data, len))?;
        Ok(object.cast_into_unchecked::<PyBytes>())
    }
}

fn split_prefix(uri: &str) -> PyResult<(String, String)> {
    let rest = uri
        .strip_prefix("s3://")
        .or_else(|| uri.strip_prefix("lakecache://"))
        .ok_or_else(|| {
            PyValueError::new_err(format!("{uri:?} must start with s3:// or lakecache://"))
        })?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(PyValueError::new_err(format!("{uri:?} names no bucket")));
    }
    Ok((bucket.to_string(), prefix.to_string()))
}

async fn load_snapshot(data: &dyn DataPlane, manifest: &str) -> PyResult<Snapshot> {
    let uri = parse_uri(manifest)?;
    load_manifest(data, &uri).await.map_err(|e| match e {
        ManifestError::Read(e) => to_py(manifest, e),
        ManifestError::Invalid(e) => {
            PyValueError::new_err(format!("snapshot manifest {manifest}: {e}"))
        }
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add(
        "SnapshotMismatchError",
        m.py().get_type::<SnapshotMismatchError>(),
    )?;
    m.add(
        "ObjectChangedError",
        m.py().get_type::<ObjectChangedError>(),
    )?;
    Ok(())
}
