//! The collector and a read that looked the index up before the collector moved the data:
//! issue 46 item 3 ("segment named by the index does not exist" after the running server
//! PUT a checkpoint, DELETEd the segment and then GOT it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::channel::oneshot;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use bufcache_s3::{LogConfig, LogStore, S3Url};

/// An in-memory bucket that can hold the next segment GET until released (telling the test
/// it arrived), and carry DELETEs out but answer them with an error.
#[derive(Debug)]
struct Gated {
    inner: InMemory,
    hold: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
    deletes_fail_after_applying: AtomicBool,
}

impl std::fmt::Display for Gated {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "Gated")
    }
}

#[async_trait]
impl ObjectStore for Gated {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        options: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, options).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        options: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, options).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let held = if location.as_ref().contains("/log/segments/") {
            self.hold.lock().unwrap().take()
        } else {
            None
        };
        if let Some((arrived, release)) = held {
            let _ = arrived.send(());
            let _ = release.await;
        }
        self.inner.get_opts(location, options).await
    }

    async fn delete(&self, location: &Path) -> object_store::Result<()> {
        self.inner.delete(location).await?;
        if self.deletes_fail_after_applying.load(Ordering::SeqCst) {
            return Err(object_store::Error::Generic {
                store: "gated",
                source: format!("DELETE {location}: 500 after it was carried out").into(),
            });
        }
        Ok(())
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> object_store::Result<()> {
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> object_store::Result<()> {
        self.inner.copy_if_not_exists(from, to).await
    }
}

#[test]
fn a_read_racing_the_collector_reads_the_moved_data_when_the_delete_is_answered_with_an_error() {
    // Goal: a read that looked a segment up in the index before the collector copied its live
    // bytes elsewhere, checkpointed and deleted it gets the data, not "segment named by the
    // index does not exist", also when the DELETE took effect but was answered with an
    // error (or reset, or is still waiting for its answer). Method: hold the read's segment
    // GET, run a collection round whose DELETE is carried out and answered with a 500, then
    // release the GET (a 404) and expect the read to look again and return the data.
    let gated = Arc::new(Gated {
        inner: InMemory::new(),
        hold: Mutex::new(None),
        deletes_fail_after_applying: AtomicBool::new(false),
    });
    let url = S3Url::parse("s3://race/disk?create-size=1048576&layout=log").unwrap();
    let config = LogConfig {
        segment_bytes_max: 64 << 10,
        gc_threshold: None,
        ..LogConfig::default()
    };
    let store = Arc::new(LogStore::open_unlocked_on(&url, gated.clone(), config).unwrap());
    // Segment 1 holds blocks 0..8; rewriting blocks 1..8 leaves block 0 its only live bytes.
    let old = vec![0x5a; 4096];
    for block in 0..8u64 {
        store.write(&old, block * 4096).unwrap();
    }
    store.flush().unwrap();
    for block in 1..8u64 {
        store.write(&[0x11; 4096], block * 4096).unwrap();
    }
    store.flush().unwrap();

    let (arrived_sender, arrived) = oneshot::channel();
    let (release, release_receiver) = oneshot::channel();
    *gated.hold.lock().unwrap() = Some((arrived_sender, release_receiver));
    let reader = {
        let store = store.clone();
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; 4096];
            store.read(&mut buffer, 0).map(|()| buffer)
        })
    };
    futures::executor::block_on(arrived).expect("the read's GET arrives");
    gated
        .deletes_fail_after_applying
        .store(true, Ordering::SeqCst);
    let round = store.collect_garbage(0.9);
    assert!(
        round.is_err(),
        "the round's DELETE was answered with an error: {round:?}"
    );
    gated
        .deletes_fail_after_applying
        .store(false, Ordering::SeqCst);
    release.send(()).unwrap();
    let read = reader.join().expect("the reader does not panic");
    assert_eq!(read.expect("the read finds the moved block"), old);
}
