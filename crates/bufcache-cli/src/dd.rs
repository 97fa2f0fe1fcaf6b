//! `bufcache dd`: seed 000's tool, copying through the buffer cache with dd's own syntax.
//!
//! Regular files and block devices are opened as cache objects (one cache for both sides, as
//! in a kernel); anything else (stdin, stdout, /dev/zero, pipes) is streamed. The copy ends by
//! writing back every dirty buffer and flushing the output device, so the elapsed time covers
//! the data reaching the device, and nothing is left in memory when the process exits.
//! With no operands it runs a demonstration: 86 MiB written from zeroes to a temporary file
//! with bs=1M, read back and checked, the file removed.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use bufcache::{
    device::size::format_size_rounded, parse_size, Cache, CacheStats, CountingDevice, Device,
    DeviceStats, DirectionStats, FileDevice, FileDeviceOptions, ObjectConfig, ObjectHandle,
};
use clap::Args;

use crate::engine_args::EngineArgs;

/// Arguments of `bufcache dd`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    bufcache dd                                  # the demonstration: 86 MiB written and read back\n  \
    bufcache dd if=/dev/zero of=disk.img bs=1M count=86 --cluster-size-max 16k\n  \
    bufcache dd if=disk.img of=/dev/null bs=1M --readahead-size-max 0\n  \
    bufcache dd if=a.img of=b.img bs=64k skip=2 seek=4 conv=notrunc oflag=direct\n\n\
    Sizes take binary units (4k = 4096, 1M = 1 MiB). Records go through the cache; the copy\n\
    ends with write-back of all dirty data and an fdatasync of the output.")]
