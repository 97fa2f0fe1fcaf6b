//! Workloads: dd, read-sweep, mixed scan + working set, tree copy and parallel build, as
//! simulated processes, and [`WorkloadSpec`], their text form for the command line.
//!
//! Syntax (`KIND[:key=value,...]`, sizes in binary units):
//! - `dd:write,bs=1M,count=86[,fsync]` or `dd:read,bs=1M,count=86` — one file of bs × count;
//! - `sweep:file=256M,sizes=32M/64M/128M,bs=1M,passes=4` — seed 003: per size one pre-read,
//!   then `passes` timed reads from the start of the file;
//! - `mixed:scan=512M,ws=32M,reads=20000,think_us=500,bs=64k` — a sequential scan (looping)
//!   competing with random block reads of a working set;
//! - `treecopy:files=2000,min=1k,max=16k` — copy a tree of small files, then sync;
//! - `build:jobs=4,sources=200,headers=300,includes=20,cpu_ms=20,header_max=24k[,builds=2]` —
//!   parallel compile jobs reading sources and shared headers and writing objects; `builds`
//!   independent builds at once (default 1), each with its own sources and headers and `jobs`
//!   jobs (seed 001's `make build` beside a kernel build).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::clock::SimRng;
use crate::disk::{split_spec, SpecError};
use crate::sched::{FileId, Os, Process, SimError, Simulation, Step};

/// dd: `count` records of `bs` bytes, read from a file to /dev/null or written from
/// /dev/zero. Records `elapsed_s` and `bytes`.
pub struct Dd {
    file: FileId,
    write: bool,
    bs: u64,
    count: u64,
    done: u64,
    fsync: bool,
    synced: bool,
    start_ns: Option<u64>,
}

impl Dd {
    /// A dd over `file`.
    pub fn new(file: FileId, write: bool, bs: u64, count: u64, fsync: bool) -> Self {
        Dd {
            file,
            write,
            bs,
            count,
            done: 0,
            fsync,
            synced: false,
            start_ns: None,
        }
    }
}

impl Process for Dd {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        let start = *self.start_ns.get_or_insert(os.now());
        if self.done == self.count {
            if self.write && self.fsync && !self.synced {
                // Timed from the next step: with an io queue the fsync's requests may wait,
                // and the clock reads true only at the start of a step.
                os.fsync(self.file)?;
                self.synced = true;
                return Ok(Step::Continue);
            }
            let elapsed = (os.now() - start) as f64 / 1e9;
            os.record("elapsed_s", elapsed);
            os.record("bytes", (self.bs * self.count) as f64);
            return Ok(Step::Done);
        }
        let offset = self.done * self.bs;
        if self.write {
            os.read_zero(self.bs);
            os.write(self.file, offset, self.bs)?;
        } else {
            os.read(self.file, offset, self.bs)?;
            os.read_zero(0); // the write(2) to /dev/null
        }
        self.done += 1;
        Ok(Step::Continue)
    }
}

/// Seed 003's read sweep: for each size, one pre-read and `passes` timed reads of the first
/// `size` bytes of the file with `bs` records. Records `pass:{size}:{n}` = seconds.
pub struct Sweep {
    file: FileId,
    sizes: Vec<u64>,
    bs: u64,
    passes: u32,
    size_index: usize,
    pass: u32,
    offset: u64,
    pass_start_ns: u64,
    /// A pass ended with the last step's read: it is timed at the start of this step.
    pass_ended: bool,
}

impl Sweep {
    /// A sweep over `file`.
    pub fn new(file: FileId, sizes: Vec<u64>, bs: u64, passes: u32) -> Self {
        Sweep {
            file,
            sizes,
            bs,
            passes,
            size_index: 0,
            pass: 0,
            offset: 0,
            pass_start_ns: 0,
            pass_ended: false,
        }
    }
}

