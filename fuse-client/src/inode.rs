//! The inode table: kernel inode numbers for S3 keys, the metadata last
//! seen for each, and the kernel's lookup counts.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const ROOT_INO: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// Object metadata as listed or HEADed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Meta {
    pub size: u64,
    pub etag: Option<String>,
    pub mtime_ms: i64,
    /// The object's user metadata (mode, owner, times: see `posix`);
    /// `None` until known (a listing does not carry it).
    pub user: Option<lakecache_protocol::UserMeta>,
}

#[derive(Debug, Clone)]
pub struct Inode {
    pub ino: u64,
    pub parent: u64,
    pub name: String,
    pub kind: Kind,
    /// Full S3 key; directories end in `/`, the root is the mount prefix.
    pub key: String,
    pub meta: Meta,
    pub validated: Instant,
    pub nlookup: u64,
    /// The handle writing this file, while an upload is open.
    pub writer: Option<u64>,
    /// The ETag whose bytes the kernel page cache may hold.
    pub page_cache_etag: Option<String>,
    /// `meta.user` was changed here and is not yet stored in S3.
    pub meta_dirty: bool,
    /// A symbolic link's target, once read.
    pub link_target: Option<String>,
    /// Open handles the kernel serves from this version's bytes without
    /// asking the mount (FUSE passthrough). The kernel keeps one backing
    /// file per open inode, so while any is open the inode stays this
    /// version: a new version of the object gets a new inode instead.
    pub version_pins: u32,
}

impl Inode {
    /// Whether `meta` is another version than the one this inode is
    /// pinned to (see [`Inode::version_pins`]).
    pub fn pinned_away_from(&self, meta: &Meta) -> bool {
        self.version_pins > 0
            && self.meta.etag.is_some()
            && meta.etag.is_some()
            && self.meta.etag != meta.etag
    }

    /// A listed name that has no inode: shown by plain `readdir` with a
    /// stable stand-in number (top bit set, never a real inode number).
    pub fn transient(parent: u64, listed: &crate::dir::Listed) -> Self {
        // FNV-1a over the key: stable and cheap.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in listed.key.as_bytes() {
            h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
        Self {
            ino: h | 1 << 63,
            parent,
            name: listed.name.clone(),
            kind: listed.kind,
            key: listed.key.clone(),
            meta: listed.meta.clone(),
            validated: Instant::now(),
            nlookup: 0,
            writer: None,
            page_cache_etag: None,
            version_pins: 0,
            meta_dirty: false,
            link_target: None,
        }
    }

    pub fn is_fresh(&self, ttl: Duration) -> bool {
        self.kind == Kind::Dir || self.writer.is_some() || self.validated.elapsed() < ttl
    }
}

struct Table {
    nodes: HashMap<u64, Inode>,
    names: HashMap<(u64, String), u64>,
    next_ino: u64,
}

pub struct InodeTable {
    table: Mutex<Table>,
}

