//! Where outgoing requests get their W3C `traceparent` header from. The
//! binary installs the source once tracing export is on
//! (`lakecache-telemetry`); without one nothing is added.

use std::sync::OnceLock;

static SOURCE: OnceLock<fn() -> Option<String>> = OnceLock::new();

/// Installs the function that names the current span; first call wins.
pub fn set_source(source: fn() -> Option<String>) {
    let _ = SOURCE.set(source);
}

/// The `traceparent` value for a request sent now, if tracing is on.
pub fn current() -> Option<String> {
    SOURCE.get().and_then(|f| f())
}
