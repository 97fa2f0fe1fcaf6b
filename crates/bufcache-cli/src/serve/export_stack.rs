//! One export's stack: the layers from what the NBD server calls down to the backend's
//! device, built in one place and in one order, which is
//!
//! ```text
//!  the server ─▶ MeteredExport          request meters (/metrics: connections, commands)
//!             ─▶ ObservedExport         --trace and the live what-if (only when on)
//!             ─▶ CacheExport            the cache object served, with its gates: the S3
//!                                       lease (LeaseGate) or a warm standby's (StandbyGate)
//!             ─▶ cache object           in the one shared Cache
//!             ─▶ io queue               --io-queue (elevator by default; none: left out)
//!             ─▶ LocalTier              --local-cache (only when given)
//!             ─▶ CountingDevice         what reaches the backend (/metrics)
//!             ─▶ the backend's device   file, memory, NBD upstream, S3 (or a standby's view)
//! ```
//!
//! A stack also holds what serving and shutdown need of its export: the meters, the rescue
//! identity, the backend's lock, the S3 device whose acknowledged data may be only in
//! memory, a warm standby.

use std::sync::{mpsc, Arc};

use anyhow::bail;
use bufcache::{format_size, Cache, CountingDevice, Device, ObjectConfig, ObjectHandle};
use bufcache_export::CacheExport;
use bufcache_nbd::Export;

use super::backend::{open_local_tier, OpenedBackend, PreparedBackend};
use super::validate::ExportSpec;
use super::{Event, ServeArgs, STANDBY_WARM_BYTES_MAX_DEFAULT};
use crate::backend_lock::BackendLock;
use crate::log::say;
use crate::metrics::{ExportMeters, ServeTier};
use crate::observe::Observers;
use crate::request_meters::{MeteredExport, RequestMeters};
use crate::rescue::{self, BackendIdentity};
use crate::standby::WarmStandby;

/// One layer of a stack, named for tests and for the order documented above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Layer {
    Metered,
    Observed,
    CacheExport,
    LeaseGate,
    StandbyGate,
    CacheObject,
    IoQueue,
    LocalTier,
    Counting,
    Backend,
}

/// What every export's stack is built with: the flags, the shared cache and observers, and
/// where a warm standby's takeover is announced.
pub(super) struct StackContext<'a> {
    pub args: &'a ServeArgs,
    pub cache: &'a Cache,
    pub block_size: u32,
    pub observers: &'a Observers,
    pub events: &'a mpsc::Sender<Event>,
}

/// One export, built: what the server serves, and what serving and shutdown hold of it.
pub(super) struct ExportStack {
    pub name: String,
    /// What the server serves: the top of the stack.
    pub export: Arc<dyn Export>,
    /// The export's cache object (views of it are taken for rescue, replay and control).
    pub object: ObjectHandle,
    pub meters: ExportMeters,
    /// The backend's identity for its rescue file; None for memory.
    pub rescuable: Option<rescue::Backend>,
    /// The S3 device saved from at a shutdown that cannot reach the store (None with a
    /// local cache, which keeps that data itself).
    pub s3: Option<Arc<bufcache_s3::S3Device>>,
    /// Exclusive use of a backing file, released once everything is written back.
    pub lock: Option<BackendLock>,
    /// The warm standby, for an s3:// backend served with --standby.
    pub standby: Option<Arc<WarmStandby>>,
    /// The layers, from the top (what the server calls) down.
    pub layers: Vec<Layer>,
}

