//! How fast can a checkpoint be made durable on this disk, and how far
//! is a write-back mount from that? Writes one checkpoint's files (by
//! default those of DLIO's scaled megatron_deepspeed checkpoint: 31 KB,
//! 562 MB and four of 15 MB) at a writer's pace, in 1 MiB writes, once per
//! case, the cases interleaved over the runs:
//!
//! - `plain`: write and close, nothing synced (local disk as DLIO and
//!   `torch.save` use it; through a write-back mount, its close is what
//!   makes the file durable);
//! - `follow`: a second thread starts the kernel's writeback of each
//!   whole chunk behind the writer (`sync_file_range`), and `fdatasync`
//!   before the close: the least a durable close can cost here;
//! - `close-sync`: `fdatasync` before each close, nothing started early.
//!
//! Usage: `ckpt-floor --case local:plain:/var/tmp/a --case
//! floor:follow:/var/tmp/b --case mount:plain:/mnt/data/ckpt --runs 5`.
//! Each case's directory is emptied before each run. Prints each run and
//! the median per case, with its ratio to the first case.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// NAME:MODE:DIR, MODE one of plain, follow, close-sync (repeat).
    #[arg(long = "case", required = true)]
    cases: Vec<String>,
    /// Runs of every case (interleaved), after one warm-up run of each.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The writer's pace in GB/s; 0: as fast as it can.
    #[arg(long, default_value_t = 1.9)]
    rate_gbps: f64,
    /// `follow`: bytes written behind the writer at a time, in KiB.
    #[arg(long, default_value_t = 2048)]
    chunk_kib: u64,
    /// File sizes in bytes, comma-separated.
    #[arg(
        long,
        default_value = "31000,562539729,15000000,15000000,15000000,15000000"
    )]
    sizes: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    Follow,
    CloseSync,
}

struct Case {
    name: String,
    mode: Mode,
    /// As given on the command line.
    mode_name: String,
    dir: PathBuf,
    totals: Vec<f64>,
}

fn parse_case(spec: &str) -> Result<Case> {
    let mut parts = spec.splitn(3, ':');
    let (Some(name), Some(mode), Some(dir)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("--case takes NAME:MODE:DIR, got {spec:?}");
    };
    let mode_name = mode.to_string();
    let mode = match mode {
        "plain" => Mode::Plain,
        "follow" => Mode::Follow,
        "close-sync" => Mode::CloseSync,
        other => bail!("--case {spec:?}: mode {other:?} is not plain, follow or close-sync"),
    };
    Ok(Case {
        name: name.to_string(),
        mode,
        mode_name,
        dir: PathBuf::from(dir),
        totals: Vec::new(),
    })
}

/// Starts writeback of each whole chunk the writer has passed, and of
/// the rest once it is done.
fn follow_writes(file: &File, written: &AtomicU64, done: &AtomicBool, chunk: u64) {
    let mut pushed = 0u64;
    loop {
        let finished = done.load(Ordering::Acquire);
        let now = written.load(Ordering::Acquire);
        let upto = if finished { now } else { now / chunk * chunk };
        if upto > pushed {
            // SAFETY: a plain syscall on a descriptor `file` owns; a
            // failure only loses the head start, and the fdatasync after
            // reports any error.
            unsafe {
                libc::sync_file_range(
                    file.as_raw_fd(),
                    pushed as i64,
                    (upto - pushed) as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
            pushed = upto;
        } else if finished {
            return;
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Writes one checkpoint into `case.dir`; returns the seconds it took and
/// each file's close.
fn checkpoint(case: &Case, sizes: &[u64], rate: f64, chunk: u64) -> Result<(f64, Vec<f64>)> {
    if case.dir.exists() {
        std::fs::remove_dir_all(&case.dir).with_context(|| format!("emptying {:?}", case.dir))?;
    }
    std::fs::create_dir_all(&case.dir).with_context(|| format!("creating {:?}", case.dir))?;
    let block: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let start = Instant::now();
    let mut closes = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let path = case.dir.join(format!("part-{i}.bin"));
        let file = File::create(&path).with_context(|| format!("creating {path:?}"))?;
        let (written, done) = (AtomicU64::new(0), AtomicBool::new(false));
        std::thread::scope(|scope| -> Result<()> {
            if case.mode == Mode::Follow {
                let (file, written, done) = (&file, &written, &done);
                scope.spawn(move || follow_writes(file, written, done, chunk));
            }
            let began = Instant::now();
            let mut n = 0u64;
            let result = (|| -> Result<()> {
                while n < size {
                    let k = (size - n).min(block.len() as u64) as usize;
                    (&file)
                        .write_all(&block[..k])
                        .with_context(|| format!("writing {path:?}"))?;
                    n += k as u64;
                    written.store(n, Ordering::Release);
                    if rate > 0.0 {
                        let due = began + Duration::from_secs_f64(n as f64 / rate);
                        while Instant::now() < due {
                            std::hint::spin_loop();
                        }
                    }
                }
                Ok(())
            })();
            done.store(true, Ordering::Release);
            result
        })?;
        let closing = Instant::now();
        if case.mode != Mode::Plain {
            file.sync_data()
                .with_context(|| format!("fdatasync of {path:?}"))?;
        }
        drop(file);
        closes.push(closing.elapsed().as_secs_f64());
    }
    Ok((start.elapsed().as_secs_f64(), closes))
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut cases = args
        .cases
        .iter()
        .map(|c| parse_case(c))
        .collect::<Result<Vec<_>>>()?;
    let sizes = args
        .sizes
        .split(',')
        .map(|s| s.trim().parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .context("--sizes takes byte counts separated by commas")?;
    if args.runs == 0 || sizes.is_empty() || args.chunk_kib == 0 {
        bail!("--runs, --sizes and --chunk-kib must not be empty or zero");
    }
    let (rate, chunk) = (args.rate_gbps * 1e9, args.chunk_kib << 10);
    let total_mib = sizes.iter().sum::<u64>() as f64 / (1u64 << 20) as f64;
    println!(
        "one checkpoint: {} files, {total_mib:.0} MiB, writer at {} GB/s; follow chunk {} KiB",
        sizes.len(),
        args.rate_gbps,
        args.chunk_kib
    );
    for run in 0..=args.runs {
        for case in cases.iter_mut() {
            let (total, closes) = checkpoint(case, &sizes, rate, chunk)?;
            let closes: Vec<String> = closes.iter().map(|c| format!("{:.1}", c * 1e3)).collect();
            let label = if run == 0 { "warm-up" } else { "run" };
            println!(
                "{label} {run} {}: {total:.3} s; closes (ms) {}",
                case.name,
                closes.join(" ")
            );
            if run > 0 {
                case.totals.push(total);
            }
        }
    }
    println!(
        "\n| case | mode | median s | range | vs {} |",
        cases[0].name
    );
    println!("|---|---|---|---|---|");
    let base = median(&cases[0].totals);
    for case in &cases {
        let m = median(&case.totals);
        let (lo, hi) = case
            .totals
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), &t| (l.min(t), h.max(t)));
        println!(
            "| {} | {} | {m:.3} | {lo:.3}-{hi:.3} | {:.2}x |",
            case.name,
            case.mode_name,
            m / base
        );
    }
    Ok(())
}