impl Process for Sweep {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        // A pass is timed at the start of the step after its last read: with an io queue that
        // read may wait, and the clock reads true only at the start of a step.
        if std::mem::take(&mut self.pass_ended) {
            let size = self.sizes[self.size_index];
            if self.pass > 0 {
                let seconds = (os.now() - self.pass_start_ns) as f64 / 1e9;
                os.record(format!("pass:{size}:{}", self.pass), seconds);
            }
            self.offset = 0;
            self.pass += 1;
            if self.pass > self.passes {
                self.pass = 0;
                self.size_index += 1;
            }
        }
        let Some(&size) = self.sizes.get(self.size_index) else {
            return Ok(Step::Done);
        };
        if self.offset == 0 {
            self.pass_start_ns = os.now();
        }
        let length = self.bs.min(size - self.offset);
        os.read(self.file, self.offset, length)?;
        self.offset += length;
        self.pass_ended = self.offset >= size;
        Ok(Step::Continue)
    }
}

/// A sequential scan that loops over a file forever (a background process).
pub struct Scan {
    file: FileId,
    bs: u64,
    offset: u64,
}

impl Scan {
    /// A scan of `file` with `bs` records.
    pub fn new(file: FileId, bs: u64) -> Self {
        Scan {
            file,
            bs,
            offset: 0,
        }
    }
}

impl Process for Scan {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        let length = os.file_len(self.file);
        let step = self.bs.min(length - self.offset);
        os.read(self.file, self.offset, step)?;
        self.offset += step;
        if self.offset >= length {
            self.offset = 0;
        }
        Ok(Step::Continue)
    }
}

/// Random single-block reads of a working set with think time. After `warmup` reads it
/// measures: records `hit_ratio` (share of its reads that needed no device read of its own)
/// and `latency_ms` (mean time per read).
pub struct WorkingSet {
    file: FileId,
    reads: u64,
    warmup: u64,
    think_ns: u64,
    done: u64,
    measure_start_ns: u64,
    measure_start_reads: u64,
}

impl WorkingSet {
    /// `reads` random block reads of `file`, the first `warmup` unmeasured.
    pub fn new(file: FileId, reads: u64, warmup: u64, think_ns: u64) -> Self {
        WorkingSet {
            file,
            reads,
            warmup,
            think_ns,
            done: 0,
            measure_start_ns: 0,
            measure_start_reads: 0,
        }
    }
}

impl Process for WorkingSet {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        if self.done == self.warmup {
            self.measure_start_ns = os.now();
            self.measure_start_reads = os.account().reads;
        }
        if self.done == self.reads {
            let measured = (self.reads - self.warmup).max(1);
            let misses = os.account().reads - self.measure_start_reads;
            os.record("hit_ratio", 1.0 - misses as f64 / measured as f64);
            os.record(
                "latency_ms",
                (os.now() - self.measure_start_ns) as f64 / 1e6 / measured as f64
                    - self.think_ns as f64 / 1e6,
            );
            return Ok(Step::Done);
        }
        let block = os.block_size(self.file);
        let blocks = os.file_len(self.file) / block;
        let chosen = os.rng().below(blocks);
        os.read(self.file, chosen * block, block)?;
        self.done += 1;
        Ok(Step::Sleep(self.think_ns))
    }
}

/// Copies a list of files (read whole, create, write whole), then syncs. Records
/// `elapsed_s` and `files`.
pub struct TreeCopy {
    sources: Vec<FileId>,
    /// Files received over the network instead (their lengths): nothing is read locally.
    remote_lengths: Vec<u64>,
    /// With the FFS model, a new directory every this many files.
    dir_files: u64,
    directory: crate::sched::DirId,
    next: usize,
    synced: bool,
    start_ns: Option<u64>,
}

impl TreeCopy {
    /// A copy of `sources`.
    pub fn new(sources: Vec<FileId>) -> Self {
        TreeCopy {
            sources,
            remote_lengths: Vec::new(),
            dir_files: 12,
            directory: 0,
            next: 0,
            synced: false,
            start_ns: None,
        }
    }

    fn files(&self) -> usize {
        self.sources.len() + self.remote_lengths.len()
    }
}