impl ExportStack {
    /// Opens `prepared` (the `index`-th export, named by `spec`) and builds its stack.
    pub(super) fn build(
        context: &StackContext<'_>,
        index: usize,
        spec: ExportSpec,
        prepared: PreparedBackend,
    ) -> anyhow::Result<ExportStack> {
        let ExportSpec { name, backend, .. } = spec;
        let args = context.args;
        let OpenedBackend {
            device,
            upstream,
            store,
            identity,
            s3,
            lock,
            standby,
        } = prepared.open(context.events, index)?;
        let lease = s3.as_ref().and_then(|device| device.lease());
        let replica = s3.as_ref().and_then(|device| device.replica().cloned());
        let mut below = vec![Layer::Counting, Layer::Backend];
        let counting = Arc::new(CountingDevice::new(device));
        let tier = local_tier(args, &backend, identity.as_ref(), &counting)?;
        let above_backend = match &tier {
            Some(tier) => {
                below.insert(0, Layer::LocalTier);
                Arc::clone(tier) as Arc<dyn Device>
            }
            None => Arc::clone(&counting) as Arc<dyn Device>,
        };
        let (device, queue) = args
            .engine
            .queue_device(above_backend, context.cache.config())?;
        if queue.is_some() {
            below.insert(0, Layer::IoQueue);
        }
        let object = open_object(context, &name, &backend, device)?;
        below.insert(0, Layer::CacheObject);
        let standby = standby
            .map(|standby| {
                WarmStandby::start(
                    standby,
                    object.reopen(),
                    args.standby_warm_bytes_max
                        .unwrap_or(STANDBY_WARM_BYTES_MAX_DEFAULT),
                )
            })
            .transpose()?;
        let rescuable = identity.map(|identity| rescue::Backend {
            export: name.clone(),
            identity: identity.identity,
            name: identity.name,
            size_bytes: object.len(),
            block_size_bytes: object.block_size(),
            state: identity.state,
        });
        if let Some(replica) = replica {
            // A refresh that maps a range anew makes the cache read it again.
            let handle = object.reopen();
            replica.set_on_change(Arc::new(move |offset, length| {
                handle.forget_clean(offset, length)
            }));
        }
        let requests = Arc::new(RequestMeters::default());
        let (export, mut layers) = export_layers(
            context,
            index,
            object.reopen(),
            lease,
            standby.as_ref(),
            Arc::clone(&requests),
        );
        layers.extend(below);
        let stack = ExportStack {
            meters: ExportMeters {
                name: name.clone(),
                requests,
                device: counting,
                queue,
                upstream,
                tier,
                store,
                standby: standby.clone(),
            },
            name,
            export,
            object,
            rescuable,
            // With a local cache the cache keeps what the log layout has not uploaded (its
            // epoch is written back only once the backend flushed it): only without one is
            // it saved from the device at shutdown.
            s3: s3.filter(|_| args.local_cache.is_none()),
            lock,
            standby,
            layers,
        };
        tracing::debug!(export = %stack.name, layers = ?stack.layers, "export stack built");
        Ok(stack)
    }
}

/// The --local-cache tier over the counted backend, if one is asked for; refused for a
/// backend without identity (memory), which has nothing to keep.
fn local_tier(
    args: &ServeArgs,
    backend: &str,
    identity: Option<&BackendIdentity>,
    counting: &Arc<CountingDevice<Arc<dyn Device>>>,
) -> anyhow::Result<Option<Arc<ServeTier>>> {
    let Some(path) = &args.local_cache else {
        return Ok(None);
    };
    let Some(identity) = identity else {
        bail!("--local-cache {}: backend `{backend}` lives in memory and does not outlive the process, so there is nothing to keep a local cache of", path.display());
    };
    let (opened, lock) = open_local_tier(
        args,
        path,
        Arc::clone(counting) as Arc<dyn Device>,
        identity,
    )?;
    // Held until the process ends, not released with the backend locks at shutdown: the
    // tier's write-back thread may still be writing its checkpoint until then.
    std::mem::forget(lock);
    Ok(Some(opened))
}

/// The export's object in the shared cache, over `device`.
fn open_object(
    context: &StackContext<'_>,
    name: &str,
    backend: &str,
    device: Arc<dyn Device>,
) -> anyhow::Result<ObjectHandle> {
    let mut object_config = ObjectConfig::new(
        if name.is_empty() {
            backend.to_string()
        } else {
            name.to_string()
        },
        device,
    );
    object_config.block_size_bytes = context.block_size;
    object_config.read_only = context.args.read_only;
    let object = context.cache.open_object(object_config)?;
    if object.is_empty() {
        bail!("backend `{backend}` is empty (0 bytes): there is nothing to export");
    }
    tracing::info!(export = %name, backend = %backend, size = %format_size(object.len()), "export ready");
    say!("export {:?} = {} ({} bytes)", name, backend, object.len());
    Ok(object)
}

