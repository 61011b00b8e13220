//! Where a record's bytes live, and the index that finds them by key.
//!
//! A record is stored in a slot (`R/{slot}`), slots handed out in creation order
//! (format 2), so new records and their updates land in the tree's last leaves. Since
//! format 4 its index entry is `i/{generation}{key}`, holding a pointer to the slot,
//! where the generation is the slot divided by 65,536: the index of each 65,536
//! records is a subtree of its own.
//!
//! Why: idempotency keys are random. Indexed by key alone (formats 1 to 3, `r/{key}`),
//! each new call's entry went to a random leaf of an index as large as the journal,
//! and once that outgrew sled's cache the writer read a leaf back from disk per call
//! and sled wrote a dirtied leaf per call: at 600,000 records a journaled call cost
//! the writer 40 µs instead of 26 µs fresh, sled's I/O threads 17 µs instead of 4.
//! New entries now go to the newest generation's subtree, which stays small and
//! cached. Finding a key probes the generations newest first (the writer asks only
//! for keys its filter says may exist, and those are mostly recent).
//!
//! Since format 3 a new stream's events are slotted the same way (`E/{slot}…`, the
//! slot named by the stream's metadata; see `keys::Events`), for the same reason.
//!
//! Opening an older journal moves its index to generations ([`migrate`]); reads of a
//! journal no format-4 build has opened yet (`outrigger journal` on a stopped,
//! older sidecar's directory) still find the older index.

use crate::Error;
use crate::store::{OwnedWrite, Store, keys};

/// Slots per index generation, as a power of two.
pub(crate) const GENERATION_BITS: u32 = 16;
/// Index entries moved per write-ahead-log frame by [`migrate`].
const MIGRATE_CHUNK: usize = if cfg!(test) { 2 } else { 10_000 };

/// The index generation a slot belongs to.
pub(crate) fn generation(slot: u64) -> u32 {
    u32::try_from(slot >> GENERATION_BITS).unwrap_or(u32::MAX)
}

/// The index entry of the record `key` stored in `slot`.
pub(crate) fn index_key(key: &str, slot: u64) -> Vec<u8> {
    keys::index(generation(slot), key)
}

/// The slot of `key`'s record, probing the index generations from `newest` down.
/// Only the format-4 index: the writer's store has been migrated.
///
/// Below `newest`, only generations that hold an entry are probed, each found with
/// one seek: `newest` may come from a damaged key (a stray `i/\xff\xff\xff\xff…`
/// would otherwise have an absent key probe four billion generations).
pub(crate) fn find(store: &Store, key: &str, newest: u32) -> Result<Option<u64>, Error> {
    let mut generation = Some(newest);
    while let Some(g) = generation {
        if let Some(value) = store.get(&keys::index(g, key))? {
            return Ok(keys::parse_pointer(&value));
        }
        generation = below(store, g)?;
    }
    Ok(None)
}

/// The newest index generation below `generation` that holds an entry, if any.
fn below(store: &Store, generation: u32) -> Result<Option<u32>, Error> {
    let Some(under) = generation.checked_sub(1) else {
        return Ok(None);
    };
    match store
        .range(keys::INDEX, &keys::index(generation, ""))
        .next_back()
    {
        // Never `generation` again, whatever the entry: each step goes down.
        Some(entry) => Ok(Some(generation_of(&entry?.0).min(under))),
        None => Ok(None),
    }
}

/// The generation an index entry is in. An entry too short to name one (damage)
/// sorts just below the generation its bytes begin, padded with zeros: [`below`]
/// goes on from there and finds no entry of it.
fn generation_of(storage_key: &[u8]) -> u32 {
    if let Some(generation) = keys::index_generation(storage_key) {
        return generation;
    }
    let raw = storage_key.get(keys::INDEX.len()..).unwrap_or_default();
    let mut bytes = [0; 4];
    for (to, from) in bytes.iter_mut().zip(raw) {
        *to = *from;
    }
    u32::from_be_bytes(bytes)
}

/// The newest index generation in the store, if any.
fn newest(store: &Store) -> Result<Option<u32>, Error> {
    match store.scan_prefix(keys::INDEX).next_back() {
        Some(entry) => Ok(Some(generation_of(&entry?.0))),
        None => Ok(None),
    }
}

/// Where a record is: in a slot, or inline under its key (format 1, not yet migrated).
pub(crate) enum Found {
    Slot(u64),
    Inline(Vec<u8>),
}

