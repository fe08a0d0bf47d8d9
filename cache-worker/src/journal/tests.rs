use super::*;
use proptest::prelude::*;

fn object(uri: &str, size: u64) -> PendingObject {
    PendingObject {
        seq: 0,
        uri: uri.into(),
        version: format!("lc-{uri}"),
        size,
        part_size: 8 << 20,
        part_crcs: vec![0xdead_beef; size.div_ceil(8 << 20) as usize],
        acked_ms: 1,
        page_size: 4 << 20,
        delete: false,
        replica_of: None,
        unconfirmed: false,
        replicas: Vec::new(),
        // Round-trips with the rest: the mount's mode and times.
        meta: [("mode".to_string(), "33188".to_string())].into(),
        tenant: Some("team-a".into()),
    }
}

fn uris(j: &Journal) -> Vec<String> {
    j.pending().map(|p| p.uri.clone()).collect()
}

fn file_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(FILE_NAME)).unwrap().len()
}

#[test]
fn pending_objects_survive_a_reopen_in_acknowledgement_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    let a = j.add_pending(object("s3://b/ckpt/a", 10)).unwrap();
    let b = j.add_pending(object("s3://b/ckpt/b", 20)).unwrap();
    let c = j.add_pending(object("s3://b/ckpt/latest", 1)).unwrap();
    assert!(a < b && b < c);
    j.mark_uploaded(a, "etag-a").unwrap();
    drop(j);
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    assert_eq!(uris(&j), ["s3://b/ckpt/b", "s3://b/ckpt/latest"]);
    assert_eq!(j.pending_bytes(), 21);
    // Sequence numbers keep growing across reopens.
    assert!(j.add_pending(object("s3://b/x", 1)).unwrap() > c);
}

#[test]
fn an_append_cut_short_by_a_crash_is_dropped_and_the_rest_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    j.add_pending(object("s3://b/kept", 10)).unwrap();
    let whole = file_len(dir.path());
    j.add_pending(object("s3://b/torn", 10)).unwrap();
    drop(j);
    for cut in [whole + 3, whole + 9, file_len(dir.path()) - 1] {
        let f = OpenOptions::new()
            .write(true)
            .open(dir.path().join(FILE_NAME))
            .unwrap();
        f.set_len(cut).unwrap();
        drop(f);
        let mut j = Journal::open(dir.path(), "w1").unwrap();
        assert_eq!(uris(&j), ["s3://b/kept"], "cut at {cut}");
        assert_eq!(file_len(dir.path()), whole, "the torn tail is cut off");
        // New records follow the good ones and replay.
        j.add_pending(object("s3://b/torn", 10)).unwrap();
        drop(j);
        let j = Journal::open(dir.path(), "w1").unwrap();
        assert_eq!(uris(&j), ["s3://b/kept", "s3://b/torn"]);
    }
}

#[test]
fn damage_before_good_records_refuses_to_start_and_keeps_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    let start = file_len(dir.path());
    j.add_pending(object("s3://b/a", 10)).unwrap();
    j.add_pending(object("s3://b/b", 10)).unwrap();
    drop(j);
    let path = dir.path().join(FILE_NAME);
    let mut raw = std::fs::read(&path).unwrap();
    raw[start as usize + 12] ^= 0x40;
    std::fs::write(&path, &raw).unwrap();
    match Journal::open(dir.path(), "w1") {
        Err(JournalError::Damaged { offset, .. }) => assert_eq!(offset, start),
        other => panic!("expected Damaged, got {:?}", other.map(|_| ())),
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        raw,
        "the journal is untouched"
    );
}

#[test]
fn a_newer_format_or_another_workers_journal_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    j.add_pending(object("s3://b/a", 10)).unwrap();
    drop(j);
    assert!(matches!(
        Journal::open(dir.path(), "w2"),
        Err(JournalError::OtherWorker { .. })
    ));
    let path = dir.path().join(FILE_NAME);
    let mut raw = std::fs::read(&path).unwrap();
    raw[8..12].copy_from_slice(&(JOURNAL_FORMAT + 1).to_le_bytes());
    std::fs::write(&path, &raw).unwrap();
    let err = Journal::open(dir.path(), "w1").err().unwrap();
    assert!(matches!(err, JournalError::NewerFormat { found, .. } if found == JOURNAL_FORMAT + 1));
    assert!(err.to_string().contains("run a newer lakecache"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), raw);
}

