//! `sim check`'s rescue files (issue #45): shutdowns that cannot reach the store, restarts
//! with a changed URL, stale rescue files and refused starts, through the server's own rescue
//! code (`bufcache_host::rescue`: the file's format, its default name, the disk identity and
//! the rule [`rescue::check_saved`] deciding whether a file may be replayed).
//!
//! Each object of the seed is an export whose backend is an S3-style disk (the only kind
//! that keeps a generation): an id recorded in the store, a generation every writable open
//! raises (each engine start here: the first, after a crash, after a replay), and a URL whose
//! parameters a restart may change (`break-lock=`, `retry-timeout-ms=`, ...) without changing
//! which disk it names. This machine's working directory, where rescue files are kept, is a
//! map from path to bytes.
//!
//! The scenario, at seeded steps:
//! - **outage**: the store stops answering (every request fails); the server's shutdown cannot
//!   write back, so it saves every dirty block of every export (`visit_dirty_blocks`, as
//!   `serve` does) into the export's rescue file, recording the generation it holds, and
//!   exits. The store and the rescue files together must then hold, for every sector, the
//!   last write acknowledged before the last acknowledged flush or something written after
//!   it (0 flushed writes lost).
//! - then either **a restart here** with the URL's open-only parameters changed: the start
//!   probes the disk (id and generation, nothing written), finds each file by its default
//!   name, asks `check_saved`, and must replay it; the store must then hold exactly what the
//!   store and the files held;
//! - or **another server** (another machine, without these files) opens the disks, raising
//!   their generation, and writes and flushes newer data. When it stops, a start here
//!   presents the old files: it must be refused, the files kept byte for byte, and the store
//!   (data and generations) unchanged by the refused start. The operator then discards them
//!   (`--rescue discard`: the disk holds newer data) and the server starts.
//!
//! A stale file replayed anyway (the planted defect `planted-rescue-defect` makes the
//! generation check pass) is reported twice over: the shadow finds flushed writes of the other
//! server overwritten ("lost write"), and the start that should have been refused was not
//! ("stale rescue file replayed").

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use bufcache::device::SeededRng;
use bufcache_host::rescue::{self, Backend, BackendIdentity, Record};

use super::s3_identity;
use super::{decode_sector, property, Harness, Shadow};
use crate::core::{FaultConfig, SECTOR_BYTES};
use bufcache_check::Violation;

/// Parameters of an S3 URL that say only how the disk is reached or opened: a restart may
/// add, drop or change any of them, and the disk, its rescue file's name and the check must
/// not change.
const OPEN_ONLY_PARAMETERS: [&str; 6] = [
    "break-lock",
    "retry-timeout-ms",
    "create-size",
    "lock",
    "segment-size",
    "gc",
];
/// Longest wait for a dirty buffer's lock while saving it, as `serve` waits.
const VISIT_LOCK_WAIT: Duration = Duration::from_secs(1);

/// What the scenario did in one seed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RescueCounts {
    /// Shutdowns that saved dirty data to rescue files.
    pub saved: u64,
    /// Starts that replayed rescue files (after a changed URL, every one).
    pub replayed: u64,
    /// Starts refused because their rescue files were stale.
    pub refused: u64,
}

/// The disks' identities and generations, the running server's view of them, and this
/// machine's rescue files.
pub(super) struct RescueWorld {
    /// Per object: the disk id its store records.
    disk_ids: Vec<u64>,
    /// Per object: the generation the store records (raised by every writable open).
    generations: Vec<u64>,
    /// Per object: the generation the running server holds (what a rescue file records).
    held: Vec<u64>,
    /// Per object: the URL the running server was started with.
    urls: Vec<String>,
    /// This machine's working directory: rescue files by path.
    files: BTreeMap<PathBuf, Vec<u8>>,
    /// The files here were saved before another server opened the disks: a start here must
    /// refuse them.
    stale: bool,
    /// Per sector, after a shutdown during an outage: the version the store and the rescue
    /// files together hold (what a replay must leave on the store).
    expected: Vec<u64>,
    pub(super) counts: RescueCounts,
}

impl RescueWorld {
    pub(super) fn new(rng: &mut SeededRng, objects: usize) -> RescueWorld {
        RescueWorld {
            disk_ids: (0..objects).map(|_| rng.next_u64()).collect(),
            generations: vec![0; objects],
            held: vec![0; objects],
            urls: (0..objects).map(base_url).collect(),
            files: BTreeMap::new(),
            stale: false,
            expected: Vec::new(),
            counts: RescueCounts::default(),
        }
    }

    /// Rescue files here are waiting for a start that must refuse them.
    pub(super) fn is_stale(&self) -> bool {
        self.stale
    }

