//! Short-circuit reads through the kernel: a mount beside its worker gets
//! a cold file's bytes inline on the worker's Unix socket and, once the
//! pages are cached, reads the worker's page files itself. No object byte
//! goes over HTTP either time, and the bytes are the object's.

use super::*;

fn worker_metric(port: u16, name: &str) -> f64 {
    let scrape = reqwest_like_get(port, "/metrics");
    common::metric(&scrape, name, &[]).unwrap_or_else(|e| panic!("worker: {e}"))
}

#[test]
fn a_mount_beside_its_worker_reads_over_the_socket_cold_and_warm() {
    let mut env = Env::start(1);
    // Past a 16 MiB segment and into a short last page.
    let data = pattern((40 << 20) + 12_345, 91);
    env.put("socket/shard.bin", Bytes::from(data.clone()));
    let socket = env.dir.path().join("cache-0").join("local.sock");
    assert!(
        socket.exists(),
        "the worker has no socket at {}\n{}",
        socket.display(),
        env.worker_logs()
    );
    let flag = [
        std::ffi::OsStr::new("--local-worker-socket"),
        socket.as_os_str(),
    ];
    env.mount_with(&flag);
    let port = env.workers[0].0;
    let file = env.mountpoint().join("socket/shard.bin");
    let want = Sha256::digest(&data).to_vec();

    assert_eq!(sha_file(&file).unwrap(), (data.len() as u64, want.clone()));
    let inline = worker_metric(port, "lakecache_local_inline_served_bytes_total");
    assert!(
        inline >= data.len() as f64,
        "only {inline} bytes came inline\n{}",
        env.log()
    );
    assert_eq!(
        worker_metric(port, "lakecache_served_bytes_total"),
        inline,
        "every byte the worker sent went on the socket, none over HTTP"
    );

    // A new mount (no kernel page cache): the pages are on the worker's
    // disk now, and the mount reads them from the page files.
    env.mount.take().unwrap().term();
    wait_mounted(&env.mountpoint(), false);
    env.mount_with(&flag);
    assert_eq!(sha_file(&file).unwrap(), (data.len() as u64, want));
    let from_files = worker_metric(port, "lakecache_local_served_bytes_total");
    assert!(
        from_files >= data.len() as f64,
        "only {from_files} bytes from page files\n{}",
        env.log()
    );
    assert_eq!(
        worker_metric(port, "lakecache_served_bytes_total"),
        inline,
        "the worker sent nothing itself on the warm read"
    );
}