pub(crate) fn locate(store: &Store, key: &str) -> Result<Option<Found>, Error> {
    if let Some(newest) = newest(store)?
        && let Some(slot) = find(store, key, newest)?
    {
        return Ok(Some(Found::Slot(slot)));
    }
    Ok(store
        .get(&keys::record(key))?
        .map(|value| match keys::parse_pointer(&value) {
            Some(slot) => Found::Slot(slot),
            None => Found::Inline(value),
        }))
}

/// Whether `key`'s index entry points at `slot` (a record read from a slot is
/// `key`'s only if so), in the generations' index or the older one.
pub(crate) fn points_at(store: &Store, key: &str, slot: u64) -> Result<bool, Error> {
    let pointer = keys::pointer(slot);
    if store.get(&index_key(key, slot))?.as_ref() == Some(&pointer) {
        return Ok(true);
    }
    Ok(store.get(&keys::record(key))?.as_ref() == Some(&pointer))
}

/// The record stored under `key`, if any. An index entry whose slot is missing reads
/// as no record (`verify` reports the record as missing).
pub(crate) fn read(store: &Store, key: &str) -> Result<Option<Vec<u8>>, Error> {
    match locate(store, key)? {
        Some(Found::Slot(slot)) => store.get(&keys::body(slot)),
        Some(Found::Inline(bytes)) => Ok(Some(bytes)),
        None => Ok(None),
    }
}

/// The slot `key`'s record is stored in; `None` for a record stored inline (format 1)
/// or absent.
#[cfg(test)]
pub(crate) fn slot(store: &Store, key: &str) -> Result<Option<u64>, Error> {
    Ok(match locate(store, key)? {
        Some(Found::Slot(slot)) => Some(slot),
        _ => None,
    })
}

/// A record's key and its bytes, or why they could not be read (its body file is
/// damaged: missing, or cut short).
pub(crate) type Scanned = (String, Result<Vec<u8>, Error>);

/// Every record as `(key, bytes)`: format-1 records in key order, then the others in
/// slot order. The index is read first (pointers are small), then the slots in one
/// pass in their order on disk; resolving the pointers one by one in key order would
/// read the slots at random, several times slower at start-up on a large journal.
/// A record whose bytes cannot be read is an item of its own, and the scan goes on.
pub(crate) fn scan(
    store: &Store,
) -> Result<impl Iterator<Item = Result<Scanned, Error>> + '_, Error> {
    let mut inline = Vec::new();
    let mut pointers = Vec::new();
    for entry in store.scan_prefix(keys::INDEX) {
        let (storage_key, value) = entry?;
        let (Some(key), Some(slot)) = (
            keys::index_entry_key(&storage_key),
            keys::parse_pointer(&value),
        ) else {
            continue;
        };
        pointers.push((slot, String::from_utf8_lossy(key).into_owned()));
    }
    for entry in store.scan_prefix(keys::RECORDS) {
        let (storage_key, value) = entry?;
        let key = String::from_utf8_lossy(&storage_key[keys::RECORDS.len()..]).into_owned();
        match keys::parse_pointer(&value) {
            Some(slot) => pointers.push((slot, key)),
            None => inline.push(key),
        }
    }
    pointers.sort_unstable_by_key(|&(slot, _)| slot);
    let inline = inline.into_iter().filter_map(move |key| {
        match store.get(&keys::record(&key)) {
            Ok(Some(bytes)) if keys::parse_pointer(&bytes).is_none() => Some(Ok((key, Ok(bytes)))),
            // Rewritten into a slot since the index was read: not in this pass.
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        }
    });
    let mut pointers = pointers.into_iter().peekable();
    let slotted = store
        .scan_prefix_each(keys::BODIES)
        .filter_map(move |entry| {
            let (storage_key, bytes) = match entry {
                Ok(entry) => entry,
                Err(e) => return Some(Err(e)),
            };
            let slot = keys::body_slot(&storage_key)?;
            // Pointers to a missing slot are passed over (the record reads as absent).
            while pointers.next_if(|&(s, _)| s < slot).is_some() {}
            let (_, key) = pointers.next_if(|&(s, _)| s == slot)?;
            Some(Ok((key, bytes)))
        });
    Ok(inline.chain(slotted))
}