impl Process for TreeCopy {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        let start = *self.start_ns.get_or_insert(os.now());
        if self.next < self.files() {
            let length = match self.sources.get(self.next) {
                Some(&source) => {
                    let length = os.file_len(source);
                    os.read(source, 0, length)?;
                    length
                }
                None => {
                    // Received from the network: a copy into the process, no disk read.
                    let length = self.remote_lengths[self.next - self.sources.len()];
                    os.read_zero(length);
                    length
                }
            };
            if os.has_directories() && (self.next as u64).is_multiple_of(self.dir_files.max(1)) {
                self.directory = os.mkdir(&format!("dir-{}", self.next), self.dir_files)?;
            }
            let copy = os.create_in(self.directory, &format!("copy-{}", self.next), length)?;
            os.write(copy, 0, length)?;
            self.next += 1;
            return Ok(Step::Continue);
        }
        if !self.synced {
            // Timed from the next step: with an io queue the sync's requests may wait, and the
            // clock reads true only at the start of a step.
            os.sync()?;
            self.synced = true;
            return Ok(Step::Continue);
        }
        os.record("elapsed_s", (os.now() - start) as f64 / 1e9);
        os.record("files", self.files() as f64);
        Ok(Step::Done)
    }
}

/// One compile job: for each of its sources, read it, read `includes` random shared
/// headers, compute, write an object file. Records `elapsed_s`.
pub struct BuildJob {
    sources: Vec<FileId>,
    headers: Vec<FileId>,
    includes: u32,
    cpu_ns: u64,
    next: usize,
    start_ns: Option<u64>,
}

impl BuildJob {
    /// A job compiling `sources`.
    pub fn new(sources: Vec<FileId>, headers: Vec<FileId>, includes: u32, cpu_ns: u64) -> Self {
        BuildJob {
            sources,
            headers,
            includes,
            cpu_ns,
            next: 0,
            start_ns: None,
        }
    }
}

impl Process for BuildJob {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        let start = *self.start_ns.get_or_insert(os.now());
        let Some(&source) = self.sources.get(self.next) else {
            os.record("elapsed_s", (os.now() - start) as f64 / 1e9);
            return Ok(Step::Done);
        };
        let length = os.file_len(source);
        os.read(source, 0, length)?;
        for _ in 0..self.includes {
            let header = self.headers[os.rng().below(self.headers.len() as u64) as usize];
            let header_length = os.file_len(header);
            os.read(header, 0, header_length)?;
        }
        os.compute(self.cpu_ns);
        let object = os.create(&format!("obj-{source}"), length * 2)?;
        os.write(object, 0, length * 2)?;
        self.next += 1;
        Ok(Step::Continue)
    }
}

/// A workload in text form; see the module documentation for the syntax.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum WorkloadSpec {
    /// dd.
    Dd {
        /// Write (from /dev/zero) rather than read.
        write: bool,
        /// Record size.
        bs: u64,
        /// Records.
        count: u64,
        /// fsync before finishing (writes).
        fsync: bool,
    },
    /// Seed 003's read sweep.
    Sweep {
        /// File size.
        file: u64,
        /// Read sizes.
        sizes: Vec<u64>,
        /// Record size.
        bs: u64,
        /// Timed passes per size.
        passes: u32,
    },
    /// A scan competing with a working set.
    Mixed {
        /// Scanned file size.
        scan: u64,
        /// Working-set size.
        ws: u64,
        /// Working-set reads (the first 40 % are warm-up).
        reads: u64,
        /// Think time between working-set reads, µs.
        think_us: u64,
        /// Scan record size.
        bs: u64,
    },
    /// Copy a tree of small files.
    TreeCopy {
        /// Files.
        files: u64,
        /// Smallest file.
        min: u64,
        /// Largest file.
        max: u64,
        /// The source comes over the network (seed 004's ssh/pax): only the copy's writes
        /// reach the disk. Default false (the source is read from the same disk).
        remote: bool,
        /// Files per directory of the copy, with the FFS model (a directory is made before
        /// each group). Default 12 (**assumed**, /usr/src/sys's order of magnitude).
        dir_files: u64,
    },
    /// A parallel build.
    Build {
        /// Parallel jobs.
        jobs: u32,
        /// Source files in all.
        sources: u64,
        /// Shared headers.
        headers: u64,
        /// Headers read per source.
        includes: u32,
        /// CPU per source, ms.
        cpu_ms: u64,
        /// Largest header (headers are 1 KiB to this).
        header_max: u64,
        /// Independent builds run at once, each with its own `sources` sources, `headers`
        /// headers and `jobs` jobs (separate trees: they share only the disk and the cache).
        /// Default 1.
        builds: u32,
    },
}

