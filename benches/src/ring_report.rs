//! Placement quality of the ring: balance with 8 workers for several
//! virtual-node counts, and keys moved when one worker joins or leaves
//! (N = 3..16) against the ideal 1/N. Prints Markdown.

use lakecache_registry::{Member, Ring, RingOptions};

fn members(n: usize) -> Vec<Member> {
    (0..n)
        .map(|i| Member {
            id: format!("worker-{i}"),
            address: format!("10.0.0.{i}:9500"),
            capacity: 0,
        })
        .collect()
}

fn owners(ring: &Ring, keys: usize) -> Vec<String> {
    (0..keys)
        .map(|k| {
            ring.owner(&format!("s3://lake/shard-{k:07}.bin"), (k % 16) as u64)
                .map(|m| m.id.clone())
                .unwrap_or_default()
        })
        .collect()
}

fn main() {
    let keys = 100_000;
    let mut out = String::new();
    out.push_str(&format!("### Balance, 8 workers, {keys} keys (object URI, segment)\n\n| vnodes/worker | busiest / mean | idlest / mean |\n|---|---|---|\n"));
    for vnodes in [64u32, 128, 256, 512, 1024] {
        let ring = Ring::new(
            &members(8),
            RingOptions {
                vnodes,
                ..Default::default()
            },
        );
        let mut counts = std::collections::HashMap::<String, usize>::new();
        for o in owners(&ring, keys) {
            *counts.entry(o).or_default() += 1;
        }
        let mean = keys as f64 / 8.0;
        let max = *counts.values().max().unwrap_or(&0) as f64 / mean;
        let min = *counts.values().min().unwrap_or(&0) as f64 / mean;
        out.push_str(&format!("| {vnodes} | {max:.3} | {min:.3} |\n"));
    }
    out.push_str(&format!(
        "\n### Keys moved when one worker joins or leaves ({} vnodes, {keys} keys)\n\n| N before | joins: moved | ideal 1/(N+1) | moved / ideal | leaves: moved | ideal 1/N | moved / ideal |\n|---|---|---|---|---|---|---|\n",
        lakecache_registry::DEFAULT_VNODES
    ));
    for n in 3..=16usize {
        let base = owners(&Ring::new(&members(n), RingOptions::default()), keys);
        let grown = owners(&Ring::new(&members(n + 1), RingOptions::default()), keys);
        let shrunk = owners(&Ring::new(&members(n - 1), RingOptions::default()), keys);
        let moved = |a: &[String], b: &[String]| {
            a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / keys as f64
        };
        let (j, l) = (moved(&base, &grown), moved(&base, &shrunk));
        let (ij, il) = (1.0 / (n + 1) as f64, 1.0 / n as f64);
        out.push_str(&format!(
            "| {n} | {j:.4} | {ij:.4} | {:.2} | {l:.4} | {il:.4} | {:.2} |\n",
            j / ij,
            l / il
        ));
    }
    print!("{out}");
}
