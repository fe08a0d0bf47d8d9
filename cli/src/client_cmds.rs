//! Client commands: cat, stat, put, ls through a worker.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use lakecache_protocol::{ObjectUri, WorkerClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Args)]
pub struct WorkerArgs {
    /// Worker address (HOST:PORT)
    #[arg(long, env = "LAKECACHE_WORKER", default_value = "127.0.0.1:9500")]
    worker: String,
    /// Request timeout in seconds
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

impl WorkerArgs {
    fn client(&self) -> Result<WorkerClient> {
        WorkerClient::new(&self.worker, Duration::from_secs(self.timeout))
            .with_context(|| format!("worker address {:?}", self.worker))
    }
}

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
    worker: WorkerArgs,
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
        let client = self.worker.client()?;
        let stat = client.stat(&uri).await.with_context(|| format!("{uri}"))?;
        let range = match &self.range {
            Some(r) => parse_range(r, stat.size)?,
            None => 0..stat.size,
        };
        if range.is_empty() {
            return Ok(());
        }
        let resp = client
            .read_stream(&uri, Some(range.clone()))
            .await
            .with_context(|| format!("{uri}"))?;
        let mut body = resp.into_body();
        let mut out = tokio::io::stdout();
        let mut written = 0u64;
        use http_body_util::BodyExt;
        while let Some(frame) = body.frame().await {
            let frame =
                frame.with_context(|| format!("{uri}: read broke after {written} bytes"))?;
            if let Ok(data) = frame.into_data() {
                written += data.len() as u64;
                out.write_all(&data).await.context("writing to stdout")?;
            }
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
    worker: WorkerArgs,
}

impl StatCmd {
    pub async fn run(self) -> Result<()> {
        let uri = parse_uri(&self.uri)?;
        let stat = self
            .worker
            .client()?
            .stat(&uri)
            .await
            .with_context(|| format!("{uri}"))?;
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
    worker: WorkerArgs,
}

impl PutCmd {
    pub async fn run(self) -> Result<()> {
        let uri = parse_uri(&self.uri)?;
        let client = self.worker.client()?;
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
        let body = http_body_util::StreamBody::new(stream).boxed();
        let stat = client
            .put(&uri, body)
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
    worker: WorkerArgs,
}

impl LsCmd {
    pub async fn run(self) -> Result<()> {
        let rest = self
            .uri
            .strip_prefix("s3://")
            .with_context(|| format!("{:?} must start with s3://", self.uri))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        lakecache_protocol::validate_bucket(bucket)?;
        let client = self.worker.client()?;
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
