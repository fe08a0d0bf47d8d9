//! `lakecache status --mount ADDR`: a mount's node-local tier, object by
//! object, read from the mount's listener (its `--metrics-listen`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use lakecache_fuse::local_tier::report::TierReport;

use crate::mount_cmd::{MountSettings, LOCAL_TIER_PATH, SETTINGS_PATH};
use crate::units::ByteSize;

/// Objects printed in the table (the JSON has every listed one).
const TABLE_ROWS: usize = 40;

pub async fn show(addr: SocketAddr, json: bool) -> Result<()> {
    let within = |path: &'static str| async move {
        tokio::time::timeout(Duration::from_secs(10), get(addr, path))
            .await
            .with_context(|| format!("the mount at {addr} did not answer within 10 s"))?
    };
    if json {
        let body = within(LOCAL_TIER_PATH)
            .await?
            .ok_or_else(|| no_tier(addr))?;
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    // Mounts from before the settings route answer 404: nothing to show.
    if let Some(body) = within(SETTINGS_PATH).await? {
        let s: MountSettings = serde_json::from_slice(&body).with_context(|| {
            format!("the mount at {addr} answered {SETTINGS_PATH} with something other than its settings")
        })?;
        print_settings(&s);
    }
    let Some(body) = within(LOCAL_TIER_PATH).await? else {
        println!("no node-local tier (the mount was started without --local-cache)");
        return Ok(());
    };
    let report: TierReport = serde_json::from_slice(&body)
        .with_context(|| format!("the mount at {addr} answered {LOCAL_TIER_PATH} with something other than a tier report"))?;
    print_report(&report);
    Ok(())
}

fn no_tier(addr: SocketAddr) -> anyhow::Error {
    anyhow::anyhow!("the mount at {addr} has no node-local tier (it was started without --local-cache), or {addr} is not a mount (is this the address given to the mount's --metrics-listen?)")
}

fn print_settings(s: &MountSettings) {
    let secs = |ms: u64| format!("{}s", ms as f64 / 1000.0);
    println!(
        "writes: {} mode; progress deadline {} (--write-progress-timeout: a worker silent that long, and then to a probe, is given up on and the write goes to the next worker); whole upload at most {}; memory {}, beyond it kept for a resend in {}",
        s.write_mode,
        secs(s.write_progress_timeout_ms),
        secs(s.upload_timeout_ms),
        ByteSize(s.memory_limit_bytes).human(),
        s.spool_dir
    );
    println!(
        "staged writes: {} (write-back files the worker on this host owns are written into {}/staged and committed by that worker; --staged-writes)",
        if s.staged_writes { "on" } else { "off" },
        s.spool_dir
    );
}

/// The body at `path`, or `None` when the mount answers 404.
async fn get(addr: SocketAddr, path: &str) -> Result<Option<Bytes>> {
    let hint = "is this the address given to the mount's --metrics-listen?";
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the mount's listener at {addr} ({hint})"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .with_context(|| format!("talking HTTP to {addr}"))?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())?;
    let resp = sender
        .send_request(req)
        .await
        .with_context(|| format!("GET http://{addr}{path}"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .with_context(|| format!("reading the answer of http://{addr}{path}"))?
        .to_bytes();
    if status == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        bail!(
            "GET http://{addr}{path}: {status}: {}",
            String::from_utf8_lossy(&body).trim()
        );
    }
    Ok(Some(body))
}

fn print_report(r: &TierReport) {
    let c = &r.completion;
    println!(
        "local tier {}: {} of {} used; {} whole, {} partial, {} missing",
        r.dir.display(),
        ByteSize(r.used_bytes).human(),
        ByteSize(r.capacity_bytes).human(),
        r.whole,
        r.partial,
        ByteSize(r.missing_bytes).human()
    );
    println!(
        "completion: {} pending, {} asked, {} completed, {} fetched, {} failures, {} abandoned; \
         fills dropped (left as holes): {}, fills its readers waited for: {}",
        c.pending,
        c.asked,
        c.completed,
        ByteSize(c.fetched_bytes).human(),
        c.failures,
        c.abandoned,
        ByteSize(r.fill_dropped_bytes).human(),
        ByteSize(r.fill_waited_bytes).human()
    );
    if r.objects.is_empty() {
        return;
    }
    println!(
        "\n{:<8} {:>10} {:>10} {:<6} OBJECT",
        "STATE", "SIZE", "MISSING", "WANTED"
    );
    for o in r.objects.iter().take(TABLE_ROWS) {
        println!(
            "{:<8} {:>10} {:>10} {:<6} {}",
            o.state,
            ByteSize(o.size).human(),
            ByteSize(o.missing_bytes).human(),
            if o.wanted_whole { "whole" } else { "-" },
            o.uri
        );
    }
    let more = (r.objects.len().saturating_sub(TABLE_ROWS)) as u64 + r.objects_not_listed;
    if more > 0 {
        println!("... and {more} more (--json lists up to 1000)");
    }
}
