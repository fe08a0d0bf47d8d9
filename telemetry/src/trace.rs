//! Traces: OTLP/HTTP export of `tracing` spans, and W3C `traceparent`
//! carried from the mount through the worker to S3 so one slow read can
//! be followed end to end.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Flushes and stops the exporter when dropped (at process exit).
pub struct TraceExport {
    provider: SdkTracerProvider,
}

impl Drop for TraceExport {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("warning: flushing traces failed: {e}");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceSetupError {
    #[error("--otlp-endpoint {0:?} must be an http:// URL (a collector on this node)")]
    Endpoint(String),
    #[error("--otlp-sample-ratio must be between 0 and 1, got {0}")]
    Ratio(f64),
    #[error("building the OTLP exporter: {0}")]
    Exporter(String),
}

/// An OTLP exporter to `endpoint` (the collector's base URL; spans go to
/// `/v1/traces`) for `service`, sampling `ratio` of new traces (a trace
/// started upstream keeps its sampling decision). Must be called before
/// the tokio runtime starts (the exporter's client is a blocking one).
pub fn otlp_layer<S>(
    endpoint: &str,
    service: &'static str,
    ratio: f64,
) -> Result<
    (
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
        TraceExport,
    ),
    TraceSetupError,
>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if !endpoint.starts_with("http://") {
        return Err(TraceSetupError::Endpoint(endpoint.to_string()));
    }
    if !(0.0..=1.0).contains(&ratio) {
        return Err(TraceSetupError::Ratio(ratio));
    }
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .build()
        .map_err(|e| TraceSetupError::Exporter(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .with_attribute(KeyValue::new("process.pid", i64::from(std::process::id())))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("lakecache");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let layer = tracing_opentelemetry::layer().with_tracer(tracer);
    Ok((layer, TraceExport { provider }))
}

/// The current span's `traceparent` header value, when it is being traced.
pub fn current_traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Makes `span` a child of the caller's span named by the request's
/// `traceparent` header (a no-op without one, or when not tracing).
pub fn adopt_remote_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    let _ = span.set_parent(cx);
}
