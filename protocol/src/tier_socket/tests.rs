//! The reader's end against a scripted mount (a thread on a real Unix
//! socket): what it keeps, when it asks, and when it gives up.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;

thread_local! {
    /// Notes the scripted mount of this test's thread received.
    static NOTES: Arc<AtomicUsize> = Arc::new(AtomicUsize::new(0));
}

/// A mount that answers hello, then each read with `answer`; counts reads
/// (and notes, in [`NOTES`]).
fn scripted_mount(
    dir: &Path,
    answer: impl Fn(&UnixStream, u64, u64) + Send + 'static,
) -> Arc<AtomicUsize> {
    let listener = UnixListener::bind(dir.join(TIER_SOCKET_NAME)).unwrap();
    let reads = Arc::new(AtomicUsize::new(0));
    let counted = reads.clone();
    let notes = NOTES.with(|n| n.clone());
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(c) = c else { return };
            while let Ok((body, _)) = recv_message(c.as_raw_fd()) {
                match serde_json::from_slice::<TierRequest>(&body).unwrap() {
                    TierRequest::Hello => reply(&c, &hello(), None),
                    TierRequest::Read { offset, len, .. } => {
                        counted.fetch_add(1, Ordering::SeqCst);
                        answer(&c, offset, len);
                    }
                    TierRequest::Plan { order, .. } => reply(
                        &c,
                        &TierAnswer::PlanTaken {
                            entries: order.len(),
                        },
                        None,
                    ),
                    TierRequest::Note { .. } => {
                        notes.fetch_add(1, Ordering::SeqCst);
                        reply(&c, &TierAnswer::Noted, None)
                    }
                }
            }
        }
    });
    reads
}

fn hello() -> TierAnswer {
    TierAnswer::Hello {
        protocol: TIER_PROTOCOL,
        bucket: "b".into(),
        prefix: "data/".into(),
    }
}

fn reply(c: &UnixStream, answer: &TierAnswer, fd: Option<i32>) {
    let body = serde_json::to_vec(answer).unwrap();
    send_message(c.as_raw_fd(), &body, fd).unwrap();
}

fn bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn a_handed_over_file_is_kept_and_read_without_asking_again() {
    let dir = tempfile::tempdir().unwrap();
    let content = bytes(300_000);
    let path = dir.path().join("object.data");
    std::fs::write(&path, &content).unwrap();
    let reads = scripted_mount(dir.path(), move |c, _, _| {
        let f = File::open(&path).unwrap();
        reply(c, &TierAnswer::File { size: 300_000 }, Some(f.as_raw_fd()));
    });
    let channel = TierChannel::connect(dir.path()).unwrap();
    assert!(channel.serves("b", "data/x") && !channel.serves("b", "other/x"));
    assert!(!channel.serves("c", "data/x"));
    for (offset, len) in [(0usize, 1000usize), (123_456, 100_000), (299_999, 1)] {
        let mut out = vec![0u8; len];
        let done = channel.read_into("s3://b/data/x", "e1", offset as u64, &mut out);
        assert_eq!(done.unwrap(), TierRead::Done);
        assert_eq!(out, content[offset..offset + len]);
    }
    assert_eq!(
        reads.load(Ordering::SeqCst),
        1,
        "asked again for a file it holds"
    );
    assert_eq!(channel.stats().file_bytes.load(Ordering::Relaxed), 101_001);
    // Past the end of a held file: the range is refused, nothing is read.
    let mut out = vec![0u8; 2];
    match channel.read_into("s3://b/data/x", "e1", 299_999, &mut out) {
        Err(TierClientError::Refused {
            kind: TierErrorKind::InvalidRange,
            ..
        }) => {}
        other => panic!("expected an invalid range, got {other:?}"),
    }
    // Another version is not the held file: the mount is asked.
    let mut out = vec![0u8; 10];
    channel
        .read_into("s3://b/data/x", "e2", 0, &mut out)
        .unwrap();
    assert_eq!(reads.load(Ordering::SeqCst), 2);
}

