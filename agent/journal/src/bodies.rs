//! Record bodies kept outside sled, in append-only files of their own (format 5):
//! sled holds, under the record's slot key, a small pointer to where the bytes are.
//!
//! Why: sled rewrites a leaf of up to 16 values every tenth change to it, so a
//! journaled call's record of about 1.9 KB cost sled about 8 KB of writes (and its
//! I/O threads about a fifth of the call's CPU). Appended here, a record is written
//! once; the pointers sled keeps are 17 bytes.
//!
//! One file per index generation of slots (`records/{generation}` in the journal
//! directory, 65,536 slots each, see [`crate::slots`]): a record rewritten later (an
//! in-doubt call resolved) is appended to its generation's file again, and once
//! retention has removed every record of a generation its file is deleted (at the
//! second rotation of the write-ahead log that finds it empty, so that a reader
//! holding a pointer taken just before does not find the file gone). Appends happen
//! where sled's writes do, when a logged batch is applied. A batch replayed from the
//! write-ahead log at open gives its bodies to sled itself instead, as every format
//! reads them there. Values stored inline (by replay, by earlier
//! formats, by tests that edit the store) are read as they are and move to a file
//! when next written.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::Error;
use crate::store::{keys, lock};

/// The directory of body files, in the journal directory.
const DIR: &str = "records";
/// The first byte of a pointer; no JSON value starts with it.
const TAG: u8 = 0xFF;
/// Tag, generation (u32), offset (u64), length (u32), big-endian.
const POINTER_LEN: usize = 1 + 4 + 8 + 4;

pub(crate) struct Bodies {
    dir: PathBuf,
    files: Mutex<HashMap<u32, Segment>>,
    /// A file was created since the last [`Bodies::sync`]: its name must be made
    /// durable too.
    created: AtomicBool,
    /// The generations found empty at the last [`Bodies::drop_empty`]: a file is
    /// deleted only when found empty twice, so a reader that took a pointer just
    /// before retention removed it does not find the file gone.
    empty_before: Mutex<HashSet<u32>>,
}

struct Segment {
    file: Arc<File>,
    /// Where the next body goes.
    len: u64,
    /// Appended to since the last [`Bodies::sync`].
    dirty: bool,
}

impl Bodies {
    /// The body files of the journal in `journal_dir`; with `create`, their
    /// directory is created if missing (an offline audit creates nothing).
    pub(crate) fn open(journal_dir: &Path, create: bool) -> Result<Self, Error> {
        let dir = journal_dir.join(DIR);
        let created = create && !dir.exists();
        if created {
            std::fs::create_dir_all(&dir)
                .and_then(|()| File::open(journal_dir)?.sync_all())
                .map_err(|e| Error::Storage(format!("cannot create {}: {e}", dir.display())))?;
        }
        Ok(Self {
            dir,
            files: Mutex::new(HashMap::new()),
            created: AtomicBool::new(false),
            empty_before: Mutex::new(HashSet::new()),
        })
    }

    /// Whether the value stored under `key` goes to a body file.
    pub(crate) fn holds(key: &[u8]) -> bool {
        key.starts_with(keys::BODIES)
    }

    /// Appends each `(key, body)` to its generation's file, one `write` per file,
    /// and returns the pointers sled keeps instead, in order.
    pub(crate) fn append_all(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<Vec<u8>>, Error> {
        let mut files = self.files();
        // Each file's new bytes, starting where the file ends.
        let mut staged: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut pointers = Vec::with_capacity(items.len());
        for (key, value) in items {
            let slot = keys::body_slot(key).ok_or_else(|| Error::Decode {
                what: "a record slot key".to_owned(),
                detail: format!("{} bytes", key.len()),
            })?;
            let generation = crate::slots::generation(slot);
            let len = u32::try_from(value.len()).map_err(|_| {
                Error::Storage(format!("a record of {} bytes is too large", value.len()))
            })?;
            let end = match files.entry(generation) {
                std::collections::hash_map::Entry::Occupied(e) => e.get().len,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(self.open_segment(generation, true)?).len
                }
            };
            let buffer = match staged.iter_mut().position(|(g, _)| *g == generation) {
                Some(i) => &mut staged[i].1,
                None => &mut staged.push_mut((generation, Vec::new())).1,
            };
            pointers.push(pointer(generation, end + buffer.len() as u64, len));
            buffer.extend_from_slice(value);
        }
        for (generation, bytes) in staged {
            // Opened above, under the same lock.
            let segment = files.get_mut(&generation).ok_or_else(|| {
                Error::Storage(format!(
                    "the record file {} was not open",
                    self.path(generation).display()
                ))
            })?;
            segment
                .file
                .write_all_at(&bytes, segment.len)
                .map_err(|e| {
                    Error::Storage(format!(
                        "writing records to {} failed: {e}",
                        self.path(generation).display()
                    ))
                })?;
            segment.len += bytes.len() as u64;
            segment.dirty = true;
        }
        Ok(pointers)
    }

