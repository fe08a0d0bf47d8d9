//! Telemetry shared by the worker and the mount.
//!
//! Metrics are OpenTelemetry instruments read on demand by a
//! [`ManualReader`](opentelemetry_sdk::metrics::ManualReader) and written
//! as Prometheus text by [`prometheus_text`], our own encoder: the
//! OpenTelemetry-Prometheus bridge crate is no longer maintained upstream,
//! and the text format is small and stable.

mod inflight;
mod listener;
mod prometheus_text;
mod registry;
pub mod trace;

pub use inflight::{InFlight, InFlightOp, InFlightView, OpGuard};
pub use listener::{serve_metrics, JsonRoutes, JsonView, MetricsListener};
pub use prometheus_text::render;
pub use registry::{counter, seconds_histogram, MetricsRegistry, LATENCY_BUCKETS};