/// What the server serves of `object`: the cache export with its gates, observed and
/// metered; and those layers, from the top.
fn export_layers(
    context: &StackContext<'_>,
    index: usize,
    object: ObjectHandle,
    lease: Option<Arc<bufcache_s3::lease::Lease>>,
    standby: Option<&Arc<WarmStandby>>,
    requests: Arc<RequestMeters>,
) -> (Arc<dyn Export>, Vec<Layer>) {
    let mut gates = Vec::new();
    let mut cache_export = CacheExport::new(object);
    if let Some(lease) = lease {
        cache_export = cache_export.with_gate(Arc::new(LeaseGate(lease)));
        gates.push(Layer::LeaseGate);
    }
    if let Some(warm) = standby {
        cache_export = cache_export.with_gate(Arc::new(StandbyGate(Arc::clone(&warm.standby))));
        gates.push(Layer::StandbyGate);
    }
    let cache_export: Arc<dyn Export> = Arc::new(cache_export);
    let observed = crate::observe::wrap(context.observers, index, Arc::clone(&cache_export));
    let mut layers = vec![Layer::Metered];
    if !Arc::ptr_eq(&observed, &cache_export) {
        layers.push(Layer::Observed);
    }
    layers.push(Layer::CacheExport);
    layers.extend(gates);
    (MeteredExport::wrap(observed, requests), layers)
}

/// Acknowledges changes to a warm standby's export only once it took the disk over, and then
/// while its lease holds (a standby serves no client before; this is the second line).
struct StandbyGate(Arc<bufcache_s3::standby::Standby>);

impl bufcache_nbd::AcknowledgeGate for StandbyGate {
    fn may_acknowledge_changes(&self) -> std::io::Result<()> {
        match self.0.writer() {
            None => Err(std::io::Error::other(
                "this server is the disk's standby: it writes only once it takes the disk over",
            )),
            Some(writer) => match writer.lease() {
                Some(lease) => lease.check().map_err(std::io::Error::other),
                None => Ok(()),
            },
        }
    }
}

/// Acknowledges changes to an S3 log-layout export only while this server's lease on the
/// disk holds (docs/s3.md, "Leases and takeover").
struct LeaseGate(Arc<bufcache_s3::lease::Lease>);