#[test]
fn compaction_keeps_only_pending_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    let seqs: Vec<u64> = (0..200)
        .map(|i| j.add_pending(object(&format!("s3://b/f{i}"), 1)).unwrap())
        .collect();
    for s in &seqs[..199] {
        j.mark_uploaded(*s, "e").unwrap();
    }
    let before = file_len(dir.path());
    j.compact().unwrap();
    assert!(file_len(dir.path()) * 50 < before);
    j.add_pending(object("s3://b/after", 1)).unwrap();
    drop(j);
    let j = Journal::open(dir.path(), "w1").unwrap();
    assert_eq!(uris(&j), ["s3://b/f199", "s3://b/after"]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Any sequence of adds and uploads, cut at any byte: what replays is
    /// what the journal said was pending after some prefix of the calls
    /// that returned (never an invented or reordered entry), and all of
    /// it when nothing was cut.
    #[test]
    fn replay_after_any_cut_is_a_returned_state(
        ops in proptest::collection::vec(any::<Option<prop::sample::Index>>(), 1..30),
        cut in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::open(dir.path(), "w").unwrap();
        let mut states = vec![(file_len(dir.path()), Vec::<String>::new())];
        for (i, op) in ops.iter().enumerate() {
            match op {
                None => { j.add_pending(object(&format!("s3://b/{i}"), 1)).unwrap(); }
                Some(pick) => {
                    let seqs: Vec<u64> = j.pending().map(|p| p.seq).collect();
                    if seqs.is_empty() { continue; }
                    j.mark_uploaded(seqs[pick.index(seqs.len())], "e").unwrap();
                }
            }
            states.push((file_len(dir.path()), uris(&j)));
        }
        let full = uris(&j);
        drop(j);
        prop_assert_eq!(&uris(&Journal::open(dir.path(), "w").unwrap()), &full);
        let total = file_len(dir.path());
        let at = states[0].0 + cut.index((total - states[0].0 + 1) as usize) as u64;
        let f = OpenOptions::new().write(true).open(dir.path().join(FILE_NAME)).unwrap();
        f.set_len(at).unwrap();
        drop(f);
        let replayed = uris(&Journal::open(dir.path(), "w").unwrap());
        let expected = states.iter().rev().find(|(len, _)| *len <= at).map(|(_, u)| u.clone()).unwrap();
        prop_assert_eq!(replayed, expected);
    }
}

#[test]
fn a_format_1_journal_is_read_and_rewritten_as_the_current_format() {
    let dir = tempfile::tempdir().unwrap();
    let mut j = Journal::open(dir.path(), "w1").unwrap();
    j.add_pending(object("s3://b/old", 5)).unwrap();
    drop(j);
    // Make the file a format-1 journal: header format field and its CRC.
    let path = dir.path().join(FILE_NAME);
    let mut raw = std::fs::read(&path).unwrap();
    raw[8..12].copy_from_slice(&1u32.to_le_bytes());
    let id_len = u16::from_le_bytes([raw[12], raw[13]]) as usize;
    let crc = crc32c::crc32c(&raw[..14 + id_len]);
    raw[14 + id_len..18 + id_len].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, &raw).unwrap();

    let j = Journal::open(dir.path(), "w1").unwrap();
    assert_eq!(uris(&j), ["s3://b/old"]);
    let raw = std::fs::read(&path).unwrap();
    assert_eq!(u32_at(&raw, 8), Some(JOURNAL_FORMAT));
    drop(j);
    assert_eq!(
        uris(&Journal::open(dir.path(), "w1").unwrap()),
        ["s3://b/old"]
    );
}