    /// The value stored under `key` stands for: for a record body ([`Bodies::holds`]),
    /// the body a pointer names; otherwise, or for a body stored inline, the value
    /// itself. Only record bodies are looked at: any other value (a stream event, a
    /// kv value) may hold any bytes, a pointer's among them.
    pub(crate) fn resolve(&self, key: &[u8], value: Vec<u8>) -> Result<Vec<u8>, Error> {
        if !Self::holds(key) {
            return Ok(value);
        }
        let Some((generation, offset, len)) = parse(&value) else {
            return Ok(value);
        };
        let (file, size) = {
            let mut files = self.files();
            match files.get(&generation) {
                Some(segment) => (Arc::clone(&segment.file), segment.len),
                None => {
                    let segment = self.open_segment(generation, false)?;
                    let found = (Arc::clone(&segment.file), segment.len);
                    files.insert(generation, segment);
                    found
                }
            }
        };
        // Within the file (whose every append goes through `files`), or damaged: read
        // nothing, and allocate nothing a damaged length asks for.
        if offset
            .checked_add(u64::from(len))
            .is_none_or(|end| end > size)
        {
            return Err(Error::Decode {
                what: format!("a record in {}", self.path(generation).display()),
                detail: format!(
                    "{len} bytes at {offset} run past the end of the file ({size} bytes)"
                ),
            });
        }
        let mut body = vec![0; len as usize];
        file.read_exact_at(&mut body, offset)
            .map_err(|e| Error::Decode {
                what: format!("a record in {}", self.path(generation).display()),
                detail: format!("{len} bytes at {offset}: {e}"),
            })?;
        Ok(body)
    }

    /// `fdatasync`s every file appended to since the last call (and the directory,
    /// if a file was created).
    pub(crate) fn sync(&self) -> Result<(), Error> {
        if self.created.swap(false, Ordering::AcqRel)
            && let Err(e) = File::open(&self.dir).and_then(|d| d.sync_all())
        {
            self.created.store(true, Ordering::Release);
            return Err(Error::Storage(format!(
                "cannot sync {}: {e}",
                self.dir.display()
            )));
        }
        let mut files = self.files();
        for (generation, segment) in files.iter_mut().filter(|(_, s)| s.dirty) {
            crate::store::sync_record_data(&segment.file).map_err(|e| {
                Error::Storage(format!(
                    "fdatasync of {} failed: {e}",
                    self.path(*generation).display()
                ))
            })?;
            segment.dirty = false;
        }
        Ok(())
    }

    /// Deletes the file of every generation but the newest for which `empty` says
    /// no record is left, now and at the call before.
    pub(crate) fn drop_empty(&self, empty: impl Fn(u32) -> bool) {
        let mut generations: Vec<u32> = self.on_disk();
        generations.sort_unstable();
        generations.pop();
        let now: HashSet<u32> = generations.into_iter().filter(|&g| empty(g)).collect();
        let before = std::mem::replace(&mut *lock(&self.empty_before), now.clone());
        let mut files = self.files();
        for generation in now.into_iter().filter(|g| before.contains(g)) {
            files.remove(&generation);
            let path = self.path(generation);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(file = %path.display(), "journal record file emptied by retention; deleted")
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot delete an emptied journal record file")
                }
            }
        }
    }

    /// The bytes the body files take.
    pub(crate) fn size_on_disk(&self) -> u64 {
        self.on_disk()
            .into_iter()
            .filter_map(|g| std::fs::metadata(self.path(g)).ok())
            .map(|m| m.len())
            .sum()
    }

    /// The generations that have a file.
    fn on_disk(&self) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| u32::from_str_radix(e.file_name().to_str()?, 16).ok())
            .collect()
    }

    /// Opens a generation's file; with `create` (to append), creating it. A file
    /// missing when read names a record retention removed while the read ran.
    fn open_segment(&self, generation: u32, create: bool) -> Result<Segment, Error> {
        let path = self.path(generation);
        let file = if create {
            if !path.exists() {
                self.created.store(true, Ordering::Release);
            }
            crate::store::open_read_write(&path)?
        } else {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| Error::Decode {
                    what: format!("the record file {}", path.display()),
                    detail: format!("{e} (its records were removed by retention?)"),
                })?
        };
        let len = file
            .metadata()
            .map_err(|e| Error::Storage(format!("cannot read {}: {e}", path.display())))?
            .len();
        Ok(Segment {
            file: Arc::new(file),
            len,
            dirty: false,
        })
    }

    fn path(&self, generation: u32) -> PathBuf {
        self.dir.join(format!("{generation:08x}"))
    }

    fn files(&self) -> MutexGuard<'_, HashMap<u32, Segment>> {
        lock(&self.files)
    }
}

/// The pointer to `len` bytes at `offset` in `generation`'s file.
fn pointer(generation: u32, offset: u64, len: u32) -> Vec<u8> {
    let mut pointer = Vec::with_capacity(POINTER_LEN);
    pointer.push(TAG);
    pointer.extend_from_slice(&generation.to_be_bytes());
    pointer.extend_from_slice(&offset.to_be_bytes());
    pointer.extend_from_slice(&len.to_be_bytes());
    pointer
}

/// `(generation, offset, length)` of a pointer; `None` for an inline value.
fn parse(value: &[u8]) -> Option<(u32, u64, u32)> {
    if value.len() != POINTER_LEN || value[0] != TAG {
        return None;
    }
    let generation = u32::from_be_bytes(value[1..5].try_into().ok()?);
    let offset = u64::from_be_bytes(value[5..13].try_into().ok()?);
    let len = u32::from_be_bytes(value[13..17].try_into().ok()?);
    Some((generation, offset, len))
}
