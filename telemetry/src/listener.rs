//! A small HTTP listener for processes that have no API of their own (the
//! mount): `GET /metrics` (Prometheus text), `GET /v1/inflight` (JSON)
//! and the JSON views the process adds ([`JsonRoutes`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::{InFlight, MetricsRegistry};

/// A JSON view served at a path, computed per request.
pub type JsonView = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Paths (such as `/v1/local-tier`) and the views they serve.
pub type JsonRoutes = Vec<(&'static str, JsonView)>;

/// A running listener; dropping it stops accepting.
#[derive(Debug)]
pub struct MetricsListener {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MetricsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `addr` and serves the registry (and the in-flight table and
/// `routes`, when given) until the returned handle is dropped.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: Arc<MetricsRegistry>,
    inflight: Option<Arc<InFlight>>,
    routes: JsonRoutes,
) -> std::io::Result<MetricsListener> {
    let routes = Arc::new(routes);
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let registry = registry.clone();
            let inflight = inflight.clone();
            let routes = routes.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let resp = answer(&req, &registry, inflight.as_deref(), &routes);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "metrics connection ended");
                }
            });
        }
    });
    Ok(MetricsListener { addr, task })
}

fn answer(
    req: &http::Request<Incoming>,
    registry: &MetricsRegistry,
    inflight: Option<&InFlight>,
    routes: &JsonRoutes,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n".into(),
        );
    }
    match (req.uri().path(), inflight) {
        ("/metrics", _) => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            registry.render(),
        ),
        ("/v1/inflight", Some(table)) => {
            let body = serde_json::json!({ "operations": table.snapshot() });
            reply(StatusCode::OK, "application/json", body.to_string())
        }
        (path, _) => match routes.iter().find(|(p, _)| *p == path) {
            Some((_, view)) => reply(StatusCode::OK, "application/json", view().to_string()),
            None => {
                let mut known = vec!["/metrics"];
                known.extend(inflight.map(|_| "/v1/inflight"));
                known.extend(routes.iter().map(|(p, _)| *p));
                reply(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    format!("no route for {path}; try {}\n", known.join(", ")),
                )
            }
        },
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    resp
}