#[test]
fn inline_bytes_longer_than_one_answer_come_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let size = MAX_TIER_INLINE as usize + 5000;
    let content = Arc::new(bytes(size));
    let served = content.clone();
    let reads = scripted_mount(dir.path(), move |c, offset, len| {
        reply(c, &TierAnswer::Inline { len }, None);
        let mut w = c;
        w.write_all(&served[offset as usize..(offset + len) as usize])
            .unwrap();
    });
    let channel = TierChannel::connect(dir.path()).unwrap();
    let mut out = vec![0u8; size - 7];
    let done = channel
        .read_into("s3://b/data/x", "e", 7, &mut out)
        .unwrap();
    assert_eq!(done, TierRead::Done);
    assert!(
        out == content[7..],
        "the parts were not put together in order"
    );
    assert_eq!(reads.load(Ordering::SeqCst), 2);
    assert_eq!(
        channel.stats().inline_bytes.load(Ordering::Relaxed),
        size as u64 - 7
    );
}

#[test]
fn a_mount_that_breaks_off_sends_reads_to_the_workers_for_a_while() {
    let dir = tempfile::tempdir().unwrap();
    // Promises bytes, then sends none and hangs up.
    let reads = scripted_mount(dir.path(), |c, _, len| {
        reply(c, &TierAnswer::Inline { len }, None);
        let _ = c.shutdown(std::net::Shutdown::Both);
    });
    let channel = TierChannel::connect(dir.path()).unwrap();
    let mut out = vec![0u8; 4096];
    let first = channel
        .read_into("s3://b/data/x", "e", 0, &mut out)
        .unwrap();
    assert!(
        matches!(&first, TierRead::Unavailable(why) if why.contains("inline bytes")),
        "{first:?}"
    );
    // Within the back-off the mount is not asked at all.
    let second = channel
        .read_into("s3://b/data/x", "e", 0, &mut out)
        .unwrap();
    assert!(matches!(second, TierRead::Unavailable(_)));
    assert_eq!(reads.load(Ordering::SeqCst), 1);
    assert_eq!(channel.stats().unavailable.load(Ordering::Relaxed), 2);
}

#[test]
fn refusals_are_the_mounts_answer_and_unavailable_is_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    scripted_mount(dir.path(), |c, offset, _| {
        let answer = if offset == 0 {
            TierAnswer::Error {
                kind: TierErrorKind::Changed,
                message: "the object is no longer the version asked for".into(),
            }
        } else {
            TierAnswer::Unavailable {
                reason: "outside this mount".into(),
            }
        };
        reply(c, &answer, None);
    });
    let channel = TierChannel::connect(dir.path()).unwrap();
    let mut out = vec![0u8; 10];
    match channel.read_into("s3://b/data/x", "e", 0, &mut out) {
        Err(TierClientError::Refused {
            kind: TierErrorKind::Changed,
            message,
        }) => assert!(message.contains("no longer")),
        other => panic!("expected Changed, got {other:?}"),
    }
    let unavailable = channel
        .read_into("s3://b/data/x", "e", 1, &mut out)
        .unwrap();
    assert_eq!(
        unavailable,
        TierRead::Unavailable("outside this mount".into())
    );
}

#[test]
fn connecting_where_no_mount_listens_says_what_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let e = TierChannel::connect(dir.path())
        .err()
        .expect("connected to nothing");
    let text = e.to_string();
    assert!(
        text.contains("--local-cache") && text.contains(&dir.path().display().to_string()),
        "{text}"
    );
    // Something else listening there: a hello of another protocol.
    let listener = UnixListener::bind(dir.path().join(TIER_SOCKET_NAME)).unwrap();
    std::thread::spawn(move || {
        let (c, _) = listener.accept().unwrap();
        let _ = recv_message(c.as_raw_fd());
        reply(&c, &TierAnswer::Unavailable { reason: "?".into() }, None);
    });
    let e = TierChannel::connect(dir.path())
        .err()
        .expect("took a foreign hello");
    assert!(
        e.to_string().contains("expected a hello of protocol"),
        "{e}"
    );
}