fn size_value(key: &str, value: &str) -> Result<u64, SpecError> {
    let size = bufcache::parse_size(value).map_err(|e| SpecError::new(key, value, &e.reason))?;
    if size == 0 {
        return Err(SpecError::new(key, value, "a size above 0"));
    }
    Ok(size)
}

fn count_value(key: &str, value: &str) -> Result<u64, SpecError> {
    value
        .parse::<u64>()
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| SpecError::new(key, value, "a whole number above 0"))
}

impl FromStr for WorkloadSpec {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (kind, pairs) = split_spec(text)?;
        let mut spec = WorkloadSpec::defaults(&kind)?;
        for (key, value) in &pairs {
            spec.set(&kind, key, value)?;
        }
        spec.check()?;
        Ok(spec)
    }
}

impl WorkloadSpec {
    /// The workload `kind` with every key at its default.
    fn defaults(kind: &str) -> Result<WorkloadSpec, SpecError> {
        let spec = match kind {
            "dd" => WorkloadSpec::Dd {
                write: false,
                bs: 1 << 20,
                count: 86,
                fsync: false,
            },
            "sweep" => WorkloadSpec::Sweep {
                file: 256 << 20,
                sizes: vec![
                    32 << 20,
                    64 << 20,
                    96 << 20,
                    128 << 20,
                    192 << 20,
                    256 << 20,
                ],
                bs: 1 << 20,
                passes: 4,
            },
            "mixed" => WorkloadSpec::Mixed {
                scan: 512 << 20,
                ws: 32 << 20,
                reads: 20_000,
                think_us: 500,
                bs: 64 << 10,
            },
            "treecopy" => WorkloadSpec::TreeCopy {
                files: 2000,
                min: 1 << 10,
                max: 16 << 10,
                remote: false,
                dir_files: 12,
            },
            "build" => WorkloadSpec::Build {
                jobs: 4,
                sources: 200,
                headers: 300,
                includes: 20,
                cpu_ms: 20,
                header_max: 24 << 10,
                builds: 1,
            },
            _ => {
                return Err(SpecError::new(
                    "workload",
                    kind,
                    "one of dd, sweep, mixed, treecopy, build",
                ))
            }
        };
        Ok(spec)
    }