    /// A writable open of every disk (an engine start): the store's generations rise and the
    /// server holds them.
    pub(super) fn open(&mut self) {
        for generation in &mut self.generations {
            *generation += 1;
        }
        self.held.clone_from(&self.generations);
    }
}

/// The export name of object `object`.
fn export_name(object: usize) -> String {
    format!("object{object}")
}

/// The URL of object `object`'s disk, without parameters.
fn base_url(object: usize) -> String {
    format!("s3://sim-bucket/disk{object}")
}

impl Harness {
    /// The identity a start computes for object `object` from its URL and a probe of the
    /// store (which writes nothing): the disk's id, its name, its generation now.
    fn probed_identity(&self, object: usize) -> BackendIdentity {
        let world = &self.rescue;
        BackendIdentity {
            identity: s3_identity(world.disk_ids[object]),
            name: rescue::s3_name_of_url(&world.urls[object])
                .expect("the simulated disks have s3:// URLs"),
            state: Some(world.generations[object]),
        }
    }

    /// The URL of a restart: the disk's base URL, maybe spelled with a trailing slash, with a
    /// seeded choice of open-only parameters.
    fn respell_url(&self, object: usize) -> String {
        let mut url = base_url(object);
        if self.draw(2) == 0 {
            url.push('/');
        }
        let mut separator = '?';
        for parameter in OPEN_ONLY_PARAMETERS {
            if self.draw(2) == 0 {
                url.push(separator);
                url.push_str(&format!("{parameter}={}", self.draw(1000)));
                separator = '&';
            }
        }
        url
    }

    /// Every sector's version on the store (the checker reads it directly).
    fn store_versions(&self) -> Result<Vec<u64>, Violation> {
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        (0..self.shadow.len() as u64)
            .map(|sector| {
                self.device.peek(&mut bytes, sector * SECTOR_BYTES);
                decode_sector(&bytes, sector).map_err(|garbage| {
                    self.violation(
                        property::RESCUE_FILES,
                        format!("corrupt sector on the store: {sector} holds {garbage}"),
                    )
                })
            })
            .collect()
    }

    /// The store changes nothing a start may write: its bytes and every disk's generation.
    fn store_snapshot(&self) -> (Vec<u8>, Vec<u64>) {
        let mut bytes = vec![0u8; self.shadow.len() * SECTOR_BYTES as usize];
        self.device.peek(&mut bytes, 0);
        (bytes, self.rescue.generations.clone())
    }

