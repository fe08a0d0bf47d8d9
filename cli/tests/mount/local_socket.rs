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
    // disk now (once written behind the reads), and the mount reads them
    // from the page files.
    super::tier_completion::wait_until("the worker's page files written", 30, || {
        worker_metric(port, "lakecache_page_writes_in_flight") == 0.0
    });
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

#[test]
fn a_worker_killed_and_restarted_under_a_socket_reading_mount_loses_no_read() {
    const FILES: usize = 16;
    let mut env = Env::start(1);
    let files: Vec<Vec<u8>> = (0..FILES)
        .map(|i| pattern((1 << 20) + 17 * i, 92 + i as u64))
        .collect();
    for (i, data) in files.iter().enumerate() {
        env.put(&format!("socket/part-{i}.bin"), Bytes::from(data.clone()));
    }
    let socket = env.dir.path().join("cache-0").join("local.sock");
    let flag = [
        std::ffi::OsStr::new("--local-worker-socket"),
        socket.as_os_str(),
    ];
    env.mount_with(&flag);
    let port = env.workers[0].0;
    let mnt = env.mountpoint();
    // Each file read through the mount once (the kernel keeps what it read).
    let read = |i: usize| {
        let (len, sha) = sha_file(&mnt.join(format!("socket/part-{i}.bin")))?;
        assert_eq!(len, files[i].len() as u64);
        assert_eq!(sha, Sha256::digest(&files[i]).to_vec(), "part {i}");
        Ok::<_, std::io::Error>(())
    };
    read(0).unwrap();
    assert!(worker_metric(port, "lakecache_local_inline_served_bytes_total") > 0.0);

    // kill -9: the socket file stays behind and the mount's pooled
    // connections to it are dead.
    env.workers[0].1.kill9();
    env.workers[0].1 = env.spawn_worker(0, port, &[]);
    assert!(
        socket.exists(),
        "the restarted worker bound its socket again"
    );
    // The first read after the restart finds those connections dead and
    // goes over HTTP; the bytes are right either way.
    read(1).unwrap_or_else(|e| panic!("read after restart: {e}\n{}", env.log()));
    // After its back-off the mount takes the new worker's socket again.
    let mut next = 2;
    common::wait_until(
        "the mount reading over the restarted worker's socket",
        Duration::from_secs(30),
        Duration::from_secs(1),
        || {
            assert!(next < FILES, "ran out of files to read\n{}", env.log());
            read(next).unwrap();
            next += 1;
            let scrape = reqwest_like_get(port, "/metrics");
            common::metric(&scrape, "lakecache_local_inline_served_bytes_total", &[])
                .is_ok_and(|v| v > 0.0)
        },
    );
}

#[test]
fn sample_reads_of_what_the_worker_holds_are_answered_on_the_kernel_request_thread() {
    use std::os::unix::fs::FileExt;
    let mut env = Env::start(1);
    let data = pattern(8 << 20, 93);
    env.put("socket/samples.bin", Bytes::from(data.clone()));
    let socket = env.dir.path().join("cache-0").join("local.sock");
    env.mount_with(&[
        std::ffi::OsStr::new("--local-worker-socket"),
        socket.as_os_str(),
        std::ffi::OsStr::new("--metrics-listen"),
        std::ffi::OsStr::new("127.0.0.1:0"),
    ]);
    let mount_port = env
        .mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30));
    let cached_now = || {
        let scrape = reqwest_like_get(mount_port, "/metrics");
        common::metric(&scrape, "lakecache_fuse_worker_cached_now_bytes_total", &[])
            .unwrap_or_else(|e| panic!("mount: {e}"))
    };
    let path = env.mountpoint().join("socket/samples.bin");
    // Samples of 1 MiB in shuffled order, as a loader reads them (random
    // advice: the kernel reads exactly what is asked).
    let order = [5u64, 2, 7, 0, 3, 6, 1, 4];
    let read_samples = |env: &Env| {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: advice on a descriptor we hold open.
        let rc = unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            ) | libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                0,
                libc::POSIX_FADV_RANDOM,
            )
        };
        assert_eq!(rc, 0);
        for &i in &order {
            let mut buf = vec![0u8; 1 << 20];
            file.read_exact_at(&mut buf, i << 20).unwrap();
            let at = (i << 20) as usize;
            assert!(buf == data[at..at + (1 << 20)], "sample {i}\n{}", env.log());
        }
    };
    // Cold: the worker fetches them, and the reads wait on the runtime.
    read_samples(&env);
    assert_eq!(cached_now(), 0.0, "nothing was held before the first reads");
    // Held by the worker now: the same reads again, through a kernel with
    // nothing of the file cached.
    let before = cached_now();
    read_samples(&env);
    let gained = cached_now() - before;
    assert!(
        gained >= (8 << 20) as f64,
        "only {gained} bytes answered on the request thread\n{}",
        env.log()
    );
    // kill -9 of the worker: the mount's pooled connections to it are
    // dead. The reads go the usual way meanwhile, and stay right.
    let port = env.workers[0].0;
    env.workers[0].1.kill9();
    env.workers[0].1 = env.spawn_worker(0, port, &[]);
    read_samples(&env);
}
