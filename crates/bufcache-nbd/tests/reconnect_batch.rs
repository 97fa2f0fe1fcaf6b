//! Goal: a batch of writes a reconnecting client sends on a connection that is cut halfway
//! through ends with every write done: the writes the cut connection lost are sent again,
//! once each, on a new connection, and each write completes exactly once, after every
//! attempt (the writes are owned requests carried through both attempts).
//! Method: a unix-socket proxy in front of our server forwards the client's bytes and cuts
//! the first connection after 300 KiB of them (past the handshake, inside a batch of sixteen
//! 64 KiB writes); the batch goes through `write_and_wait`. Every write succeeds, the client
//! reconnected once, the second connection carried no more than the batch once over, and the
//! export holds every byte.

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bufcache_device::{write_and_wait, Device};
use bufcache_nbd::{Export, MemoryExport, ReconnectPolicy, ReconnectingClient};
use common::*;

const WRITE_BYTES: usize = 64 << 10;
const WRITE_COUNT: usize = 16;
const CUT_AFTER_BYTES: u64 = 300 << 10;

/// Forwards connections on `listen` to `target`; the first is cut once `cut_after_bytes` of
/// the client's bytes went through. `forwarded[i]`: client bytes connection `i` carried.
fn start_proxy(listen: &Path, target: &Path, cut_after_bytes: u64) -> Arc<[AtomicU64; 2]> {
    let listener = UnixListener::bind(listen).expect("proxy socket");
    let forwarded: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let counters = Arc::clone(&forwarded);
    let target = target.to_path_buf();
    std::thread::spawn(move || {
        for (index, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { return };
            let server = UnixStream::connect(&target).expect("server socket");
            let cut = (index == 0).then_some(cut_after_bytes);
            let counters = Arc::clone(&counters);
            let (mut from_client, mut to_server) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                let mut buffer = vec![0u8; 16 << 10];
                loop {
                    let length = match from_client.read(&mut buffer) {
                        Ok(0) | Err(_) => break,
                        Ok(length) => length,
                    };
                    let slot = &counters[index.min(1)];
                    let total = slot.fetch_add(length as u64, Ordering::SeqCst) + length as u64;
                    if cut.is_some_and(|cut| total >= cut) {
                        break;
                    }
                    if to_server.write_all(&buffer[..length]).is_err() {
                        break;
                    }
                }
                let _ = from_client.shutdown(Shutdown::Both);
                let _ = to_server.shutdown(Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_server, &mut to_client);
                let _ = to_client.shutdown(Shutdown::Both);
            });
        }
    });
    forwarded
}

#[test]
fn writes_a_cut_connection_lost_are_sent_once_more_on_a_new_one() {
    let export = Arc::new(MemoryExport::new(4 << 20));
    let server = start_server(vec![("mem", export.clone() as Arc<dyn Export>)]);
    let directory = tempfile::tempdir().unwrap();
    let proxy = directory.path().join("proxy.sock");
    let forwarded = start_proxy(&proxy, &server.socket_path, CUT_AFTER_BYTES);
    let client = ReconnectingClient::connect(
        &format!("nbd+unix:///mem?socket={}", proxy.display()),
        ReconnectPolicy::default(),
    )
    .expect("connect through the proxy");
    let writes: Vec<(u64, Vec<u8>)> = (0..WRITE_COUNT)
        .map(|index| {
            let bytes = (0..WRITE_BYTES)
                .map(|at| (at as u8) ^ (index as u8).wrapping_mul(37))
                .collect();
            ((index * WRITE_BYTES * 2) as u64, bytes)
        })
        .collect();
    let outcomes = write_and_wait(&client, writes.clone());
    for (index, (_, result)) in outcomes.iter().enumerate() {
        assert!(result.is_ok(), "write {index}: {result:?}");
    }
    assert_eq!(client.reconnect_count(), 1, "one new connection");
    let first = forwarded[0].load(Ordering::SeqCst);
    let second = forwarded[1].load(Ordering::SeqCst);
    assert!(
        first >= CUT_AFTER_BYTES,
        "the first connection was cut at {first} bytes"
    );
    let batch_bytes = (WRITE_COUNT * (WRITE_BYTES + 32)) as u64;
    assert!(
        second > 0 && second < batch_bytes + (4 << 10),
        "the second connection carried {second} bytes, the batch is {batch_bytes}"
    );
    for (offset, bytes) in &writes {
        let mut back = vec![0u8; bytes.len()];
        client
            .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], *offset)
            .unwrap();
        assert!(back == *bytes, "the write at {offset} reads back different");
    }
}
