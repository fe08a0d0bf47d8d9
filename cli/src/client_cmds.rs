//! Client commands: cat, stat, put, ls through the cluster (or one worker).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use lakecache_protocol::ObjectUri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cluster_args::ClusterArgs;

/// Bytes per read request of `cat`; a few are kept in flight.
const CAT_CHUNK: u64 = 8 << 20;
const CAT_IN_FLIGHT: usize = 4;

fn parse_uri(s: &str) -> Result<ObjectUri> {
    s.parse::<ObjectUri>()
        .with_context(|| format!("invalid object URI {s:?}"))
}

#[derive(Args)]
pub struct CatCmd {
    /// s3://bucket/key
    uri: String,
    /// Byte range FIRST-LAST (inclusive) or FIRST-
    #[arg(long)]
    range: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

fn parse_range(s: &str, size: u64) -> Result<std::ops::Range<u64>> {
    let (a, b) = s
        .split_once('-')
        .context("--range must be FIRST-LAST or FIRST-")?;
    let first: u64 = a.parse().context("--range: FIRST must be a number")?;
    let end = if b.is_empty() {
        size
    } else {
        b.parse::<u64>()
            .context("--range: LAST must be a number")?
            .saturating_add(1)
            .min(size)
    };
    if first >= end {
        bail!("--range {s} is empty or past the end of a {size}-byte object");
    }
    Ok(first..end)
}

impl CatCmd {
    pub async fn run(self) -> Result<()> {
        let uri = parse_uri(&self.uri)?;
        let client = self.cluster.connect().await?;
        let stat = client.stat(&uri).await.with_context(|| format!("{uri}"))?;
        let range = match &self.range {
            Some(r) => parse_range(r, stat.size)?,
            None => 0..stat.size,
        };
        let chunks: Vec<std::ops::Range<u64>> = (range.start..range.end)
            .step_by(CAT_CHUNK as usize)
            .map(|s| s..(s + CAT_CHUNK).min(range.end))
            .collect();
        let etag = stat.etag.clone();
        let mut reads = futures::stream::iter(chunks)
            .map(|r| {
                let (client, uri, etag) = (client.clone(), uri.clone(), etag.clone());
                async move { client.read(&uri, r, Some(&etag)).await }
            })
            .buffered(CAT_IN_FLIGHT);
        let mut out = tokio::io::stdout();
        let mut written = 0u64;
        while let Some(piece) = reads.next().await {
            let piece =
                piece.with_context(|| format!("{uri}: read failed after {written} bytes"))?;
            written += piece.len() as u64;
            out.write_all(&piece).await.context("writing to stdout")?;
        }
        out.flush().await.context("writing to stdout")?;
        let want = range.end - range.start;
        if written != want {
            bail!("{uri}: got {written} of {want} bytes");
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct StatCmd {
    /// s3://bucket/key
    uri: String,
    /// Print JSON instead of a table
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl StatCmd {
    pub async fn run(self) -> Result<()> {
        let uri = parse_uri(&self.uri)?;
        let client = self.cluster.connect().await?;
        let stat = client.stat(&uri).await.with_context(|| format!("{uri}"))?;
        if self.json {
            println!("{}", serde_json::to_string_pretty(&stat)?);
        } else {
            println!("uri:           {}", stat.uri);
            println!("size:          {}", stat.size);
            println!("etag:          {}", stat.etag);
            println!("last_modified: {} ms since epoch", stat.last_modified_ms);
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct PutCmd {
    /// s3://bucket/key
    uri: String,
    /// File to upload; stdin when omitted or "-"
    file: Option<PathBuf>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl PutCmd {
    pub async fn run(self) -> Result<()> {
        let uri = parse_uri(&self.uri)?;
        // The upload streams for as long as the input lasts; the timeout
        // guards only the final answer after it.
        let client = self
            .cluster
            .connect()
            .await?
            .writer_for(&uri)?
            .with_timeout(std::time::Duration::from_secs(24 * 3600));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let source = self.file.filter(|p| p.as_os_str() != "-");
        let reader = tokio::spawn(async move {
            let mut input: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match &source {
                Some(p) => match tokio::fs::File::open(p).await {
                    Ok(f) => Box::new(f),
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                },
                None => Box::new(tokio::io::stdin()),
            };
            loop {
                let mut buf = vec![0u8; 1 << 20];
                match input.read(&mut buf).await {
                    Ok(0) => return,
                    Ok(n) => {
                        buf.truncate(n);
                        if tx.send(Ok(Bytes::from(buf))).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        use http_body_util::BodyExt;
        let stream = frames_from(rx);
        let body = BodyExt::boxed(http_body_util::StreamBody::new(stream));
        let stat = client
            .put(&uri, body, &Default::default())
            .await
            .with_context(|| format!("uploading {uri}"))?;
        let _ = reader.await;
        println!("{} {} bytes etag {}", stat.uri, stat.size, stat.etag);
        Ok(())
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Frames = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<http_body::Frame<Bytes>, BoxError>> + Send + Sync>,
>;

/// Turns chunks read from a file or stdin into request body frames.
fn frames_from(mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Frames {
    Box::pin(futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|item| {
            item.map(|r| {
                r.map(http_body::Frame::data)
                    .map_err(|e| -> BoxError { Box::new(e) })
            })
        })
    }))
}

#[derive(Args)]
pub struct LsCmd {
    /// s3://bucket/ or s3://bucket/prefix/
    uri: String,
    /// List every key under the prefix instead of one level
    #[arg(long, short)]
    recursive: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl LsCmd {
    pub async fn run(self) -> Result<()> {
        let rest = self
            .uri
            .strip_prefix("s3://")
            .with_context(|| format!("{:?} must start with s3://", self.uri))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        lakecache_protocol::validate_bucket(bucket)?;
        let client = self.cluster.connect().await?;
        let delimiter = if self.recursive { None } else { Some("/") };
        let mut token: Option<String> = None;
        loop {
            let page = client
                .list(bucket, prefix, delimiter, token.as_deref(), None)
                .await
                .with_context(|| format!("listing {}", self.uri))?;
            for p in &page.common_prefixes {
                println!("{:>14}  {p}", "PRE");
            }
            for o in &page.objects {
                println!("{:>14}  {}", o.size, o.key);
            }
            match page.next_token {
                Some(t) => token = Some(t),
                None => return Ok(()),
            }
        }
    }
}
