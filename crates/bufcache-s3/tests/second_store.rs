//! Both layouts against S3 implementations written by others: the `s3s-fs` crate (a
//! file-system-backed S3 server, run in-process on a loopback port) and SeaweedFS (a
//! distributed store: master, volume server, filer and S3 gateway, `weed server` on loopback).
//! moto is the first (every other test file); a store that answers differently from moto in
//! some corner (conditional PUTs, ranged GETs, 404 bodies, listing) shows up here.

mod support;

use std::net::SocketAddr;

use bufcache_device::Device;
use bufcache_s3::{S3Device, S3Url};
use rand::{Rng, SeedableRng};
use support::{have_seaweedfs, S3Server, SeaweedFs};

/// An s3s-fs server over a temporary directory, serving until the test's process ends.
struct S3sFs {
    address: SocketAddr,
    root: tempfile::TempDir,
}

impl S3sFs {
    fn start() -> Self {
        support::set_test_credentials();
        let root = tempfile::tempdir().unwrap();
        let file_system = s3s_fs::FileSystem::new(root.path()).unwrap();
        let service = {
            let mut builder = s3s::service::S3ServiceBuilder::new(file_system);
            builder.set_auth(s3s::auth::SimpleAuth::from_single("testing", "testing"));
            builder.build()
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let http = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                loop {
                    let Ok((socket, _)) = listener.accept().await else {
                        continue;
                    };
                    let connection = http
                        .serve_connection(hyper_util::rt::TokioIo::new(socket), service.clone())
                        .into_owned();
                    tokio::spawn(async move {
                        let _ = connection.await;
                    });
                }
            });
        });
        S3sFs { address, root }
    }
}

impl S3Server for S3sFs {
    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Creates a bucket: s3s-fs keeps each bucket as a directory of its root.
    fn create_bucket(&self, name: &str) {
        std::fs::create_dir(self.root.path().join(name)).unwrap();
    }
}

fn url(server: &dyn S3Server, bucket: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://{bucket}/disk?endpoint={}{parameters}",
        server.endpoint()
    ))
    .unwrap()
}

fn random(length: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; length];
    rand::rngs::StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

/// Random writes (some as batches), zeroes and flushes through `device`, mirrored in `model`.
fn write_randomly(device: &S3Device, model: &mut [u8], seed: u64) {
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for step in 0..40u64 {
        let length = rng.gen_range(1..=96 << 10);
        let offset = rng.gen_range(0..(model.len() - length) as u64);
        if step % 7 == 6 {
            device.write_zeroes(offset, length as u64).unwrap();
            model[offset as usize..offset as usize + length].fill(0);
        } else {
            let data = random(length, seed + step);
            device
                .write_vectored_at(&[std::io::IoSlice::new(&data)], offset)
                .unwrap();
            model[offset as usize..offset as usize + length].copy_from_slice(&data);
        }
        if step % 10 == 9 {
            device.flush().unwrap();
        }
    }
    device.flush().unwrap();
}

fn read_all(device: &S3Device, length: usize) -> Vec<u8> {
    let mut back = vec![0u8; length];
    device
        .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], 0)
        .unwrap();
    back
}

#[test]
fn both_layouts_keep_every_byte_on_a_second_s3_implementation() {
    // Goal: the chunk and log layouts work on an S3 server other than moto: writes at any
    // offset, zeroes and flushes read back exactly, before and after the disk is closed and
    // opened again (the log layout then replays its checkpoint and segments from this store).
    // Method: one s3s-fs server, one bucket per layout, 40 random writes/zeroes of up to
    // 96 KiB on a 1 MiB disk with small chunks/segments, compared with a model; reopen and
    // compare again.
    both_layouts_keep_every_byte(&S3sFs::start());
}

#[test]
fn both_layouts_keep_every_byte_on_seaweedfs() {
    // Goal and method: those of `both_layouts_keep_every_byte_on_a_second_s3_implementation`,
    // on SeaweedFS.
    if have_seaweedfs("both_layouts_keep_every_byte_on_seaweedfs") {
        both_layouts_keep_every_byte(&SeaweedFs::start());
    }
}

/// The body of the both-layouts tests, on `server`.
fn both_layouts_keep_every_byte(server: &dyn S3Server) {
    for (bucket, parameters, seed) in [
        ("chunks", "&layout=chunk&chunk-size=64k", 0x5335_0001_u64),
        ("log", "&layout=log&segment-size=64k", 0x5335_0002_u64),
    ] {
        server.create_bucket(bucket);
        let created = url(server, bucket, &format!("&create-size=1M{parameters}"));
        let mut model = vec![0u8; 1 << 20];
        {
            let device = S3Device::open_locked(&created).unwrap();
            write_randomly(&device, &mut model, seed);
            assert!(
                read_all(&device, model.len()) == model,
                "{bucket}: the disk differs from the model (seed {seed})"
            );
        }
        let device = S3Device::open_locked(&url(server, bucket, "")).unwrap();
        assert!(
            read_all(&device, model.len()) == model,
            "{bucket}: after reopening, the disk differs from the model (seed {seed})"
        );
    }
}

#[test]
fn a_second_server_is_refused_by_the_lock_on_a_second_s3_implementation() {
    // Goal: the disk lock (a create-only PUT, then the probe that the store refuses a second
    // one) holds on s3s-fs too: while one server has the disk open, another open is refused
    // by name, and once the first closes, the second may open. Method: open, open again and
    // read the error; drop the first; open again.
    a_second_server_is_refused_by_the_lock(&S3sFs::start());
}

#[test]
fn a_second_server_is_refused_by_the_lock_on_seaweedfs() {
    // Goal and method: those of
    // `a_second_server_is_refused_by_the_lock_on_a_second_s3_implementation`, on SeaweedFS.
    if have_seaweedfs("a_second_server_is_refused_by_the_lock_on_seaweedfs") {
        a_second_server_is_refused_by_the_lock(&SeaweedFs::start());
    }
}

/// The body of the lock tests, on `server`.
fn a_second_server_is_refused_by_the_lock(server: &dyn S3Server) {
    server.create_bucket("locked");
    let first = S3Device::open_locked(&url(server, "locked", "&create-size=1M")).unwrap();
    let refused = S3Device::open_locked(&url(server, "locked", ""))
        .err()
        .expect("a second open of a locked disk must fail");
    let text = refused.to_string();
    assert!(text.contains("in use") || text.contains("lock"), "{text}");
    drop(first);
    S3Device::open_locked(&url(server, "locked", "")).unwrap();
}
