//! What a plan costs a worker (issue #35): memory and CPU to install one
//! of a million page entries (a shuffled epoch over a million pages), to
//! follow its reader through it, and one eviction pass over it, furthest
//! use first. Prints Markdown.

use std::time::{Duration, Instant};

use lakecache_worker::pages::PageKey;
use lakecache_worker::plan_order::PlanOrder;

/// Resident memory of this process, from /proc.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// User + system CPU time of this process.
fn cpu() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// A fixed permutation of 0..n (multiplication by a number prime to n).
fn shuffled(n: u64) -> Vec<u64> {
    let step = 1_000_003 % n;
    (0..n).map(|i| i * step % n).collect()
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let pages: Vec<PageKey> = shuffled(n)
        .into_iter()
        .map(|i| {
            PageKey::new(
                &format!("s3://lake/shard-{:05}.bin", i / 64),
                "etag",
                i % 64,
            )
        })
        .collect();
    // Each entry a 1 MiB sample of its 8 MiB page, as workers keep them.
    let spans: Vec<(u32, u32)> = (0..n)
        .map(|i| ((i % 8) as u32) << 20)
        .map(|s| (s, s + (1 << 20)))
        .collect();
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(3600);

    let (rss0, cpu0, t0) = (rss_bytes(), cpu(), Instant::now());
    order
        .install("job/0", None, &pages, &spans, far)
        .expect("within the limits");
    let install = (t0.elapsed(), cpu() - cpu0, rss_bytes().saturating_sub(rss0));

    let (cpu0, t0) = (cpu(), Instant::now());
    let ranked = order.furthest_first(None).take(pages.len()).count();
    let pass = (t0.elapsed(), cpu() - cpu0);

    let (cpu0, t0) = (cpu(), Instant::now());
    for (key, &(start, end)) in pages.iter().zip(&spans) {
        let part = Some(u64::from(start)..u64::from(end));
        order.read_part(key, part, lakecache_worker::plan_order::ReadKind::Demand);
    }
    let follow = (t0.elapsed(), cpu() - cpu0);
    assert!(
        order.distance(&pages[0]).is_none(),
        "the reader went through the plan"
    );

    let per_m = 1_000_000.0 / n as f64;
    println!("### A plan of {n} page entries (one shuffled epoch over {n} pages)\n");
    println!("| step | wall | CPU | per million entries |");
    println!("|---|---|---|---|");
    println!(
        "| install | {:.2} s | {:.2} s | {:.2} CPU-s, {:.0} MiB resident |",
        install.0.as_secs_f64(),
        install.1.as_secs_f64(),
        install.1.as_secs_f64() * per_m,
        install.2 as f64 * per_m / (1 << 20) as f64
    );
    println!(
        "| one eviction pass, furthest first ({ranked} pages) | {:.2} s | {:.2} s | {:.2} CPU-s |",
        pass.0.as_secs_f64(),
        pass.1.as_secs_f64(),
        pass.1.as_secs_f64() * per_m
    );
    println!(
        "| the reader's {n} reads moving the plan | {:.2} s | {:.2} s | {:.2} CPU-s ({:.0} ns a read) |",
        follow.0.as_secs_f64(),
        follow.1.as_secs_f64(),
        follow.1.as_secs_f64() * per_m,
        follow.1.as_nanos() as f64 / n as f64
    );
    println!(
        "\nResident memory is the process's growth across the install (the page keys themselves, {:.0} MiB, were built before).",
        (n * 32) as f64 / (1 << 20) as f64
    );
}
