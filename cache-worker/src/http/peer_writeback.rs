//! Worker-to-worker calls of write-back copies: a copy's PUT headers, a
//! replica asking its primary about a version, a primary telling a
//! replica to drop a copy or to record a delete behind it.

use std::sync::Arc;

use http::StatusCode;
use lakecache_protocol::{
    is_cache_version, ErrorCode, ObjectUri, WriteBackEntry, CACHE_VERSION_PREFIX, CONFIRM_HEADER,
    REPLICA_OF_HEADER, VERSION_HEADER,
};

use super::auth::Access;
use super::response::{cache_error, error, json, Response};
use super::routes::AppState;
use crate::journal::ReplicaOf;
use crate::writeback::{WriteBack, WriteRole};

// A write-back PUT from another worker carries the primary and the
/// version; a client's PUT carries neither.
pub(super) fn replica_role(headers: &http::HeaderMap) -> Result<WriteRole, Box<Response>> {
    let bad = |msg: String| Box::new(error(ErrorCode::BadRequest, msg));
    let text = |name: &str| -> Result<Option<String>, Box<Response>> {
        match headers.get(name).map(|v| v.to_str()) {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(v.trim().to_string())),
            Some(Err(_)) => Err(bad(format!("{name} is not ASCII"))),
        }
    };
    let (of, version) = (text(REPLICA_OF_HEADER)?, text(VERSION_HEADER)?);
    let (of, version) = match (of, version) {
        (None, None) => return Ok(WriteRole::Primary),
        (Some(of), Some(version)) => (of, version),
        _ => {
            return Err(bad(format!(
                "{REPLICA_OF_HEADER} and {VERSION_HEADER} go together"
            )))
        }
    };
    Ok(WriteRole::Replica {
        version: checked_version(version)?,
        of: parse_replica_of(&of)?,
        confirm: confirm_asked(headers)?,
    })
}

/// Whether the primary will confirm the copy ([`CONFIRM_HEADER`]: `1`).
fn confirm_asked(headers: &http::HeaderMap) -> Result<bool, Box<Response>> {
    match headers.get(CONFIRM_HEADER).map(|v| v.as_bytes()) {
        None => Ok(false),
        Some(b"1") => Ok(true),
        Some(_) => Err(Box::new(error(
            ErrorCode::BadRequest,
            format!("{CONFIRM_HEADER} must be 1 where present"),
        ))),
    }
}

fn checked_version(version: String) -> Result<String, Box<Response>> {
    let well_formed = version.len() <= 64
        && is_cache_version(&version)
        && version[CACHE_VERSION_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric());
    if well_formed {
        Ok(version)
    } else {
        Err(Box::new(error(
            ErrorCode::BadRequest,
            format!(
            "{VERSION_HEADER} must be a cache version ({CACHE_VERSION_PREFIX} and up to 61 letters or digits)"
        ),
        )))
    }
}

/// `<journal id> <address>` of a replica header.
fn parse_replica_of(of: &str) -> Result<ReplicaOf, Box<Response>> {
    match of.split_once(' ') {
        Some((journal_id, addr)) if !journal_id.is_empty() && !addr.trim().is_empty() => {
            Ok(ReplicaOf {
                journal_id: journal_id.to_string(),
                addr: addr.trim().to_string(),
            })
        }
        _ => Err(Box::new(error(
            ErrorCode::BadRequest,
            format!("{REPLICA_OF_HEADER} must be '<journal id> <address>'"),
        ))),
    }
}

/// `version=` from a query string.
fn version_param(query: &str) -> Result<String, Box<Response>> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        if let Some(("version", v)) = pair.split_once('=') {
            return percent_encoding::percent_decode_str(v)
                .decode_utf8()
                .map(|v| v.into_owned())
                .map_err(|_| Box::new(error(ErrorCode::BadRequest, "version is not valid UTF-8")));
        }
    }
    Err(Box::new(error(
        ErrorCode::BadRequest,
        "version=<cache version> is required",
    )))
}

