//! Prometheus text exposition (format 0.0.4) of collected OpenTelemetry
//! metrics, named the way the OpenTelemetry specification maps them:
//! the unit as a suffix (`By` → `_bytes`, `s` → `_seconds`), `_total` on
//! monotonic sums, `_bucket`/`_sum`/`_count` on histograms.

use std::fmt::Write as _;

use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};

/// Renders every metric in `rm`, sorted by name so scrapes are stable.
pub fn render(rm: &ResourceMetrics) -> String {
    let mut metrics: Vec<&Metric> = rm.scope_metrics().flat_map(|s| s.metrics()).collect();
    metrics.sort_by(|a, b| a.name().cmp(b.name()));
    let mut out = String::new();
    for m in metrics {
        match m.data() {
            AggregatedMetrics::U64(d) => family(&mut out, m, d, |v| v.to_string()),
            AggregatedMetrics::I64(d) => family(&mut out, m, d, |v| v.to_string()),
            AggregatedMetrics::F64(d) => family(&mut out, m, d, |v| float(*v)),
        }
    }
    out
}

fn unit_suffix(unit: &str) -> &'static str {
    match unit {
        "By" => "_bytes",
        "s" => "_seconds",
        "ms" => "_milliseconds",
        _ => "",
    }
}

fn family<T: Copy>(out: &mut String, m: &Metric, data: &MetricData<T>, fmt: impl Fn(&T) -> String) {
    let base = format!("{}{}", m.name(), unit_suffix(m.unit()));
    let help = escape_help(m.description());
    match data {
        MetricData::Gauge(g) => {
            header(out, &base, &help, "gauge");
            for p in g.data_points() {
                sample(out, &base, p.attributes(), None, &fmt(&p.value()));
            }
        }
        MetricData::Sum(s) => {
            let (name, kind) = if s.is_monotonic() {
                (format!("{base}_total"), "counter")
            } else {
                (base, "gauge")
            };
            header(out, &name, &help, kind);
            for p in s.data_points() {
                sample(out, &name, p.attributes(), None, &fmt(&p.value()));
            }
        }
        MetricData::Histogram(h) => {
            header(out, &base, &help, "histogram");
            for p in h.data_points() {
                let mut cumulative = 0u64;
                let counts: Vec<u64> = p.bucket_counts().collect();
                for (i, bound) in p.bounds().enumerate() {
                    cumulative += counts.get(i).copied().unwrap_or(0);
                    let le = ("le", float(bound));
                    let n = cumulative.to_string();
                    sample(out, &format!("{base}_bucket"), p.attributes(), Some(le), &n);
                }
                let inf = ("le", "+Inf".to_string());
                let count = p.count().to_string();
                sample(
                    out,
                    &format!("{base}_bucket"),
                    p.attributes(),
                    Some(inf),
                    &count,
                );
                sample(
                    out,
                    &format!("{base}_sum"),
                    p.attributes(),
                    None,
                    &fmt(&p.sum()),
                );
                sample(out, &format!("{base}_count"), p.attributes(), None, &count);
            }
        }
        // No instrument of ours asks for exponential buckets.
        MetricData::ExponentialHistogram(_) => {}
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    if !help.is_empty() {
        let _ = writeln!(out, "# HELP {name} {help}");
    }
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample<'a>(
    out: &mut String,
    name: &str,
    attrs: impl Iterator<Item = &'a KeyValue>,
    extra: Option<(&str, String)>,
    value: &str,
) {
    let mut labels: Vec<(String, String)> = attrs
        .map(|kv| (label_name(kv.key.as_str()), label_value(&kv.value)))
        .collect();
    labels.sort();
    if let Some((k, v)) = extra {
        labels.push((k.to_string(), v));
    }
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{k}=\"{}\"", escape_value(v));
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

fn label_name(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn label_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.as_str().to_string(),
        other => other.to_string(),
    }
}

fn float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else if v.is_nan() {
        "NaN".to_string()
    } else {
        v.to_string()
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use crate::{counter, seconds_histogram, MetricsRegistry};
    use opentelemetry::KeyValue;

    #[test]
    fn counters_gauges_and_histograms_render_with_their_units_and_labels() {
        let reg = MetricsRegistry::new();
        let meter = reg.meter("test");
        let c = counter(&meter, "t_read", "By", "Bytes read");
        c.add(5, &[KeyValue::new("op", "get"), KeyValue::new("b", "x\"y")]);
        c.add(7, &[KeyValue::new("op", "get"), KeyValue::new("b", "x\"y")]);
        let h = seconds_histogram(&meter, "t_latency", "Latency");
        h.record(0.0003, &[KeyValue::new("op", "read")]);
        h.record(2.0, &[KeyValue::new("op", "read")]);
        meter
            .u64_observable_gauge("t_used")
            .with_unit("By")
            .with_callback(|o| o.observe(42, &[]))
            .build();
        let text = reg.render();
        assert!(
            text.contains("# TYPE t_read_bytes_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("t_read_bytes_total{b=\"x\\\"y\",op=\"get\"} 12\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE t_latency_seconds histogram\n"),
            "{text}"
        );
        assert!(
            text.contains("t_latency_seconds_bucket{op=\"read\",le=\"0.0001\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("t_latency_seconds_bucket{op=\"read\",le=\"0.0005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_latency_seconds_bucket{op=\"read\",le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("t_latency_seconds_count{op=\"read\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("t_latency_seconds_sum{op=\"read\"} 2.0003\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE t_used_bytes gauge\nt_used_bytes 42\n"),
            "{text}"
        );
        // Families come out sorted, whatever order they were made in.
        let latency = text.find("t_latency").unwrap();
        let read = text.find("t_read").unwrap();
        let used = text.find("t_used").unwrap();
        assert!(latency < read && read < used, "{text}");
    }
}
