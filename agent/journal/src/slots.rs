//! Where a record's bytes live. A record's key (`r/{key}`) is its index entry; since
//! format 2 it holds a pointer to the record's slot (`R/{slot}`, slots in creation
//! order) rather than the record itself.
//!
//! Why: idempotency keys are random, so a journal keyed by them spreads new records
//! over every leaf of the tree, and once the journal outgrows sled's cache each new
//! call read a whole leaf of old records back from disk (about a quarter of the
//! writer's time under load). Pointers are small, so the index stays cached for far
//! longer, and the records themselves are written where the newest ones are. Format-1 journals keep
//! their inline records until each is next written.
//!
//! Since format 3 a new stream's events are slotted the same way (`E/{slot}…`, the
//! slot named by the stream's metadata; see `keys::Events`), for the same reason.

use crate::Error;
use crate::store::{Store, keys};

/// The record stored under `key`, if any. An index entry whose slot is missing reads
/// as no record (`verify` reports the record as missing).
pub(crate) fn read(store: &Store, key: &str) -> Result<Option<Vec<u8>>, Error> {
    match store.get(&keys::record(key))? {
        Some(value) => resolve(store, value),
        None => Ok(None),
    }
}

/// The slot `key`'s record is stored in; `None` for a record stored inline (format 1)
/// or absent.
pub(crate) fn slot(store: &Store, key: &str) -> Result<Option<u64>, Error> {
    Ok(store
        .get(&keys::record(key))?
        .and_then(|value| keys::parse_pointer(&value)))
}

/// The record an index entry's value names: the record itself in format 1.
fn resolve(store: &Store, value: Vec<u8>) -> Result<Option<Vec<u8>>, Error> {
    match keys::parse_pointer(&value) {
        Some(slot) => store.get(&keys::body(slot)),
        None => Ok(Some(value)),
    }
}

/// Every record as `(key, bytes)`: format-1 records in key order, then the others in
/// slot order. The index is read first (pointers are small), then the slots in one
/// pass in their order on disk; resolving the pointers one by one in key order would
/// read the slots at random, several times slower at start-up on a large journal.
pub(crate) fn scan(
    store: &Store,
) -> Result<impl Iterator<Item = Result<(String, Vec<u8>), Error>> + '_, Error> {
    let mut inline = Vec::new();
    let mut pointers = Vec::new();
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
            Ok(Some(bytes)) if keys::parse_pointer(&bytes).is_none() => Some(Ok((key, bytes))),
            // Rewritten into a slot since the index was read: not in this pass.
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        }
    });
    let mut pointers = pointers.into_iter().peekable();
    let slotted = store.scan_prefix(keys::BODIES).filter_map(move |entry| {
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
    match store.scan_prefix(prefix).next_back() {
        Some(entry) => {
            let (storage_key, _) = entry?;
            let slot = slot_of(&storage_key).ok_or_else(|| Error::Decode {
                what: what.to_owned(),
                detail: format!("{} bytes, too short", storage_key.len()),
            })?;
            Ok(slot + 1)
        }
        None => Ok(1),
    }
}