/// What every peer call checks first: the object, a peer token (when
/// tokens are on), the version asked about, and write-back being on.
fn peer_call<'a>(
    state: &'a AppState,
    access: &Access<'_>,
    rest: &str,
    query: &str,
) -> Result<(ObjectUri, String, &'a Arc<WriteBack>), Box<Response>> {
    let uri = ObjectUri::from_api_path(rest)
        .map_err(|e| Box::new(error(ErrorCode::InvalidPath, e.to_string())))?;
    access.peer_object(&uri)?;
    let version = version_param(query)?;
    let wb = state.cache.writeback.as_ref().ok_or_else(|| {
        Box::new(error(
            ErrorCode::BadRequest,
            "this worker has write-back turned off",
        ))
    })?;
    Ok((uri, version, wb))
}

/// A replica asks the primary about one version it holds a copy of.
pub(super) async fn pending_entry(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    query: &str,
) -> Response {
    let (uri, version, wb) = match peer_call(state, access, rest, query) {
        Ok(call) => call,
        Err(resp) => return *resp,
    };
    // The journal lock is held across a journal fsync: wait for it off
    // the runtime's threads, so a slow disk does not stop every request.
    let wb = wb.clone();
    let uri = uri.to_string();
    let entry = tokio::task::spawn_blocking(move || WriteBackEntry {
        journal_id: wb.id.clone(),
        state: wb.entry_state(&uri, &version),
    })
    .await;
    match entry {
        Ok(entry) => json(StatusCode::OK, &entry),
        Err(e) => error(
            ErrorCode::Internal,
            format!("write-back state lookup failed: {e}"),
        ),
    }
}

/// A primary tells a replica its copy is settled.
pub(super) async fn drop_replica(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    query: &str,
) -> Response {
    let (uri, version, wb) = match peer_call(state, access, rest, query) {
        Ok(call) => call,
        Err(resp) => return *resp,
    };
    match state
        .cache
        .drop_replica(wb, &uri.to_string(), &version)
        .await
    {
        Ok(dropped) => json(StatusCode::OK, &serde_json::json!({ "dropped": dropped })),
        Err(e) => cache_error(&e),
    }
}

/// A primary journaled a delete behind a pending write this worker holds
/// a copy of: the copy gets the delete too.
pub(super) async fn replica_delete(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    query: &str,
    headers: &http::HeaderMap,
) -> Response {
    let (uri, version, _) = match peer_call(state, access, rest, query) {
        Ok(call) => call,
        Err(resp) => return *resp,
    };
    let confirm = match confirm_asked(headers) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    let version = match checked_version(version) {
        Ok(v) => v,
        Err(resp) => return *resp,
    };
    let of = match headers.get(REPLICA_OF_HEADER).map(|v| v.to_str()) {
        Some(Ok(v)) => match parse_replica_of(v.trim()) {
            Ok(of) => of,
            Err(resp) => return *resp,
        },
        _ => {
            return error(
                ErrorCode::BadRequest,
                format!("a replica delete needs {REPLICA_OF_HEADER}"),
            )
        }
    };
    match state
        .cache
        .record_replica_delete(&uri, version, of, confirm)
        .await
    {
        Ok(()) => json(StatusCode::OK, &serde_json::json!({ "recorded": true })),
        Err(e) => cache_error(&e),
    }
}

/// A primary's journal now holds the write this worker has a copy of.
pub(super) async fn confirm_replica(
    state: &AppState,
    access: &Access<'_>,
    rest: &str,
    query: &str,
) -> Response {
    let (uri, version, wb) = match peer_call(state, access, rest, query) {
        Ok(call) => call,
        Err(resp) => return *resp,
    };
    let (wb, key) = (wb.clone(), uri.to_string());
    let confirmed = tokio::task::spawn_blocking(move || wb.confirm_copy(&key, &version)).await;
    match confirmed {
        Ok(Ok(true)) => json(StatusCode::OK, &serde_json::json!({ "confirmed": true })),
        Ok(Ok(false)) => error(
            ErrorCode::NotFound,
            format!("this worker holds no copy of {uri} at that version to confirm"),
        ),
        Ok(Err(e)) => error(ErrorCode::Internal, format!("confirming a copy: {e}")),
        Err(e) => error(ErrorCode::Internal, format!("confirming a copy: {e}")),
    }
}