impl InodeTable {
    pub fn new(root_key: &str) -> Self {
        let root = Inode {
            ino: ROOT_INO,
            parent: ROOT_INO,
            name: String::new(),
            kind: Kind::Dir,
            key: root_key.to_string(),
            meta: Meta::default(),
            validated: Instant::now(),
            nlookup: 1,
            writer: None,
            page_cache_etag: None,
            version_pins: 0,
            meta_dirty: false,
            link_target: None,
        };
        Self {
            table: Mutex::new(Table {
                nodes: HashMap::from([(ROOT_INO, root)]),
                names: HashMap::new(),
                next_ino: ROOT_INO + 1,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, ino: u64) -> Option<Inode> {
        self.lock().nodes.get(&ino).cloned()
    }

    pub fn child(&self, parent: u64, name: &str) -> Option<Inode> {
        let t = self.lock();
        let ino = t.names.get(&(parent, name.to_string()))?;
        t.nodes.get(ino).cloned()
    }

    /// Records what S3 says about `parent/name`: updates the existing inode
    /// (unless a local upload owns it) or makes a new one.
    pub fn upsert(&self, parent: u64, name: &str, kind: Kind, key: String, meta: Meta) -> Inode {
        self.upsert_at(parent, name, kind, key, meta, Instant::now())
    }

    /// [`Self::upsert`] with metadata learned at `seen` (a listing's age
    /// counts against the attribute TTL).
    pub fn upsert_at(
        &self,
        parent: u64,
        name: &str,
        kind: Kind,
        key: String,
        meta: Meta,
        seen: Instant,
    ) -> Inode {
        let mut t = self.lock();
        let name_key = (parent, name.to_string());
        if let Some(&ino) = t.names.get(&name_key) {
            if let Some(node) = t.nodes.get_mut(&ino) {
                if node.kind == kind && !node.pinned_away_from(&meta) {
                    if node.writer.is_none() && !node.meta_dirty && seen >= node.validated {
                        if node.meta.etag != meta.etag {
                            node.link_target = None;
                        }
                        // A listing has no user metadata: keep what a
                        // stat of this same version found.
                        let user = match meta.user {
                            None if node.meta.etag == meta.etag => node.meta.user.take(),
                            u => u,
                        };
                        node.meta = Meta { user, ..meta };
                        node.key = key;
                        node.validated = seen;
                    }
                    return node.clone();
                }
            }
            t.names.remove(&name_key);
        }
        let ino = t.next_ino;
        t.next_ino += 1;
        let node = Inode {
            ino,
            parent,
            name: name.to_string(),
            kind,
            key,
            meta,
            validated: seen,
            nlookup: 0,
            writer: None,
            page_cache_etag: None,
            version_pins: 0,
            meta_dirty: false,
            link_target: None,
        };
        t.names.insert(name_key, ino);
        t.nodes.insert(ino, node.clone());
        node
    }

    pub fn len(&self) -> usize {
        self.lock().nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gives back the maps' spare room after the kernel forgot most
    /// inodes (a hash map keeps its largest capacity otherwise).
    pub fn shrink(&self) {
        let mut t = self.lock();
        if t.nodes.capacity() > 4 * t.nodes.len() + 1024 {
            t.nodes.shrink_to_fit();
        }
        if t.names.capacity() > 4 * t.names.len() + 1024 {
            t.names.shrink_to_fit();
        }
    }

    pub fn update<R>(&self, ino: u64, f: impl FnOnce(&mut Inode) -> R) -> Option<R> {
        self.lock().nodes.get_mut(&ino).map(f)
    }

    pub fn add_lookup(&self, ino: u64) {
        if let Some(n) = self.lock().nodes.get_mut(&ino) {
            n.nlookup += 1;
        }
    }

    /// The kernel dropped `n` references; unreferenced inodes are freed.
    pub fn forget(&self, ino: u64, n: u64) {
        if ino == ROOT_INO {
            return;
        }
        let mut t = self.lock();
        let Some(node) = t.nodes.get_mut(&ino) else {
            return;
        };
        node.nlookup = node.nlookup.saturating_sub(n);
        if node.nlookup > 0 || node.writer.is_some() || node.meta_dirty {
            return;
        }
        let name_key = (node.parent, node.name.clone());
        t.nodes.remove(&ino);
        if t.names.get(&name_key) == Some(&ino) {
            t.names.remove(&name_key);
        }
    }

    /// Forgets the name `parent/name` (the inode lives on until forgotten).
    pub fn unlink(&self, parent: u64, name: &str) {
        self.lock().names.remove(&(parent, name.to_string()));
    }

    /// Drops the name `parent/name` only while it still means `ino`: a
    /// lookup may have given the name a newer inode meanwhile.
    pub fn unlink_inode(&self, ino: u64, parent: u64, name: &str) {
        let mut t = self.lock();
        let key = (parent, name.to_string());
        if t.names.get(&key) == Some(&ino) {
            t.names.remove(&key);
        }
    }

    /// Moves an inode to a new name, replacing whatever had that name.
    pub fn rename(&self, ino: u64, new_parent: u64, new_name: &str, new_key: String, meta: Meta) {
        let mut t = self.lock();
        let Some(node) = t.nodes.get_mut(&ino) else {
            return;
        };
        let old = (node.parent, node.name.clone());
        node.parent = new_parent;
        node.name = new_name.to_string();
        node.key = new_key;
        node.meta = meta;
        node.validated = Instant::now();
        if t.names.get(&old) == Some(&ino) {
            t.names.remove(&old);
        }
        t.names.insert((new_parent, new_name.to_string()), ino);
    }

    /// True when a file under the directory key `prefix` is being written.
    pub fn writer_under(&self, prefix: &str) -> bool {
        let t = self.lock();
        t.nodes
            .values()
            .any(|n| n.writer.is_some() && n.key.starts_with(prefix) && n.key != prefix)
    }

    /// User metadata changed here and not yet stored, by key, under
    /// `prefix`.
    pub fn pending_meta_under(
        &self,
        prefix: &str,
    ) -> HashMap<String, lakecache_protocol::UserMeta> {
        let t = self.lock();
        t.nodes
            .values()
            .filter(|n| n.meta_dirty && n.key.starts_with(prefix))
            .filter_map(|n| Some((n.key.clone(), n.meta.user.clone()?)))
            .collect()
    }

    /// Keys under `old` (a directory key) now live under `new`, as the
    /// versions `moved` names by old key; the directory's own inode is
    /// moved by [`Self::rename`].
    pub fn rekey_under(&self, old: &str, new: &str, moved: &HashMap<String, Meta>) {
        let mut t = self.lock();
        for n in t.nodes.values_mut() {
            if n.key.starts_with(old) && n.key != old {
                if let Some(meta) = moved.get(&n.key) {
                    if n.kind == Kind::File {
                        n.meta = meta.clone();
                        n.page_cache_etag = None;
                    }
                }
                n.key = format!("{new}{}", &n.key[old.len()..]);
                n.meta_dirty = false;
            }
        }
    }

    /// Children with an upload in progress: they exist only here so far.
    pub fn local_children(&self, parent: u64) -> Vec<Inode> {
        let t = self.lock();
        t.nodes
            .values()
            .filter(|n| n.parent == parent && n.writer.is_some() && n.ino != ROOT_INO)
            .filter(|n| t.names.get(&(parent, n.name.clone())) == Some(&n.ino))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_version_of_a_pinned_inode_gets_a_new_inode_and_the_old_one_keeps_its_version() {
        let t = InodeTable::new("");
        let v = |etag: &str| Meta {
            size: 3,
            etag: Some(etag.into()),
            ..Meta::default()
        };
        let a = t.upsert(ROOT_INO, "a", Kind::File, "a".into(), v("one"));
        // Unpinned, a new version updates the inode in place.
        let same = t.upsert(ROOT_INO, "a", Kind::File, "a".into(), v("two"));
        assert_eq!(same.ino, a.ino);
        t.update(a.ino, |n| n.version_pins = 1);
        let newer = t.upsert(ROOT_INO, "a", Kind::File, "a".into(), v("three"));
        assert_ne!(newer.ino, a.ino);
        assert_eq!(t.get(a.ino).unwrap().meta.etag.as_deref(), Some("two"));
        assert_eq!(t.child(ROOT_INO, "a").unwrap().ino, newer.ino);
    }

    #[test]
    fn upsert_keeps_inode_numbers_and_forget_frees() {
        let t = InodeTable::new("");
        let a = t.upsert(ROOT_INO, "a", Kind::File, "a".into(), Meta::default());
        let again = t.upsert(
            ROOT_INO,
            "a",
            Kind::File,
            "a".into(),
            Meta {
                size: 5,
                ..Meta::default()
            },
        );
        assert_eq!(a.ino, again.ino);
        assert_eq!(again.meta.size, 5);
        // A file replaced by a directory of the same name is a new inode.
        let dir = t.upsert(ROOT_INO, "a", Kind::Dir, "a/".into(), Meta::default());
        assert_ne!(dir.ino, a.ino);
        t.add_lookup(dir.ino);
        t.add_lookup(dir.ino);
        t.forget(dir.ino, 1);
        assert!(t.get(dir.ino).is_some());
        t.forget(dir.ino, 1);
        assert!(t.get(dir.ino).is_none());
        assert!(t.child(ROOT_INO, "a").is_none());
    }

    #[test]
    fn rename_moves_the_name() {
        let t = InodeTable::new("p/");
        let f = t.upsert(ROOT_INO, "tmp", Kind::File, "p/tmp".into(), Meta::default());
        let old = t.upsert(
            ROOT_INO,
            "final",
            Kind::File,
            "p/final".into(),
            Meta::default(),
        );
        t.rename(f.ino, ROOT_INO, "final", "p/final".into(), Meta::default());
        assert!(t.child(ROOT_INO, "tmp").is_none());
        let now = t.child(ROOT_INO, "final").expect("renamed");
        assert_eq!(now.ino, f.ino);
        assert_ne!(now.ino, old.ino);
        assert_eq!(now.key, "p/final");
    }
}