    /// Sets `key` of a workload of `kind` (named in the error for a key it does not have).
    fn set(&mut self, kind: &str, key: &str, value: &str) -> Result<(), SpecError> {
        let unknown = |key: &str, value: &str, keys: &str| {
            Err(SpecError::new(
                key,
                value,
                &format!("a key of {kind}: {keys}"),
            ))
        };
        match self {
            WorkloadSpec::Dd {
                write,
                bs,
                count,
                fsync,
            } => match key {
                "write" => *write = true,
                "read" => *write = false,
                "fsync" => *fsync = true,
                "bs" => *bs = size_value(key, value)?,
                "count" => *count = count_value(key, value)?,
                _ => return unknown(key, value, "read, write, bs, count, fsync"),
            },
            WorkloadSpec::Sweep {
                file,
                sizes,
                bs,
                passes,
            } => match key {
                "file" => *file = size_value(key, value)?,
                "sizes" => {
                    *sizes = value
                        .split('/')
                        .map(|s| size_value(key, s))
                        .collect::<Result<_, _>>()?
                }
                "bs" => *bs = size_value(key, value)?,
                "passes" => *passes = count_value(key, value)?.min(1000) as u32,
                _ => return unknown(key, value, "file, sizes (a/b/c), bs, passes"),
            },
            WorkloadSpec::Mixed {
                scan,
                ws,
                reads,
                think_us,
                bs,
            } => match key {
                "scan" => *scan = size_value(key, value)?,
                "ws" => *ws = size_value(key, value)?,
                "reads" => *reads = count_value(key, value)?,
                "think_us" => {
                    *think_us = value
                        .parse()
                        .map_err(|_| SpecError::new(key, value, "a whole number of µs"))?
                }
                "bs" => *bs = size_value(key, value)?,
                _ => return unknown(key, value, "scan, ws, reads, think_us, bs"),
            },
            WorkloadSpec::TreeCopy {
                files,
                min,
                max,
                remote,
                dir_files,
            } => match key {
                "files" => *files = count_value(key, value)?,
                "min" => *min = size_value(key, value)?,
                "max" => *max = size_value(key, value)?,
                "dir_files" => *dir_files = count_value(key, value)?,
                "remote" => {
                    *remote = match value {
                        "on" | "1" | "true" => true,
                        "off" | "0" | "false" => false,
                        _ => return Err(SpecError::new(key, value, "on or off")),
                    }
                }
                _ => return unknown(key, value, "files, min, max, remote, dir_files"),
            },
            WorkloadSpec::Build {
                jobs,
                sources,
                headers,
                includes,
                cpu_ms,
                header_max,
                builds,
            } => match key {
                "jobs" => *jobs = count_value(key, value)?.min(1024) as u32,
                "builds" => *builds = count_value(key, value)?.min(64) as u32,
                "sources" => *sources = count_value(key, value)?,
                "headers" => *headers = count_value(key, value)?,
                "includes" => *includes = count_value(key, value)?.min(10_000) as u32,
                "cpu_ms" => {
                    *cpu_ms = value
                        .parse()
                        .map_err(|_| SpecError::new(key, value, "a whole number of ms"))?
                }
                "header_max" => *header_max = size_value(key, value)?.max(1 << 10),
                _ => {
                    return unknown(
                        key,
                        value,
                        "jobs, sources, headers, includes, cpu_ms, header_max, builds",
                    )
                }
            },
        }
        Ok(())
    }

    /// Refuses keys that contradict each other (a sweep size above the file, min above max).
    fn check(&self) -> Result<(), SpecError> {
        match self {
            WorkloadSpec::Sweep { file, sizes, .. } => {
                if let Some(&too_big) = sizes.iter().find(|&&s| s > *file) {
                    return Err(SpecError::new(
                        "sizes",
                        &bufcache::format_size(too_big),
                        "sizes no larger than file",
                    ));
                }
            }
            WorkloadSpec::TreeCopy { min, max, .. } if min > max => {
                return Err(SpecError::new(
                    "min",
                    &bufcache::format_size(*min),
                    "min no larger than max",
                ))
            }
            _ => {}
        }
        Ok(())
    }
}

impl fmt::Display for WorkloadSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use bufcache::format_size as s;
        match self {
            WorkloadSpec::Dd {
                write,
                bs,
                count,
                fsync,
            } => write!(
                f,
                "dd:{},bs={},count={count}{}",
                if *write { "write" } else { "read" },
                s(*bs),
                if *fsync { ",fsync" } else { "" }
            ),
            WorkloadSpec::Sweep {
                file,
                sizes,
                bs,
                passes,
            } => write!(
                f,
                "sweep:file={},sizes={},bs={},passes={passes}",
                s(*file),
                sizes.iter().map(|&x| s(x)).collect::<Vec<_>>().join("/"),
                s(*bs)
            ),
            WorkloadSpec::Mixed {
                scan,
                ws,
                reads,
                think_us,
                bs,
            } => write!(
                f,
                "mixed:scan={},ws={},reads={reads},think_us={think_us},bs={}",
                s(*scan),
                s(*ws),
                s(*bs)
            ),
            WorkloadSpec::TreeCopy {
                files,
                min,
                max,
                remote,
                dir_files,
            } => write!(
                f,
                "treecopy:files={files},min={},max={},remote={},dir_files={dir_files}",
                s(*min),
                s(*max),
                if *remote { "on" } else { "off" }
            ),
            WorkloadSpec::Build {
                jobs,
                sources,
                headers,
                includes,
                cpu_ms,
                header_max,
                builds,
            } => {
                write!(
                    f,
                    "build:jobs={jobs},sources={sources},headers={headers},includes={includes},cpu_ms={cpu_ms},header_max={}",
                    s(*header_max)
                )?;
                // Only when not the default, so one build's text stays as it was.
                if *builds != 1 {
                    write!(f, ",builds={builds}")?;
                }
                Ok(())
            }
        }
    }
}