impl bufcache_nbd::AcknowledgeGate for LeaseGate {
    fn may_acknowledge_changes(&self) -> std::io::Result<()> {
        self.0.check().map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::backend::prepare_backend;
    use clap::Parser;

    /// `bufcache serve` parsed from `flags`.
    fn serve_args(flags: &[String]) -> ServeArgs {
        let arguments = ["bufcache".to_string(), "serve".to_string()]
            .into_iter()
            .chain(flags.iter().cloned());
        match crate::Cli::try_parse_from(arguments)
            .expect("clap accepts the flags")
            .command
        {
            crate::Command::Serve(args) => *args,
            _ => unreachable!("a serve command"),
        }
    }

    /// Builds every export `flags` name, as `run` does, with `observers`.
    fn build(flags: &[String], observers: &Observers) -> anyhow::Result<Vec<ExportStack>> {
        let args = serve_args(flags);
        let validated = super::super::validate::validate(&args)?;
        let cache = bufcache_host::system_cache(validated.config)?;
        let (events, _receiver) = mpsc::channel();
        let context = StackContext {
            args: &args,
            cache: &cache,
            block_size: validated.block_size,
            observers,
            events: &events,
        };
        let mut stacks = Vec::new();
        for (index, spec) in validated.specs.into_iter().enumerate() {
            let prepared = prepare_backend(&spec.backend, &args, spec.is_default, &spec.name)?;
            stacks.push(ExportStack::build(&context, index, spec, prepared)?);
        }
        Ok(stacks)
    }

    fn strings(flags: &[&str]) -> Vec<String> {
        flags.iter().map(|flag| flag.to_string()).collect()
    }

    #[test]
    fn a_file_backend_with_a_local_tier_is_stacked_in_the_documented_order() {
        // Goal: a file backend served with --local-cache is stacked as the module documents:
        // meters, the cache export, the cache object, the io queue (on by default), the
        // local tier, the counting device, the file; its meters see the tier and the backend, its rescue identity is the
        // file's, its lock is held, and data written through the top reads back. Method: a
        // real file and local cache in a temporary directory, built as `run` builds them.
        let directory = tempfile::tempdir().unwrap();
        let disk = directory.path().join("disk.img");
        let local = directory.path().join("local.cache");
        let flags = strings(&[
            "--backend",
            disk.to_str().unwrap(),
            "--create-size",
            "4M",
            "--local-cache",
            local.to_str().unwrap(),
            "--local-cache-size",
            "16M",
            "--prefault=off",
        ]);
        let stacks = build(&flags, &Observers::default()).unwrap();
        let [stack] = &stacks[..] else {
            panic!("one export")
        };
        assert_eq!(
            stack.layers,
            [
                Layer::Metered,
                Layer::CacheExport,
                Layer::CacheObject,
                Layer::IoQueue,
                Layer::LocalTier,
                Layer::Counting,
                Layer::Backend,
            ]
        );
        assert!(stack.meters.tier.is_some());
        assert!(stack.lock.is_some(), "the backing file is locked");
        assert!(stack.s3.is_none());
        let rescuable = stack
            .rescuable
            .as_ref()
            .expect("a file outlives the process");
        assert!(
            rescuable.identity.starts_with("file-disk:"),
            "{}",
            rescuable.identity
        );
        assert_eq!(rescuable.size_bytes, 4 << 20);
        let data = vec![0x5a; 8192];
        stack.export.write(4096, &data, false).unwrap();
        stack.export.flush().unwrap();
        let mut back = vec![0; 8192];
        stack.export.read(4096, &mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(
            stack.meters.requests.commands[1]
                .requests
                .load(std::sync::atomic::Ordering::Relaxed),
            1,
            "the write was counted at the top"
        );
    }

    #[test]
    fn memory_exports_are_observed_read_only_and_not_rescued_and_a_local_cache_of_one_is_refused() {
        // Goal: memory exports are stacked without a tier (nor a queue with --io-queue
        // none), observed when observing is on (in their order: the index names them in traces), flagged read-only by -r
        // all the way up, with no rescue identity; and a --local-cache over memory is
        // refused with the message users know. Method: two memory exports built with a
        // trace recorder; then one memory export with --local-cache.
        let directory = tempfile::tempdir().unwrap();
        let observers = Observers {
            whatif: None,
            trace: Some(Arc::new(
                crate::trace_capture::TraceRecorder::create(
                    &directory.path().join("trace.csv"),
                    1 << 20,
                )
                .unwrap(),
            )),
        };
        let flags = strings(&[
            "--export",
            "a=memory:1M",
            "--backend",
            "memory:2M",
            "--export-name",
            "b",
            "-r",
            "--io-queue",
            "none",
        ]);
        let stacks = build(&flags, &observers).unwrap();
        let names: Vec<&str> = stacks.iter().map(|stack| stack.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        for stack in &stacks {
            assert_eq!(
                stack.layers,
                [
                    Layer::Metered,
                    Layer::Observed,
                    Layer::CacheExport,
                    Layer::CacheObject,
                    Layer::Counting,
                    Layer::Backend,
                ]
            );
            assert!(stack.export.read_only());
            assert!(stack.rescuable.is_none() && stack.lock.is_none());
        }
        assert_eq!(stacks[1].export.size(), 2 << 20);
        let local = directory.path().join("local.cache");
        let flags = strings(&[
            "--backend",
            "memory:1M",
            "--local-cache",
            local.to_str().unwrap(),
        ]);
        let refused = build(&flags, &Observers::default()).err().expect("refused");
        assert_eq!(
            refused.to_string(),
            format!(
                "--local-cache {}: backend `memory:1M` lives in memory and does not outlive the process, so there is nothing to keep a local cache of",
                local.display()
            )
        );
        assert!(!local.exists(), "nothing was created");
    }
}