pub struct DdArgs {
    /// dd operands: if=FILE of=FILE bs=SIZE count=N skip=N seek=N conv=notrunc[,fsync]
    /// iflag=direct oflag=direct. No operands: the demonstration.
    #[arg(value_name = "OPERAND")]
    operands: Vec<String>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Parsed dd operands.
#[derive(Debug, Default, PartialEq)]
struct Operands {
    input: Option<PathBuf>,
    output: Option<PathBuf>,
    block_size_bytes: u64,
    count: Option<u64>,
    skip: u64,
    seek: u64,
    no_truncate: bool,
    input_direct: bool,
    output_direct: bool,
}

fn parse_operands(operands: &[String]) -> anyhow::Result<Operands> {
    let mut parsed = Operands {
        block_size_bytes: 512,
        ..Default::default()
    };
    for operand in operands {
        let (key, value) = operand
            .split_once('=')
            .with_context(|| format!("operand `{operand}` is not KEY=VALUE (for example bs=1M)"))?;
        let number = |what: &str| -> anyhow::Result<u64> {
            value
                .parse()
                .with_context(|| format!("operand {key}=`{value}`: {what} must be a whole number"))
        };
        match key {
            "if" => parsed.input = Some(PathBuf::from(value)),
            "of" => parsed.output = Some(PathBuf::from(value)),
            "bs" => {
                parsed.block_size_bytes = parse_size(value).with_context(|| format!("operand bs=`{value}`"))?;
                if parsed.block_size_bytes == 0 || parsed.block_size_bytes > 1 << 30 {
                    bail!("operand bs={value}: must be from 1 byte to 1GiB");
                }
            }
            "count" => parsed.count = Some(number("count")?),
            "skip" => parsed.skip = number("skip")?,
            "seek" => parsed.seek = number("seek")?,
            "conv" => {
                for flag in value.split(',') {
                    match flag {
                        "notrunc" => parsed.no_truncate = true,
                        // The copy always ends with write-back and a device flush.
                        "fsync" | "fdatasync" => {}
                        other => bail!("operand conv={value}: unsupported conversion `{other}` (supported: notrunc, fsync)"),
                    }
                }
            }
            "iflag" | "oflag" => {
                for flag in value.split(',') {
                    match (key, flag) {
                        ("iflag", "direct") => parsed.input_direct = true,
                        ("oflag", "direct") => parsed.output_direct = true,
                        _ => bail!("operand {key}={value}: unsupported flag `{flag}` (supported: direct)"),
                    }
                }
            }
            other => bail!("unknown operand `{other}` in `{operand}` (supported: if of bs count skip seek conv iflag oflag)"),
        }
    }
    Ok(parsed)
}

/// A predicate over each record read, for the demonstration's read-back check.
type ReadBackCheck = dyn Fn(&[u8]) -> bool;

/// Where records come from.
enum Source {
    Cached {
        object: ObjectHandle,
        device: Arc<CountingDevice<FileDevice>>,
    },
    Stream(Box<dyn Read>),
    Zeroes,
}

/// Where records go.
enum Sink {
    Cached {
        object: ObjectHandle,
        device: Arc<CountingDevice<FileDevice>>,
    },
    Stream(Box<dyn Write>),
}

fn is_cacheable(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .is_ok_and(|metadata| metadata.is_file() || metadata.file_type().is_block_device())
}

fn open_object(
    cache: &Cache,
    path: &Path,
    options: FileDeviceOptions,
    block_size: u32,
) -> anyhow::Result<(ObjectHandle, Arc<CountingDevice<FileDevice>>)> {
    let device = Arc::new(CountingDevice::new(FileDevice::open(path, &options)?));
    let config = ObjectConfig::new(
        path.display().to_string(),
        Arc::clone(&device) as Arc<dyn Device>,
    )
    .block_size(block_size);
    let object = cache.open_object(config)?;
    Ok((object, device))
}

/// Counts of whole and partial records.
#[derive(Default, Debug, Clone, Copy)]
struct Records {
    full: u64,
    partial: u64,
}

impl Records {
    fn add(&mut self, length: u64, record_size: u64) {
        if length == record_size {
            self.full += 1;
        } else {
            self.partial += 1;
        }
    }
}

/// What one copy did.
struct Report {
    records_in: Records,
    records_out: Records,
    bytes: u64,
    seconds: f64,
    reads: DirectionStats,
    writes: DirectionStats,
    cache: CacheStats,
}

pub fn run(args: DdArgs) -> anyhow::Result<()> {
    let config = args.engine.config()?;
    let block_size = args.engine.block_size_bytes(&config)?;
    if args.operands.is_empty() {
        return demonstration(&args.engine, block_size);
    }
    let operands = parse_operands(&args.operands)?;
    let cache = bufcache_host::system_cache(config)?;
    let report = copy(&cache, &operands, block_size, None)?;
    print_report(&report);
    Ok(())
}

fn copy(
    cache: &Cache,
    operands: &Operands,
    block_size: u32,
    check: Option<&ReadBackCheck>,
) -> anyhow::Result<Report> {
    let record_size = operands.block_size_bytes;
    let (source, input_length) = open_source(cache, operands, block_size)?;
    let copy_bytes = match (operands.count, input_length) {
        (Some(count), Some(length)) => {
            Some((count * record_size).min(length.saturating_sub(operands.skip * record_size)))
        }
        (Some(count), None) => Some(count * record_size),
        (None, Some(length)) => Some(length.saturating_sub(operands.skip * record_size)),
        (None, None) => None,
    };
    let mut sink = open_sink(cache, operands, block_size, copy_bytes)?;
    let started = Instant::now();
    let mut report = transfer(source, &mut sink, operands, copy_bytes, check)?;
    if let Sink::Cached { object, .. } = &sink {
        object
            .flush()
            .with_context(|| format!("writing back {}", object.name()))?;
    }
    if let Sink::Stream(stream) = &mut sink {
        stream.flush().context("flushing output")?;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report.cache = cache.stats();
    report.writes = device_stats(&sink_device(&sink)).writes;
    Ok(report)
}

fn open_source(
    cache: &Cache,
    operands: &Operands,
    block_size: u32,
) -> anyhow::Result<(Source, Option<u64>)> {
    match &operands.input {
        None => Ok((Source::Stream(Box::new(std::io::stdin())), None)),
        Some(path) if is_cacheable(path) => {
            let options = FileDeviceOptions {
                direct: operands.input_direct,
                read_only: true,
                ..Default::default()
            };
            let (object, device) = open_object(cache, path, options, block_size)?;
            let length = object.len();
            Ok((Source::Cached { object, device }, Some(length)))
        }
        Some(path) if path == Path::new("/dev/zero") => Ok((Source::Zeroes, None)),
        Some(path) => {
            let file = File::open(path)
                .with_context(|| format!("cannot open input {}", path.display()))?;
            Ok((Source::Stream(Box::new(file)), None))
        }
    }
}

fn open_sink(
    cache: &Cache,
    operands: &Operands,
    block_size: u32,
    copy_bytes: Option<u64>,
) -> anyhow::Result<Sink> {
    let Some(path) = &operands.output else {
        return Ok(Sink::Stream(Box::new(std::io::stdout().lock())));
    };
    let is_new_or_file = !path.exists() || std::fs::metadata(path).is_ok_and(|m| m.is_file());
    if !is_new_or_file && !is_cacheable(path) {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open output {}", path.display()))?;
        return Ok(Sink::Stream(Box::new(file)));
    }
    let Some(copy_bytes) = copy_bytes else {
        bail!("of={}: copying an endless stream into a file needs count=N (the output is sized up front)", path.display());
    };
    let end = operands.seek * operands.block_size_bytes + copy_bytes;
    let existing = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let is_block_device = path.exists() && !std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let length = if operands.no_truncate {
        existing.max(end)
    } else {
        end
    };
    let options = FileDeviceOptions {
        direct: operands.output_direct,
        create_length_bytes: Some(length),
        set_length_bytes: (!is_block_device).then_some(length),
        ..Default::default()
    };
    let (object, device) = open_object(cache, path, options, block_size)?;
    Ok(Sink::Cached { object, device })
}

fn transfer(
    mut source: Source,
    sink: &mut Sink,
    operands: &Operands,
    copy_bytes: Option<u64>,
    check: Option<&ReadBackCheck>,
) -> anyhow::Result<Report> {
    let record_size = operands.block_size_bytes;
    let mut buffer = vec![0u8; record_size as usize];
    let mut records_in = Records::default();
    let mut records_out = Records::default();
    let mut copied = 0u64;
    let mut input_position = operands.skip * record_size;
    let mut output_position = operands.seek * record_size;
    if let Source::Stream(stream) = &mut source {
        skip_stream(stream.as_mut(), input_position)?;
    }
    loop {
        let wanted = match copy_bytes {
            Some(total) => (total - copied).min(record_size),
            None => record_size,
        };
        if wanted == 0 {
            break;
        }
        let record = &mut buffer[..wanted as usize];
        let length = read_record(&mut source, record, input_position)?;
        if length == 0 {
            break;
        }
        records_in.add(length as u64, record_size);
        let data = &record[..length];
        if let Some(check) = check {
            if !check(data) {
                bail!("read-back check failed at offset {input_position}: the data is not what was written");
            }
        }
        write_record(sink, data, output_position)?;
        records_out.add(length as u64, record_size);
        copied += length as u64;
        input_position += length as u64;
        output_position += length as u64;
    }
    Ok(Report {
        records_in,
        records_out,
        bytes: copied,
        seconds: 0.0,
        reads: device_stats(&source_device(&source)).reads,
        writes: device_stats(&sink_device(sink)).writes,
        cache: CacheStats::default(),
    })
}

fn source_device(source: &Source) -> Option<Arc<CountingDevice<FileDevice>>> {
    match source {
        Source::Cached { device, .. } => Some(Arc::clone(device)),
        _ => None,
    }
}

fn sink_device(sink: &Sink) -> Option<Arc<CountingDevice<FileDevice>>> {
    match sink {
        Sink::Cached { device, .. } => Some(Arc::clone(device)),
        Sink::Stream(_) => None,
    }
}

fn device_stats(device: &Option<Arc<CountingDevice<FileDevice>>>) -> DeviceStats {
    device
        .as_ref()
        .map(|device| device.stats())
        .unwrap_or_default()
}

fn skip_stream(stream: &mut dyn Read, bytes: u64) -> anyhow::Result<()> {
    let skipped =
        std::io::copy(&mut stream.take(bytes), &mut std::io::sink()).context("skipping input")?;
    if skipped < bytes {
        bail!("skip: the input ended after {skipped} of {bytes} bytes");
    }
    Ok(())
}

fn read_record(source: &mut Source, record: &mut [u8], position: u64) -> anyhow::Result<usize> {
    match source {
        Source::Zeroes => {
            record.fill(0);
            Ok(record.len())
        }
        Source::Cached { object, .. } => {
            let available = object
                .len()
                .saturating_sub(position)
                .min(record.len() as u64) as usize;
            object
                .read_at(position, &mut record[..available])
                .with_context(|| format!("reading {} at offset {position}", object.name()))?;
            Ok(available)
        }
        Source::Stream(stream) => {
            let mut filled = 0;
            while filled < record.len() {
                match stream.read(&mut record[filled..]) {
                    Ok(0) => break,
                    Ok(count) => filled += count,
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(error) => return Err(error).context("reading input"),
                }
            }
            Ok(filled)
        }
    }
}

fn write_record(sink: &mut Sink, data: &[u8], position: u64) -> anyhow::Result<()> {
    match sink {
        Sink::Cached { object, .. } => object
            .write_at(position, data, false)
            .with_context(|| format!("writing {} at offset {position}", object.name())),
        Sink::Stream(stream) => stream.write_all(data).context("writing output"),
    }
}

fn print_report(report: &Report) {
    let Report {
        records_in,
        records_out,
        bytes,
        seconds,
        ..
    } = report;
    eprintln!("{}+{} records in", records_in.full, records_in.partial);
    eprintln!("{}+{} records out", records_out.full, records_out.partial);
    let rate = if *seconds > 0.0 {
        *bytes as f64 / seconds
    } else {
        0.0
    };
    eprintln!(
        "{bytes} bytes ({}, {}) copied, {seconds:.4} s, {}/s",
        decimal_size(*bytes as f64),
        format_size_rounded(*bytes),
        decimal_size(rate)
    );
    print_direction("device reads ", &report.reads);
    print_direction("device writes", &report.writes);
    let cache = &report.cache;
    eprintln!(
        "cache: {} hits, {} misses, read-ahead {} issued / {} used / {} wasted blocks, {} read clusters, {} write clusters",
        cache.hits,
        cache.misses,
        cache.readahead_issued_blocks,
        cache.readahead_used_blocks,
        cache.readahead_wasted_blocks,
        cache.read_clusters,
        cache.write_clusters
    );
}

fn print_direction(label: &str, stats: &DirectionStats) {
    let average = stats.average_transfer_bytes();
    eprintln!(
        "{label}: {} transfers, {} bytes, average transfer {} ({:.0} bytes)",
        stats.requests,
        stats.bytes,
        if stats.requests > 0 {
            format_size_rounded(average.round() as u64)
        } else {
            "-".into()
        },
        average
    );
}

fn decimal_size(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    // Spelled as format_size_rounded spells binary sizes: no space before the unit.
    if unit == 0 {
        format!("{value:.0}{}", UNITS[unit])
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

/// The embedded default: write 86 MiB of zeroes with bs=1M, read it back in a fresh cache
/// (as after a remount), check it, remove the file.
fn demonstration(engine: &EngineArgs, block_size: u32) -> anyhow::Result<()> {
    let path = std::env::temp_dir().join(format!("bufcache-dd-{}.img", std::process::id()));
    let result = (|| -> anyhow::Result<()> {
        eprintln!(
            "== bufcache dd if=/dev/zero of={} bs=1M count=86 ==",
            path.display()
        );
        let write = Operands {
            input: Some(PathBuf::from("/dev/zero")),
            output: Some(path.clone()),
            block_size_bytes: 1 << 20,
            count: Some(86),
            ..Default::default()
        };
        print_report(&copy(
            &bufcache_host::system_cache(engine.config()?)?,
            &write,
            block_size,
            None,
        )?);
        eprintln!(
            "\n== bufcache dd if={} of=/dev/null bs=1M (fresh cache, data checked) ==",
            path.display()
        );
        let read = Operands {
            input: Some(path.clone()),
            output: Some(PathBuf::from("/dev/null")),
            block_size_bytes: 1 << 20,
            ..Default::default()
        };
        let all_zero = |data: &[u8]| data.iter().all(|&byte| byte == 0);
        print_report(&copy(
            &bufcache_host::system_cache(engine.config()?)?,
            &read,
            block_size,
            Some(&all_zero),
        )?);
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|item| item.to_string()).collect()
    }

    #[test]
    fn operands_parse_like_dd() {
        let parsed = parse_operands(&strings(&[
            "if=a",
            "of=b",
            "bs=64k",
            "count=3",
            "skip=1",
            "seek=2",
            "conv=notrunc",
            "oflag=direct",
        ]))
        .unwrap();
        assert_eq!(parsed.block_size_bytes, 65536);
        assert_eq!((parsed.count, parsed.skip, parsed.seek), (Some(3), 1, 2));
        assert!(parsed.no_truncate && parsed.output_direct && !parsed.input_direct);
    }

    #[test]
    fn bad_operands_are_named() {
        let error = parse_operands(&strings(&["bs=12q"])).unwrap_err();
        assert!(format!("{error:#}").contains("bs="), "{error:#}");
        let error = parse_operands(&strings(&["colour=blue"])).unwrap_err();
        assert!(error.to_string().contains("colour"), "{error}");
        let error = parse_operands(&strings(&["conv=ucase"])).unwrap_err();
        assert!(error.to_string().contains("ucase"), "{error}");
        let error = parse_operands(&strings(&["count"])).unwrap_err();
        assert!(error.to_string().contains("KEY=VALUE"), "{error}");
    }
}