impl WorkloadSpec {
    /// Creates the workload's files in `sim` and spawns its processes.
    pub fn install(&self, sim: &mut Simulation) -> Result<(), SimError> {
        match self {
            WorkloadSpec::Dd {
                write,
                bs,
                count,
                fsync,
            } => {
                let file = sim.create_file("dd", bs * count)?;
                sim.spawn(
                    "dd",
                    Box::new(Dd::new(file, *write, *bs, *count, *fsync)),
                    0,
                    true,
                );
            }
            WorkloadSpec::Sweep {
                file,
                sizes,
                bs,
                passes,
            } => {
                let id = sim.create_file("sweep", *file)?;
                sim.spawn(
                    "sweep",
                    Box::new(Sweep::new(id, sizes.clone(), *bs, *passes)),
                    0,
                    true,
                );
            }
            WorkloadSpec::Mixed {
                scan,
                ws,
                reads,
                think_us,
                bs,
            } => {
                let hot = sim.create_file("working-set", *ws)?;
                let big = sim.create_file("scan", *scan)?;
                sim.spawn(
                    "working-set",
                    Box::new(WorkingSet::new(hot, *reads, reads * 2 / 5, think_us * 1000)),
                    0,
                    true,
                );
                sim.spawn("scan", Box::new(Scan::new(big, *bs)), 0, false);
            }
            WorkloadSpec::TreeCopy {
                files,
                min,
                max,
                remote,
                dir_files,
            } => {
                let mut rng = SimRng::new(0x7EE);
                let mut copy = TreeCopy::new(Vec::new());
                for index in 0..*files {
                    let length = rng.between(*min, *max);
                    if *remote {
                        copy.remote_lengths.push(length);
                    } else {
                        copy.sources
                            .push(sim.create_file(&format!("src-{index}"), length)?);
                    }
                }
                copy.dir_files = *dir_files;
                sim.spawn("cp", Box::new(copy), 0, true);
            }
            WorkloadSpec::Build {
                jobs,
                sources,
                headers,
                includes,
                cpu_ms,
                header_max,
                builds,
            } => {
                for build in 0..*builds {
                    // Build 0 keeps the names and sizes one build always had; each further
                    // build is a tree of its own (its own names and sizes).
                    let prefix = if build == 0 {
                        String::new()
                    } else {
                        format!("b{build}-")
                    };
                    let mut rng = SimRng::new(0xB11D + u64::from(build));
                    let header_files = (0..*headers)
                        .map(|i| {
                            sim.create_file(
                                &format!("{prefix}h-{i}"),
                                rng.between(1 << 10, *header_max),
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let source_files = (0..*sources)
                        .map(|i| {
                            sim.create_file(
                                &format!("{prefix}c-{i}"),
                                rng.between(2 << 10, 40 << 10),
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    for job in 0..*jobs as usize {
                        let mine: Vec<FileId> = source_files
                            .iter()
                            .copied()
                            .skip(job)
                            .step_by(*jobs as usize)
                            .collect();
                        sim.spawn(
                            &format!("{prefix}cc-{job}"),
                            Box::new(BuildJob::new(
                                mine,
                                header_files.clone(),
                                *includes,
                                cpu_ms * 1_000_000,
                            )),
                            0,
                            true,
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