    /// A seeded step: the store becomes unreachable and the server shuts down (saving what
    /// it could not write back), or, while another server runs on the disks, that server
    /// stops and a start here presents the old files.
    pub(super) fn outage(&mut self) -> Result<(), Violation> {
        if self.rescue.stale {
            return self.present_stale_files();
        }
        self.note("the store stops answering; shutdown".to_string());
        let unreachable = FaultConfig {
            read_error_probability: 1.0,
            write_error_probability: 1.0,
            flush_error_probability: 1.0,
            ..FaultConfig::default()
        };
        self.device.set_faults(unreachable, self.rng.clone());
        self.drain_jobs();
        self.enter(self.client_accounts[0]);
        let synced = self.cache.as_ref().expect("running").sync();
        // The shutdown's last resort, as `serve` does it: every dirty block of every export.
        let mut records_by_object = vec![Vec::new(); self.scenario.regions.len()];
        for (object, handle) in self.handles[0].iter().enumerate() {
            handle.visit_dirty_blocks(VISIT_LOCK_WAIT, |offset, bytes| {
                if let Some(bytes) = bytes {
                    records_by_object[object].push(Record {
                        export: export_name(object),
                        offset,
                        data: bytes.to_vec(),
                    });
                }
            });
        }
        self.leave();
        self.collect_failed_writes();
        let mut saved_bytes = 0;
        for (object, records) in records_by_object.iter().enumerate() {
            if records.is_empty() {
                continue;
            }
            let region = self.scenario.regions[object];
            let ours = self.probed_identity(object);
            let backend = Backend {
                export: export_name(object),
                identity: ours.identity,
                name: ours.name.clone(),
                size_bytes: region.length,
                block_size_bytes: region.block_size,
                state: Some(self.rescue.held[object]),
            };
            saved_bytes += records.iter().map(|r| r.data.len()).sum::<usize>();
            let path = rescue::default_path(&backend.export, &ours.name);
            self.rescue
                .files
                .insert(path, rescue::encode(&[backend], records));
        }
        if saved_bytes > 0 {
            self.rescue.counts.saved += 1;
        }
        // The process ends; the store keeps what it made durable (a crash of its volatile
        // state, so nothing later counts on writes it never confirmed).
        self.spawner.clear();
        self.handles.clear();
        self.cache = None;
        self.device.crash(&self.rng);
        self.device.restart();
        self.device.take_failed_writes();
        self.device
            .set_faults(self.scenario.faults.clone(), self.rng.clone());
        self.note(format!(
            "sync -> {}; saved {saved_bytes} bytes to {} rescue files",
            if synced.is_ok() { "ok" } else { "error" },
            self.rescue.files.len()
        ));
        // The store and the files together: no flushed write may be missing from both.
        let on_store = self.store_versions()?;
        let mut expected = on_store.clone();
        for (object, records) in records_by_object.iter().enumerate() {
            let base = self.scenario.regions[object].base;
            for record in records {
                let first = (base + record.offset) / SECTOR_BYTES;
                for (index, bytes) in record.data.chunks(SECTOR_BYTES as usize).enumerate() {
                    let sector = first + index as u64;
                    expected[sector as usize] =
                        decode_sector(bytes, sector).map_err(|garbage| {
                            self.violation(
                                property::RESCUE_FILES,
                                format!("corrupt rescue record: sector {sector} holds {garbage}"),
                            )
                        })?;
                }
            }
        }
        for (sector, shadow) in self.shadow.iter().enumerate() {
            if !shadow.survives(expected[sector]) {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    format!(
                    "lost write at a shutdown during an outage: sector {sector} holds version {} \
                     on the store and in the rescue files, expected one of {:?}",
                    expected[sector],
                    shadow.expected_after_crash()
                ),
                ));
            }
        }
        if self.rescue.files.is_empty() || self.draw(2) == 0 {
            self.rescue.expected = expected;
            return self.start_here(true);
        }
        // Another server, without these files, opens the disks (raising their generation)
        // and goes on: what it serves is what the store holds.
        self.rescue.stale = true;
        self.reset_shadow(&on_store);
        self.note("another server opens the disks".to_string());
        self.start_engine();
        Ok(())
    }

    /// The shadow starts over from `versions`, durable.
    fn reset_shadow(&mut self, versions: &[u64]) {
        for (shadow, &version) in self.shadow.iter_mut().zip(versions) {
            *shadow = Shadow {
                versions: vec![(version, true)],
                floor: 0,
            };
        }
    }

    /// The other server stops cleanly (the store answers again: its last sync must succeed,
    /// so every write it acknowledged is flushed); a start here finds the old files and must
    /// refuse them, changing nothing; the operator then discards them and starts again.
    fn present_stale_files(&mut self) -> Result<(), Violation> {
        self.note("the other server stops".to_string());
        self.device
            .set_faults(FaultConfig::default(), self.rng.clone());
        self.drain_jobs();
        self.enter(self.client_accounts[0]);
        let synced = self.cache.as_ref().expect("running").sync();
        self.leave();
        self.collect_failed_writes();
        if let Err(error) = synced {
            return Err(self.violation(
                property::RESCUE_FILES,
                format!("the other server's last sync failed with faults off: {error}"),
            ));
        }
        for object in 0..self.scenario.regions.len() {
            let (first, sectors) = self.region_sectors(object);
            self.make_durable(first, sectors);
        }
        self.spawner.clear();
        self.handles.clear();
        self.cache = None;
        self.device
            .set_faults(self.scenario.faults.clone(), self.rng.clone());
        self.start_here(true)?;
        if self.cache.is_some() {
            // Replayed, not refused: start_here reported it unless the check is off.
            return Ok(());
        }
        self.note(format!(
            "--rescue discard: {} stale rescue files deleted",
            self.rescue.files.len()
        ));
        self.rescue.files.clear();
        self.rescue.stale = false;
        self.start_here(false)
    }

    /// A start here, as `serve` orders it: probe every disk (nothing written), check every
    /// export's rescue file with [`rescue::check_saved`]; refused, nothing is written and the
    /// files are kept; accepted, open the disks (raising their generations), replay, sync
    /// and delete the files. `respell` changes the URLs' open-only parameters first.
    fn start_here(&mut self, respell: bool) -> Result<(), Violation> {
        if respell {
            for object in 0..self.scenario.regions.len() {
                self.rescue.urls[object] = self.respell_url(object);
            }
        }
        let before = self.store_snapshot();
        let files_before = self.rescue.files.clone();
        let mut found: Vec<(usize, PathBuf, Vec<Record>)> = Vec::new();
        let mut refusal = None;
        for object in 0..self.scenario.regions.len() {
            let ours = self.probed_identity(object);
            let export = export_name(object);
            let path = rescue::default_path(&export, &ours.name);
            let Some(bytes) = self.rescue.files.get(&path) else {
                continue;
            };
            let contents = rescue::decode(bytes).map_err(|damage| {
                self.violation(
                    property::RESCUE_FILES,
                    format!("rescue file {} unreadable: {damage}", path.display()),
                )
            })?;
            let size_bytes = self.scenario.regions[object].length;
            for saved in contents.backends.iter().flatten() {
                if saved.export != export {
                    continue;
                }
                if let Err(why) = rescue::check_saved(saved, &ours, Some(size_bytes), false) {
                    refusal.get_or_insert((path.clone(), why));
                }
            }
            found.push((object, path, contents.records));
        }
        let urls = self.rescue.urls.join(" ");
        if let Some((path, why)) = refusal {
            self.rescue.counts.refused += 1;
            self.note(format!(
                "start with {urls}: rescue file {} refused ({why:?})",
                path.display()
            ));
            if !self.rescue.stale {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    format!(
                        "fresh rescue file refused: {} ({why:?}) at a start with {urls}",
                        path.display()
                    ),
                ));
            }
            if self.store_snapshot() != before {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    "a refused start changed the store".to_string(),
                ));
            }
            if self.rescue.files != files_before {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    "a refused start changed its rescue files".to_string(),
                ));
            }
            return Ok(());
        }
        if found.is_empty() && !self.rescue.files.is_empty() {
            return Err(self.violation(
                property::RESCUE_FILES,
                format!(
                    "rescue files not found at a start with {urls}: {:?}",
                    self.rescue.files.keys().collect::<Vec<_>>()
                ),
            ));
        }
        self.start_engine();
        let replayed = !found.is_empty();
        // The store answers again: the replay, and its sync, must succeed.
        self.device
            .set_faults(FaultConfig::default(), self.rng.clone());
        for (object, path, records) in found {
            for record in &records {
                self.enter(self.client_accounts[0]);
                let result = self.handles[0][object].write_at(record.offset, &record.data, false);
                self.leave();
                if let Err(error) = result {
                    return Err(self.violation(
                        property::RESCUE_FILES,
                        format!(
                            "replaying {} failed: offset {}: {error}",
                            path.display(),
                            record.offset
                        ),
                    ));
                }
            }
            self.rescue.files.remove(&path);
        }
        let synced = if replayed {
            self.enter(self.client_accounts[0]);
            let synced = self.cache.as_ref().expect("running").sync();
            self.leave();
            self.collect_failed_writes();
            synced
        } else {
            Ok(())
        };
        self.device
            .set_faults(self.scenario.faults.clone(), self.rng.clone());
        if replayed {
            if let Err(error) = synced {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    format!("the replay's sync failed with faults off: {error}"),
                ));
            }
            self.rescue.counts.replayed += 1;
        }
        self.note(format!(
            "start with {urls}{}",
            if replayed {
                ": rescue files replayed"
            } else {
                ""
            }
        ));
        self.verify_start(&urls, replayed)
    }

    /// After a start with `urls` (which `replayed` rescue files or not): a stale file's
    /// replay is a violation (and so is what it overwrote), a fresh file's records must be
    /// on the store; the shadow then starts over from the store.
    fn verify_start(&mut self, urls: &str, replayed: bool) -> Result<(), Violation> {
        let on_store = self.store_versions()?;
        if self.rescue.stale {
            // What the other server flushed must still be there.
            for (sector, shadow) in self.shadow.iter().enumerate() {
                if !shadow.survives(on_store[sector]) {
                    return Err(self.violation(
                        property::RESCUE_FILES,
                        format!(
                        "lost write: a stale rescue file was replayed over data flushed since: \
                         sector {sector} holds version {}, expected one of {:?}",
                        on_store[sector],
                        shadow.expected_after_crash()
                    ),
                    ));
                }
            }
            return Err(self.violation(
                property::RESCUE_FILES,
                format!(
                "stale rescue file replayed: the disks' generations moved on since it was saved \
                 ({:?} now), yet a start with {urls} replayed it",
                self.rescue.generations
            ),
            ));
        }
        if replayed {
            if let Some(sector) =
                (0..on_store.len()).find(|&s| on_store[s] != self.rescue.expected[s])
            {
                return Err(self.violation(
                    property::RESCUE_FILES,
                    format!(
                        "rescued write not replayed after a restart with {urls}: sector {sector} \
                     holds version {}, the store and the rescue files held {}",
                        on_store[sector], self.rescue.expected[sector]
                    ),
                ));
            }
        }
        self.reset_shadow(&on_store);
        Ok(())
    }
}