/// Moves an older journal's index (`r/{key}`) to generations, and a format-1
/// record stored inline to a slot of its own, in frames of [`MIGRATE_CHUNK`] keys;
/// `format` is written with the first frame (if there is any to move), so that an
/// older build refuses the journal from then on rather than miss the moved entries. Each key moves whole
/// within one frame, so a crash part-way leaves some keys moved and the others as
/// they were, and the next open moves the rest. Returns how many moved.
pub(crate) fn migrate(store: &Store, format: &[u8]) -> Result<u64, Error> {
    // Looked up only for a format-1 record: an open with nothing to move reads no
    // slot.
    let mut next = None;
    move_in_frames(
        store,
        keys::RECORDS,
        format,
        |storage_key, value, writes| {
            let key = String::from_utf8_lossy(&storage_key[keys::RECORDS.len()..]).into_owned();
            let slot = match keys::parse_pointer(&value) {
                Some(slot) => slot,
                None => {
                    let slot = match next {
                        Some(slot) => slot,
                        None => next_slot(store)?,
                    };
                    next = Some(slot + 1);
                    writes.push((keys::body(slot), Some(value)));
                    slot
                }
            };
            writes.push((index_key(&key, slot), Some(keys::pointer(slot))));
            Ok(())
        },
    )
}

/// Moves an older journal's task index (`t/{task}\0{created µs}{key}`, formats 1 to
/// 5) to the one by slot (`T/{task}\0{slot}{key}`), as [`migrate`] moves its index
/// and after it (every record is in a slot then). An entry whose record is gone
/// goes. Returns how many moved.
pub(crate) fn migrate_tasks(store: &Store, format: &[u8]) -> Result<u64, Error> {
    move_in_frames(
        store,
        keys::TASKS_BY_TIME,
        format,
        |storage_key, _, writes| {
            if let Some((task, key)) = keys::task_by_time_entry(storage_key) {
                let task = String::from_utf8_lossy(task);
                let key = String::from_utf8_lossy(key);
                if let Some(Found::Slot(slot)) = locate(store, &key)? {
                    writes.push((keys::task(&task, slot, &key), Some(Vec::new())));
                }
            }
            Ok(())
        },
    )
}

/// Moves every entry under `prefix`, in frames of [`MIGRATE_CHUNK`]: `each` adds
/// what an entry becomes, and the entry itself is deleted in the same frame.
/// `format` is written with the first frame. Returns how many entries moved.
fn move_in_frames(
    store: &Store,
    prefix: &[u8],
    format: &[u8],
    mut each: impl FnMut(&[u8], Vec<u8>, &mut Vec<OwnedWrite>) -> Result<(), Error>,
) -> Result<u64, Error> {
    let mut moved = 0;
    loop {
        let mut writes: Vec<OwnedWrite> = Vec::new();
        if moved == 0 {
            writes.push((keys::FORMAT.to_vec(), Some(format.to_vec())));
        }
        let mut taken = 0;
        for entry in store.scan_prefix(prefix).take(MIGRATE_CHUNK) {
            let (storage_key, value) = entry?;
            each(&storage_key, value, &mut writes)?;
            writes.push((storage_key, None));
            taken += 1u64;
        }
        if taken == 0 {
            return Ok(moved);
        }
        moved += taken;
        store.apply(writes)?;
    }
}

/// The slot after the highest one in use: where the next record goes.
pub(crate) fn next_slot(store: &Store) -> Result<u64, Error> {
    next_after(store, keys::BODIES, keys::body_slot, "a record slot key")
}

/// The slot after the highest one holding stream events: where the next new stream's
/// events go (format 3; see [`keys::Events`]).
pub(crate) fn next_events_slot(store: &Store) -> Result<u64, Error> {
    next_after(
        store,
        keys::EVENT_SLOTS,
        keys::events_slot,
        "a stream event slot key",
    )
}

fn next_after(
    store: &Store,
    prefix: &[u8],
    slot_of: fn(&[u8]) -> Option<u64>,
    what: &str,
) -> Result<u64, Error> {
    // Keys only: the last record's body is not read (its file may be damaged).
    match store.last_key(prefix)? {
        Some(storage_key) => {
            let slot = slot_of(&storage_key).ok_or_else(|| Error::Decode {
                what: what.to_owned(),
                detail: format!("{} bytes, too short", storage_key.len()),
            })?;
            slot.checked_add(1).ok_or_else(|| Error::Decode {
                what: what.to_owned(),
                detail: "it names the last slot there can be".to_owned(),
            })
        }
        None => Ok(1),
    }
}