#[test]
fn after_a_plan_each_switch_to_a_held_file_is_noted_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("object.data");
    std::fs::write(&path, bytes(1000)).unwrap();
    scripted_mount(dir.path(), move |c, _, _| {
        let f = File::open(&path).unwrap();
        reply(c, &TierAnswer::File { size: 1000 }, Some(f.as_raw_fd()));
    });
    let notes = NOTES.with(|n| n.clone());
    let channel = TierChannel::connect(dir.path()).unwrap();
    let mut out = vec![0u8; 10];
    for uri in ["s3://b/data/x", "s3://b/data/y"] {
        channel.read_into(uri, "e", 0, &mut out).unwrap();
    }
    channel
        .read_into("s3://b/data/x", "e", 5, &mut out)
        .unwrap();
    assert_eq!(notes.load(Ordering::SeqCst), 0, "noted without a plan");
    let plan: Vec<(crate::ObjectUri, std::ops::Range<u64>)> = vec![
        ("s3://bkt/data/x".parse().unwrap(), 0..10),
        ("s3://bkt/other/z".parse().unwrap(), 0..10),
    ];
    // The scripted mount serves bucket "b": nothing of this plan is its.
    assert_eq!(channel.publish_plan("job/0", 60, &plan).unwrap(), 0);
    for uri in [
        "s3://b/data/y",
        "s3://b/data/y",
        "s3://b/data/x",
        "s3://b/data/x",
    ] {
        channel.read_into(uri, "e", 0, &mut out).unwrap();
    }
    assert_eq!(
        notes.load(Ordering::SeqCst),
        2,
        "one note per switch of file"
    );
}

#[test]
fn an_idle_connection_the_mount_dropped_is_replaced_without_going_to_the_workers() {
    // A mount that answers one request per connection and then hangs up,
    // as a restarted mount leaves every pooled connection of the old one.
    let dir = tempfile::tempdir().unwrap();
    let listener = UnixListener::bind(dir.path().join(TIER_SOCKET_NAME)).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            let Ok((body, _)) = recv_message(c.as_raw_fd()) else {
                continue;
            };
            match serde_json::from_slice::<TierRequest>(&body).unwrap() {
                TierRequest::Hello => reply(&c, &hello(), None),
                TierRequest::Read { len, .. } => {
                    reply(&c, &TierAnswer::Inline { len }, None);
                    c.write_all(&bytes(len as usize)).unwrap();
                }
                TierRequest::Plan { order, .. } => reply(
                    &c,
                    &TierAnswer::PlanTaken {
                        entries: order.len(),
                    },
                    None,
                ),
                TierRequest::Note { .. } => reply(&c, &TierAnswer::Noted, None),
            }
        }
    });
    let channel = TierChannel::connect(dir.path()).unwrap();
    let mut out = vec![0u8; 4096];
    for round in 0..3 {
        let got = channel
            .read_into("s3://b/data/x", "e", 0, &mut out)
            .unwrap();
        assert_eq!(got, TierRead::Done, "read {round}");
        assert_eq!(out, bytes(4096), "read {round}");
    }
    // A plan on an idle connection too (this mount's bucket is too short
    // to name in a plan, so none of it is the mount's).
    let uri: crate::ObjectUri = "s3://bkt/data/x".parse().unwrap();
    assert_eq!(
        channel.publish_plan("job/0", 60, &[(uri, 0..10)]).unwrap(),
        0
    );
    assert_eq!(channel.stats().unavailable.load(Ordering::Relaxed), 0);
    // Hello, then one new connection per call after the first failed.
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
}
